"""Decoding: containers and codecs to arrays.

* :mod:`avpipe.decoding.video` — :class:`VideoDecoder` over NVDEC (PyNvVideoCodec) and PyAV.
* :mod:`avpipe.decoding.audio` — :func:`load_audio` (soundfile; PyAV for video containers).
* :mod:`avpipe.decoding.image` — :func:`decode_images` (DALI: nvJPEG / nvJPEG2000 / nvTIFF).
* :func:`build_index` / :func:`load_index` — a persisted index of video scans (``VideoDecoder(index=)``).
"""

from ._video_index import VideoIndex, build_index, load_index

__all__ = ["VideoIndex", "build_index", "load_index"]
