"""Array operators: pure functions written once against the array module (numpy on the CPU,
cupy on a GPU); results stay on the inputs' device.

* :mod:`avpipe.ops.audio` — dither, preemphasis, STFT, mel filterbank, log, MFCC,
  normalization, frame stacking, resampling, and the preset pipeline :func:`log_mel`.
* :mod:`avpipe.ops.image` — resize, crop, flip, normalize, layout and dtype; a video clip
  ``[T, H, W, C]`` is a batch of frames and an image is a clip of one frame.
* :mod:`avpipe.ops.color` — NV12 -> RGB (one colour table; swscale's fixed-point path and the
  NVDEC backend's CUDA kernel).

Every public name of the modules in ``_SUBMODULES`` is also reachable here
(``avpipe.ops.log_mel``), except names two of them define (``normalize``), which must be taken
from their module. The modules are imported with the package (they cost little beyond numpy,
which each needs), so adding one is one entry in ``_SUBMODULES``.
"""

from __future__ import annotations

import importlib

from . import color

_SUBMODULES = ("audio", "image")

_modules = [importlib.import_module(f"avpipe.ops.{sub}") for sub in _SUBMODULES]
_names = [name for mod in _modules for name in mod.__all__]
_AMBIGUOUS = {name for name in _names if _names.count(name) > 1}
for _mod in _modules:
    for _name in _mod.__all__:
        if _name not in _AMBIGUOUS:
            globals()[_name] = getattr(_mod, _name)

__all__ = ["color", *_SUBMODULES, *dict.fromkeys(n for n in _names if n not in _AMBIGUOUS)]


def __getattr__(name: str):
    if name in _AMBIGUOUS:  # e.g. normalize: say which one, never guess
        where = " or ".join(
            f"avpipe.ops.{sub}.{name}"
            for sub, mod in zip(_SUBMODULES, _modules)
            if name in mod.__all__
        )
        raise AttributeError(f"avpipe.ops.{name} is ambiguous: use {where}")
    raise AttributeError(f"module 'avpipe.ops' has no attribute {name!r}")
