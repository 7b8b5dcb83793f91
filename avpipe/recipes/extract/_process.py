"""Turning items into feature arrays: decode streams per kind, operators, shard assembly.

Each kind has an ordered stream over a worker's items of that kind (decoding runs ahead in the
background: the batched audio loader's processes or GPU decoder, a thread pool of video
decoders, the image stream). :func:`iter_shards` pulls the results shard by shard, in input
order. Audio features are computed in batches formed *within a shard* (``batch_size``
consecutive audio items of the shard), so an item's bytes never depend on which worker or
engine ran it: the same shard gives the same bytes everywhere on one kind of device.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from ... import settings
from ..._source import NOT_REGULAR, is_special_file
from ...decoding.audio import (
    flac_header_info,
    flac_length_of_path,
    load_audio,
    shorter_than_declared,
)
from ...decoding.audio.flac_gpu import compile_kernels as flac_compile_kernels
from ...decoding.image import decode_image_batch
from ...decoding.video import VideoDecoder
from ...device import download, to_numpy
from ...errors import CorruptDataError, naming, renamed
from ...formats import is_flac
from ...ops import registry
from ...pipeline import AbandonablePool
from ...pipeline.audio_loader import AudioBatchLoader
from ...pipeline.image_stream import decode_image_stream
from ...pipeline.samplers import clip_indices_regular, uniform_indices
from ...pipeline.sources import Item


def profiling() -> bool:
    """``AVPIPE_EXTRACT_PROFILE``: time each stage and print a breakdown."""
    return settings.extract_profile()
_times: dict[str, float] = {}


class timed:
    """Adds the block's wall time to ``_times[name]`` when AVPIPE_EXTRACT_PROFILE is set."""

    __slots__ = ("name", "t")

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        if profiling():
            self.t = time.perf_counter()

    def __exit__(self, *exc):
        if profiling():
            _times[self.name] = _times.get(self.name, 0.0) + time.perf_counter() - self.t


def mark(name: str, seconds: float) -> None:
    """Record a one-off duration (start-up phases) when AVPIPE_EXTRACT_PROFILE is set."""
    if profiling():
        _times[name] = _times.get(name, 0.0) + seconds


def profile_report() -> str:
    return ", ".join(f"{k} {v:.2f} s" for k, v in sorted(_times.items()))


# audio files longer than this go through the one-file-at-a-time path (the batched loader
# sizes its ring by the longest file)



@dataclass
class Result:
    """One input's outcome: ``array`` (numpy) and ``info`` when ok, else ``error`` / ``message``."""

    item: Item
    array: np.ndarray | None = None
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    message: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _fail(item: Item, e: BaseException | str) -> Result:
    if isinstance(e, BaseException):
        return Result(item, error=type(e).__name__, message=str(e))
    return Result(item, error="DecodeError", message=str(e))


# --- operators ------------------------------------------------------------------------------


def apply_audio_ops(x, lengths, sample_rate: int, ops: list[dict], *, host_lengths=True):
    """``x [B, n]`` (numpy or cupy, zero-padded), ``lengths`` host int64 -> ``(features
    [B, C, T], frame_lengths)``: host int64, or with ``host_lengths=False`` where the
    operators left them (on the device for a cupy batch: no wait for the device here). Each
    operator is the registry's (:mod:`avpipe.ops.registry`, checked when the preset was read),
    given the preset's ``sample_rate`` where it takes one."""
    data = (x, lengths)
    for op in ops:
        entry = registry.get(op["op"], "audio")
        data = entry.apply(data, {k: v for k, v in op.items() if k != "op"},
                           sample_rate=sample_rate)  # fmt: skip
    feats, fl = data
    if host_lengths:
        fl = np.asarray(to_numpy(fl), dtype=np.int64).reshape(-1)
    return feats, fl


def apply_pixel_ops(x, ops: list[dict]):
    """``x [H, W, 3]`` or ``[N, H, W, 3]`` uint8 -> the same after the registry's image
    operators (resize, center_crop, ...)."""
    for op in ops:
        x = registry.get(op["op"], "image").apply(x, {k: v for k, v in op.items() if k != "op"})
    return x


# --- ordered streams ------------------------------------------------------------------------


def _ordered_map(fn, items, threads: int) -> Iterator:
    """``fn(item)`` for each item, in order, with at most ``2 * threads`` running ahead, on
    daemon threads nothing joins (:class:`~avpipe.pipeline._threads.AbandonablePool`): a read
    that never returns, given up by the Ray engine's watch, holds its thread, never the
    process's exit. Stopped early, it cancels what has not started."""
    if not items:
        return
    ex = AbandonablePool(max(1, threads), "avpipe-extract-map")
    try:
        pending: deque = deque()
        it = iter(items)
        for x in it:
            pending.append(ex.submit(fn, x))
            if len(pending) >= 2 * threads:
                break
        while pending:
            yield pending.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(ex.submit(fn, nxt))
    finally:
        ex.shutdown(cancel_futures=True)


def _first_byte(path) -> None:
    """Read ``path``'s first byte in Python before a library opens it: a read that never
    returns then blocks here, in this thread alone. soundfile opens every file under one
    process-wide lock, so a stuck ``sf_open`` of a path would stop every other audio open of
    the worker. Errors are left to the decoder."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError:
        pass


def _probe_audio(item: Item):
    """``(frames, sample rate, subtype, channels)`` or None. FLAC: its STREAMINFO (one small
    read)."""
    import soundfile as sf

    _first_byte(item.path)
    if is_flac(item.path):
        fl = flac_length_of_path(item.path)
        if fl is not None and fl.problem:  # a count its frames contradict: load_audio's
            return None
        h = flac_header_info(item.path)
        if h is not None and h[2] == 1:
            return int(h[0]), int(h[1]), "FLAC", 1
    try:
        i = sf.info(item.path)
        return int(i.frames), int(i.samplerate), str(i.subtype), int(i.channels)
    except Exception:
        return None


def _probe_all(items: list[Item], threads: int = 16) -> list:
    """:func:`_probe_audio` of each item, on daemon threads nothing waits for at exit; a
    probe without an answer within ``AVPIPE_EXTRACT_FILE_TIMEOUT`` seconds (a read that never
    returns) is None: its input goes the one-by-one way, whose wait the engine's watchdog
    times, and the probe's thread is left behind."""
    if not items:
        return []
    pool = AbandonablePool(threads, "avpipe-extract-probe")
    try:
        futs = [pool.submit(_probe_audio, it) for it in items]
        limit = settings.extract_file_timeout()
        out = []
        for f in futs:
            t0 = time.monotonic()
            while True:  # a slow probe's wait starts when it starts, not when it was queued
                try:
                    out.append(f.result(timeout=0.1 if limit else None))
                    break
                except TimeoutError:
                    if not f.running():
                        t0 = time.monotonic()
                    elif time.monotonic() - t0 > limit:
                        out.append(None)
                        break
        return out
    finally:
        pool.shutdown(cancel_futures=True)


@dataclass(frozen=True)
class Rows:
    """A decoded signal: row ``row`` of a padded batch ``x`` (zero past ``n`` unless ``cut``:
    the row holds more, decoded past the item's manifest duration), or the 1-D array ``x``
    itself (``row`` None); ``damaged``: why it is damaged though decoded (kept with
    ``on_damage="warn"``, recorded in its index row's ``info``), or None."""

    x: Any
    row: int | None
    n: int
    damaged: str | None = None
    cut: bool = False

    def signal(self):
        return self.x if self.row is None else self.x[self.row, : self.n]


def warm_up_audio(acfg: dict, dev, *, flac: bool = False) -> list[threading.Thread]:
    """Start compiling what the first audio batch needs, ahead of it, in threads (returned,
    started): the GPU FLAC decoder's kernels (``flac``) in one, the preset's operators (run on
    a small zero batch, thrown away: their kernels, cuFFT's plan and libraries) in another. On
    a GPU each is NVRTC compiling on a machine without CuPy's kernel cache (seconds, with the
    GIL released), which the first batch would otherwise wait for one after the other, after
    the files' headers are read. Errors are left to the real batch."""

    def flac_kernels():
        try:
            with dev.activate():  # a new thread's current device is not the caller's
                flac_compile_kernels()
        except Exception:  # noqa: BLE001
            pass

    def operators():
        try:
            with dev.activate():
                sr = int(acfg["sample_rate"])
                lens = np.array([2 * sr, sr], dtype=np.int64)
                x = dev.xp.zeros((2, 2 * sr), dtype=dev.xp.float32)
                x[0, ::97] = 0.25  # not all zeros: some operators branch on silence
                x[1, : sr : 89] = -0.25
                feats, _ = apply_audio_ops(x, lens, sr, acfg["ops"])
                if acfg.get("dtype", "float32") != "float32":
                    feats = feats.astype(acfg["dtype"])
                _to_host(feats)
        except Exception:  # noqa: BLE001
            pass

    threads = [threading.Thread(target=f, daemon=True, name=f"avpipe-extract-warm-up-{i}")
               for i, f in enumerate([flac_kernels] * flac + [operators])]
    for t in threads:
        t.start()
    return threads


class _AudioStream:
    """Decoded audio per item, in order: ``(item, Rows | None, error)``.

    On a GPU, files at the preset's rate, read whole, no longer than
    ``AVPIPE_EXTRACT_LOADER_MAX_SECONDS`` go through AudioBatchLoader (GPU FLAC decode for
    .flac, worker processes otherwise); the rest (other rates: resampled; manifest offsets;
    long files; what libsndfile cannot open), and every file on the CPU, through
    ``load_audio`` in a thread pool."""

    def __init__(self, items: list[Item], cfg: dict, dev, workers: int, batch: int):
        self.items = items
        self.sr = int(cfg["sample_rate"])
        self.cfg = cfg
        # a file holding fewer samples than its header, or its manifest's duration, declares:
        # an error (errors.jsonl; counted by --strict), or kept and noted (--allow-damaged)
        self.on_damage = cfg.get("on_damage", "error")
        self.dev = dev
        self.route = {}
        self.streams = {}
        rest = items
        self.warm: list[threading.Thread] = []
        if dev.is_cuda:
            # FLAC on a GPU: the loader reads every file's STREAMINFO itself, no probe first
            flac = [it for it in items
                    if is_flac(it.path) and "offset" not in it.fields]
            # the kernels compile in threads meanwhile (joined before any loader forks)
            self.warm = warm_up_audio(cfg, dev, flac=bool(flac))
            loader = self._gpu_loader(flac, batch) if flac else None
            if loader is not None:
                self.streams["flac"] = self._loader_stream(flac, loader)
                self.route.update((it.index, "flac") for it in flac)
                rest = [it for it in items if it.index not in self.route]
        # a shard's members: decoded from their bytes one by one (no file to probe or batch)
        members = [it for it in rest if it.locator is not None]
        rest = [it for it in rest if it.locator is None]
        if members:
            self.route.update((it.index, "members") for it in members)
            self.streams["members"] = _ordered_map(self._load_one, members, max(2, workers))
        if not rest:
            return
        if not dev.is_cuda:
            # on the CPU every file is decoded by load_audio in this process's threads
            # (libsndfile releases the GIL): the features are computed on the same cores, so
            # the batched loader's worker processes would only add their start, a probe of
            # every file and a copy through shared memory
            self.route.update((it.index, "slow") for it in rest)
            self.streams["slow"] = _ordered_map(self._load_one, rest, max(2, workers))
            return
        with timed("audio probe"):
            probes = _probe_all(rest)
        cap = int(settings.extract_loader_max_seconds() * self.sr)
        groups: dict[str, list] = {"other": [], "slow": []}
        for it, p in zip(rest, probes):
            if p is None or p[1] != self.sr or p[0] <= 0 or p[0] > cap or "offset" in it.fields:
                g = "slow"
            else:
                g = "other"
            groups[g].append((it, p))
            self.route[it.index] = g
        if groups["other"]:
            # this loader forks its worker processes: no thread of ours running
            with timed("audio warm-up wait"):
                self.join_warm_up()
            group = groups["other"]
            # int16 transport is exact for mono 16-bit PCM only: a downmix (the channels'
            # mean) is not an integer, and rounding it to int16 would change the features
            pcm16 = all(p[2] == "PCM_16" and p[3] == 1 for _, p in group)
            kwargs = dict(batch_size=batch, device=str(dev) if dev.is_cuda else "cpu",
                          max_samples=max(p[0] for _, p in group), prefetch=4, decoder="cpu",
                          on_damage=self.on_damage,
                          num_workers=max(1, workers), transport="int16" if pcm16 else "float32")
            with dev.activate(), timed("audio loader init (cpu)"):
                loader = AudioBatchLoader([it.path for it, _ in group], **kwargs)
            self.streams["other"] = self._loader_stream([it for it, _ in group], loader)
        if groups["slow"]:
            self.streams["slow"] = _ordered_map(self._load_one, [it for it, _ in groups["slow"]],
                                                max(2, workers))

    def _gpu_loader(self, flac: list[Item], batch: int):
        """The GPU FLAC loader over ``flac``, or None when they are not all at the preset's
        rate (then they are probed and routed one by one)."""
        try:
            # not inside dev.activate(): the loader's header pass needs no device, and the
            # warm-up threads create the device's context meanwhile (a third of a second)
            with timed("audio loader init (gpu flac)"):
                loader = AudioBatchLoader([it.path for it in flac], batch_size=batch,
                                          device=str(self.dev), prefetch=4, decoder="gpu",
                                          on_damage=self.on_damage)
        except ValueError:  # several sample rates
            return None
        if loader.sample_rate not in (None, self.sr):
            loader.close()
            return None
        return loader

    def _loader_stream(self, items: list[Item], loader):
        try:
            k = 0
            with self.dev.activate():
                for x, lengths, _paths, errors in loader.batches():
                    errors = dict(errors)  # (index, DecodeError) pairs -> {index: error}
                    for i in range(len(lengths)):
                        it = items[k]
                        k += 1
                        if i in errors:
                            yield it, None, errors[i]
                            continue
                        n = int(lengths[i])
                        why = loader.damaged.get(it.path) or self._short(it, n)
                        if why and self.on_damage == "error":
                            yield it, None, CorruptDataError(it.path, why)
                        else:  # the row of the loader's batch (zero past the length), cut
                            # at the manifest's duration as load_audio (and the feeds) cut it
                            m = self._span_of(it, n)
                            yield it, Rows(x, i, m, why, cut=m < n), None
        finally:
            loader.close()

    def _load_one(self, it: Item):
        f = it.fields
        try:
            if it.locator is None:
                _first_byte(it.path)  # a read that never returns stops here, not in soundfile
            src = it.media()
            offset = float(f.get("offset", 0.0) or 0.0)
            duration = f.get("duration")  # a span [offset, offset + duration), as the feeds
            with self.dev.activate(), naming(it.path, src):
                a = load_audio(src, sample_rate=self.sr, offset=offset,
                                     duration=None if duration is None else float(duration),
                                     device=str(self.dev), on_damage=self.on_damage)
            n = int(a.samples.shape[-1])
            if n == 0:
                return it, None, "no audio samples"
            why = a.damaged or self._short(it, n)
            if why and self.on_damage == "error":
                return it, None, CorruptDataError(it.path, why)
            rows = Rows(a.samples, None, n, why)
            if not self.dev.is_cuda:
                # on the CPU the features are computed here, in the decoding thread (NumPy's
                # FFT and matrix products release the GIL): the cores compute items side by
                # side instead of the main thread computing each batch alone; an item's
                # features are the same alone as in a batch (test_extract_purity)
                (r,) = _launch_audio_features([(it, rows)], self.cfg, self.dev)()
                return it, r, None
            return it, rows, None
        except Exception as e:  # noqa: BLE001 - a bad input is recorded, never fatal
            return it, None, e

    def _span_of(self, it: Item, n: int) -> int:
        """``n`` decoded samples (at the preset's rate, the file's own in the loader) cut at the
        item's manifest ``duration``, rounded to the nearest sample as ``load_audio`` rounds."""
        d = it.fields.get("duration")
        if d is None:
            return n
        return min(n, int(math.floor(float(d) * self.sr + 0.5)))

    def _short(self, it: Item, n: int) -> str | None:
        """Why ``n`` samples at the preset's rate fall short of the item's manifest
        ``duration`` (beyond the tolerance of ``shorter_than_declared``), or None."""
        try:
            declared = float(it.fields.get("duration") or 0.0)
        except (TypeError, ValueError):
            return None
        return shorter_than_declared(n, self.sr, declared)

    def join_warm_up(self) -> None:
        """Wait for the warm-up threads (long done by the end of a worker's audio; joined so
        that none is inside CUDA calls when the process exits)."""
        for t in self.warm:
            t.join()

    def close(self) -> None:
        """End the streams: the loaders' worker processes and their queues' semaphores (a
        stream left suspended at its last item would keep them until the interpreter's
        tear-down, which a worker process skips)."""
        self.join_warm_up()
        for stream in self.streams.values():
            stream.close()
        self.streams.clear()

    def next_for(self, item: Item):
        got = next(self.streams[self.route[item.index]])
        assert got[0].index == item.index, (got[0].index, item.index)
        return got


def _video_one(item: Item, vcfg: dict, dev):
    try:
        src = item.media()
        with dev.activate(), naming(item.path, src):
            with VideoDecoder(src, device=str(dev)) as dec:
                m = dec.metadata
                n = int(m.num_frames)
                if n <= 0:
                    raise ValueError("no video frames")
                idx = video_indices(vcfg, m)
                flat = idx.reshape(-1)
                batch = dec.get_frames(flat.tolist())
                data = batch.data
                data = data.reshape(*idx.shape, *data.shape[1:])
                pts = np.asarray(batch.pts_seconds).reshape(idx.shape)
            lead = data.shape[: idx.ndim]
            px = apply_pixel_ops(data.reshape(-1, *data.shape[idx.ndim:]), vcfg["ops"])
            px = px.reshape(*lead, *px.shape[1:])
            arr = np.ascontiguousarray(to_numpy(px))
        info = {"frame_indices": idx.tolist(),
                "times": [round(float(t), 6) for t in pts.reshape(-1)],
                "num_frames": n, "fps": round(float(m.average_fps), 6),
                "height": int(m.height), "width": int(m.width)}
        return Result(item, arr, info)
    except Exception as e:  # noqa: BLE001
        return _fail(item, e)


def video_indices(vcfg: dict, m) -> np.ndarray:
    """The frame indices a video sampler picks: [N] (uniform, fps) or [clips, T] (clips)."""
    n = int(m.num_frames)
    s = vcfg["sampler"]
    if s == "uniform":
        return uniform_indices(n, int(vcfg["num_frames"]))
    if s == "fps":
        step = 1.0 / float(vcfg["fps"])
        count = max(1, int(np.floor((m.end_seconds - m.begin_seconds) / step - 1e-9)) + 1)
        if vcfg.get("max_frames"):
            count = min(count, int(vcfg["max_frames"]))
        t = m.begin_seconds + np.arange(count) * step
        t = t[t < m.end_seconds - 1e-9] if count > 1 else t
        idx = np.searchsorted(np.asarray(m.pts_seconds), t + 1e-9, side="right") - 1
        return np.clip(idx, 0, n - 1).astype(np.int64)
    T, C, st = int(vcfg["clip_length"]), int(vcfg["num_clips"]), int(vcfg["stride"])
    # a video shorter than one clip: every clip is the whole video, its last frame repeated
    return clip_indices_regular(n, clip_length=T, stride=st, num_clips=C,
                                short_video="repeat_last")


def _image_stream(items: list[Item], icfg: dict, dev, batch: int) -> Iterator[Result]:
    """Each item's thumbnail (or its error), in order. Files are looked for once: the decoded
    batches are matched to the files found then, so a file that disappears later fails alone
    (its batch is decoded again item by item) and never shifts other items' outputs."""
    present = [it for it in items if it.locator is not None or os.path.isfile(it.path)]
    position = {it.index: k for k, it in enumerate(present)}
    members = any(it.locator is not None for it in present)

    def batches(start: int):
        """Batches of ``present[start:]``, ``batch`` images each."""
        paths = [it.path for it in present[start:]]
        if not paths:
            return iter(())
        if members:  # a shard's members: each batch's bytes read when it is decoded
            return (_named_batch(present[start + i: start + i + batch],
                                 [it.media() for it in present[start + i: start + i + batch]],
                                 dev)
                    for i in range(0, len(paths), batch))
        if dev.is_cuda:
            with dev.activate():
                return iter(decode_image_stream(paths, batch_size=batch, device=str(dev)))
        # on the CPU, batch by batch: DALI's CPU decoder behind the prefetching stream can
        # crash the process (SIGSEGV in ImageDecoder<CPUBackend>) on damaged images while the
        # audio loader's worker processes run beside it; decode_image_batch does not
        return (decode_image_batch(paths[i : i + batch], device="cpu")
                for i in range(0, len(paths), batch))

    def one_by_one(start: int):
        """``present[start:start + batch]`` decoded alone each: (images, {position: error})."""
        imgs, errs = [], {}
        for j, it in enumerate(present[start : start + batch]):
            try:
                b = _named_batch([it], [it.media()], dev)
                imgs.append(b.images[0] if not b.errors else None)
                if b.errors:
                    errs[j] = b.errors[0][1]
            except Exception as e:  # noqa: BLE001 — this item's error, not the batch's
                imgs.append(None)
                errs[j] = e
        return imgs, errs

    stream = batches(0)
    imgs, errs = [], {}
    for it in items:
        k = position.get(it.index)
        if k is None:
            yield _fail(it, FileNotFoundError(f"no such file: {it.path}"))
            continue
        if k % batch == 0:
            try:
                with dev.activate():
                    b = next(stream)
                errs, imgs = dict(b.errors), b.images
            except Exception:  # noqa: BLE001 — a stream that raised is over: restart it after
                imgs, errs = one_by_one(k)
                stream = batches(k + batch)
        j = k % batch
        if j in errs:
            yield _fail(it, errs[j])
            continue
        try:
            with dev.activate():
                img = imgs[j]
                h, w = int(img.shape[0]), int(img.shape[1])
                arr = np.ascontiguousarray(to_numpy(apply_pixel_ops(img, icfg["ops"])))
            yield Result(it, arr, {"height": h, "width": w})
        except Exception as e:  # noqa: BLE001
            yield _fail(it, e)


def _named_batch(items: list[Item], sources: list, dev):
    """``decode_image_batch`` of ``sources``, its errors about bytes naming their inputs."""
    with dev.activate():
        b = decode_image_batch(sources, device=str(dev))
    errors = [(j, renamed(e, items[j].path)) for j, e in b.errors]
    return SimpleNamespace(images=b.images, errors=errors)


# --- shard assembly -------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """Inputs ``start .. end - 1`` of the input list."""

    start: int
    end: int


def iter_shards(
    shards: list[Shard],
    items,
    cfg: dict,
    dev,
    *,
    workers: int,
    on_result: Callable[[Result], None] | None = None,
    blocked: dict | None = None,
) -> Iterator[tuple[Shard, list[Result]]]:
    """An iterator of ``(shard, results in input order)`` for each shard, computing on ``dev``. ``items``: the
    input list, or a mapping from index to :class:`Item` holding at least the shards' inputs.

    The decoders (and the batched loader's worker processes, forked) are set up here, before
    the first result is asked for: call it before starting threads of your own.
    ``blocked``: ``{input index: why}`` for inputs not to decode (a decoder crashed the process
    on them): they are reported as errors; so are inputs that are not regular files and
    inputs refused with the input list (``Item.error``)."""
    batch = int(cfg["batch_size"])
    blocked = dict(blocked or {})
    for s in shards:  # pipes, sockets, devices: never opened (a read may never return)
        for i in range(s.start, s.end):
            p = items[i].path
            if i not in blocked and items[i].error is not None:  # refused with the input list
                blocked[i] = items[i].error
            elif i not in blocked and is_special_file(p):
                blocked[i] = ("UnsupportedFormatError", f"{p}: {NOT_REGULAR}")
    mine = [items[i] for s in shards for i in range(s.start, s.end) if i not in blocked]
    by_kind = {k: [it for it in mine if it.kind == k] for k in ("audio", "video", "image")}
    audio = video = image = None
    if by_kind["audio"]:
        audio = _AudioStream(by_kind["audio"], cfg["audio"], dev, workers, batch)
    if by_kind["video"]:
        threads = max(2, workers) if not dev.is_cuda else 8
        video = _ordered_map(lambda it: _video_one(it, cfg["video"], dev), by_kind["video"],
                             threads)
    if by_kind["image"]:
        image = _image_stream(by_kind["image"], cfg["image"], dev, batch)

    return _shard_results(shards, items, cfg, dev, batch, audio, video, image, on_result, blocked)


def _shard_results(shards, items, cfg, dev, batch, audio, video, image, on_result, blocked):
    def emit(r):
        if on_result is not None:
            on_result(r)
        return r

    try:
        yield from _shard_results_of(shards, items, cfg, dev, batch, audio, video, image, emit,
                                     blocked)
    finally:  # every shard given, or the caller stopped: the decoders' processes end here
        if dev.is_cuda:
            # a batch still in flight when an error or the caller ended a shard: its copy into
            # page-locked memory finishes before that memory can go back to the pool
            with dev.activate():
                dev.xp.cuda.Device().synchronize()
        if audio is not None:
            audio.close()
        for stream in (video, image):
            close = getattr(stream, "close", None)
            if close is not None:
                close()


# the input the worker's main thread waits for, since when (``time.monotonic()``), and whether
# it is the first of its kind (that wait includes its decoders' start): read by the local
# engine's watchdog (``_engine_local``), which gives up a worker that waits on one input longer
# than ``AVPIPE_EXTRACT_FILE_TIMEOUT`` (a read that never returns). Set where the wait is for
# that input alone: videos and audio decoded one by one (a batch loader's or the image
# stream's wait is for a batch, and blaming its first file would be wrong; the audio loaders
# time out their batches themselves)
WAITING = {"index": None, "since": 0.0, "first": False, "kinds": set()}


def _next_of(it, get):
    WAITING["since"] = time.monotonic()
    WAITING["first"] = it.kind not in WAITING["kinds"]
    WAITING["index"] = it.index
    try:
        return get()
    finally:
        WAITING["index"] = None
        WAITING["kinds"].add(it.kind)


def _shard_results_of(shards, items, cfg, dev, batch, audio, video, image, emit, blocked):
    for s in shards:
        results: dict[int, Result] = {}
        pending: list = []  # decoded audio waiting for its batch: (item, signal)
        launched: list = []  # the batch whose features are on their way (at most one)

        def collect(launched, results):
            for r in launched.pop()():
                results[r.item.index] = emit(r)

        def flush(pending, launched, results):
            # the next batch is queued before the last one is collected: the device computes
            # one while the host gathers the next
            nxt = _launch_audio_features(list(pending), cfg["audio"], dev)
            pending.clear()
            if launched:
                collect(launched, results)
            launched.append(nxt)

        for it in (items[i] for i in range(s.start, s.end)):
            if it.index in blocked:
                why = blocked[it.index]  # a crash's text, or (error type, message)
                err, msg = why if isinstance(why, tuple) else ("CorruptDataError", why)
                results[it.index] = emit(Result(it, error=err, message=msg))
            elif it.kind == "audio":
                with timed("audio decode wait"):
                    if audio.route.get(it.index) == "slow":  # one file at a time: watched
                        _, sig, err = _next_of(it, lambda it=it: audio.next_for(it))
                    else:  # a batch loader: its own timeout fails the batch's late files
                        _, sig, err = audio.next_for(it)
                if err is not None:
                    results[it.index] = emit(_fail(it, err))
                elif isinstance(sig, Result):  # its features were computed with its decode
                    results[it.index] = emit(sig)
                else:
                    pending.append((it, sig))
                    if len(pending) >= batch:
                        flush(pending, launched, results)
            elif it.kind == "video":
                r = _next_of(it, lambda: next(video))
                assert r.item.index == it.index
                results[it.index] = emit(r)
            else:  # decoded a batch at a time: a wait is not one file's (not watched)
                r = next(image)
                assert r.item.index == it.index
                results[it.index] = emit(r)
        if pending:
            flush(pending, launched, results)
        if launched:
            collect(launched, results)
        if s is shards[-1] and audio is not None:
            audio.join_warm_up()
        yield s, [results[i] for i in range(s.start, s.end)]


def _to_host(x) -> np.ndarray:
    """numpy as it is; cupy copied into page-locked memory (several times faster than a
    pageable copy) and waited for."""
    (host,), event = download([x])
    if event is not None:
        event.synchronize()
    return host


def _audio_batch(pending, dev):
    """The padded signals ``[B, n]`` of ``pending`` ((item, Rows) pairs) and their lengths."""
    xp = dev.xp
    lens = np.array([sig.n for _, sig in pending], dtype=np.int64)
    width = int(lens.max())
    first = pending[0][1]
    if (first.row is not None and first.x.shape[1] == width
            and all(sig.x is first.x and sig.row == first.row + i and not sig.cut
                    for i, (_, sig) in enumerate(pending))):
        # the batch is rows r..r+b of one loader batch of the same width: no copy (same
        # values as the copy below: the loader's batches are zero past each length)
        return first.x[first.row : first.row + len(pending)], lens
    x = xp.zeros((len(pending), width), dtype=xp.float32)
    for i, (_, sig) in enumerate(pending):
        x[i, : lens[i]] = sig.signal()
    return x, lens


def _launch_audio_features(pending, acfg: dict, dev) -> Callable[[], list[Result]]:
    """Queue the features of a batch of decoded audio (``pending``: (item, Rows) pairs) and
    their copy to the host, without waiting for the device; returns the function that waits
    for them and gives the batch's Results. On a GPU the caller launches the next batch
    before it collects this one, so the device computes one batch while the host gathers the
    next (the wait for a batch was a third of a worker's audio time). The batch's signals and
    features are held until collected (their memory is not handed back to the pool while a
    kernel or the copy may still read it). A batch that fails is computed again item by item,
    so one bad input costs only itself."""
    sr = int(acfg["sample_rate"])
    try:
        with dev.activate():
            x, lens = _audio_batch(pending, dev)
            with timed("audio features"):
                feats, fl = apply_audio_ops(x, lens, sr, acfg["ops"], host_lengths=False)
                if acfg.get("dtype", "float32") != "float32":  # cast on the device
                    feats = feats.astype(acfg["dtype"])
                (host, fl_host), event = download([feats, fl])
    except Exception as e:  # noqa: BLE001 - the batch fails: each item alone
        return _each_alone(pending, acfg, dev, e)

    def collect() -> list[Result]:
        nonlocal x, feats
        failed = None
        if event is not None:
            try:
                with timed("audio to host"):
                    event.synchronize()
            except Exception as e:  # noqa: BLE001
                failed = e
        x = feats = None  # the device memory goes back once the copy is done (or failed)
        if failed is not None:
            return _each_alone(pending, acfg, dev, failed)()
        fls = np.asarray(fl_host, dtype=np.int64).reshape(-1)
        out = []
        for i, (it, _) in enumerate(pending):
            arr = host[i, ..., : int(fls[i])]  # a view: written as it is (C order)
            info = {"sample_rate": sr, "num_samples": int(lens[i]),
                    "seconds": round(lens[i] / sr, 6), "frames": int(fls[i])}
            if pending[i][1].damaged:  # kept though damaged (--allow-damaged): said so
                info["damaged"] = pending[i][1].damaged
            out.append(Result(it, arr, info))
        return out

    return collect


def _each_alone(pending, acfg: dict, dev, e: BaseException) -> Callable[[], list[Result]]:
    """The collector of a failed batch: a single item fails with ``e``; several are computed
    one by one (in order, when collected). ``e`` is kept without its traceback, whose frames
    would hold the failed batch's device arrays until then."""
    e = e.with_traceback(None)
    if len(pending) == 1:
        return lambda: [_fail(pending[0][0], e)]
    return lambda: [r for p in pending for r in _launch_audio_features([p], acfg, dev)()]
