"""Still-image decoding: :func:`decode_images` / :func:`decode_image_batch` (``decode``) over the
image backends listed in :mod:`avpipe.decoding.backends` under ``"image"`` (the helper process,
nvImageCodec on a GPU, DALI's CPU decoders); ``decode``'s docstring says how."""

from __future__ import annotations

from ._cpu import native_stderr
from ._header import file_reader, j2k_check
from .decode import (
    ImageBatch,
    admit,
    decode_image_batch,
    decode_images,
    decoder_status,
    isolate,
    j2k_header_problem,
    resolve_max_pixels,
    size_problem,
    sniff_format,
    square_window,
    truncation,
)

__all__ = [
    "file_reader",
    "j2k_check",
    "decode_images",
    "decode_image_batch",
    "ImageBatch",
    "sniff_format",
    "square_window",
    "decoder_status",
    "admit",
    "isolate",
    "j2k_header_problem",
    "resolve_max_pixels",
    "size_problem",
    "truncation",
    "native_stderr",
]
