"""A pool of decoding threads kept for its owner's life, in the process that uses it (private:
the feeds' ``Task`` and ``ClipFeed`` hold one).

Threads are kept from one epoch to the next because each keeps what it opened (a decoder
session, a CUDA stream). A forked child copies the pool object but none of its threads: work
handed to that copy would wait for ever. :meth:`ProcessThreads.get` therefore starts a pool of
the child's own there (as ``workers._Spawner`` does for its thread).

The threads are daemon threads of :class:`AbandonablePool`, not ``concurrent.futures``'
``ThreadPoolExecutor``: that one's workers are joined at interpreter exit (a
``threading._register_atexit`` hook), so one thread inside a read that never returns (a
stalled network mount, a device file named ``x.wav``) kept the process from exiting. Nothing
joins these: a stuck read costs its thread, never the exit, a shutdown or the next epoch.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import queue
import threading
import weakref

__all__ = ["ProcessThreads", "AbandonablePool"]

_names = itertools.count()


class AbandonablePool:
    """``threads`` daemon threads (started as work comes) running :meth:`submit`'s calls in
    order; ``submit`` returns a ``concurrent.futures.Future`` (``cf.wait`` and ``cancel``
    work as with an executor). :meth:`shutdown` lets the threads end after what is queued
    (``cancel_futures``: cancel it instead) and never waits for them; a thread stuck in a call
    stays stuck alone, and the interpreter exits without it."""

    def __init__(self, threads: int, name: str = "avpipe-thread"):
        self.max_threads = max(1, int(threads))
        self.name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)
        self._shutdown = False
        # a pool dropped without shutdown still lets its idle threads end
        self._count = [0]
        self._ended = weakref.finalize(self, _end_threads, self._q, self._count)
        self._ended.atexit = False

    def submit(self, fn, *args, **kwargs) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit to a pool that was shut down")
            self._q.put((fut, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and \
                    len(self._threads) < self.max_threads:
                t = threading.Thread(target=_work, args=(self._q, self._idle), daemon=True,
                                     name=f"{self.name}_{next(_names)}")
                self._threads.append(t)
                self._count[0] += 1
                t.start()
        return fut

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = False) -> None:
        """No more work; the threads end once the queue is empty (``cancel_futures``: its
        jobs not started are cancelled). ``wait`` is accepted for the executor's signature
        and ignored: a thread may be inside a call that never returns."""
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        job = self._q.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None:
                        job[0].cancel()
        self._ended()

    @property
    def threads(self) -> list[threading.Thread]:
        return list(self._threads)


def _end_threads(q, count):
    for _ in range(count[0]):
        q.put(None)


def _work(q, idle):
    while True:
        job = q.get()
        if job is None:
            return
        fut, fn, args, kwargs = job
        del job
        if fut.set_running_or_notify_cancel():
            try:
                r = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the future
                fut.set_exception(e)
                del e
            else:
                fut.set_result(r)
                del r
        del fut, fn, args, kwargs
        idle.release()


class ProcessThreads:
    """``threads`` threads named ``name``, started by the first :meth:`get` of each process;
    :meth:`shutdown` stops them (cancelling what has not started), a later :meth:`get` starts
    new ones. :meth:`retire` gives up the current threads (one of them is stuck in a call
    that may never return) and counts a new generation (``gen``): work queued on the old ones
    and not started is submitted again by its owner (``feed._Work``). Neither waits for a
    thread, and none is joined at exit (:class:`AbandonablePool`)."""

    def __init__(self, threads: int, name: str):
        self.threads, self.name = int(threads), name
        self._pool: AbandonablePool | None = None
        self._pid = None
        self.gen = 0

    def retire(self) -> None:
        """New threads from the next :meth:`get` on; the current ones finish what they run and
        what is queued (unless its owner cancels it) and end, a stuck one when its call
        returns (or never: it is a daemon, not waited for)."""
        pool, self._pool = self._pool, None
        self.gen += 1
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(cancel_futures=False)

    def get(self) -> AbandonablePool:
        if self._pool is None or self._pid != os.getpid():  # none yet, or the parent's
            self._pool = AbandonablePool(self.threads, self.name)
            self._pid = os.getpid()
        return self._pool

    def shutdown(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(cancel_futures=True)
