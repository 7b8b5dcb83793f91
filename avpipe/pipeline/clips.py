"""A feed of transformed video clips: per file one random clip, decoded by a pool of threads.

Each clip is ``clip_length`` frames ``stride`` apart at a seeded random start
(:func:`~avpipe.pipeline.samplers.sample_random_clips`), decoded by a :class:`VideoDecoder` on
the feed's device (NVDEC on a GPU: each thread has its own decoder session and CUDA stream),
then resized (short side), centre-cropped and normalized in one fused pass
(:func:`avpipe.ops.image.resize_crop_normalize`) into ``[clip_length, 3, crop, crop]``::

    feed = ClipFeed(paths, clip_length=16, stride=4, crop_size=224, batch_size=8, device="cuda")
    for batch in feed:                 # one epoch, a new shuffle each time
        batch.clips                    # [B, 16, 3, 224, 224] float16 on the device
        batch.errors                   # ((index in the epoch, DecodeError), ...): skipped files

This is the workload the ``video`` benchmark (``benchmarks/workloads/video.py``) measures (its ``avpipe`` contender calls
:meth:`ClipFeed.clip` from its own threads). Threads overlap well here: decoding waits on NVDEC
and the transform is one kernel, so a thread per decoder session keeps NVDEC's engines busy.
Iterating keeps them busy across batches too: up to ``2 * threads + batch_size`` clips are
decoded ahead of the consumer (40 with the defaults: about 190 MB of float16 224² clips), in the
epoch's order (no thread waits for a batch's slowest clip).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import settings
from .._results import BatchResult
from .._validate import check_on_error, pos_int
from ..decoding import load_index
from ..decoding.video import VideoDecoder
from ..device import resolve_device
from ..errors import DecodeError
from ..ops import image as _image
from . import samplers
from ._threads import ProcessThreads
from .feed import EpochOrder, Work, collect_works, resolve_deadline
from .scan_ahead import SCAN_DEPTH, ScanAhead

__all__ = ["ClipFeed", "Clip", "ClipBatch", "ThreadStreams", "decode_clip"]


class ThreadStreams:
    """One non-blocking CUDA stream per calling thread on ``device`` (None on the CPU)."""

    def __init__(self, device):
        self.device = device
        self._local = threading.local()

    def get(self):
        if not self.device.is_cuda:
            return None
        s = getattr(self._local, "stream", None)
        if s is None:
            import cupy

            with cupy.cuda.Device(self.device.index):
                s = self._local.stream = cupy.cuda.Stream(non_blocking=True)
        return s


def decode_clip(path, select, transform, *, device, stream=None, on_open=None, index=None):
    """The one "decode a clip's frames on this thread's stream" of :class:`ClipFeed` and the
    video recipe: open ``path`` with a :class:`VideoDecoder` on ``device`` (``index``: a
    persisted video index, as ``VideoDecoder``'s), ``select(dec) ->
    (frames, meta)`` (decodes only the frames it asks for), then ``transform(frames, meta)``
    inside ``stream`` (this thread's; None on the CPU), finished before returning (its result
    is ready for any other stream). ``on_open(seconds)``: told the open + scan time.

    Returns ``(transformed, meta, backend, pts_mismatches)``."""
    import time

    t0 = time.perf_counter()
    dec = VideoDecoder(path, device=device, index=index)
    if on_open is not None:
        on_open(time.perf_counter() - t0)
    with dec:
        frames, meta = select(dec)
        if stream is None:
            out = transform(frames, meta)
        else:
            with stream:
                out = transform(frames, meta)
            stream.synchronize()
        backend = dec.backend
        mismatches = int(getattr(dec._gpu, "pts_mismatches", 0) or 0)
    return out, meta, backend, mismatches


@dataclass(frozen=True)
class Clip:
    """One transformed clip: ``data`` [T, 3, crop, crop] (layout ``"NCHW"``) on the feed's
    device; ``indices`` and ``pts_seconds`` [T] numpy; ``backend``: ``"nvdec"`` or ``"pyav"``;
    ``pts_mismatches``: frames NVDEC numbered differently from the scan (decoded on the CPU)."""

    data: Any
    indices: np.ndarray
    pts_seconds: np.ndarray
    path: str
    backend: str
    pts_mismatches: int = 0


@dataclass(frozen=True)
class ClipBatch(BatchResult):
    """``clips`` [B, T, 3, crop, crop] on the feed's device (None when every item failed);
    ``paths`` the B good items' paths; ``errors`` ``(index in the epoch, DecodeError)``."""

    clips: Any = None
    paths: tuple = ()
    errors: tuple = ()
    device: str = "cpu"


class ClipFeed:
    """Batches of one random clip per file (see the module's docstring).

    Args:
        paths: video files.
        clip_length, stride: frames per clip and the step between them.
        crop_size, short_side: resize the short side to ``short_side`` (default ``crop_size``),
            then a centre crop of ``crop_size``.
        mean, std, dtype, layout, antialias: as :func:`avpipe.ops.image.resize_crop_normalize`
            (defaults: ImageNet statistics, float16, ``"NCHW"`` per clip, no antialias).
        batch_size: clips per batch.
        threads: decoding threads (each keeps its own decoder session and CUDA stream).
        device: None (the GPU when usable, else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        seed, shuffle: epoch ``e`` visits the files in the feeds' epoch order
            (:class:`avpipe.pipeline.feed.EpochOrder`: a keyed permutation of ``(seed, e)``)
            and draws each clip's start from ``(seed, e, index)``; the same arguments give the
            same clips.
        on_error: ``"skip"`` (default; a bad file, a missing one or one too short for a clip
            is reported in the batch's ``errors``) or ``"raise"``.
        deadline: seconds one clip may take on a decoding thread; past it the clip is a
            :class:`~avpipe.errors.DecodeTimeoutError` in the batch's ``errors`` (``on_error``
            applies), its thread is left to finish in the background and the feed goes on
            with fresh threads (nothing waits for the stuck one: not the next epoch,
            :meth:`close` nor the interpreter's exit). ``"auto"`` (default): the
            ``AVPIPE_FEED_DEADLINE`` setting (60 s); None or 0: no limit.
        index: a persisted video index (``avpipe index``'s file or a loaded one): files it
            holds, unchanged since, are opened without a scan.

    Other files' MP4 scans are read ahead in ``AVPIPE_VIDEO_SCAN_AHEAD`` worker processes,
    kept for the feed's life: :meth:`close` stops them (also done when the feed is collected).
    """

    def __init__(
        self,
        paths: Sequence,
        *,
        clip_length: int = 16,
        stride: int = 4,
        crop_size: int = 224,
        short_side: int | None = None,
        mean=_image.IMAGENET_MEAN,
        std=_image.IMAGENET_STD,
        dtype="float16",
        layout: str = "NCHW",
        antialias: bool = False,
        batch_size: int = 8,
        threads: int = 16,
        device=None,
        seed: int = 0,
        shuffle: bool = True,
        on_error: str = "skip",
        index=None,
        deadline="auto",
    ):
        self.paths = [str(p) for p in paths]
        self.clip_length = pos_int("clip_length", clip_length)
        self.stride = pos_int("stride", stride)
        self.crop_size = pos_int("crop_size", crop_size)
        self.short_side = (
            self.crop_size if short_side is None else pos_int("short_side", short_side)
        )
        self.batch_size = pos_int("batch_size", batch_size)
        self.threads = pos_int("threads", threads)
        self.device = resolve_device(device)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.on_error = check_on_error(on_error)
        self.index = None if index is None else load_index(index)
        self.deadline = resolve_deadline(deadline)
        self._transform_args = dict(
            short_side=self.short_side, crop_size=self.crop_size, mean=mean, std=std,
            antialias=bool(antialias), dtype=dtype, layout=layout,
        )  # fmt: skip
        self._streams = ThreadStreams(self.device)
        self._ahead = None
        self._pool = None  # the decoding threads, kept across epochs (their NVDEC sessions)
        # the feeds' epoch order (a keyed permutation of (seed, epoch), cut into batches)
        self.order = EpochOrder(len(self.paths), batch_size=self.batch_size, seed=self.seed,
                                shuffle=self.shuffle)
        self.epoch = 0

    def __len__(self) -> int:
        return -(-len(self.paths) // self.batch_size)

    # -- one clip (the unit of work; thread-safe) -------------------------------------------
    def _stream(self):
        return self._streams.get()

    def transform(self, frames):
        """[T, H, W, 3] uint8 frames -> the feed's transformed clip."""
        return _image.resize_crop_normalize(frames, **self._transform_args)

    def clip(self, path, seed) -> Clip:
        """One random clip of ``path`` (start drawn from ``seed``), transformed. On a GPU the
        transform runs on this thread's stream and is finished when this returns."""

        def select(dec):
            c = samplers.sample_random_clips(
                dec, num_clips=1, clip_length=self.clip_length, stride=self.stride, seed=seed
            )
            return c.data[0], c

        out, c, backend, mismatches = decode_clip(
            path, select, lambda frames, _: self.transform(frames), device=self.device,
            stream=self._stream(), index=self.index,
        )  # fmt: skip
        return Clip(
            data=out, indices=c.indices[0], pts_seconds=c.pts_seconds[0], path=str(path),
            backend=backend, pts_mismatches=mismatches,
        )  # fmt: skip

    # -- epochs -------------------------------------------------------------------------------
    def _scan_ahead(self) -> ScanAhead:
        if self._ahead is None:
            self._ahead = ScanAhead(settings.video_scan_ahead())
            self._ahead_done = weakref.finalize(self, self._ahead.close)
        return self._ahead

    def _threads_owner(self) -> ProcessThreads:
        """The decoding threads, started by the first epoch and kept for the next ones: each
        keeps its decoder session and CUDA stream (a new thread opens new ones); a forked
        child starts its own (:class:`._threads.ProcessThreads`). A clip past the deadline
        retires them (:func:`.feed.collect_works`): later clips go to fresh ones."""
        if self._pool is None:
            self._pool = ProcessThreads(self.threads, "avpipe-clips")
            self._pool_done = weakref.finalize(self, self._pool.shutdown)
        return self._pool

    def _threads(self):
        """The current pool of :meth:`_threads_owner`."""
        return self._threads_owner().get()

    def close(self) -> None:
        """Stop the scan-ahead processes and the decoding threads (also done when the feed
        is collected); a later epoch starts them again. An epoch being iterated meanwhile
        ends with a ``RuntimeError`` saying so."""
        if self._ahead is not None:
            self._ahead_done()
            self._ahead = None
        if self._pool is not None:
            self._pool_done()
            self._pool = None

    def _one(self, args, ahead=None):
        pos, path, seed = args
        try:
            if ahead is not None:
                ahead.take(path)
            return pos, self.clip(path, seed), None
        except (DecodeError, OSError, ValueError) as e:  # the file's (missing, too short, bad)
            return pos, None, e

    def _window(self) -> int:
        """Clips decoded ahead at most: twice the threads plus a batch. Each batch's clips
        are waited for in order while the threads go on with the next ones; the slack keeps
        them busy while a slow clip holds up its batch."""
        return 2 * self.threads + self.batch_size

    def __iter__(self) -> Iterator[ClipBatch]:
        epoch = self.epoch
        self.epoch += 1
        order = self.order.permutation(epoch)
        work = [(pos, self.paths[i], [self.seed, epoch, int(i)]) for pos, i in enumerate(order)]
        xp = self.device.xp
        bs = self.batch_size
        ahead = self._scan_ahead()  # the next batches' files (_scan_ahead), kept across epochs
        taker = ahead if ahead.active else None
        pending: collections.deque = collections.deque()  # jobs (Work), in the epoch's order
        nxt = scanned = 0  # work[:nxt] submitted to the threads, work[:scanned] to scan-ahead
        pool = self._threads_owner()

        def fill():
            # no barrier between batches: the threads go on with the next clips while a
            # batch is stacked and consumed (at most _window() clips decoded ahead)
            nonlocal nxt, scanned
            while len(pending) < self._window() and nxt < len(work):
                if ahead.active:  # scans read SCAN_DEPTH batches before their decoding
                    hi = min(len(work), nxt + (SCAN_DEPTH + 1) * bs)
                    if hi > scanned:
                        ahead.submit(p for _, p, _ in work[scanned:hi])
                        scanned = hi
                try:
                    if self._pool is not pool:  # close(): no new threads for this epoch
                        raise RuntimeError
                    pending.append(Work(pool, self._one, (work[nxt], taker),
                                         (work[nxt][0], work[nxt][1])))
                except RuntimeError:  # the pool was shut down: close() during this epoch
                    raise RuntimeError("ClipFeed.close() was called during an epoch") from None
                nxt += 1

        try:
            fill()
            for b0 in range(0, len(work), bs):
                jobs = [pending.popleft() for _ in range(min(bs, len(work) - b0))]
                done = []
                for job, v in zip(jobs, collect_works(jobs, self.deadline)[0]):
                    if isinstance(v, concurrent.futures.CancelledError):  # close() cancelled it
                        raise RuntimeError("ClipFeed.close() was called during an epoch")
                    if isinstance(v, DecodeError):  # past the deadline
                        v = (job.pair[0], None, v)
                    elif isinstance(v, BaseException):
                        raise v
                    done.append(v)
                fill()
                good = [c for _, c, _ in done if c is not None]
                errors = tuple((pos, e) for pos, _, e in done if e is not None)
                if errors and self.on_error == "raise":
                    raise errors[0][1]
                clips = None
                if good:
                    with self.device.activate():
                        clips = xp.stack([c.data for c in good])
                yield ClipBatch(
                    clips=clips, paths=tuple(c.path for c in good), errors=errors,
                    device=str(self.device),
                )  # fmt: skip
        finally:  # an early stop (an error raised, the consumer's break): no new clips
            for job in pending:
                job.fut.cancel()
