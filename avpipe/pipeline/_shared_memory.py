"""Host memory shared with worker processes, and where those processes come from (private;
the audio batch loader's decode ring and the GPU FLAC loader's read staging use it).

Workers come from a fork server, never from a fork of the calling process (which may hold
threads: a feed's producer, BLAS threads, whose locks a fork would copy), and map the parent's
memory through its ``/proc`` entry: a ``memfd`` segment, sized by memory rather than by
``/dev/shm``'s mount.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
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


def context():
    """The multiprocessing context of avpipe's worker processes: a fork server (a clean
    single-threaded process) with the audio modules preloaded."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["avpipe.pipeline.audio_loader", "soundfile"])
    return ctx


def can_start_processes() -> bool:
    """False inside a daemonic process (a torch DataLoader worker), which may not have
    children."""
    return not mp.current_process().daemon
