"""The one registry of file extensions: which files avpipe treats as audio, video or images.

Extensions are lower case with the dot; match them with ``os.path.splitext(p)[1].lower()``
(:func:`kind_of`). Images are what DALI's decoders read (JPEG, PNG, TIFF, JPEG 2000, BMP, WebP,
PNM); video and audio what PyAV / libsndfile open in practice. Content is never trusted to the
name: decoders sniff the bytes and raise :class:`~avpipe.errors.UnsupportedFormatError`.
"""

from __future__ import annotations

import os

__all__ = [
    "AUDIO_EXTENSIONS", "VIDEO_EXTENSIONS", "IMAGE_EXTENSIONS", "EXTENSIONS", "kind_of",
    "MP4_EXTENSIONS", "NON_MP4_CONTAINER_EXTENSIONS", "is_flac",
]  # fmt: skip

AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".opus", ".mp3")
VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mkv", ".webm", ".avi", ".mov")
IMAGE_EXTENSIONS = (
    ".jpg", ".jpeg", ".jpe", ".png", ".tif", ".tiff", ".jp2", ".j2k", ".jpx",
    ".bmp", ".webp", ".pnm", ".ppm", ".pgm", ".pbm",
)  # fmt: skip

# The ISO base media family, whose first open reads its sample tables (decoding/video/_mp4.py),
# and names of other containers, whose files are never sniffed for an MP4 ``ftyp`` box.
MP4_EXTENSIONS = (".mp4", ".mov", ".m4v")
NON_MP4_CONTAINER_EXTENSIONS = (
    ".mkv", ".webm", ".avi", ".ts", ".mts", ".m2ts", ".flv", ".mpg", ".mpeg", ".ogv",
)  # fmt: skip

# extension -> "audio" | "video" | "image"
EXTENSIONS = {
    **{e: "audio" for e in AUDIO_EXTENSIONS},
    **{e: "video" for e in VIDEO_EXTENSIONS},
    **{e: "image" for e in IMAGE_EXTENSIONS},
}


def kind_of(path) -> str | None:
    """``"audio"``, ``"video"``, ``"image"`` or None, from ``path``'s extension."""
    return EXTENSIONS.get(os.path.splitext(os.fspath(path))[1].lower())


def is_flac(path) -> bool:
    """Whether ``path`` is named as a FLAC file (the GPU FLAC decoder's files)."""
    return os.path.splitext(os.fspath(path))[1].lower() == ".flac"
