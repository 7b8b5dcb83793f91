"""Typed errors.

Every error about a source's *content* derives from :class:`DecodeError` and names the
source (its path, or ``"<bytes>"`` / ``"<file>"`` for in-memory data). A missing path raises
the built-in :class:`FileNotFoundError`; a bad argument raises :class:`ValueError` or
:class:`TypeError` naming the parameter and the value.
"""

from __future__ import annotations

__all__ = [
    "DecodeError",
    "UnsupportedFormatError",
    "CorruptDataError",
    "EmptyMediaError",
    "DecodeTimeoutError",
    "ImageTooLargeError",
    "MemoryCapError",
]


class DecodeError(Exception):
    """A source's content could not be decoded. ``.source`` names it, ``.cause`` says why."""

    def __init__(self, source: str, cause: str):
        self.source = source
        self.cause = cause
        super().__init__(f"{source}: {cause}")

    def __reduce__(self):  # picklable across processes (workers, Ray)
        return (type(self), (self.source, self.cause))


class UnsupportedFormatError(DecodeError):
    """The container, codec, pixel format or sample format is not supported."""


class CorruptDataError(DecodeError):
    """The data is truncated, corrupt, or holds invalid values (e.g. NaN audio)."""


class EmptyMediaError(DecodeError):
    """The source holds no frames / samples of the requested kind."""


class DecodeTimeoutError(DecodeError):
    """Decoding did not finish within the allowed time (a watchdog, never a hang)."""


class ImageTooLargeError(DecodeError):
    """The image's header declares more pixels than the pixel cap (``max_pixels``) allows."""


class MemoryCapError(ValueError):
    """A request would need more memory than the caller's cap allows."""
