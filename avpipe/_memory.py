"""The process's C allocator, kept from growing under many threads (glibc only).

glibc gives each thread that allocates while another holds an arena an arena of its own, up to
8 per core. A feed's decode threads and a remote read-ahead allocate and free large transient
buffers (decoded audio, shard reads) from different threads; the freed memory stays in the
arenas it came from, fragmented, so the process's peak grows epoch after epoch although the live
data does not. Limiting the arenas (``mallopt(M_ARENA_MAX)``, ``AVPIPE_MALLOC_ARENAS``) keeps it
flat at a cost of a few percent of CPU time. glibc fixes its arena count when a second arena is
first made, so the limit is set as ``avpipe`` is imported, before threads of its own allocate; in
a process whose threads allocated before that, it does nothing. Other C libraries are left
alone.
"""

from __future__ import annotations

import ctypes
import threading

from . import settings

__all__ = ["limit_malloc_arenas"]

_M_ARENA_MAX = -8  # glibc's mallopt parameter
_DONE: dict = {}
_LOCK = threading.Lock()


def limit_malloc_arenas() -> int | None:
    """Set glibc's arena limit to ``AVPIPE_MALLOC_ARENAS`` once per process (0: left alone);
    returns the limit set, or None (glibc absent, the setting 0, or set before)."""
    n = settings.malloc_arenas()
    with _LOCK:
        if n == 0 or _DONE.get("arenas") == n:
            return None
        try:
            # the process's own symbols: the C library it runs on (find_library would start
            # ldconfig at every import)
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):  # not glibc: nothing to set
            _DONE["arenas"] = n
            return None
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        ok = mallopt(_M_ARENA_MAX, n)
        _DONE["arenas"] = n
        return n if ok == 1 else None
