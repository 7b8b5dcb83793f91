"""Array operators: pure functions written once against the array module (numpy on the CPU,
cupy on a GPU); results stay on the inputs' device.

* :mod:`avpipe.ops.audio` — dither, preemphasis, STFT, mel filterbank, log, MFCC,
  normalization, frame stacking, and the preset pipeline :func:`log_mel`.
* :mod:`avpipe.ops.image` — resize, crop, flip, normalize, layout and dtype, NV12 → RGB; a video
  clip ``[T, H, W, C]`` is a batch of frames and an image is a clip of one frame.

Every name of those modules' ``__all__`` is also reachable here (``avpipe.ops.log_mel``), except
names both define (``normalize``), which must be taken from their module.
"""

from __future__ import annotations

import importlib

_SUBMODULES = ("audio", "image", "audio_augment", "image_augment")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"avpipe.ops.{name}")
    found = []
    for sub in _SUBMODULES:
        mod = importlib.import_module(f"avpipe.ops.{sub}")
        if name in getattr(mod, "__all__", ()):
            found.append((sub, getattr(mod, name)))
    if len(found) == 1:
        globals()[name] = found[0][1]
        return found[0][1]
    if len(found) > 1:  # e.g. normalize: say which one, never guess
        where = " or ".join(f"avpipe.ops.{sub}.{name}" for sub, _ in found)
        raise AttributeError(f"avpipe.ops.{name} is ambiguous: use {where}")
    raise AttributeError(f"module 'avpipe.ops' has no attribute {name!r}")
