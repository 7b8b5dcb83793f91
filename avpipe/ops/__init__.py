"""Array operators: pure functions written once against the array module (numpy on the CPU,
cupy on a GPU); results stay on the inputs' device.

* :mod:`avpipe.ops.audio` — dither, preemphasis, STFT, mel filterbank, log, MFCC,
  normalization, frame stacking, resampling, and the preset pipeline :func:`log_mel`.
* :mod:`avpipe.ops.image` — resize, crop, flip, normalize, layout and dtype; a video clip
  ``[T, H, W, C]`` is a batch of frames and an image is a clip of one frame.
* :mod:`avpipe.ops.audio_augment`, :mod:`avpipe.ops.image_augment` — augmentations drawn per
  sample (speed perturbation, noise, reverb, SpecAugment; random resized crop, flip, colour
  jitter, mixup/cutmix), each a parameter sampler plus a pure apply function, chained by
  ``Chain``.
* :mod:`avpipe.ops.random` — counter-based draws keyed by (seed, stream, epoch, sample id),
  the same on numpy and cupy.
* :mod:`avpipe.ops.color` — NV12 -> RGB (one colour table; swscale's fixed-point path and the
  NVDEC backend's CUDA kernel).
* :mod:`avpipe.ops.registry` — the named operators (``register``, ``get``, ``names``) that
  ``Chain.from_config`` and extraction presets build from: one function plus one registration
  makes an operator usable in both.

Every public name of the modules in ``_SUBMODULES`` is also reachable here
(``avpipe.ops.log_mel``), except names two of them define (``normalize``), which must be taken
from their module. The modules are imported with the package (they cost little beyond numpy,
which each needs), so adding one is one entry in ``_SUBMODULES``.
"""

from __future__ import annotations

import importlib

from . import color, random, registry

_SUBMODULES = ("audio", "image", "audio_augment", "image_augment")

_modules = [importlib.import_module(f"avpipe.ops.{sub}") for sub in _SUBMODULES]
_names = [name for mod in _modules for name in mod.__all__]
# a name is ambiguous where two modules give it different objects (normalize); one object
# exported by several modules (Chain) is not
_AMBIGUOUS = {
    name
    for name in _names
    if len({id(getattr(m, name)) for m in _modules if name in m.__all__}) > 1
}
for _mod in _modules:
    for _name in _mod.__all__:
        if _name not in _AMBIGUOUS:
            globals()[_name] = getattr(_mod, _name)

__all__ = ["color", "random", "registry", *_SUBMODULES, *dict.fromkeys(n for n in _names if n not in _AMBIGUOUS)]


def __getattr__(name: str):
    if name in _AMBIGUOUS:  # e.g. normalize: say which one, never guess
        where = " or ".join(
            f"avpipe.ops.{sub}.{name}"
            for sub, mod in zip(_SUBMODULES, _modules)
            if name in mod.__all__
        )
        raise AttributeError(f"avpipe.ops.{name} is ambiguous: use {where}")
    raise AttributeError(f"module 'avpipe.ops' has no attribute {name!r}")
