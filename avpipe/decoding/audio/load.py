"""Audio loading: :func:`load_audio` -> :class:`Audio` (float32 samples), plus :func:`resample`.

:func:`load_audio` walks the ``"audio"`` list of :mod:`avpipe.decoding.backends`. Files
libsndfile reads (WAV PCM 16/24/32-bit and float, FLAC, OGG/Vorbis, and Opus / MP3 where the
installed libsndfile has them) go through soundfile, which seeks: an ``offset`` / ``duration``
read decodes only that part. Anything else (the audio track of a video container, AAC, ...)
goes through PyAV, which seeks to the offset and stops decoding after the duration. The GPU
FLAC decoder (``_flac_cuda``) is listed first: a whole FLAC file asked for on a GPU
(``device="cuda"``) is decoded there, bit-exact to libFLAC, and stays there; it refuses a span
and the files it does not decode (:class:`FlacCudaEntry`), which soundfile or PyAV then decode.
:mod:`avpipe.pipeline`'s FLAC windows drive the same decoder over many files at once.

Resampling (``sample_rate=``) is :func:`resample`, a polyphase windowed-sinc resampler of
stated quality (see :mod:`avpipe.ops._resample`) that runs on numpy or cupy.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..._source import open_source
from ..._validate import check_choice, nonneg_float, nonneg_int, pos_int
from ...device import array_module, is_cupy, resolve_device, to_device
from ...errors import CorruptDataError, DecodeError, EmptyMediaError, UnsupportedFormatError
from ...ops.audio import RESAMPLE_QUALITIES, resample
from ..backends import (
    AudioRequest,
    BackendRefused,
    backends,
    first_accepting,
    register,
    warn_fallback,
)
from . import _flac_cuda
from ._flac_scan import flac_length

__all__ = ["load_audio", "Audio", "resample", "audio_info", "DAMAGE_POLICIES",
           "DURATION_TOLERANCE_S", "shorter_than_declared"]

_RATES = (1000, 768000)  # source sample rates load_audio resamples from

DAMAGE_POLICIES = ("error", "warn")  # load_audio(on_damage=...), and the loaders' and feeds'

# How much shorter than a manifest's duration a decoded item may be before it counts as damaged
# (seconds). Manifests round durations (NeMo's to 0.01 s, others to a 20 ms frame); a lossy
# codec's priming and padding move the decoded length by up to a frame (AAC 2,112 samples,
# 0.048 s at 44.1 kHz; MP3 about 0.05 s). 0.1 s is past all of these and a tenth of the
# shortest utterances, where a cut file loses seconds (a WAV cut to a third: 8 s of 12 s).
DURATION_TOLERANCE_S = 0.1


def shorter_than_declared(num_samples: int, sample_rate: int, declared_s) -> str | None:
    """Why ``num_samples`` decoded at ``sample_rate`` fall short of ``declared_s`` seconds (a
    manifest's duration) by more than :data:`DURATION_TOLERANCE_S`, or None (also for no
    declared duration)."""
    if not declared_s or declared_s <= 0:
        return None
    got = num_samples / float(sample_rate)
    if got + DURATION_TOLERANCE_S >= float(declared_s):
        return None
    return (f"decoded {got:.3f} s of the {float(declared_s):.3f} s the manifest declares "
            f"(more than {DURATION_TOLERANCE_S:g} s short: cut short or damaged)")


@dataclass(frozen=True)
class Audio:
    """Decoded audio.

    ``samples``: float32, ``[n]`` when mono (or one channel was chosen), else ``[channels, n]``
    (a mono file read with ``mono=False`` gives ``[1, n]``); numpy, or cupy with
    ``device="cuda"``. ``sample_rate``: of ``samples``. ``source_sample_rate`` and
    ``source_channels``: the file's own. ``offset_samples``: where the read began, in samples
    at the file's rate. ``damaged``: None for a clean read, else why the file is damaged
    though samples were decoded (e.g. it ends before its header says: the samples are what it
    holds), with ``load_audio(on_damage="warn")``; the default raises
    :class:`~avpipe.CorruptDataError` instead. ``backend``: the name of the backend that
    decoded it (``"flac_cuda"``, ``"soundfile"``, ``"pyav"``); ``fallbacks``: the
    :class:`~avpipe.decoding.backends.Fallback` of each backend that refused it first.
    """

    samples: Any
    sample_rate: int
    source_sample_rate: int = 0
    source_channels: int = 0
    offset_samples: int = 0
    source: str = field(default="", repr=False)
    damaged: str | None = None
    backend: str = field(default="", repr=False)
    fallbacks: tuple = field(default=(), repr=False)

    @property
    def num_samples(self) -> int:
        return int(self.samples.shape[-1])

    @property
    def duration_seconds(self) -> float:
        return self.num_samples / self.sample_rate


def _check_args(sample_rate, offset, duration, channel, quality):
    if sample_rate is not None:
        pos_int("sample_rate", sample_rate)
    nonneg_float("offset", offset, " of seconds")
    if duration is not None:
        nonneg_float("duration", duration, " of seconds")
    if channel is not None:
        nonneg_int("channel", channel)
    check_choice("resample_quality", quality, RESAMPLE_QUALITIES)


def _span(sr, total, offset, duration, name):
    """(start, count) in samples at the file's rate; total may be None (unknown)."""
    # nearest sample, halves rounded up (Python's round() would send 2.5 to 2)
    start = int(math.floor(offset * sr + 0.5))
    count = None if duration is None else int(math.floor(duration * sr + 0.5))
    if total is not None:
        if start > total or (start == total and total > 0 and offset > 0):
            raise ValueError(f"offset={offset!r} s is past the end of {name} ({total / sr:.6f} s)")
        rest = total - start
        count = rest if count is None else min(count, rest)
    return start, count


def _read_soundfile(src, offset, duration, dtype):
    """(data [n, C], sr, C, start, damaged) through libsndfile; raises :class:`BackendRefused`
    when libsndfile cannot open it."""
    import soundfile as sf

    stream = src.path_or_stream()
    try:
        try:
            f = sf.SoundFile(stream)
        except Exception as e:  # LibsndfileError / RuntimeError / TypeError: not for libsndfile
            raise BackendRefused(str(e)) from None
        with f:
            sr, C = int(f.samplerate), int(f.channels)
            exact = f.format != "MPEG"  # an MP3's length is an estimate, the others' exact
            total = int(f.frames) if f.seekable() else None
            start, count = _span(sr, total, offset, duration, src.name)
            if start:
                if f.seekable():
                    f.seek(start)
                else:
                    f.read(frames=start, dtype=dtype, always_2d=True)
            try:
                data = f.read(frames=-1 if count is None else count, dtype=dtype, always_2d=True)
            except Exception as e:
                raise CorruptDataError(src.name, f"libsndfile failed to decode: {e}") from None
    finally:
        if not isinstance(stream, str):
            stream.close()
    short = None
    if count is not None and data.shape[0] < count and exact:
        short = (
            f"the data ends early: {start + data.shape[0]} of the {total} samples its header "
            "declares were decoded (truncated or corrupt)"
        )
    return data, sr, C, start, short


def _wav_format_problem(src) -> str | None:
    """What is inconsistent in a PCM / float WAV's format chunk (channels, sample size and block
    size disagree, no channels), or None. PyAV crashed the process on such a file (9 channels of
    32-bit floats in 4-byte blocks) that libsndfile had refused."""
    try:
        with src.stream() as f:
            head = f.read(4096)
    except (OSError, ValueError):
        return None
    if head[:4] not in (b"RIFF", b"RF64") or head[8:12] != b"WAVE":
        return None
    at = 12
    while at + 8 <= len(head):
        cid, n = head[at : at + 4], int.from_bytes(head[at + 4 : at + 8], "little")
        if cid == b"fmt " and at + 24 <= len(head):
            tag, ch = (int.from_bytes(head[at + k : at + k + 2], "little") for k in (8, 10))
            align, bits = (int.from_bytes(head[at + k : at + k + 2], "little") for k in (20, 22))
            if tag not in (1, 3, 0xFFFE):
                return None
            if ch == 0 or bits == 0 or align != ch * ((bits + 7) // 8):
                return (
                    f"the WAV format chunk is inconsistent ({ch} channels of {bits}-bit "
                    f"samples in {align}-byte blocks)"
                )
            return None
        at += 8 + n + (n & 1)
    return None


def header_damage(src) -> str | None:
    """Truncation that the container's own fields show: a WAV whose data chunk runs past the end
    of the file, an Ogg stream that ends without its end-of-stream page."""
    import os

    try:
        with src.stream() as f:
            head = f.read(1 << 16)
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - (1 << 16)))
            tail = f.read()
    except (OSError, ValueError):
        return None
    if head[:4] in (b"RIFF", b"RF64") and head[8:12] == b"WAVE":
        at, big = 12, None
        for _ in range(64):
            if at + 8 > len(head):
                return None
            cid, n = head[at : at + 4], int.from_bytes(head[at + 4 : at + 8], "little")
            if cid == b"ds64" and at + 24 <= len(head):
                big = int.from_bytes(head[at + 16 : at + 24], "little")
            if cid == b"data":
                if n == 0xFFFFFFFF and big is not None:
                    n = big
                have = size - (at + 8)
                if 0 < n < 0xFFFFFFFF and n > have:  # 0 / ~0: written to a pipe, size unknown
                    return (
                        f"the WAV data chunk declares {n} bytes but the file holds {have} "
                        "(truncated)"
                    )
                return None
            at += 8 + n + (n & 1)
        return None
    if head[:4] == b"OggS":
        last = tail.rfind(b"OggS")
        if last < 0 or len(tail) < last + 27:
            return "the Ogg stream ends inside a page (truncated)"
        nseg = tail[last + 26]
        body = last + 27 + nseg
        if len(tail) < body or len(tail) < body + sum(tail[last + 27 : body]):
            return "the Ogg stream ends inside a page (truncated)"
        if not tail[last + 5] & 0x04:
            return "the Ogg stream ends without its end-of-stream page (truncated)"
    return None


def _first_byte(path) -> None:
    """Read ``path``'s first byte in Python before any library opens it: a read that never
    returns (a stalled network mount) then blocks here, in the calling thread alone, not inside
    ``sf_open``, which soundfile calls under one process-wide lock (a stuck open there would
    stop every soundfile open of the process). Errors are left to the decoders."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError:
        pass


def _flac_length(src):
    """:class:`~._flac_scan.FlacLength` of a FLAC source (its STREAMINFO and the count its
    frames hold), or None for anything else."""
    try:
        with src.stream() as f:
            head = f.read(4)
            if head[:4] != b"fLaC" and head[:3] != b"ID3":
                return None
            return flac_length(f)
    except (OSError, ValueError):
        return None


def _read_pyav(src, offset, duration):
    """(data [n, C] float32, sr, C, start, damaged) through PyAV: the first audio stream of any
    container."""
    import av

    stream_in = src.path_or_stream()
    try:
        try:
            container = av.open(stream_in, mode="r")
        except Exception as e:
            raise UnsupportedFormatError(src.name, f"not a readable audio file ({e})") from None
        with container:
            if not container.streams.audio:
                raise EmptyMediaError(src.name, "the container has no audio stream")
            st = container.streams.audio[0]
            if st.codec_context is None:  # FFmpeg has no decoder for it (a damaged header)
                raise UnsupportedFormatError(src.name, "no decoder for the audio stream's codec")
            sr = int(st.codec_context.sample_rate or st.rate or 0)
            if sr <= 0:
                raise UnsupportedFormatError(src.name, "the audio stream has no sample rate")
            start, count = _span(sr, None, offset, duration, src.name)
            stop = None if count is None else start + count
            if start > 0 and st.time_base:
                try:
                    container.seek(
                        max(0, int((offset - 1.0) / st.time_base)) + int(st.start_time or 0),
                        stream=st,
                        backward=True,
                    )
                except Exception:
                    container.seek(0)
            resampler = av.AudioResampler(format="fltp")
            chunks, pos, C = [], None, 0
            damaged = None
            try:
                for frame in container.decode(st):
                    if pos is None:
                        if frame.pts is not None and st.time_base is not None:
                            rel = (frame.pts - (st.start_time or 0)) * st.time_base
                            pos = max(0, int(round(float(rel) * sr)))
                        else:
                            pos = 0
                    for out in resampler.resample(frame):
                        a = out.to_ndarray()  # [C, k] planar float32
                        C = a.shape[0]
                        k = a.shape[1]
                        lo = max(start - pos, 0)
                        hi = k if stop is None else min(k, stop - pos)
                        if hi > lo:
                            chunks.append(a[:, lo:hi])
                        pos += k
                    if stop is not None and pos >= stop:
                        break
            except av.error.FFmpegError as e:
                if not chunks:
                    raise CorruptDataError(
                        src.name, f"FFmpeg failed to decode audio: {e}"
                    ) from None
                damaged = f"decoding stopped at a damaged packet ({e}); the samples before it are kept"
            data = (
                np.concatenate(chunks, axis=1).T if chunks else np.zeros((0, max(C, 1)), np.float32)
            )
            C = C or int(getattr(st.codec_context, "channels", 1) or 1)
    finally:
        if not isinstance(stream_in, str):
            stream_in.close()
    if start > 0 and data.shape[0] == 0:
        raise ValueError(f"offset={offset!r} s is past the end of {src.name}")
    return np.ascontiguousarray(data, dtype=np.float32), sr, C, start, damaged


def _gpu_problem(device) -> str | None:
    """Why the GPU FLAC decoder cannot run on ``device`` (no cupy, kernels that do not compile),
    or None. A compiled module is cached per device, so after the first file this is a lookup;
    a failed compile is tried again at the next file."""
    try:
        import cupy  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a cupy that fails to load
        return f"cupy is not available ({type(e).__name__}: {e})"
    try:
        with device.activate():
            _flac_cuda.compile_kernels()
    except Exception as e:  # noqa: BLE001 - NVRTC missing or failing, a device error
        return f"the GPU FLAC kernels are not available ({type(e).__name__}: {e})"
    return None


def _source_size(src) -> int:
    """The source's size in bytes."""
    import os

    if src.data is not None:
        return len(src.data)
    if src.path is not None:
        return os.path.getsize(src.path)
    with src.stream() as f:
        return f.seek(0, os.SEEK_END)


def _read_padded(src) -> np.ndarray:
    """The source's bytes in a uint8 buffer followed by ``_flac_cuda.PAD`` zero bytes (the
    kernels' bit reader looks that far past the end)."""
    import os

    with src.stream() as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        buf = np.zeros(size + _flac_cuda.PAD, np.uint8)
        view, got = memoryview(buf)[:size], 0
        while got < size:  # a file that shrank meanwhile keeps zeros: its frames do not cover
            k = f.readinto(view[got:])
            if not k:
                break
            got += k
    return buf


def _decode_on_gpu(buf, offsets, plan, device):
    """``(samples, why)``: the one file of ``plan`` decoded on ``device``, cupy float32
    ``[n, C]`` (None, and why, where the GPU's frames do not cover it exactly)."""
    with device.activate():
        return _flac_cuda.collect_channels(_flac_cuda.launch(buf, offsets, plan), 0)


class FlacCudaEntry:
    """The GPU FLAC decoder (``_flac_cuda``), bit-exact to libFLAC: a FLAC file asked for on a
    GPU (``device="cuda"``) is decoded there as a window of one file and its samples stay on
    the GPU. :mod:`avpipe.pipeline`'s FLAC windows drive the same decoder over many files.

    It takes whole files only: a span (``offset`` / ``duration``) is refused and left to
    soundfile, which seeks to it and decodes only that part (the GPU decoder would decode the
    whole file to cut it). It refuses, saying why, the files the window plan leaves to the CPU
    (:func:`~._flac_cuda.gpu_refusals`: no sample count in STREAMINFO, samples of more than 24
    bits, a count the file's bytes cannot hold), a STREAMINFO count that the frames contradict,
    and any file when cupy or its kernels are not available. A file whose frames the GPU does
    not decode exactly (a damaged frame fails its CRC) is refused too, after the decode, so
    libFLAC decodes it or reports the damage (:class:`~avpipe.CorruptDataError` naming the
    file): the GPU never returns a sample libFLAC would not."""

    name = "flac_cuda"

    def accepts(self, req: AudioRequest):
        if req.flac is None or not getattr(req.device, "is_cuda", False):
            return None
        if req.offset or req.duration is not None:
            return "the GPU FLAC decoder decodes whole files; soundfile seeks to a span"
        if req.flac.problem:
            return req.flac.problem
        if req.flac.info.sample_rate <= 0:
            return "STREAMINFO gives no sample rate"
        why = _flac_cuda.file_refusal(req.flac.info, _source_size(req.source))
        if why is not None:
            return why
        return _gpu_problem(req.device) or True

    def decode(self, req: AudioRequest):
        buf = _read_padded(req.source)
        offsets = np.array([0, len(buf) - _flac_cuda.PAD], np.int64)
        plan = _flac_cuda.plan_batch(buf, offsets)
        if 0 in plan.cpu:  # the bytes read are not those accepts saw (the file changed)
            raise BackendRefused(plan.cpu[0])
        try:
            data, why = _decode_on_gpu(buf, offsets, plan, req.device)
        except Exception as e:  # noqa: BLE001 - out of memory, a launch error: libFLAC decodes
            raise BackendRefused(f"the GPU FLAC decoder failed ({type(e).__name__}: {e})") from None
        if data is None:
            raise BackendRefused(why)
        si = plan.infos[0]
        return data, int(si.sample_rate), int(si.channels), 0, None


class SoundfileEntry:
    """libsndfile: seeks, so a span decodes only that part. It refuses a FLAC whose STREAMINFO
    has no sample count or one its frames contradict, and anything it cannot open."""

    name = "soundfile"

    def accepts(self, req: AudioRequest):
        if req.flac is not None and (req.flac.streamed or req.flac.problem):
            # libsndfile trusts STREAMINFO's count (it fails without one and stops early at one
            # too small): FFmpeg decodes the frames to their end
            return "libsndfile trusts the FLAC STREAMINFO's sample count, which is missing or wrong"
        return True

    def decode(self, req: AudioRequest):
        return _read_soundfile(req.source, req.offset, req.duration, "float32")


class PyAVEntry:
    """PyAV (FFmpeg): the first audio stream of any container FFmpeg opens."""

    name = "pyav"

    def accepts(self, req: AudioRequest):
        return True

    def decode(self, req: AudioRequest):
        bad = _wav_format_problem(req.source)  # FFmpeg reads past its buffers on these
        if bad is not None:
            raise CorruptDataError(req.source_name, bad)
        return _read_pyav(req.source, req.offset, req.duration)


register("audio", FlacCudaEntry())
register("audio", SoundfileEntry())
register("audio", PyAVEntry())


def _decode(req: AudioRequest, fallbacks: list):
    """The first audio backend that accepts ``req`` and decodes it: ``(name, data, sr, C,
    start, damaged)``; refusals go to ``fallbacks``."""
    _, got = first_accepting(backends("audio"), req, lambda b: (b.name, *b.decode(req)),
                             fallbacks)  # fmt: skip
    if got is None:
        why = "; ".join(str(f) for f in fallbacks) or "no audio backend accepts it"
        raise UnsupportedFormatError(req.source_name, f"not a readable audio file ({why})")
    for f in fallbacks:
        warn_fallback(req.source_name, f, got[0], level=logging.DEBUG)
    return got


def load_audio(
    source,
    *,
    sample_rate=None,
    mono=True,
    offset=0.0,
    duration=None,
    channel=None,
    device="cpu",
    resample_quality="high",
    check_finite=True,
    strict=False,
    on_damage="error",
) -> Audio:
    """Decode audio to float32.

    ``source``: a path, bytes or a binary file object. ``sample_rate``: resample to this rate
    (None: the file's). ``mono``: average the channels (``[n]``); False: ``[channels, n]``.
    ``channel``: take this one channel instead (``[n]``). ``offset`` / ``duration``: seconds at
    the file's own rate, rounded to the nearest sample; only that span is decoded (a duration
    past the end is cut at the end; an offset past the end raises ValueError). ``device``:
    ``"cpu"`` (numpy, default) or ``"cuda[:N]"`` (cupy; resampling then runs on the GPU, and a
    whole FLAC file is decoded there too: ``Audio.backend == "flac_cuda"``, the same samples
    as libFLAC's; a span or a file that decoder refuses is decoded on the CPU and uploaded,
    its refusal in :attr:`Audio.fallbacks`).

    Errors: a missing path raises FileNotFoundError; content that no decoder reads raises
    :class:`~avpipe.UnsupportedFormatError`, a decode failure or NaN / infinite samples
    :class:`~avpipe.CorruptDataError`, no samples :class:`~avpipe.EmptyMediaError` — all
    :class:`~avpipe.DecodeError` naming the file (``"<bytes>"`` for in-memory data).

    Damage: a file that holds fewer samples than its own header declares (a WAV whose data
    chunk runs past the end, an Ogg stream without its end page or with a page skipped for a
    bad CRC, a FLAC whose STREAMINFO count disagrees with its frames, a bad packet) raises
    :class:`~avpipe.CorruptDataError` naming the file and saying what is missing, with
    ``on_damage="error"`` (the default); ``on_damage="warn"`` decodes it as far as it goes (a
    FLAC: every sample its frames hold) and says why in :attr:`Audio.damaged`.
    ``strict=True`` is ``on_damage="error"``. A FLAC whose STREAMINFO gives no count (0: a
    stream written to a pipe) is not damaged: its frames are decoded to the end.
    """
    _check_args(sample_rate, offset, duration, channel, resample_quality)
    check_choice("on_damage", on_damage, DAMAGE_POLICIES)
    dev = resolve_device(device)
    src = open_source(source)
    if src.data is not None and len(src.data) == 0:
        raise EmptyMediaError(src.name, "no data (0 bytes)")
    if src.path is not None:
        import os

        if os.path.getsize(src.path) == 0:
            raise EmptyMediaError(src.name, "empty file (0 bytes)")
        _first_byte(src.path)
    flac = _flac_length(src)
    if flac is not None and flac.problem and (strict or on_damage == "error"):
        raise CorruptDataError(src.name, flac.problem)
    req = AudioRequest(source=src, source_name=src.name, offset=offset, duration=duration,
                       device=dev, flac=flac)  # fmt: skip
    fallbacks: list = []
    try:
        used, data, sr, C, start, damaged = _decode(req, fallbacks)
        damaged = (flac.problem if flac is not None else None) or damaged
    except DecodeError as e:
        cut = header_damage(src)  # a truncated file is corrupt, not of an unknown format
        if cut is None or isinstance(e, CorruptDataError):
            raise
        raise CorruptDataError(src.name, f"{cut}; {e.cause}") from None
    damaged = header_damage(src) or damaged
    if damaged and (strict or on_damage == "error" or data.size == 0):
        raise CorruptDataError(src.name, damaged)
    if sample_rate is not None and sample_rate != sr and not _RATES[0] <= sr <= _RATES[1]:
        # a damaged header's rate (1 Hz, 4 GHz) would make resampling a time and memory bomb
        raise UnsupportedFormatError(
            src.name, f"the file's sample rate {sr} Hz is outside the {_RATES[0]}..{_RATES[1]} Hz "
            "that avpipe resamples from (a damaged header?)"
        )
    if data.size == 0 and (duration is None or duration > 0):
        raise EmptyMediaError(src.name, "no audio samples")
    # numpy from the CPU backends, cupy (on dev) from a GPU backend: each step runs where the
    # data is, and numpy data goes to the GPU once, mixed down (fewer bytes to upload)
    xp = array_module(data)
    with dev.activate() if xp is not np else contextlib.nullcontext():
        if check_finite and data.size and not bool(xp.isfinite(data).all()):
            raise CorruptDataError(src.name, "the audio holds NaN or infinite samples")
        if channel is not None:
            if channel >= C:
                raise ValueError(f"channel must be < the file's {C} channels, got {channel}")
            out = data[:, channel]
        elif mono:
            out = data[:, 0] if C == 1 else data.mean(axis=1, dtype=xp.float32)
        else:
            out = data.T
        out = xp.ascontiguousarray(out, dtype=xp.float32)
    if dev.is_cuda and not is_cupy(out):
        out = to_device(out, dev)
    rate = sr
    if sample_rate is not None and sample_rate != sr:
        with dev.activate() if is_cupy(out) else contextlib.nullcontext():
            out = resample(out, sr, int(sample_rate), quality=resample_quality)
        rate = int(sample_rate)
    return Audio(
        samples=out,
        sample_rate=int(rate),
        source_sample_rate=sr,
        source_channels=C,
        offset_samples=start,
        source=src.name,
        damaged=damaged,
        backend=used,
        fallbacks=tuple(fallbacks),
    )


def audio_info(source) -> dict:
    """The file's sample rate, channels, frames and format without decoding (soundfile only)."""
    import soundfile as sf

    src = open_source(source)
    if src.path is not None:
        _first_byte(src.path)
    stream = src.path_or_stream()
    try:
        i = sf.info(stream)
    except Exception as e:
        raise UnsupportedFormatError(src.name, f"libsndfile cannot read it ({e})") from None
    finally:
        if not isinstance(stream, str):
            stream.close()
    return {
        "sample_rate": int(i.samplerate),
        "channels": int(i.channels),
        "frames": int(i.frames),
        "format": i.format,
        "subtype": i.subtype,
    }
