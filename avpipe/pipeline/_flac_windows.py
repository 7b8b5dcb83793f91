"""Windows of GPU FLAC decoding for :class:`~avpipe.pipeline.audio_loader.AudioBatchLoader`:
which files go to the GPU together, read ahead into page-locked staging buffers, and handed out
batch by batch. The decoding of one window (kernels, plan, libFLAC for the rest) is
:mod:`avpipe.decoding.audio._flac_cuda`.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..decoding.audio import _flac_cuda as _flac

__all__ = ["GpuFlacBatches"]


class GpuFlacBatches:
    """Padded float32 cupy batches of FLAC files decoded on the GPU.

    One GPU thread decodes one FLAC frame, so a launch over a single batch of 64 utterances
    (about 2,000 frames) leaves most of the GPU idle while each thread works through its 4,096
    samples. The kernels therefore run over a *window* of consecutive batches (``window``
    files, whole batches) at once, and the window's batches are handed out one by one.
    ``read_threads`` threads read upcoming windows' bytes (no decoding on the CPU) into
    ``prefetch`` page-locked staging buffers; files the GPU does not cover exactly are decoded by
    libFLAC on the CPU. Errors are per item (``{index: message}``, length 0), never per batch.

    The kernels run on a stream of their own: they occupy few threads for long, so the
    caller's work on its batches (its current stream: the feature kernels) runs beside them on
    the GPU instead of queueing behind the next window's decode. Events order the two streams:
    the caller's stream waits for a window's decode before its batches are handed out, and the
    decode stream waits for the caller's reads of a window before that window's memory is
    reused.
    """

    def __init__(self, sizes: dict, *, max_samples: int, prefetch: int = 2, read_threads: int = 8,
                 window: int = 256):
        import cupy

        self.sizes = sizes  # path -> bytes on disk
        self.max_samples = int(max_samples)
        self.prefetch = max(1, int(prefetch))
        self.read_threads = max(1, int(read_threads))
        self.window = max(1, int(window))
        self._cupy = cupy
        # one per window read ahead, one queued on the GPU, one being handed out
        self._staging = [None] * (self.prefetch + 2)
        self._warned = False

    def _buffer(self, k, nbytes):
        cur = self._staging[k]
        if cur is None or cur.nbytes < nbytes:
            mem = self._cupy.cuda.alloc_pinned_memory(max(nbytes, 1 << 20))
            cur = np.frombuffer(mem, np.uint8, mem.size())
            self._staging[k] = cur
        return cur

    @staticmethod
    def _read_files(buf, offsets, paths, lo, hi):
        errors = {}
        for i in range(lo, hi):
            a, n = int(offsets[i]), int(offsets[i + 1] - offsets[i])
            try:
                with open(paths[i], "rb", buffering=0) as f:
                    got = f.readinto(memoryview(buf)[a : a + n])
                if got < n:  # the file shrank since it was listed: its frames will not cover
                    buf[a + got : a + n] = 0
            except OSError as e:
                errors[i] = f"{type(e).__name__}: {e}"
                buf[a : a + n] = 0
        return errors

    def _load(self, slot, paths, io):
        """Read ``paths`` back to back into staging buffer ``slot`` and plan their decode."""
        sizes = [self.sizes.get(p, 0) for p in paths]
        offsets = np.zeros(len(paths) + 1, np.int64)
        offsets[1:] = np.cumsum(sizes)
        buf = self._buffer(slot, int(offsets[-1]) + _flac.PAD)
        step = max(1, -(-len(paths) // self.read_threads))
        futs = [io.submit(self._read_files, buf, offsets, paths, a, min(a + step, len(paths)))
                for a in range(0, len(paths), step)]
        errors = {}
        for f in futs:
            errors.update(f.result())
        buf[int(offsets[-1]) : int(offsets[-1]) + _flac.PAD] = 0
        return buf, offsets, errors, _flac.plan_batch(buf, offsets)

    def _finish(self, x, plan, left, paths, read_errors):
        """Fill the rows the GPU left with libFLAC's decode; lengths and errors per item."""
        cupy = self._cupy
        lengths = np.array(
            [(si.total_samples if si is not None else 0) for si in plan.infos], np.int64
        )
        errors = {}
        for i in left:
            if i in read_errors:
                errors[i] = read_errors[i]
                lengths[i] = 0
                continue
            try:
                y = _flac._cpu_decode(paths[i], self.max_samples)
            except Exception as e:  # one bad file does not stop the batch
                errors[i] = f"{type(e).__name__}: {e}"
                lengths[i] = 0
                continue
            lengths[i] = len(y)
            if len(y) > x.shape[1]:
                x = cupy.pad(x, ((0, 0), (0, len(y) - x.shape[1])))
            x[i, : len(y)] = cupy.asarray(y)
            x[i, len(y) :] = 0
        for i in np.flatnonzero(lengths > self.max_samples):
            errors[int(i)] = (
                f"{int(lengths[i])} samples, more than max_samples={self.max_samples}: skipped"
            )
            lengths[i] = 0
            x[int(i)] = 0
        return x, lengths, errors

    def run(self, groups):
        """Yield ``(signals, lengths, group, errors)`` for each group (batch) of paths, ready on
        the caller's current stream (read the batches of one window on one stream)."""
        cupy = self._cupy
        groups = iter(groups)
        pending = []
        dstream = cupy.cuda.Stream(non_blocking=True)  # the decode kernels (class docstring)
        with ThreadPoolExecutor(self.prefetch, thread_name_prefix="avpipe-flac-window") as ex, \
                ThreadPoolExecutor(self.read_threads, thread_name_prefix="avpipe-flac-read") as io:

            def submit():
                win, n = [], 0
                while n < self.window:
                    g = next(groups, None)
                    if g is None:
                        break
                    win.append(list(g))
                    n += len(g)
                if win:
                    slot = submit.k % (self.prefetch + 2)
                    submit.k += 1
                    paths = [p for g in win for p in g]
                    pending.append((win, paths, ex.submit(self._load, slot, paths, io)))

            submit.k = 0
            for _ in range(self.prefetch):
                submit()

            def start():
                """Queue the next window's decode on the GPU (no waiting)."""
                if not pending:
                    return None
                win, paths, fut = pending.pop(0)
                buf, offsets, read_errors, plan = fut.result()
                try:
                    with dstream:
                        job = _flac.launch(buf, offsets, plan)
                except Exception as e:  # noqa: BLE001 - e.g. no NVRTC: libFLAC decodes them all
                    self._warn(e)
                    job = None
                return win, paths, read_errors, plan, job

            cur = start()
            while cur is not None:
                # the next window's decode is queued before the consumer's work on this one,
                # so the GPU never waits for the host between windows
                nxt = start()
                win, paths, read_errors, plan, job = cur
                with dstream:
                    try:
                        if job is None:
                            raise RuntimeError("launch failed")
                        x, plan, left = _flac.collect(job)
                    except Exception as e:  # noqa: BLE001
                        if job is not None:
                            self._warn(e)
                        x = cupy.zeros((len(paths), max(plan.max_len, 1)), cupy.float32)
                        left = {i: "GPU decoder failed" for i in range(len(paths))}
                submit()  # this window's staging buffer has been uploaded: read ahead into it
                if nxt is None:  # nothing was read ahead (prefetch 1)
                    nxt = start()
                with dstream:
                    x, lengths, errors = self._finish(x, plan, left, paths, read_errors)
                # the caller's reads after the decode
                cupy.cuda.get_current_stream().wait_event(dstream.record())
                r0 = 0
                try:
                    for g in win:
                        r1 = r0 + len(g)
                        lens = lengths[r0:r1]
                        max_len = int(lens.max()) if len(lens) else 0
                        # a copy, never a view of x: x's memory belongs to the decode stream
                        xg = x[r0:r1, :max_len].copy()
                        errs = {i - r0: m for i, m in errors.items() if r0 <= i < r1}
                        yield xg, lens.copy(), g, errs
                        r0 = r1
                finally:
                    # x's memory goes back to the decode stream's pool: reused there only
                    # after the caller's copies out of it
                    dstream.wait_event(cupy.cuda.get_current_stream().record())
                del x
                cur = nxt

    def _warn(self, e):
        if not self._warned:
            self._warned = True
            warnings.warn(f"GPU FLAC decoding failed ({type(e).__name__}: {e}); "
                          "decoding on the CPU instead", RuntimeWarning, stacklevel=3)
