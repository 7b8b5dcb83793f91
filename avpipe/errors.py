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
    "MemoryCapError",
    "StateError",
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


class MemoryCapError(ValueError):
    """A request would need more memory than the caller's cap allows."""


class StateError(ValueError):
    """A feed state (``load_state_dict``) that the feed did not write, or wrote for another
    feed: a missing or unknown field, a value of the wrong type or out of range, another
    version, another item list (the ``items`` fingerprint), or a list of ranks' states that
    cannot resume this rank exactly. ``.field`` names the field, ``.value`` is its value."""

    def __init__(self, field: str, value, why: str):
        self.field = field
        self.value = value
        self.why = why
        shown = repr(value)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        super().__init__(f"state: {field}={shown}: {why}")

    def __reduce__(self):  # picklable across processes (workers)
        return (type(self), (self.field, self.value, self.why))
