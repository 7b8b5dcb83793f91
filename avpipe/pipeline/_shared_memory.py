"""Host memory shared with worker processes (private; the audio batch loader's decode ring and
the GPU FLAC loader's readers use it; the processes themselves are :mod:`.workers`).

Workers map the parent's memory through its ``/proc`` entry: a ``memfd`` segment, sized by
memory rather than by ``/dev/shm``'s mount.
"""

from __future__ import annotations

import mmap
import os


class Ring:
    """An anonymous shared-memory file (``memfd``) of ``nbytes``, mapped here; workers map it
    through :attr:`path`."""

    def __init__(self, nbytes: int, name: str = "avpipe-ring"):
        self.nbytes = max(int(nbytes), 1)
        self.fd = os.memfd_create(name)
        os.ftruncate(self.fd, self.nbytes)
        self.mm = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self):
        try:
            self.mm.close()
        except BufferError:  # a caller still holds a view of it: freed when the views go
            pass
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def map_ring(path: str, nbytes: int) -> mmap.mmap:
    """In a worker: the parent's :class:`Ring` at ``path``, mapped."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


_ATTACHED: dict = {}  # in a worker: the one ring it has mapped, {path: mmap}


def attach_ring(path: str, nbytes: int) -> mmap.mmap:
    """In a worker: the ring at ``path``, mapped once; a request for another ring (another
    loader's) unmaps the previous one first."""
    mm = _ATTACHED.get(path)
    if mm is None:
        for old in _ATTACHED.values():
            old.close()
        _ATTACHED.clear()
        mm = _ATTACHED[path] = map_ring(path, nbytes)
    return mm
