"""Normalize the three kinds of source every avpipe reader accepts.

A source is a path (``str`` or ``os.PathLike``), ``bytes``/``bytearray``/``memoryview``, or a
binary file-like object with ``read`` (and ideally ``seek``). :func:`open_source` turns any of
them into a :class:`Source` that carries a display name for error messages and can hand out
either a filesystem path (cheapest for libraries that mmap) or a seekable binary stream.
"""

from __future__ import annotations

import io
import os
import stat
from dataclasses import dataclass
from typing import BinaryIO, Union

SourceLike = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO]

__all__ = ["Source", "SourceLike", "open_source", "source_name"]


@dataclass(frozen=True)
class Source:
    """A resolved source: exactly one of ``path`` or ``data``/``fileobj`` is set."""

    name: str
    path: str | None = None
    data: bytes | None = None
    fileobj: BinaryIO | None = None

    def stream(self) -> BinaryIO:
        """A fresh seekable binary stream over the source (rewinds file objects)."""
        if self.path is not None:
            return open(self.path, "rb")
        if self.data is not None:
            return io.BytesIO(self.data)
        f = self.fileobj
        assert f is not None
        if hasattr(f, "seek"):
            try:
                f.seek(0)
                return _NoClose(f)
            except (OSError, io.UnsupportedOperation):
                pass
        return io.BytesIO(f.read())

    def read_bytes(self) -> bytes:
        if self.data is not None:
            return self.data
        with self.stream() as s:
            return s.read()

    def path_or_stream(self):
        """The path when there is one (libraries read files fastest), else a stream."""
        return self.path if self.path is not None else self.stream()


class _NoClose(io.BufferedIOBase):
    """Wraps a caller's file object so that our ``with`` blocks don't close it."""

    def __init__(self, f):
        self._f = f

    def read(self, n=-1):
        return self._f.read(n)

    def readinto(self, b):
        if hasattr(self._f, "readinto"):
            return self._f.readinto(b)
        data = self._f.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, pos, whence=0):
        return self._f.seek(pos, whence)

    def tell(self):
        return self._f.tell()

    def seekable(self):
        return True

    def readable(self):
        return True

    def close(self):  # leave the caller's object open
        pass


class TimedFile(io.RawIOBase):
    """A file opened by path for reading, counting the bytes read (``bytes_read``) and the
    seconds spent reading (``seconds``): a decoder given this reads only the parts it needs
    (a span of a long file), and the caller sees how much that was."""

    def __init__(self, path: str):
        super().__init__()
        self.name = path
        self._f = open(path, "rb", buffering=0)
        self.bytes_read = 0
        self.seconds = 0.0

    def readinto(self, b):
        import time

        t = time.perf_counter()
        n = self._f.readinto(b)
        self.seconds += time.perf_counter() - t
        self.bytes_read += n or 0
        return n

    def seek(self, pos, whence=0):
        return self._f.seek(pos, whence)

    def tell(self):
        return self._f.tell()

    def seekable(self):
        return True

    def readable(self):
        return True

    def close(self):
        self._f.close()
        super().close()


def source_name(source) -> str:
    """The name errors use for ``source`` without opening it."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return "<bytes>"
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    name = getattr(source, "name", None)
    return name if isinstance(name, str) else "<file>"


NOT_REGULAR = "not a regular file (a pipe, socket or device), which reading could block on; not read"


def is_regular_file(path) -> bool:
    """Whether ``path`` (following links) is a regular file; False for a missing one, and for
    pipes, sockets and devices, whose reads may never end (a FIFO named ``x.wav``)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def is_special_file(path) -> bool:
    """Whether ``path`` (following links) exists and is not a regular file or a folder: a
    pipe, socket or device (a missing path, a dangling link, is not)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def open_source(source, *, param: str = "source") -> Source:
    """Resolve ``source``; a missing path raises ``FileNotFoundError``, a path that is not a
    regular file (a pipe, socket or device) :class:`~avpipe.errors.UnsupportedFormatError`.

    Anything that is not a path, bytes or a binary reader raises ``TypeError`` naming ``param``.
    """
    if isinstance(source, Source):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{param}: no such file: {path!r}")
        if os.path.isdir(path):
            raise IsADirectoryError(f"{param}: is a directory, not a media file: {path!r}")
        if not is_regular_file(path):
            from .errors import UnsupportedFormatError

            raise UnsupportedFormatError(path, NOT_REGULAR)
        return Source(name=path, path=path)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return Source(name="<bytes>", data=bytes(source))
    if hasattr(source, "read"):
        return Source(name=source_name(source), fileobj=source)
    raise TypeError(
        f"{param} must be a path, bytes or a binary file-like object, got {type(source).__name__}"
    )
