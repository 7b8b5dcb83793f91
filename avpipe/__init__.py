"""avpipe: audio, video and image files to training-ready GPU tensors and stored features.

The public API is small and imported lazily, so ``import avpipe`` is cheap (PyAV, DALI and
PyNvVideoCodec load the first time a decoder needs them)::

    avpipe.info()                     # versions, GPU, NVDEC codecs, DALI decoders
    avpipe.VideoDecoder(src, device=None)
    avpipe.load_audio(src, sample_rate=None, mono=True, offset=0.0, duration=None)
    avpipe.decode_images(sources, device=None)
    avpipe.ops.log_mel(signals, lengths, preset="nemo")

Sub-packages, one per concern: ``decoding`` (containers and codecs to arrays), ``ops`` (pure
array operators, numpy or cupy), ``pipeline`` (sources that training jobs consume), ``recipes``
(ready-made jobs), ``cli`` (the ``avpipe`` command); ``device`` hands arrays to torch / JAX /
cupy through DLPack.
"""

from __future__ import annotations

import importlib

from ._version import __version__
from .errors import (
    CorruptDataError,
    DecodeError,
    DecodeTimeoutError,
    EmptyMediaError,
    MemoryCapError,
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
_SUBMODULES = {"ops", "decoding", "device", "pipeline", "recipes", "cli"}

__all__ = [
    "__version__",
    "DecodeError",
    "UnsupportedFormatError",
    "CorruptDataError",
    "EmptyMediaError",
    "DecodeTimeoutError",
    "MemoryCapError",
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
