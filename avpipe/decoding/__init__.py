"""Decoding: one request in, arrays out (no prefetching, no sampling: that is
:mod:`avpipe.pipeline`).

* :mod:`avpipe.decoding.video` — :class:`VideoDecoder` over NVDEC (PyNvVideoCodec) and PyAV.
* :mod:`avpipe.decoding.audio` — :func:`load_audio` (soundfile; PyAV for video containers), and
  the CUDA FLAC decoder of a window of files.
* :mod:`avpipe.decoding.image` — :func:`decode_images` (DALI: nvJPEG / nvJPEG2000 / nvTIFF).
* :func:`build_index` / :func:`load_index` — a persisted index of video scans (``VideoDecoder(index=)``).
* :mod:`avpipe.decoding.backends` — the decoder seam: per media kind, the ordered list of
  backends the three front objects walk, and the :class:`~.backends.Fallback` record of a
  backend that refused.
"""

from __future__ import annotations

from .audio import Audio, audio_info, load_audio
from .image import ImageBatch, decode_image_batch, decode_images
from .video import FrameBatch, VideoDecoder, VideoIndex, VideoMetadata, build_index, load_index

__all__ = [
    "VideoDecoder",
    "VideoMetadata",
    "FrameBatch",
    "VideoIndex",
    "build_index",
    "load_index",
    "load_audio",
    "Audio",
    "audio_info",
    "decode_images",
    "decode_image_batch",
    "ImageBatch",
]
