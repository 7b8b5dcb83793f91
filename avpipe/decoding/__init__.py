"""Decoding: one request in, arrays out (no prefetching, no sampling: that is
:mod:`avpipe.pipeline`).

* :mod:`avpipe.decoding.video` — :class:`VideoDecoder` over NVDEC (PyNvVideoCodec) and PyAV.
* :mod:`avpipe.decoding.audio` — :func:`load_audio` (soundfile; PyAV for video containers), and
  the CUDA FLAC decoder of a window of files.
* :mod:`avpipe.decoding.image` — :func:`decode_images` (DALI: nvJPEG / nvJPEG2000 / nvTIFF).
"""
