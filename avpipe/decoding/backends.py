"""The decoder seam: for each kind of media, an ordered list of backends.

``"video"`` (:class:`~avpipe.decoding.video.VideoDecoder`): NVDEC, then PyAV.
``"audio"`` (:func:`~avpipe.decoding.audio.load_audio`): the GPU FLAC decoder, soundfile, PyAV.
``"image"`` (:func:`~avpipe.decoding.image.decode_image_batch`): the helper process,
nvImageCodec, DALI's CPU decoders.

A front object walks its kind's list in order and asks each backend ``accepts(request)``:

* ``True``: the backend decodes it (it may still refuse when it opens or decodes the source, by
  raising :class:`BackendRefused`);
* a string: it would serve this request but cannot decode this source (a codec, a bit depth, a
  header it does not trust); the string says why, is recorded as a :class:`Fallback`, and the
  walk goes on;
* ``None``: not this backend's business (a GPU backend asked for the CPU, a FLAC decoder
  asked for a WAV): skipped without a word.

A :class:`Fallback` names the backend that refused and why. ``VideoDecoder`` and ``Audio`` keep
them in ``.fallbacks`` (oldest first) beside ``.backend``, the name of the backend that decoded;
an ``ImageBatch`` keeps ``(index, Fallback)`` pairs and one name per image in ``.backends``.
Each is logged through :func:`warn_fallback`. The request and what a backend does once chosen
differ by kind (see :class:`VideoRequest`, :class:`AudioRequest`, :class:`ImageRequest`):

* video: ``open(request)`` returns a :class:`~avpipe.decoding.video._backend.VideoBackend`;
* audio: ``decode(request)`` returns ``(samples [n, C] float32, sample_rate, channels,
  start, damaged)``; ``samples`` numpy, or cupy on the request's device from a GPU backend;
* image: ``decode(work, indices)`` decodes a group of images that passed the header checks
  into ``work.images`` / ``work.errors``.

A backend is added with :func:`register` (or for a while with :func:`registered`); ``before=``
puts it ahead of a named one. The lists are meant to be changed while setting up, not while
other threads decode. ``docs/how-it-works.md`` has a worked example.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Backend",
    "BackendRefused",
    "Fallback",
    "KINDS",
    "AudioRequest",
    "ImageRequest",
    "VideoRequest",
    "backends",
    "first_accepting",
    "register",
    "registered",
    "unregister",
    "warn_fallback",
]

log = logging.getLogger("avpipe")

KINDS = ("video", "audio", "image")


class BackendRefused(Exception):
    """The backend cannot decode this source (its text says why); the next one must."""


@dataclass(frozen=True)
class Fallback:
    """A backend that refused a source, and why; the next backend in the list decoded it."""

    backend: str
    reason: str

    def __str__(self) -> str:
        return f"{self.backend}: {self.reason}"


@runtime_checkable
class Backend(Protocol):
    """One entry of a kind's list: a name and what it decodes."""

    name: str

    def accepts(self, request) -> bool | str | None:
        """True: decode it; a string: refused, and why; None: not this backend's request."""
        ...


@dataclass(frozen=True)
class VideoRequest:
    """What a video backend is asked to decode: one stream that a packet scan described.
    ``cpu``: the PyAV backend of the decoder, which decodes the frames another backend did not
    deliver. ``options``: the decoder's other arguments (``allow_cpu_fallback``, ``threads``)."""

    source: Any  # avpipe._source.Source
    source_name: str
    scan: Any  # decoding.video._scan.StreamScan
    device: Any  # avpipe.device.Device
    cpu: Any = None
    options: dict = field(default_factory=dict)

    @property
    def codec(self) -> str:
        return self.scan.codec

    @property
    def container(self) -> str | None:
        return self.scan.container


@dataclass(frozen=True)
class AudioRequest:
    """What an audio backend is asked to decode: a source, the span (seconds at the file's
    rate) and ``flac`` (:class:`~avpipe.decoding.audio._flac_scan.FlacLength`, None for a file
    that is not FLAC)."""

    source: Any  # avpipe._source.Source
    source_name: str
    offset: float
    duration: float | None
    device: Any
    flac: Any = None
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ImageRequest:
    """One admitted image: its bytes, the format its header names, the device, and whether the
    header checks send it to the helper process (``isolated``)."""

    source_name: str
    data: Any
    fmt: str
    device: Any
    isolated: bool = False


_LISTS: dict[str, list] = {k: [] for k in KINDS}


def _check_kind(kind: str) -> list:
    try:
        return _LISTS[kind]
    except KeyError:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}") from None


def backends(kind: str) -> tuple:
    """The backends of ``kind`` (``"video"``, ``"audio"``, ``"image"``), in the order tried."""
    return tuple(_check_kind(kind))


def register(kind: str, backend, *, before: str | None = None):
    """Add ``backend`` to ``kind``'s list: last, or just before the backend named ``before``.
    A backend of the same name is replaced (in its place). Returns ``backend``."""
    entries = _check_kind(kind)
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not callable(getattr(backend, "accepts", None)):
        raise TypeError(f"a backend has a str .name and an .accepts(request), got {backend!r}")
    for i, b in enumerate(entries):
        if b.name == name:
            entries[i] = backend
            return backend
    names = [b.name for b in entries]
    if before is not None and before not in names:
        raise ValueError(f"before={before!r} names no {kind} backend; they are {names}")
    entries.insert(names.index(before) if before is not None else len(entries), backend)
    return backend


def unregister(kind: str, name: str) -> None:
    """Remove the backend named ``name`` from ``kind``'s list (nothing if it is not there)."""
    entries = _check_kind(kind)
    entries[:] = [b for b in entries if b.name != name]


@contextlib.contextmanager
def registered(kind: str, backend, *, before: str | None = None) -> Iterator:
    """:func:`register` for the ``with`` block; the list is as it was afterwards."""
    saved = list(_check_kind(kind))
    register(kind, backend, before=before)
    try:
        yield backend
    finally:
        _LISTS[kind][:] = saved


def first_accepting(
    entries: Sequence, request, attempt: Callable, fallbacks: list, *, start: int = 0
):
    """Walk ``entries[start:]``: the first backend that accepts ``request`` and whose
    ``attempt(backend)`` does not raise :class:`BackendRefused` gives ``(position, result)``;
    each refusal on the way is appended to ``fallbacks``. ``(None, None)`` when none does."""
    for i in range(start, len(entries)):
        b = entries[i]
        ok = b.accepts(request)
        if ok is None or ok is False:
            continue
        if ok is not True:
            fallbacks.append(Fallback(b.name, str(ok)))
            continue
        try:
            return i, attempt(b)
        except BackendRefused as e:
            fallbacks.append(Fallback(b.name, str(e)))
    return None, None


def warn_fallback(source_name: str, fallback: Fallback, used: str, *, level=logging.WARNING) -> None:
    """Log one fallback the same way for every kind of media (``level``: video warns, as a GPU
    stream decoded on the CPU is slow; audio logs at DEBUG, as PyAV is the usual road for
    containers libsndfile does not read)."""
    log.log(level, "avpipe: %s: %s refused it (%s); decoding with %s", source_name,
            fallback.backend, fallback.reason, used)  # fmt: skip

