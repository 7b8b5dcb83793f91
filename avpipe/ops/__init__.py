"""Array operators: pure functions written once against the array module (numpy on the CPU,
cupy on a GPU); results stay on the inputs' device.

* :mod:`avpipe.ops.audio` — dither, preemphasis, STFT, mel filterbank, log, MFCC,
  normalization, frame stacking, and the preset pipeline :func:`log_mel`.
* :mod:`avpipe.ops.image` — resize, crop, flip, normalize, layout and dtype, NV12 → RGB; a video
  clip ``[T, H, W, C]`` is a batch of frames and an image is a clip of one frame.

Every name of those modules' ``__all__`` is also reachable here (``avpipe.ops.log_mel``).
"""

from __future__ import annotations

import importlib

_SUBMODULES = ("audio", "image")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"avpipe.ops.{name}")
    for sub in _SUBMODULES:
        try:
            mod = importlib.import_module(f"avpipe.ops.{sub}")
        except ModuleNotFoundError:
            continue
        if name in getattr(mod, "__all__", ()):
            value = getattr(mod, name)
            globals()[name] = value
            return value
    raise AttributeError(f"module 'avpipe.ops' has no attribute {name!r}")
