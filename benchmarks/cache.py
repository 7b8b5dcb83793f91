"""Page-cache control for the cold contenders: files dropped from the page cache, so that the
next read comes from the disk, and a count of how much of a file is still cached.

:func:`evict` writes back a file's dirty pages (``fsync``) and then asks the kernel to drop its
cached pages (``posix_fadvise(POSIX_FADV_DONTNEED)``); :func:`drop_all` drops the whole page
cache where the process may (root: ``/proc/sys/vm/drop_caches``). A new name for the same file
(a hard link) shares the cached pages of its inode: it is not cold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

PAGE = mmap.PAGESIZE


def evict(paths) -> int:
    """Drop each file of ``paths`` from the page cache (fsync first: dirty pages cannot be
    dropped); the number of files advised."""
    n = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def drop_all() -> bool:
    """Write back everything and drop the whole page cache (root only): whether it did."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


_libc = None


def _mincore():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                  ctypes.POINTER(ctypes.c_ubyte)]
    return _libc


def resident_fraction(path: str) -> float | None:
    """The fraction of ``path``'s pages in the page cache (``mincore``; None where it cannot
    be asked, and 0.0 for an empty file)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        libc = _mincore()
    except OSError:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            return sum(v & 1 for v in vec) / pages
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def cold_copies(files, folder: str, copies: int) -> list[str]:
    """At least ``copies`` distinct files (real copies, not links: a link shares its inode's
    cached pages) of ``files`` in ``folder``, fsync'd and dropped from the page cache."""
    import shutil

    os.makedirs(folder, exist_ok=True)
    out = []
    for k in range(max(1, -(-copies // len(files)))):
        for f in files:
            p = os.path.join(folder, f"{k:03d}_{os.path.basename(f)}")
            if not os.path.exists(p):
                shutil.copyfile(f, p)
            out.append(p)
    evict(out)
    return out
