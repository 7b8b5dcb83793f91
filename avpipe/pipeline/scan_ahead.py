"""Video scans read ahead of their decoding, in worker processes (private; the video recipe
uses it).

Opening a video the process has never seen reads its container's sample tables
(:func:`avpipe.decoding.video._scan.scan_mp4_file`): about a millisecond of Python a file,
under the GIL that the feed's decoding threads and its producer need. A feed knows which files
come next, so :class:`ScanAhead` has a few processes read those tables a few batches early;
the decoding thread then takes the finished scan (:meth:`ScanAhead.take`: a cache entry, valid
while the file's size and mtime are unchanged) instead of scanning.

What stays as it was: only MP4 / MOV files are read ahead (pure Python, no native decoder in
the workers); any other file, a file the reader declines, a scan not started yet or not
finished within ``wait`` seconds, or workers that cannot start (a daemonic DataLoader worker)
or died: the decoding thread scans the file itself, as without this, and reports what is wrong
with it. A file is never decoded with a scan other than the one its own open would have made.
"""

from __future__ import annotations

import collections
import threading
import weakref

from ..decoding.video import is_scan_cached, remember_scan, scan_mp4_file
from .workers import WorkerPool, can_start_processes

__all__ = ["ScanAhead", "lookahead", "SCAN_DEPTH"]

# batches whose files are scanned ahead before they are handed to the decoding threads (which
# themselves may run a few batches ahead of the consumer)
SCAN_DEPTH = 2


class ScanAhead:
    """Scans of files submitted ahead (:meth:`submit`), taken by the thread that opens them
    (:meth:`take`). ``workers`` processes (0: off) of a :class:`~.workers.WorkerPool`
    (fresh interpreters, which never run the caller's ``__main__`` again; a thread each waits
    for its answers with the GIL released); ``keep``: futures held at most (the oldest untaken
    are dropped); ``wait``: seconds :meth:`take` waits for a scan under way (default ``WAIT``:
    a scan takes about a millisecond). A scan not yet started (the processes still starting, or
    busy) is not waited for: the opening thread scans itself, as without scan-ahead."""

    WAIT = 0.25

    def __init__(self, workers: int, *, keep: int = 512, wait: float | None = None):
        self.keep = int(keep)
        self.wait = self.WAIT if wait is None else float(wait)
        self._futs: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = None
        self.taken = self.missed = 0  # scans used / opens that scanned themselves
        if int(workers) > 0 and can_start_processes():
            self._pool = WorkerPool(int(workers), answer_s=30.0, name="avpipe-scan-ahead")
            _close_at_exit(self)

    @property
    def active(self) -> bool:
        return self._pool is not None

    def submit(self, paths) -> None:
        """Start scanning ``paths`` (MP4 / MOV; others come back empty) not yet submitted and
        not in this process's scan cache."""
        pool = self._pool
        if pool is None:
            return
        for p in paths:
            p = str(p)
            with self._lock:
                if p in self._futs:
                    continue
            if is_scan_cached(p):
                continue
            try:
                fut = pool.submit(scan_mp4_file, p)
            except RuntimeError:  # closed meanwhile, or its processes do not start here
                self.close()
                return
            with self._lock:
                self._futs[p] = fut
                while len(self._futs) > self.keep:
                    _, old = self._futs.popitem(last=False)
                    old.cancel()

    def take(self, path) -> bool:
        """Put ``path``'s scan into the scan cache if it was read ahead (waiting up to
        ``wait`` seconds for a scan under way; one not started is cancelled); True when it was.
        Thread-safe."""
        with self._lock:
            fut = self._futs.pop(str(path), None)
        if fut is None:
            return False
        if fut.cancel():  # not started yet: scanning here is quicker than waiting for it
            self.missed += 1
            return False
        try:
            got = fut.result(timeout=self.wait)
        except Exception:  # noqa: BLE001 - late (a slow disk), or the process died
            self.missed += 1
            return False
        if got is None:
            self.missed += 1
            return False
        remember_scan(*got)
        self.taken += 1
        return True

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._futs.clear()
        if pool is not None:
            pool.close()


# Scan-ahead pools still open when the interpreter exits are closed before concurrent.futures
# joins its executors' threads (a ``threading._register_atexit`` hook, which runs before
# those joins: they are called in reverse order of registration): a pool's thread waiting for
# the scan of a file whose read never returns would otherwise hold the exit for the pool's
# ``answer_s``. Closing it kills the worker process, which ends that wait.
_LIVE: weakref.WeakSet = weakref.WeakSet()
_EXIT_HOOK: list = []


def _close_at_exit(scan: ScanAhead) -> None:
    _LIVE.add(scan)
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(True)
        try:
            threading._register_atexit(_close_live)
        except (AttributeError, RuntimeError):  # no such hook, or the interpreter is exiting
            pass


def _close_live() -> None:
    for scan in list(_LIVE):
        try:
            scan.close()
        except Exception:  # noqa: BLE001 - interpreter exit: the next one still closes
            pass


def lookahead(groups, depth: int, on_seen):
    """``groups`` unchanged and in order, each first shown to ``on_seen(group)`` ``depth``
    groups before it is handed on (so work keyed by it can start early)."""
    buf = collections.deque()
    it = iter(groups)
    for g in it:
        on_seen(g)
        buf.append(g)
        if len(buf) > depth:
            yield buf.popleft()
    while buf:
        yield buf.popleft()
