"""avpipe: audio, video and image files to training-ready GPU tensors and stored features.

::

    avpipe.info()                     # versions, GPU, NVDEC codecs, DALI decoders
    avpipe.VideoDecoder(src, device=None)
    avpipe.load_audio(src, sample_rate=None, mono=True, offset=0.0, duration=None)
    avpipe.decode_images(sources, device=None)
    avpipe.ops.log_mel(signals, lengths, preset="nemo")

Layers, each importing only from those before it: ``ops`` (array math, numpy or cupy) <-
``decoding`` (one request in, arrays out) <- ``pipeline`` (samplers, prefetching, batch
loaders, feeds) <- ``recipes`` (ready-made jobs) <- ``cli`` (the ``avpipe`` command); below
them ``settings``, ``formats``, ``device`` and ``errors``.

The names above load on first use: every layer imports numpy, which ``import avpipe`` alone
does not need (PyAV, DALI, CuPy and PyNvVideoCodec load only when a decoder needs them).
"""

from __future__ import annotations

import importlib

from ._memory import limit_malloc_arenas as _limit_malloc_arenas
from ._version import __version__
from .errors import (
    CorruptDataError,
    DecodeError,
    DecodeTimeoutError,
    EmptyMediaError,
    MemoryCapError,
    StateError,
    UnsupportedFormatError,
)

# name -> module that defines it; resolved on first access
_LAZY = {
    "info": "avpipe._info",
    "VideoDecoder": "avpipe.decoding.video",
    "VideoMetadata": "avpipe.decoding.video",
    "FrameBatch": "avpipe.decoding.video",
    "load_audio": "avpipe.decoding.audio",
    "Audio": "avpipe.decoding.audio",
    "decode_images": "avpipe.decoding.image",
    "Device": "avpipe.device",
    "resolve_device": "avpipe.device",
}
_SUBMODULES = {"ops", "decoding", "device", "pipeline", "recipes", "cli", "settings", "formats"}

# glibc fixes its arena count when a second arena is first made: the limit is set here, as the
# package loads, before any thread of a feed or a remote read allocates (avpipe._memory)
_limit_malloc_arenas()

__all__ = [
    "__version__",
    "DecodeError",
    "UnsupportedFormatError",
    "CorruptDataError",
    "EmptyMediaError",
    "DecodeTimeoutError",
    "MemoryCapError",
    "StateError",
    *_LAZY,
    *sorted(_SUBMODULES),
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"avpipe.{name}")
    raise AttributeError(f"module 'avpipe' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
