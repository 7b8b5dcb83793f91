"""Fast batched audio decoding for training input: worker processes decode straight into a
shared host ring of fixed-stride slots; the consumer gets padded GPU (or numpy) batches.

Why processes and int16 (what makes soundfile in Python threads slow): libsndfile's FLAC decode
itself runs without the GIL, but each read in a thread allocates a fresh output array (large
allocations are fresh ``mmap`` pages, so every thread page-faults under the one process-wide
memory-map lock) and the per-file Python work (opening, format checks, array wrapping) runs
under the GIL. Here each worker *process* reads with ``SoundFile.read(out=...)`` into rows of a
shared, already-touched buffer (no allocation, no page faults, no GIL shared with anyone), in
``int16`` (exact for 16-bit sources, half the bytes of float32); the consumer copies only the
used ``[B, max_len]`` block to the GPU (``cudaMemcpy2DAsync`` from page-locked memory when the
buffer can be registered) and converts to float32 there (``x / 32768``, soundfile's scaling).

Public as :class:`AudioBatchLoader`; the ``audio`` benchmark (``benchmarks/workloads/audio.py``) measures it.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import settings
from .._results import BatchResult
from .._source import NOT_REGULAR, is_regular_file, open_source
from .._validate import pos_float
from ..decoding.audio import DAMAGE_POLICIES, flac_length_of_path, header_damage, load_audio
from ..decoding.audio import flac_header_info as header_info
from ..device import resolve_device
from ..errors import (
    CorruptDataError,
    DecodeTimeoutError,
    EmptyMediaError,
    UnsupportedFormatError,
)
from ..formats import is_flac
from ._flac_windows import GpuFlacBatches, drop_readers_ahead, start_readers, start_readers_ahead
from ._shared_memory import Ring as _Ring
from ._shared_memory import attach_ring
from .workers import WorkerLost, WorkerPool

# the GPU FLAC loader's reader processes, started ahead of a loader (extraction's worker does
# this while its parent resolves the inputs) and dropped when no loader took them
__all__ = ["AudioBatch", "AudioBatchLoader", "start_readers_ahead", "drop_readers_ahead"]

# In a worker process only: the loader's buffer it has mapped and that loader's layout (every
# request carries its loader's state; a request from another loader maps that one's ring)
_WORKER: dict = {}

_RATES = (1000, 768000)  # sample rates outside this are damaged headers, not audio
_SAMPLES_PER_BYTE = 512  # no file holds more samples per byte (FLAC's constant frames: ~400)


def _attach(state):
    """In a worker: the layout and ring of the loader whose request this is."""
    _WORKER.update(state, mm=attach_ring(state["ring"], state["nbytes"]))


def _plausible(path, info):
    """``info`` (frames, rate, channels), or (-1, 0, 0) where the header is absurd: a length no
    file of that size holds, a sample rate no audio has (a damaged file, reported when read)."""
    frames, rate, _ = info
    if frames < 0:
        return info
    try:
        size = os.path.getsize(path)
    except OSError:
        return -1, 0, 0
    if frames > max(size, 1) * _SAMPLES_PER_BYTE or not _RATES[0] <= rate <= _RATES[1]:
        return -1, 0, 0
    return info


@dataclass(frozen=True)
class AudioBatch(BatchResult):
    """One batch of :class:`AudioBatchLoader`: ``signals`` ``[b, max_len]`` float32 (None with
    ``decode_only``), ``lengths`` numpy int64 samples (0 for a failed item), ``paths``, and
    ``errors`` ``((index in the batch, DecodeError), ...)``. Unpacks as
    ``signals, lengths, paths, errors``."""

    signals: Any
    lengths: np.ndarray
    paths: list
    errors: tuple = ()
    device: str = "cpu"

    def _astuple(self):
        return (self.signals, self.lengths, self.paths, self.errors)

    def __iter__(self):
        return iter(self._astuple())

    def __getitem__(self, i):
        return self._astuple()[i]


def _as_errors(paths, messages: dict) -> tuple:
    """The loaders' ``{index: message}`` as ``((index, DecodeError), ...)``."""
    out = []
    for i, why in sorted(messages.items()):
        if why.startswith("no answer from the decoding worker"):
            cls = DecodeTimeoutError
        elif why == "no audio samples":
            cls = EmptyMediaError
        elif why == NOT_REGULAR:
            cls = UnsupportedFormatError
        else:
            cls = CorruptDataError
        out.append((int(i), cls(str(paths[i]), why)))
    return tuple(out)


def _frames_of(path):
    import soundfile as sf

    if not is_regular_file(path):  # a pipe or device: never opened (reading could block)
        return -1, 0, 0
    try:
        i = sf.info(path)
        fl = flac_length_of_path(path) if i.format == "FLAC" else None
        if fl is not None and (fl.streamed or fl.problem):  # libsndfile's count: STREAMINFO's
            frames = fl.frames if fl.frames else -1
            return _plausible(path, (frames, fl.info.sample_rate, fl.info.channels))
        return _plausible(path, (int(i.frames), int(i.samplerate), int(i.channels)))
    except Exception:
        return -1, 0, 0


def _header_and_size(path):
    """``(frames, rate, channels, bytes, leave)`` of a file for the GPU FLAC loader: its FLAC
    header (libsndfile for anything else), checked; 0 bytes where it cannot be stat'ed;
    ``leave``: why the CPU decodes it (None: the GPU may)."""
    if not is_regular_file(path):  # a pipe or device: never opened (reading could block)
        return -1, 0, 0, 0, None
    fl = flac_length_of_path(path)
    if fl is not None and (fl.streamed or fl.problem):
        # the CPU decodes it: the GPU plans a file by its STREAMINFO count
        si = fl.info
        info = _plausible(path, (fl.frames if fl.frames else -1, si.sample_rate, si.channels))
        leave = fl.problem or "STREAMINFO does not give the sample count"
    else:
        info, leave = _plausible(path, header_info(path) or _frames_of(path)), None
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    return (*info, size, leave)


def _cut_short(path):
    """Why a file that decoded is damaged (a WAV whose data chunk runs past its end), or None."""
    try:
        return header_damage(open_source(path))
    except Exception:  # noqa: BLE001 - a report only
        return None


def _decode_into(task):
    """Worker: decode ``path`` into slot ``slot`` row ``row`` (at most ``limit`` samples from
    its start; None: all); returns (frames, error or None, damaged or None)."""
    slot, row, path, limit = task
    import soundfile as sf

    g = _WORKER
    dt = g["dtype"]
    stride = g["max_samples"]
    warn = g.get("on_damage") == "warn"
    base = (slot * g["batch"] + row) * stride * dt.itemsize
    out = np.frombuffer(g["mm"], dtype=dt, count=stride, offset=base)
    if not is_regular_file(path):
        return 0, NOT_REGULAR
    rate = g.get("sample_rate")
    try:
        with sf.SoundFile(path) as f:
            fl = flac_length_of_path(path) if f.format == "FLAC" else None
            if fl is not None and (fl.streamed or fl.problem):
                k = -1  # libsndfile's count is STREAMINFO's: decoded below
            elif rate and int(f.samplerate) != rate:
                return 0, f"sample rate {int(f.samplerate)} Hz, not the loader's {rate} Hz: skipped"
            else:
                n = int(f.frames) if limit is None else min(int(f.frames), int(limit))
                if n > stride:
                    return 0, f"{n} samples, more than max_samples={stride}: skipped"
                # libsndfile hands float files to an int16 read unscaled (0.3 -> 0): those go
                # through float32 and are scaled here, as a downmix is
                if f.channels == 1 and not (dt == np.int16 and f.subtype in ("FLOAT", "DOUBLE")):
                    got = f.read(frames=n, dtype=dt.name, out=out[:n])
                    k = len(got)
                else:
                    data = f.read(frames=n, dtype="float32", always_2d=True).mean(axis=1)
                    if dt == np.int16:
                        data = np.clip(np.round(data * 32768.0), -32768, 32767)
                    k = len(data)
                    out[:k] = data.astype(dt)
        if k < 0:
            return _decode_flac_frames(path, fl, out, limit, warn)
        if k == 0:
            return 0, "no audio samples"
        damaged = None
        if k < n:
            damaged = f"decoded {k} of the {n} samples its header declares (truncated)"
        damaged = _cut_short(path) or damaged
        if damaged and not warn:
            return 0, damaged
        return k, None, damaged
    except Exception as e:  # reported per item; one bad file does not stop the batch
        return 0, f"{type(e).__name__}: {e}"


def _decode_flac_frames(path, fl, out, limit, warn):
    """Worker: a FLAC whose STREAMINFO gives no count, or one its frames contradict, decoded
    by ``load_audio`` (FFmpeg, to the frames' end) into ``out``, or that damage refused."""
    if fl.problem and not warn:
        return 0, fl.problem
    rate = _WORKER.get("sample_rate")
    if rate and fl.info.sample_rate != rate:
        return 0, f"sample rate {fl.info.sample_rate} Hz, not the loader's {rate} Hz: skipped"
    a = load_audio(path, on_damage="warn", check_finite=False,
                   duration=None if limit is None else limit / fl.info.sample_rate)
    data = a.samples
    if len(data) > len(out):
        return 0, f"{len(data)} samples, more than max_samples={len(out)}: skipped"
    if out.dtype == np.int16:
        data = np.clip(np.round(data * 32768.0), -32768, 32767)
    k = len(data)
    out[:k] = data.astype(out.dtype)
    if k == 0:
        return 0, "no audio samples"
    return k, None, a.damaged


def _shutdown(pool, ring):
    if pool is not None:
        pool.close()
    if ring is not None:
        ring.close()


def _decode_many(state, tasks):
    _attach(state)
    return [_decode_into(t) for t in tasks]


def _frames_many(paths):
    return [_frames_of(p) for p in paths]


class AudioBatchLoader:
    """Iterate padded batches of decoded audio: yields :class:`AudioBatch` (unpacks as
    ``(signals, lengths, paths, errors)``).

    ``signals``: ``[b, max_len]`` float32 on ``device`` (cupy on a GPU, numpy on the CPU; None
    with ``decode_only=True``, which decodes into the host ring and hands nothing out: for
    measurements),
    zero past each length; ``lengths``: numpy int64 samples; ``errors``: ``(index, DecodeError)``
    for items that failed (their length is 0), including files longer than ``max_samples``.
    Sources must be mono or are downmixed; no resampling: files of different sample rates are
    refused up front (``ValueError``). A batch whose workers do not answer within ``timeout``
    seconds (a worker killed by a crashing decoder, say) is decoded again item by item, and the
    items that still do not answer are reported in ``errors`` as
    :class:`~avpipe.DecodeTimeoutError` (with ``strict=True`` the batch raises :class:`~avpipe.DecodeTimeoutError` instead): the
    loader never hangs. A file whose header is absurd (a length no file of its size holds, a
    sample rate outside 1 kHz..768 kHz) or whose rate differs from nearly all others (at most
    1% of the files, or one file among three or more) is reported in its batch's ``errors``.
    A file that holds fewer samples than its header declares (cut short, an Ogg page skipped,
    a FLAC STREAMINFO count its frames contradict) is an error of its batch
    (:class:`~avpipe.CorruptDataError`, length 0) with ``on_damage="error"`` (the default);
    with ``on_damage="warn"`` it is decoded as far as it goes and listed in ``damaged``
    (``{path: why}``, filled as batches are read). A FLAC whose STREAMINFO gives no count (a
    stream written to a pipe) is decoded whole (its length from its frames; on the CPU).
    ``read_seconds``: per path, the seconds decoded from its start at most (None: all), e.g.
    what a manifest's duration needs of a longer file (decoder "cpu", ``max_samples=None``:
    the ring is sized by them; only those samples are read).

    ``num_workers`` processes (default: the CPU count), ``prefetch`` batches decoded ahead.
    ``transport``: "int16" (exact for 16-bit PCM sources) or "float32".
    Its workers are fresh interpreters (``workers.Worker``: never forks of this process,
    and they never run the caller's ``__main__`` again), started with the first batch.

    ``decoder``: "cpu" (libsndfile in the worker processes), "gpu" (FLAC frames decoded on the
    GPU, bit-exact to libFLAC: threads only read the files' bytes; any file the GPU does not
    decode exactly, or that is not FLAC, is decoded by libsndfile instead; needs
    ``device="cuda"``), or "auto": "gpu" when ``device`` is a GPU and every path ends in
    ``.flac``, else "cpu". ``transport`` and ``num_workers`` apply to "cpu" only. The GPU decoder
    runs over windows of whole batches (``AVPIPE_FLAC_WINDOW`` files, default 256: one thread per
    FLAC frame needs many frames per launch to fill the GPU).
    """

    def __init__(
        self,
        paths,
        *,
        batch_size=64,
        num_workers=None,
        prefetch=4,
        device=None,
        transport="int16",
        max_samples=None,
        timeout=120.0,
        decoder="auto",
        decode_only: bool = False,
        strict=False,
        on_damage="error",
        read_seconds=None,
    ):
        if on_damage not in DAMAGE_POLICIES:
            raise ValueError(f"on_damage must be 'error' or 'warn', got {on_damage!r}")
        if transport not in ("int16", "float32"):
            raise ValueError(f"transport must be 'int16' or 'float32', got {transport!r}")
        if decoder not in ("auto", "cpu", "gpu"):
            raise ValueError(f"decoder must be 'auto', 'cpu' or 'gpu', got {decoder!r}")
        self.paths = [os.fspath(p) for p in paths]
        if not self.paths:
            raise ValueError("paths must not be empty")
        self.batch = int(batch_size)
        self.num_workers = int(num_workers or os.cpu_count() or 1)
        self.prefetch = max(1, int(prefetch))
        self.device = resolve_device(device)
        self.decode_only = bool(decode_only)
        self.dtype = np.dtype(transport)
        self.timeout = pos_float("timeout", timeout, " of seconds")
        self.strict = bool(strict)
        self.on_damage = on_damage
        self.damaged: dict = {}  # path -> why, for files that decoded though damaged
        self._limits: dict = {}  # path -> samples read from its start at most
        self._read_s: dict = {}  # path -> seconds read from its start at most
        if read_seconds is not None:
            read_seconds = list(read_seconds)
            if len(read_seconds) != len(self.paths):
                raise ValueError(f"read_seconds must give one entry per path ({len(self.paths)}),"
                                 f" got {len(read_seconds)}")
            for p, sec in zip(self.paths, read_seconds):
                if sec is not None:
                    self._read_s[p] = max(self._read_s.get(p, 0.0), float(sec))
        on_gpu = self.device.is_cuda
        if decoder == "gpu" and not on_gpu:
            raise ValueError(f"decoder='gpu' needs device='cuda', got device={device!r}")
        if decoder == "gpu" and self.decode_only:
            raise ValueError("decode_only=True measures the CPU decoder; decoder='gpu' has none")
        if self.decode_only:
            on_gpu = False  # the CPU decoder: nothing is handed to a device
        if decoder == "auto":
            decoder = (
                "gpu" if on_gpu and all(is_flac(p) for p in self.paths) else "cpu"
            )
        self.decoder = decoder
        self._registered = False
        if decoder == "gpu":
            self._init_gpu(max_samples)
            return
        if max_samples is None:
            n = min(self.num_workers, 16)
            per = max(16, -(-len(self.paths) // (4 * n)))
            heads = WorkerPool(n, answer_s=self.timeout + len(self.paths) / 100,
                               name="avpipe-audio-headers")
            try:
                futs = [heads.submit(_frames_many, self.paths[a : a + per])
                        for a in range(0, len(self.paths), per)]
                self._take_infos([i for f in futs for i in f.result()])
            finally:
                heads.close()
            if self._read_s and self.sample_rate:
                # the samples of that many seconds at the loader's rate (one more: rounding)
                self._limits = {p: int(np.ceil(sec * self.sample_rate)) + 1
                                for p, sec in self._read_s.items()}
                cap = np.array([self._limits.get(p, -1) for p in self.paths])
                self.frames = np.where(cap >= 0, np.minimum(self.frames, cap), self.frames)
            max_samples = int(max(self.frames.max(), 1))
        else:
            self.frames, self.sample_rate = None, None
        self.max_samples = int(max_samples)
        self.n_slots = self.prefetch + 1
        nbytes = self.n_slots * self.batch * self.max_samples * self.dtype.itemsize
        # the ring the workers map (fresh processes: workers.Worker)
        self._mm = _Ring(nbytes)
        count = nbytes // self.dtype.itemsize
        self._host = np.frombuffer(self._mm.mm, dtype=self.dtype, count=count).reshape(
            self.n_slots, self.batch, self.max_samples
        )
        self._host[:] = 0  # touch every page once, here, in the parent
        self._state = dict(
            ring=self._mm.path, nbytes=self._mm.nbytes, dtype=self.dtype,
            max_samples=self.max_samples, batch=self.batch, sample_rate=self.sample_rate,
            on_damage=self.on_damage,
        )  # fmt: skip
        # workers and the shared segment go away with the loader, also without close()
        self._finalizer = weakref.finalize(self, _shutdown, None, self._mm)
        self._pool = self._new_pool()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, self._mm)
        self._registered = False
        self._events = [None] * self.n_slots
        self._inflight: dict = {}  # slot -> (chunks, handles) an abandoned run left running

    def _new_pool(self):
        """Worker processes for this loader (each request names its ring). A worker that gives
        no answer at all is replaced by the pool past twice the loader's timeout; the loader's
        own deadline (``_results``) comes first."""
        return WorkerPool(self.num_workers, answer_s=2 * self.timeout + 60,
                          name="avpipe-audio-decode")

    def _take_infos(self, infos):
        """Per-file ``(frames, sample rate, channels)`` (frames -1: unreadable) -> ``frames`` and
        ``sample_rate``; files of different rates are refused (this loader does not resample),
        except a few odd ones (damaged headers), which are reported when read."""
        from collections import Counter

        self.frames = np.array([i[0] for i in infos])
        rates = Counter(i[1] for i in infos if i[0] >= 0)
        if len(rates) > 1:
            rate, n = rates.most_common(1)[0]
            odd = sum(rates.values()) - n
            if len(infos) < 3 or odd > max(1, len(infos) // 100):
                raise ValueError(
                    f"paths must share one sample rate (no resampling here), got {sorted(rates)}"
                )
            self.frames = np.array([i[0] if i[1] == rate else -1 for i in infos])
            rates = Counter({rate: n})
        self.sample_rate = next(iter(rates)) if rates else None

    def _init_gpu(self, max_samples):
        """The GPU decoder's set-up: file sizes and lengths come from the files' own headers
        (libsndfile for anything else), read by the GPU loader's reader processes where this
        process may have them (no GIL shared: threads spend about 0.1 ms a file), else, or
        when they do not answer in time, in threads."""
        readers = start_readers()
        try:
            got = None
            if readers is not None:
                try:
                    got = readers.map(_header_and_size, self.paths,
                                      timeout=120.0 + len(self.paths) / 1000)
                except mp.TimeoutError:  # a worker died or hangs: threads, and no readers
                    readers.close()
                    readers, got = None, None
            if got is None:
                with ThreadPoolExecutor(8) as ex:
                    got = list(ex.map(_header_and_size, self.paths))
            self._take_infos([g[:3] for g in got])
        except BaseException:
            if readers is not None:
                readers.close()
            raise
        if max_samples is None:
            max_samples = int(max(self.frames.max(), 1))
        self.max_samples = int(max_samples)
        sizes = {p: g[3] for p, g in zip(self.paths, got)}  # 0: reported when its batch is read
        # the first CUDA call of this set-up comes after the header pass: a caller that starts
        # the device's context in another thread meanwhile (extraction's warm-up) overlaps them
        with self.device.activate():
            self._gpu = GpuFlacBatches(
                sizes, max_samples=self.max_samples, prefetch=min(self.prefetch, 2),
                window=settings.flac_window(),
                readers=readers if readers is not None else "threads",
                leave={p: g[4] for p, g in zip(self.paths, got) if g[4]},
                on_damage=self.on_damage,
            )
        self._pool = None
        self._mm = None
        self._host = None
        self._finalizer = weakref.finalize(self, lambda: None)

    def _submit_chunks(self, chunks):
        return [self._pool.submit(_decode_many, self._state, c) for c in chunks]

    def _restart_pool(self, pending):
        """A worker is stuck: replace the pool and hand the other batches' work to the new one."""
        self._pool.close()
        self._pool = self._new_pool()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, self._mm)
        for entry in pending:
            entry[3][:] = self._submit_chunks(entry[2])

    def _results(self, chunks, handles, pending):
        """The batch's per-item results; items with no answer by the deadline become errors."""
        deadline = time.monotonic() + self.timeout
        out, stuck = [], False
        for chunk, h in zip(chunks, handles):
            try:
                out.extend(h.result(timeout=max(0.0, deadline - time.monotonic())))
            except WorkerLost as e:  # its process died (replaced): the chunk's files fail
                why = f"the decoding worker process ended on this file's chunk ({e})"
                if self.strict:
                    raise CorruptDataError(chunk[0][2], why) from None
                out.extend((0, why) for _ in chunk)
            except cf.TimeoutError:
                stuck = True
                why = f"no answer from the decoding worker within {self.timeout:g} s"
                for _slot, _row, path, _limit in chunk:
                    err = DecodeTimeoutError(path, why)
                    if self.strict:
                        self._restart_pool(pending)
                        raise err from None
                    out.append((0, why))  # reported as DecodeTimeoutError (_as_errors)
        if stuck:
            self._restart_pool(pending)
        return out

    # -- GPU helpers -------------------------------------------------------------------------
    def _register(self):
        import cupy

        if self._registered:
            return
        try:
            ptr = self._host.ctypes.data
            cupy.cuda.runtime.hostRegister(ptr, self._host.nbytes, 0)
            self._registered = True
        except Exception:
            self._registered = None  # pageable copies then

    def _to_gpu(self, slot, b, max_len, lengths):
        import cupy

        self._register()
        itemsize = self.dtype.itemsize
        dst = cupy.empty((b, max_len), dtype=self.dtype)
        if self._registered and max_len > 0:
            src = self._host[slot].ctypes.data
            stream = cupy.cuda.get_current_stream()
            cupy.cuda.runtime.memcpy2DAsync(
                dst.data.ptr,
                max_len * itemsize,
                src,
                self.max_samples * itemsize,
                max_len * itemsize,
                b,
                cupy.cuda.runtime.memcpyHostToDevice,
                stream.ptr,
            )
            ev = cupy.cuda.Event(block=False, disable_timing=True)
            ev.record(stream)
            self._events[slot] = ev
        else:
            dst.set(np.ascontiguousarray(self._host[slot, :b, :max_len]))
            self._events[slot] = None
        lens = cupy.asarray(lengths)
        scale = np.float32(1.0 / 32768.0) if self.dtype == np.int16 else np.float32(1.0)
        keep = cupy.arange(max_len)[None, :] < lens[:, None]
        return cupy.where(keep, dst.astype(cupy.float32) * scale, cupy.float32(0))

    def _to_cpu(self, slot, b, max_len, lengths):
        x = self._host[slot, :b, :max_len].astype(np.float32)
        if self.dtype == np.int16:
            x *= np.float32(1.0 / 32768.0)
        x[np.arange(max_len)[None, :] >= lengths[:, None]] = 0
        return x

    # -- iteration ---------------------------------------------------------------------------
    def batches(self, epochs=1):
        """Yield ``(signals, lengths, paths, errors)`` for ``epochs`` passes in file order."""
        n = len(self.paths)
        groups = [range(i, min(i + self.batch, n)) for i in range(0, n, self.batch)]
        return self.decode_groups(groups[k % len(groups)] for k in range(len(groups) * int(epochs)))

    def decode_groups(self, groups):
        """Yield one :class:`AudioBatch` per group of ``groups`` (an iterable, read lazily, of
        lists of indices into ``paths``; at most ``batch_size`` each for the CPU decoder, any size
        for the GPU's), in order, decoded ahead
        as :meth:`batches` does (the worker processes' ring, or the GPU FLAC windows). A batch's
        row ``r`` is the group's ``r``-th index. For a training feed's own order: shuffled,
        sharded, bucketed groups."""
        n = len(self.paths)

        def path_groups():
            for g in groups:
                idx = [int(i) for i in g]
                if len(idx) > self.batch and self.decoder != "gpu":  # the ring's rows
                    raise ValueError(f"a group holds at most batch_size={self.batch} indices, "
                                     f"got {len(idx)}")
                if idx and (min(idx) < 0 or max(idx) >= n):
                    raise IndexError(f"indices must be in [0, {n}), got {idx}")
                yield [self.paths[i] for i in idx]

        return self._run(path_groups())

    def _run(self, groups):
        """The decoding loop over an iterator of path lists."""
        if self.decoder == "gpu":
            dev = str(self.device)
            for x, lengths, group, errs in self._gpu.run(groups):
                self.damaged.update(self._gpu.damaged)
                yield AudioBatch(x, lengths, list(group), _as_errors(group, errs), dev)
            return
        pending = deque()
        k_submit = 0
        source = iter(groups)
        exhausted = False

        def submit():
            nonlocal k_submit, exhausted
            group = next(source, None)
            if group is None:
                exhausted = True
                return
            slot = k_submit % self.n_slots
            old = self._inflight.pop(slot, None)
            if old is not None and not all(h.done() for h in old[1]):
                try:  # an earlier run's work on this slot (see below): its writes land first
                    self._results(old[0], old[1], pending)
                except Exception:  # noqa: BLE001 - only waited for
                    pass
            ev = self._events[slot]
            if ev is not None:
                ev.synchronize()
                self._events[slot] = None
            tasks = [(slot, r, p, self._limits.get(p)) for r, p in enumerate(group)]
            size = max(1, len(tasks) // (self.num_workers * 2))
            chunks = [tasks[i : i + size] for i in range(0, len(tasks), size)]
            pending.append((slot, group, chunks, self._submit_chunks(chunks)))
            k_submit += 1

        while not exhausted and len(pending) < self.prefetch:
            submit()
        try:
            yield from self._batches(pending, submit, lambda: exhausted)
        finally:
            # a consumer that stopped early: the work still in flight writes into its slots;
            # the next run waits for it before it reuses a slot (else a late write would
            # overwrite a new batch's row), not this close (a stuck file would hold it)
            while pending:
                slot, _, chunks, handles = pending.popleft()
                self._inflight[slot] = (chunks, handles)

    def _batches(self, pending, submit, exhausted):
        while pending:
            slot, group, chunks, handles = pending.popleft()
            results = self._results(chunks, handles, pending)
            lengths = np.array([r[0] for r in results], dtype=np.int64)
            errors = {i: r[1] for i, r in enumerate(results) if r[1] is not None}
            for i, r in enumerate(results):
                if len(r) > 2 and r[2]:
                    self.damaged[group[i]] = r[2]
            b = len(group)
            max_len = int(lengths.max()) if b else 0
            if self.decode_only:
                x = None  # decode only (measurements)
            elif self.device.is_cuda:
                x = self._to_gpu(slot, b, max_len, lengths)
            else:
                x = self._to_cpu(slot, b, max_len, lengths)
            if not exhausted():
                submit()
            yield AudioBatch(x, lengths, group, _as_errors(group, errors), str(self.device))

    def close(self):
        if self._registered:
            try:
                import cupy

                for ev in self._events:
                    if ev is not None:
                        ev.synchronize()
                cupy.cuda.runtime.deviceSynchronize()
                cupy.cuda.runtime.hostUnregister(self._host.ctypes.data)
            except Exception:
                pass
            self._registered = False
        if getattr(self, "_gpu", None) is not None:
            self._gpu.close()  # its reader processes
        self._host = None
        self._pool = None
        self._finalizer()  # ends the workers; closes the shared buffer unless a caller views it

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
