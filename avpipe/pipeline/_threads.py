"""A pool of decoding threads kept for its owner's life, in the process that uses it (private:
the feeds' ``Task`` and ``ClipFeed`` hold one).

Threads are kept from one epoch to the next because each keeps what it opened (a decoder
session, a CUDA stream). A forked child copies the pool object but none of its threads: work
handed to that copy would wait for ever. :meth:`ProcessThreads.get` therefore starts a pool of
the child's own there (as ``_shared_memory._Spawner`` does for its thread).
"""

from __future__ import annotations

import concurrent.futures as cf
import os

__all__ = ["ProcessThreads"]


class ProcessThreads:
    """``threads`` threads named ``name``, started by the first :meth:`get` of each process;
    :meth:`shutdown` stops them (cancelling what has not started), a later :meth:`get` starts
    new ones. :meth:`retire` gives up the current threads (one of them is stuck in a call
    that may never return) and counts a new generation (``gen``): work queued on the old ones
    and not started is submitted again by its owner (``feed._Work``)."""

    def __init__(self, threads: int, name: str):
        self.threads, self.name = int(threads), name
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pid = None
        self.gen = 0

    def retire(self) -> None:
        """New threads from the next :meth:`get` on; the current ones finish what they run and
        what is queued (unless its owner cancels it) and end, a stuck one when its call
        returns."""
        pool, self._pool = self._pool, None
        self.gen += 1
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=False, cancel_futures=False)

    def get(self) -> cf.ThreadPoolExecutor:
        if self._pool is None or self._pid != os.getpid():  # none yet, or the parent's
            self._pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
            self._pid = os.getpid()
        return self._pool

    def shutdown(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=False, cancel_futures=True)
