"""Array operators: pure functions written once against the array module (numpy on the CPU,
cupy on a GPU); results stay on the inputs' device.

* :mod:`avpipe.ops.audio` — dither, preemphasis, STFT, mel filterbank, log, MFCC,
  normalization, frame stacking, resampling, and the preset pipeline :func:`log_mel`.
* :mod:`avpipe.ops.image` — resize, crop, flip, normalize, layout and dtype; a video clip
  ``[T, H, W, C]`` is a batch of frames and an image is a clip of one frame.
* :mod:`avpipe.ops.color` — NV12 -> RGB (one colour table; swscale's fixed-point path and the
  NVDEC backend's CUDA kernel).

Every public name of ``audio`` and ``image`` is also reachable here (``avpipe.ops.log_mel``),
except names both define (``normalize``), which must be taken from their module.
"""

from __future__ import annotations

from . import audio, color, image
from .audio import (
    MLPERF_RNNT,
    NEMO,
    PRESET_DOCS,
    PRESETS,
    LogMelConfig,
    dct_matrix,
    dither,
    get_window,
    hz_to_mel,
    log_guarded,
    log_mel,
    log_mel_frame_lengths,
    mel_filterbank,
    mel_spectrogram,
    mel_to_hz,
    mfcc,
    pad_to_multiple,
    power_to_db,
    preemphasis,
    resample,
    spectrogram,
    stack_frames,
    stft,
    stft_frame_lengths,
)
from .image import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    center_crop,
    crop,
    flip,
    nv12_to_rgb,
    resize,
    resize_crop_normalize,
    resize_short_side_size,
    to_chw,
    to_dtype,
    to_layout,
)

__all__ = [
    "audio",
    "color",
    "image",
    "log_mel",
    "log_mel_frame_lengths",
    "LogMelConfig",
    "PRESETS",
    "PRESET_DOCS",
    "NEMO",
    "MLPERF_RNNT",
    "dither",
    "preemphasis",
    "resample",
    "stft",
    "spectrogram",
    "get_window",
    "stft_frame_lengths",
    "mel_filterbank",
    "mel_spectrogram",
    "hz_to_mel",
    "mel_to_hz",
    "log_guarded",
    "power_to_db",
    "mfcc",
    "dct_matrix",
    "stack_frames",
    "pad_to_multiple",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "resize",
    "resize_short_side_size",
    "crop",
    "center_crop",
    "flip",
    "to_layout",
    "to_chw",
    "to_dtype",
    "nv12_to_rgb",
    "resize_crop_normalize",
]


def __getattr__(name: str):
    # a name both modules define (normalize): say which one to use, never guess
    if name in audio.__all__ and name in image.__all__:
        raise AttributeError(
            f"avpipe.ops.{name} is ambiguous: use avpipe.ops.audio.{name} or avpipe.ops.image.{name}"
        )
    raise AttributeError(f"module 'avpipe.ops' has no attribute {name!r}")
