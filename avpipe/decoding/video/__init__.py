"""Video decoding: :class:`VideoDecoder` over the video backends (NVDEC on a GPU, PyAV).

::

    with avpipe.VideoDecoder("clip.mp4", device=None) as dec:   # GPU when usable, else CPU
        dec.metadata.num_frames, dec.metadata.pts_seconds
        batch = dec.get_frames([10, 3, 3, 40])                   # any order, duplicates
        batch = dec.get_frames_at([0.5, 1.25])                   # the frame shown at t
        batch = dec.get_frames_in_range(0, 64, step=4)
        for chunk in dec.iter_frames(chunk_size=32): ...         # without holding the video

Modules: ``decoder`` (:class:`VideoDecoder`, :class:`VideoMetadata`, :class:`FrameBatch`),
``_scan`` (the packet scan), ``_mp4`` (the MP4/MOV box parser), ``_nal`` (the H.264/HEVC
bitstream), ``_pyav`` and ``_nvdec*`` (the backends), ``_plan`` (which packets a request
decodes), ``_index`` (persisted scans). The backends are listed in
:mod:`avpipe.decoding.backends` under ``"video"``.
"""

from __future__ import annotations

from ._index import VideoIndex, build_index, load_index
from ._nvdec_caps import supported_codecs as nvdec_codecs
from ._scan import is_scan_cached, remember_scan, scan_mp4_file
from .decoder import FrameBatch, VideoDecoder, VideoMetadata

__all__ = ["VideoDecoder", "VideoMetadata", "FrameBatch", "VideoIndex", "build_index",
           "load_index", "nvdec_codecs", "is_scan_cached", "remember_scan", "scan_mp4_file"]
