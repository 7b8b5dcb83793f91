"""Windows of GPU FLAC decoding for :class:`~avpipe.pipeline.audio_loader.AudioBatchLoader`:
which files go to the GPU together, read ahead into page-locked staging buffers, and handed out
batch by batch. The decoding of one window (kernels, plan, libFLAC for the rest) is
:mod:`avpipe.decoding.audio.flac_gpu`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import warnings
import weakref

import numpy as np

from ..decoding.audio import flac_gpu as _flac
from ..decoding.audio import load_audio
from ..device import pinned_size
from ._shared_memory import Ring, attach_ring
from ._threads import AbandonablePool
from .workers import Worker, can_start_processes, ping

__all__ = ["GpuFlacBatches"]

MAX_SLOT_BYTES = 256 << 20  # a staging slot's cap; a window past it is read by threads


def _read_into_ring(ring: tuple, base: int, offsets: list, paths: list) -> dict:
    """In a reader process: ``paths[i]`` into the ring ``(path, nbytes)`` at ``base +
    offsets[i]`` (its ``offsets[i + 1] - offsets[i]`` bytes; zeros past a file that shrank, or
    for one that cannot be read); ``{i: why}`` for those."""
    mm = memoryview(attach_ring(*ring))
    errors = {}
    for i, path in enumerate(paths):
        a, b = base + offsets[i], base + offsets[i + 1]
        try:
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(mm[a:b])
            if got < b - a:  # the file shrank since it was listed: its frames will not cover
                mm[a + got : b] = bytes(b - a - got)
        except OSError as e:
            errors[i] = f"{type(e).__name__}: {e}"
            mm[a:b] = bytes(b - a)
    return errors


def _map_chunk(fn, items):
    return [fn(x) for x in items]


class ProcessReaders:
    """Worker processes that read a window's files into a slot of a shared staging ring, and
    run other per-file work (:meth:`map`: the files' headers, before the ring exists).

    Reading files in threads of the feed's own process needs the GIL a few times per file, and
    a feed's producer thread, which holds it most of the time, kept those threads waiting: the
    next window was often not read when the producer needed it. Processes read without it;
    the parent waits once per chunk. :meth:`allocate` makes the ring; it is page-locked for
    the GPU's copy where its ``register`` succeeds (``cudaHostRegister``).

    Each process is a :class:`~.workers.Worker` (a fresh interpreter with a pipe of
    its own, which never runs the caller's ``__main__`` again); a request goes to every process
    at once, and the caller blocks in ``poll`` / ``recv`` (the GIL released) until each
    answers. No helper thread: a ``multiprocessing.Pool`` keeps one that wakes whenever a
    result is waiting in its pipe, and while the result thread waits for the GIL that one wakes
    again and again (about 20,000 times a second in extraction, each wake-up polling every
    worker's exit code under the GIL the feed's threads need). A process that dies or does
    not answer within ``timeout`` seconds is replaced; its part of the request is reported
    (:meth:`read`) or raises ``multiprocessing.TimeoutError`` (:meth:`map`). A request that
    fails on this side (a call that cannot be pickled, an interrupt) replaces every process
    whose answer it did not take, so no later request reads an earlier one's answer."""

    BOOT_S = 60.0  # seconds a new process has to answer its first request

    def __init__(self, workers: int, *, timeout: float = 120.0, wait: bool = True):
        self.workers, self.timeout = max(1, int(workers)), float(timeout)
        self._lock = threading.Lock()  # one request at a time (windows load from two threads)
        self.ring, self.views, self.slot_bytes = None, [], 0
        self._state = {"procs": [], "ring": None, "unregister": None}
        self._finalizer = weakref.finalize(self, ProcessReaders._shutdown, self._state)
        self._booting = True  # the pings sent at start are not all answered yet
        try:
            for _ in range(self.workers):
                w = Worker()
                self._state["procs"].append(w)
                try:
                    w.send((ping, ()))
                except (OSError, ValueError):  # it ended already: boot() says so
                    pass
            if wait:
                self.boot()
        except BaseException:
            self._finalizer()
            raise

    def boot(self) -> None:
        """Wait for each process's answer to the ping it was sent at start (``wait=False``
        leaves this to the first request, so that the processes start while the caller does
        other work). Where this interpreter cannot start them (an embedding application's
        ``sys.executable``) a process does not answer: RuntimeError, and the readers are
        closed (the caller reads in threads)."""
        if not self._booting:
            return
        with self._lock:
            if not self._booting:
                return
            deadline = time.monotonic() + self.BOOT_S
            lost = None
            try:
                for w in self._state["procs"]:
                    try:
                        if not w.poll(max(0.0, deadline - time.monotonic())):
                            lost = f"no answer within {self.BOOT_S:g} s"
                            break
                        kind, value = w.recv()
                        if kind != "ok":
                            lost = f"{type(value).__name__}: {value}"
                            break
                    except (EOFError, OSError):
                        lost = "a reader process ended at its start"
                        break
            except BaseException:  # interrupted with answers half taken: none is reusable
                self._finalizer()
                raise
            if lost is None:
                self._booting = False
                return
        self._finalizer()
        raise RuntimeError(f"reader processes do not start here: {lost}")

    @staticmethod
    def _shutdown(state):
        procs, state["procs"] = state["procs"], []
        for w in procs:
            w.stop()
        if state["unregister"] is not None:
            try:
                state["unregister"]()
            except Exception:  # noqa: BLE001 - the process is ending, or the device is gone
                pass
        if state["ring"] is not None:
            state["ring"].close()

    @property
    def alive(self) -> bool:
        return bool(self._state["procs"])

    def _renew(self, procs: list, k: int) -> None:
        """Replace process ``k`` (dead, stuck, or owing an answer), unless the readers were
        closed meanwhile (``procs`` is no longer theirs)."""
        procs[k].stop()
        if self._state["procs"] is procs:
            procs[k] = Worker()

    def _ask(self, requests: list, timeout: float) -> list:
        """Send request ``k`` (``(fn, args)``) to process ``k``; each one's answer: ``("ok",
        value)``, ``("error", exception)`` (``fn`` raised) or ``("lost", why)`` (the process
        died or did not answer in time: it is replaced)."""
        self.boot()
        with self._lock:
            procs = self._state["procs"]
            if len(requests) > len(procs):
                raise RuntimeError("the reader processes are closed")
            owed = set()  # processes sent a request whose answer is not taken yet
            try:
                sent = []
                for k, req in enumerate(requests):
                    try:
                        procs[k].send(req)
                        owed.add(k)
                        sent.append(True)
                    except (OSError, ValueError):
                        sent.append(False)
                t0 = time.monotonic()
                deadline = t0 + timeout
                out = []
                for k in range(len(requests)):
                    why = "a reader process is gone"
                    if sent[k]:
                        w = procs[k]
                        # a process started in place of a lost one answers its first request
                        # after starting: it has BOOT_S for that, as the first ones had
                        end = deadline if w.answered else max(deadline, t0 + self.BOOT_S)
                        try:
                            if w.poll(max(0.0, end - time.monotonic())):
                                out.append(w.recv())
                                owed.discard(k)
                                continue
                            why = f"no answer from a reader process within {timeout:g} s"
                        except (EOFError, OSError):
                            why = "a reader process died"
                    owed.discard(k)
                    self._renew(procs, k)
                    out.append(("lost", why))
                return out
            except BaseException:
                for k in owed:
                    self._renew(procs, k)
                raise

    def map(self, fn, items: list, *, chunksize: int = 64, timeout: float | None = None) -> list:
        """``[fn(item) for item in items]`` in the processes (``fn`` importable by name), in
        contiguous parts of at least ``chunksize`` items; ``multiprocessing.TimeoutError`` when
        a process died or did not answer within ``timeout`` seconds."""
        items = list(items)
        if not items:
            return []
        per = max(int(chunksize), -(-len(items) // self.workers))
        reqs = [(_map_chunk, (fn, items[a : a + per])) for a in range(0, len(items), per)]
        out = []
        for kind, value in self._ask(reqs, self.timeout if timeout is None else float(timeout)):
            if kind == "lost":
                raise mp.TimeoutError(value)
            if kind == "error":
                raise value  # what fn raised, in the reader process
            out.extend(value)
        return out

    def allocate(self, slots: int, slot_bytes: int, *, register=None) -> None:
        """The staging ring: ``slots`` slots of ``slot_bytes``; ``register(views)`` may
        page-lock them and return how to undo it."""
        self.slot_bytes = int(slot_bytes)
        self.ring = Ring(int(slots) * self.slot_bytes, "avpipe-flac-staging")
        self._state["ring"] = self.ring
        self.views = [np.frombuffer(self.ring.mm, np.uint8, self.slot_bytes,
                                    offset=k * self.slot_bytes) for k in range(int(slots))]
        if register is not None:
            self._state["unregister"] = register(self.views)

    def read(self, slot: int, offsets: np.ndarray, paths: list) -> dict:
        """Read ``paths`` back to back into ``views[slot]`` at ``offsets`` (relative, int64
        ``[n + 1]``, ``offsets[-1] <= slot_bytes``); ``{index: why}`` for the files that could
        not be read (their bytes are zeros)."""
        offs = [int(v) for v in offsets]
        n = len(paths)
        step = max(1, -(-n // self.workers))
        base = slot * self.slot_bytes
        ring = (self.ring.path, self.ring.nbytes)
        starts = list(range(0, n, step))
        reqs = [(_read_into_ring, (ring, base, offs[a : min(a + step, n) + 1],
                                   paths[a : min(a + step, n)])) for a in starts]
        errors = {}
        for a, (kind, got) in zip(starts, self._ask(reqs, self.timeout)):
            if kind != "ok":
                why = got if kind == "lost" else f"{type(got).__name__}: {got}"
                got = {i: why for i in range(min(step, n - a))}
            errors.update({a + i: why for i, why in got.items()})
        return errors

    def close(self) -> None:
        self._finalizer()


_AHEAD: list = []  # readers started by start_readers_ahead(), for the next start_readers()
_AHEAD_LOCK = threading.Lock()


def _reader_count(workers: int) -> int:
    return max(1, min(int(workers), os.cpu_count() or 1))


def start_readers(workers: int = 8, *, required: bool = False):
    """:class:`ProcessReaders` with ``workers`` processes (at most the CPU count), or None
    where this process may not have children (a daemonic DataLoader worker) or they cannot
    start, unless ``required``. Readers of that size started ahead (:func:`start_readers_ahead`)
    are taken instead of new ones."""
    if not can_start_processes():
        if required:
            raise RuntimeError("readers='processes' inside a daemonic process")
        return None
    n = _reader_count(workers)
    with _AHEAD_LOCK:
        ahead = _AHEAD.pop() if _AHEAD and _AHEAD[-1].workers == n else None
    try:
        if ahead is not None:
            ahead.boot()  # (their start overlapped the caller's other work)
            return ahead
        return ProcessReaders(n)
    except (OSError, ValueError, RuntimeError):
        if required:
            raise
        return None


def start_readers_ahead(workers: int = 8) -> None:
    """Start the processes of the next :func:`start_readers` now, without waiting for them: an
    interpreter's start and imports (a few tenths of a second, more with many starting at
    once) then overlap whatever the caller does before it needs them (extraction's worker
    does this while its parent resolves the inputs). :func:`drop_readers_ahead` ends them
    if they are not taken."""
    if not can_start_processes():
        return
    try:
        r = ProcessReaders(_reader_count(workers), wait=False)
    except Exception:  # noqa: BLE001 - only a head start: the loader starts its own
        return
    with _AHEAD_LOCK:
        _AHEAD.append(r)


def drop_readers_ahead() -> None:
    """End the readers started ahead that no :func:`start_readers` took."""
    with _AHEAD_LOCK:
        left = _AHEAD[:]
        _AHEAD.clear()
    for r in left:
        r.close()


def _cpu_decode(path, max_samples, on_damage="error"):
    """``(samples, damaged)``: the file decoded by :func:`~avpipe.load_audio` (libFLAC through
    soundfile, FFmpeg for a STREAMINFO without a count or one its frames contradict),
    channels averaged: the CPU path for what the GPU leaves. Damage raises
    :class:`~avpipe.CorruptDataError` unless ``on_damage="warn"`` (then ``damaged`` says why)."""
    a = load_audio(path, on_damage=on_damage, check_finite=False)
    x = a.samples
    if x.shape[0] > max_samples:
        raise ValueError(f"{x.shape[0]} samples, more than max_samples={max_samples}: skipped")
    if x.shape[0] == 0:
        raise ValueError("no audio samples")
    return x, a.damaged


class GpuFlacBatches:
    """Padded float32 cupy batches of FLAC files decoded on the GPU.

    One GPU thread decodes one FLAC frame, so a launch over a single batch of 64 utterances
    (about 2,000 frames) leaves most of the GPU idle while each thread works through its 4,096
    samples. The kernels therefore run over a *window* of consecutive batches (``window``
    files, whole batches) at once, and the window's batches are handed out one by one.
    Upcoming windows' bytes (no decoding on the CPU) are read ahead, ``prefetch`` windows, into
    page-locked staging slots: by ``read_threads`` reader processes into a shared ring
    (:class:`ProcessReaders`; ``readers="auto"``, where this process may have children), else by
    as many threads (``readers="threads"``, and inside a daemonic process such as a DataLoader
    worker, or for a window larger than a slot). Files the GPU does not cover exactly are
    decoded by libFLAC on the CPU. Errors are per item (``{index: message}``, length 0), never
    per batch.

    The kernels run on a stream of their own: they occupy few threads for long, so the
    caller's work on its batches (its current stream: the feature kernels) runs beside them on
    the GPU instead of queueing behind the next window's decode. Events order the two streams:
    the caller's stream waits for a window's decode before its batches are handed out, and the
    decode stream waits for the caller's reads of a window before that window's memory is
    reused.
    """

    def __init__(self, sizes: dict, *, max_samples: int, prefetch: int = 2, read_threads: int = 8,
                 window: int = 256, readers="auto", leave=None, on_damage="error"):
        import cupy

        self.sizes = sizes  # path -> bytes on disk
        # path -> why the CPU decodes it (a STREAMINFO count its frames contradict, or none)
        self.leave = dict(leave or {})
        self.on_damage = on_damage
        self.damaged: dict = {}  # path -> why, decoded though damaged (on_damage="warn")
        self.max_samples = int(max_samples)
        self.prefetch = max(1, int(prefetch))
        self.read_threads = max(1, int(read_threads))
        self.window = max(1, int(window))
        self._cupy = cupy
        # one per window read ahead, one queued on the GPU, one being handed out
        self._staging = [None] * (self.prefetch + 2)
        self._warned = False
        self._procs = None
        if isinstance(readers, ProcessReaders):
            self._procs = readers
        elif readers not in ("auto", "processes", "threads"):
            raise ValueError(f"readers must be 'auto', 'processes', 'threads' or a "
                             f"ProcessReaders, got {readers!r}")
        elif readers != "threads":
            self._procs = start_readers(self.read_threads, required=readers == "processes")
        if self._procs is not None:
            self._procs.allocate(self.prefetch + 2, self._slot_bytes(), register=self._register)

    def _slot_bytes(self) -> int:
        """A staging slot: the largest files a window can hold (a window ends with a whole
        group: ``window`` files plus a batch's worth), at most ``MAX_SLOT_BYTES``."""
        top = np.sort(np.fromiter(self.sizes.values(), np.int64, len(self.sizes)))
        need = int(top[-(self.window + 64):].sum()) + _flac.PAD
        return -(-min(need, MAX_SLOT_BYTES) // 4096) * 4096

    def _register(self, views):
        """Page-lock the staging slots (None where that fails: pageable copies, slower)."""
        rt = self._cupy.cuda.runtime
        ptrs = []
        try:
            for v in views:
                rt.hostRegister(v.ctypes.data, v.nbytes, 0)
                ptrs.append(v.ctypes.data)
        except Exception:  # noqa: BLE001
            for p in ptrs:
                rt.hostUnregister(p)
            return None

        def unregister():
            rt.deviceSynchronize()  # no copy from the ring in flight
            for p in ptrs:
                rt.hostUnregister(p)

        return unregister

    def close(self) -> None:
        """End the reader processes (also done when the loader is collected)."""
        if self._procs is not None:
            self._procs.close()
            self._procs = None

    def _buffer(self, k, nbytes):
        cur = self._staging[k]
        if cur is None or cur.nbytes < nbytes:
            # a size the pool meets again (see device.pinned_size): a window's bytes vary
            mem = self._cupy.cuda.alloc_pinned_memory(pinned_size(max(nbytes, 1 << 20)))
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
        procs = self._procs
        if procs is not None and int(offsets[-1]) + _flac.PAD <= procs.slot_bytes:
            buf = procs.views[slot]
            errors = procs.read(slot, offsets, paths)
        else:  # threads, into a page-locked buffer of this slot's own
            buf = self._buffer(slot, int(offsets[-1]) + _flac.PAD)
            step = max(1, -(-len(paths) // self.read_threads))
            futs = [io.submit(self._read_files, buf, offsets, paths, a,
                              min(a + step, len(paths)))
                    for a in range(0, len(paths), step)]  # fmt: skip
            errors = {}
            for f in futs:
                errors.update(f.result())
        buf[int(offsets[-1]) : int(offsets[-1]) + _flac.PAD] = 0
        leave = {i: self.leave[p] for i, p in enumerate(paths) if p in self.leave}
        return buf, offsets, errors, _flac.plan_batch(buf, offsets, leave)

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
                y, damaged = _cpu_decode(paths[i], self.max_samples, self.on_damage)
                if damaged:
                    self.damaged[paths[i]] = damaged
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
        # daemon threads nothing joins (._threads.AbandonablePool): a read that never returns
        # (a stalled mount) holds its thread, never the interpreter's exit; a run ended or
        # dropped lets them go (queued reads cancelled)
        ex = AbandonablePool(self.prefetch, "avpipe-flac-window")
        io = AbandonablePool(self.read_threads, "avpipe-flac-read")
        try:

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
        finally:
            if any(not f.cancel() and not f.done() for _, _, f in pending):
                # a window still loading (the run was stopped early, or a read never
                # returns) keeps its staging buffers: a later run gets buffers of its own
                self._staging = [None] * len(self._staging)
            ex.shutdown(cancel_futures=True)
            io.shutdown(cancel_futures=True)

    def _warn(self, e):
        if not self._warned:
            self._warned = True
            warnings.warn(f"GPU FLAC decoding failed ({type(e).__name__}: {e}); "
                          "decoding on the CPU instead", RuntimeWarning, stacklevel=3)
