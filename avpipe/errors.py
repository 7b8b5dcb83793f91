"""Typed errors.

Every error about a source's *content* derives from :class:`DecodeError` and names the
source (its path, or ``"<bytes>"`` / ``"<file>"`` for in-memory data). A missing path raises
the built-in :class:`FileNotFoundError`; a bad argument raises :class:`ValueError` or
:class:`TypeError` naming the parameter and the value.
"""

from __future__ import annotations

import contextlib

__all__ = [
    "DecodeError",
    "naming",
    "renamed",
    "UnsupportedFormatError",
    "CorruptDataError",
    "EmptyMediaError",
    "DecodeTimeoutError",
    "ImageTooLargeError",
    "MemoryCapError",
    "ManifestError",
    "OutsideRootError",
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


def renamed(e: BaseException, name: str) -> BaseException:
    """``e`` naming ``name`` instead of its source (the same class and cause); ``e`` itself
    where it is no :class:`DecodeError` or names ``name`` already."""
    if not isinstance(e, DecodeError) or e.source == name:
        return e
    return type(e)(name, e.cause)


@contextlib.contextmanager
def naming(name: str, source):
    """Errors raised inside about in-memory bytes (``source``: a shard's member, read into
    memory) name ``name`` (``URL#KEY``) instead of ``<bytes>``; other errors pass unchanged."""
    try:
        yield
    except DecodeError as e:
        if isinstance(source, (bytes, bytearray, memoryview)):
            raise renamed(e, name) from None
        raise


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


class ManifestError(ValueError):
    """A line of an item list (NeMo manifest, CSV, file list) that cannot be used: bad JSON,
    bytes that are not UTF-8, a missing field or a field of the wrong type or range.
    ``.manifest`` (the file), ``.line`` (1-based; None: the whole file), ``.field`` and
    ``.value`` (None when not about one field) say where; ``.reason`` says why."""

    def __init__(self, manifest: str, line: int | None, reason: str, field: str | None = None,
                 value=None):
        self.manifest = manifest
        self.line = line
        self.reason = reason
        self.field = field
        self.value = value
        where = manifest if line is None else f"{manifest}:{line}"
        what = "" if field is None else f"field {field!r} = {_short(value)}: "
        super().__init__(f"{where}: {what}{reason}")

    def __reduce__(self):
        return (type(self), (self.manifest, self.line, self.reason, self.field, self.value))


class OutsideRootError(ValueError):
    """A listed path that lies outside the ``root`` the caller allowed (``../`` climbing out,
    an absolute path elsewhere, or a link resolving elsewhere). ``.path`` (as written),
    ``.root``, and where it was listed (``.manifest``, ``.line``; None when not from a file)."""

    def __init__(self, path: str, root: str, manifest: str | None = None,
                 line: int | None = None):
        self.path = path
        self.root = root
        self.manifest = manifest
        self.line = line
        where = "" if manifest is None else (
            f"{manifest}: " if line is None else f"{manifest}:{line}: ")
        super().__init__(f"{where}{path!r} lies outside root={root!r}")

    def __reduce__(self):
        return (type(self), (self.path, self.root, self.manifest, self.line))


def _short(value, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a 401-digit number stays readable)."""
    try:
        r = repr(value)
    except Exception:  # noqa: BLE001
        r = f"<{type(value).__name__}>"
    return r if len(r) <= limit else f"{r[: limit - 12]}...({len(r)} chars)"


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
