"""Every ``AVPIPE_*`` environment variable, parsed in one place with one grammar.

Each variable is read when the setting is asked for (never at import), so a test or a process
may change it between calls. Grammar:

* booleans: ``1``/``0``, ``true``/``false``, ``on``/``off``, ``yes``/``no`` (any case,
  surrounding spaces ignored); unset or empty means the default;
* integers and floats: a number in the stated range (``auto`` too where the table says so);
* anything else raises ``ValueError`` naming the variable and the value.

=============================== ======= ================================================================
variable                        default meaning
=============================== ======= ================================================================
``AVPIPE_DISABLE_GPU``          off     ``device=None`` means the CPU even where a GPU is usable
``AVPIPE_IMAGE_KERNELS``        on      image ops and augmentations use fused CUDA kernels (off: cupy ops)
``AVPIPE_NVDEC_PACKETS``        auto    NVDEC packet path: auto (H.264/HEVC in MP4/MOV), on (also
                                        other containers, PyNvVideoCodec's demuxer), off
``AVPIPE_NVDEC_CHUNK``          auto    packets per NVDEC ``Decode`` call on the packet path (>= 1;
                                        auto: as many as 32 MiB of frames hold, 16 to 64)
``AVPIPE_NVDEC_DLPACK``         off     read NVDEC frames through DLPack instead of plane pointers
``AVPIPE_FLAC_WINDOW``          256     files per GPU FLAC decode launch (>= 1)
``AVPIPE_VIDEO_SCAN_AHEAD``     2       processes reading MP4/MOV sample tables ahead of the video
                                        feed's decoding (>= 0; 0: each open scans its own file)
``AVPIPE_JPEG_HW_LOAD``         1.0     share of a JPEG batch for the hardware decoder, in [0, 1]
``AVPIPE_DALI_THREADS``         CPUs    DALI CPU threads per pipeline (>= 1; default min(CPUs, 16))
``AVPIPE_DALI_STREAM_OUTPUTS``  on      DALI outputs ordered on the caller's CUDA stream
``AVPIPE_EXTRACT_WRITERS``      4       writer threads of ``avpipe extract`` per worker (>= 1)
``AVPIPE_EXTRACT_WRITEBACK_MB`` 8       ``avpipe extract`` starts a tar shard's writeback every this many
                                        MB written (>= 0; 0: only the fsync at the shard's end)
``AVPIPE_EXTRACT_PROFILE``      off     ``avpipe extract`` prints a time breakdown per stage
``AVPIPE_EXTRACT_LOADER_MAX_SECONDS`` 60 audio longer than this is decoded alone, not batched
``AVPIPE_FEED_DEADLINE``        60      seconds one item of a feed may take to read and decode (>= 0; 0: no
                                        limit); a feed's ``deadline="auto"`` (its default)
``AVPIPE_EXTRACT_FILE_TIMEOUT`` 60      seconds ``avpipe extract`` waits on one input before it gives
                                        the input up as a timeout error (>= 0; 0: no limit)
``AVPIPE_NATIVE_STDERR``        off     let native decoders (nvImageCodec, libtiff, OpenCV) write to
                                        stderr (off: their lines go into the error's message)
``AVPIPE_STORAGE_RETRIES``      5       retries of a remote read or write that failed transiently
                                        (5xx, 408, 429, resets, timeouts), with exponential backoff
``AVPIPE_STORAGE_TIMEOUT``      60      seconds a remote request may take before it counts as failed
``AVPIPE_MALLOC_ARENAS``        2       glibc malloc arenas of a process that imports avpipe, set at
                                        import (>= 0; 0: glibc's default, 8 per core)
``AVPIPE_CACHE_DIR``            ~/.cache/avpipe  where shard indexes are kept (one file per shard
                                        version)
``AVPIPE_MAX_IMAGE_PIXELS``     179 M   images whose header declares more pixels are refused before
                                        decoding (``max_pixels=``'s default; an integer >= 0, 0: no
                                        cap; default 178956970, Pillow's decompression-bomb limit)
``AVPIPE_IMAGE_ISOLATION``      auto    which images decode in a helper process, where a decoder's crash
                                        costs only that image: auto (JPEG 2000 whose header check
                                        cannot vouch for it), all, off
=============================== ======= ================================================================
"""

from __future__ import annotations

import math
import os

__all__ = [
    "env_bool",
    "env_int",
    "env_float",
    "disable_gpu",
    "image_kernels",
    "nvdec_packets",
    "nvdec_chunk",
    "nvdec_dlpack",
    "flac_window",
    "video_scan_ahead",
    "jpeg_hw_load",
    "dali_threads",
    "dali_stream_outputs",
    "native_stderr",
    "extract_writers",
    "extract_writeback_mb",
    "extract_profile",
    "extract_loader_max_seconds",
    "storage_retries",
    "storage_timeout",
    "malloc_arenas",
    "cache_dir",
    "max_image_pixels",
    "image_isolation",
    "feed_deadline",
    "extract_file_timeout",
    "FEED_DEADLINE_S",
    "EXTRACT_FILE_TIMEOUT_S",
    "VARIABLES",
]

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def _raw(name: str) -> str | None:
    v = os.environ.get(name)
    if v is None or not v.strip():
        return None
    return v.strip()


def env_bool(name: str, default: bool) -> bool:
    """The boolean variable ``name`` (see the module's grammar); ``default`` when unset/empty."""
    v = _raw(name)
    if v is None:
        return default
    low = v.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(
        f"{name} must be one of 1/0, true/false, on/off, yes/no, got {os.environ.get(name)!r}"
    )


def env_int(name: str, default: int | None, *, minimum: int | None = None) -> int | None:
    """The integer variable ``name`` (at least ``minimum``); ``default`` when unset/empty."""
    v = _raw(name)
    if v is None:
        return default
    try:
        n = int(v)
    except ValueError:
        n = None
    if n is None or (minimum is not None and n < minimum):
        want = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {want}, got {os.environ.get(name)!r}")
    return n


def env_float(name: str, default: float, *, lo: float, hi: float) -> float:
    """The number variable ``name`` in ``[lo, hi]``; ``default`` when unset/empty."""
    v = _raw(name)
    if v is None:
        return default
    try:
        x = float(v)
    except ValueError:
        x = math.nan
    if not (lo <= x <= hi):  # also NaN
        raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}], got {os.environ.get(name)!r}")
    return x


def disable_gpu() -> bool:
    """``AVPIPE_DISABLE_GPU``: ``device=None`` means the CPU even where a GPU is usable."""
    return env_bool("AVPIPE_DISABLE_GPU", False)


def image_kernels() -> bool:
    """``AVPIPE_IMAGE_KERNELS``: the image ops' fused CUDA kernels (off: the cuBLAS path)."""
    return env_bool("AVPIPE_IMAGE_KERNELS", True)


def nvdec_packets() -> str:
    """``AVPIPE_NVDEC_PACKETS``: ``"auto"`` (default), ``"on"`` or ``"off"``; ``auto`` or a
    boolean."""
    v = _raw("AVPIPE_NVDEC_PACKETS")
    if v is None or v.lower() == "auto":
        return "auto"
    try:
        return "on" if env_bool("AVPIPE_NVDEC_PACKETS", False) else "off"
    except ValueError:
        raise ValueError(
            "AVPIPE_NVDEC_PACKETS must be auto or one of 1/0, true/false, on/off, yes/no, "
            f"got {os.environ.get('AVPIPE_NVDEC_PACKETS')!r}"
        ) from None


def nvdec_chunk() -> int | None:
    """``AVPIPE_NVDEC_CHUNK``: packets per ``Decode`` call on the NVDEC packet path; None
    (unset, empty or ``auto``): the packet path picks by frame size."""
    v = _raw("AVPIPE_NVDEC_CHUNK")
    if v is not None and v.lower() == "auto":
        return None
    try:
        return env_int("AVPIPE_NVDEC_CHUNK", None, minimum=1)
    except ValueError:
        raise ValueError(
            "AVPIPE_NVDEC_CHUNK must be auto or an integer >= 1, "
            f"got {os.environ.get('AVPIPE_NVDEC_CHUNK')!r}"
        ) from None


def nvdec_dlpack() -> bool:
    """``AVPIPE_NVDEC_DLPACK``: read NVDEC frames through DLPack instead of plane pointers."""
    return env_bool("AVPIPE_NVDEC_DLPACK", False)


def flac_window() -> int:
    """``AVPIPE_FLAC_WINDOW``: files per GPU FLAC decode launch."""
    return env_int("AVPIPE_FLAC_WINDOW", 256, minimum=1)


def video_scan_ahead() -> int:
    """``AVPIPE_VIDEO_SCAN_AHEAD``: processes scanning the video feed's next files (0: off)."""
    return env_int("AVPIPE_VIDEO_SCAN_AHEAD", 2, minimum=0)


def jpeg_hw_load() -> float:
    """``AVPIPE_JPEG_HW_LOAD``: the share of a JPEG batch DALI gives its hardware decoder."""
    return env_float("AVPIPE_JPEG_HW_LOAD", 1.0, lo=0.0, hi=1.0)


def dali_threads() -> int | None:
    """``AVPIPE_DALI_THREADS``: DALI CPU threads per pipeline (None: avpipe's default)."""
    return env_int("AVPIPE_DALI_THREADS", None, minimum=1)


def dali_stream_outputs() -> bool:
    """``AVPIPE_DALI_STREAM_OUTPUTS``: DALI outputs ordered on the caller's CUDA stream."""
    return env_bool("AVPIPE_DALI_STREAM_OUTPUTS", True)


def native_stderr() -> bool:
    """``AVPIPE_NATIVE_STDERR``: let native decoders write to stderr (default: captured)."""
    return env_bool("AVPIPE_NATIVE_STDERR", False)


def extract_writers() -> int:
    """``AVPIPE_EXTRACT_WRITERS``: writer threads per ``avpipe extract`` worker."""
    return env_int("AVPIPE_EXTRACT_WRITERS", 4, minimum=1)


def extract_writeback_mb() -> int:
    """``AVPIPE_EXTRACT_WRITEBACK_MB``: MB between a tar shard's early writeback calls (0: off)."""
    return env_int("AVPIPE_EXTRACT_WRITEBACK_MB", 8, minimum=0)


def extract_profile() -> bool:
    """``AVPIPE_EXTRACT_PROFILE``: ``avpipe extract`` times its stages and prints them."""
    return env_bool("AVPIPE_EXTRACT_PROFILE", False)


def extract_loader_max_seconds() -> float:
    """``AVPIPE_EXTRACT_LOADER_MAX_SECONDS``: longer audio is decoded alone, not batched."""
    return env_float("AVPIPE_EXTRACT_LOADER_MAX_SECONDS", 60.0, lo=0.0, hi=1e9)


def storage_retries() -> int:
    """``AVPIPE_STORAGE_RETRIES``: retries of a remote request that failed transiently."""
    return env_int("AVPIPE_STORAGE_RETRIES", 5, minimum=0)


def storage_timeout() -> float:
    """``AVPIPE_STORAGE_TIMEOUT``: seconds a remote request may take."""
    return env_float("AVPIPE_STORAGE_TIMEOUT", 60.0, lo=0.001, hi=1e6)


def malloc_arenas() -> int:
    """``AVPIPE_MALLOC_ARENAS``: the most glibc malloc arenas (0: glibc's default)."""
    return env_int("AVPIPE_MALLOC_ARENAS", 2, minimum=0)


def cache_dir() -> str:
    """``AVPIPE_CACHE_DIR``: avpipe's local cache (shard indexes); default
    ``$XDG_CACHE_HOME/avpipe`` or ``~/.cache/avpipe``."""
    v = _raw("AVPIPE_CACHE_DIR")
    if v is not None:
        path = os.path.expanduser(v)
        if not os.path.isabs(path):  # a relative one would move with the working directory
            raise ValueError(f"AVPIPE_CACHE_DIR must be an absolute path, got {v!r}")
        return path
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "avpipe")
# Pillow's DecompressionBombError threshold (2 * Image.MAX_IMAGE_PIXELS): every image Pillow
# opens decodes here too (150 Mpx medium-format photos included); one image at the cap is
# 537 MB as RGB uint8, a few times that while a decoder works on it
MAX_IMAGE_PIXELS_DEFAULT = 178_956_970


def max_image_pixels() -> int | None:
    """``AVPIPE_MAX_IMAGE_PIXELS``: the pixel cap of the image decoders (None: no cap)."""
    v = env_int("AVPIPE_MAX_IMAGE_PIXELS", MAX_IMAGE_PIXELS_DEFAULT, minimum=0)
    return v or None


def image_isolation() -> str:
    """``AVPIPE_IMAGE_ISOLATION``: ``"auto"`` (default), ``"all"`` or ``"off"``."""
    v = _raw("AVPIPE_IMAGE_ISOLATION")
    if v is None:
        return "auto"
    v = v.strip().lower()
    if v not in ("auto", "all", "off"):
        raise ValueError("AVPIPE_IMAGE_ISOLATION must be auto, all or off, "
                         f"got {os.environ.get('AVPIPE_IMAGE_ISOLATION')!r}")
    return v


FEED_DEADLINE_S = 60.0
EXTRACT_FILE_TIMEOUT_S = 60.0


def feed_deadline() -> float | None:
    """``AVPIPE_FEED_DEADLINE``: a feed's default per-item deadline in seconds (None: 0, no
    limit). An item past it is skipped as a ``DecodeTimeoutError`` and its thread given up."""
    x = env_float("AVPIPE_FEED_DEADLINE", FEED_DEADLINE_S, lo=0.0, hi=1e9)
    return x or None


def extract_file_timeout() -> float | None:
    """``AVPIPE_EXTRACT_FILE_TIMEOUT``: seconds ``avpipe extract`` waits on one input (None:
    0, no limit); then the worker process is replaced and the input listed as a timeout."""
    x = env_float("AVPIPE_EXTRACT_FILE_TIMEOUT", EXTRACT_FILE_TIMEOUT_S, lo=0.0, hi=1e9)
    return x or None


# name -> the function that reads it (docs/settings.md lists the same in its table)
VARIABLES = {
    "AVPIPE_DISABLE_GPU": disable_gpu,
    "AVPIPE_MALLOC_ARENAS": malloc_arenas,
    "AVPIPE_IMAGE_KERNELS": image_kernels,
    "AVPIPE_NVDEC_PACKETS": nvdec_packets,
    "AVPIPE_NVDEC_CHUNK": nvdec_chunk,
    "AVPIPE_NVDEC_DLPACK": nvdec_dlpack,
    "AVPIPE_FLAC_WINDOW": flac_window,
    "AVPIPE_VIDEO_SCAN_AHEAD": video_scan_ahead,
    "AVPIPE_JPEG_HW_LOAD": jpeg_hw_load,
    "AVPIPE_DALI_THREADS": dali_threads,
    "AVPIPE_DALI_STREAM_OUTPUTS": dali_stream_outputs,
    "AVPIPE_NATIVE_STDERR": native_stderr,
    "AVPIPE_EXTRACT_WRITERS": extract_writers,
    "AVPIPE_EXTRACT_WRITEBACK_MB": extract_writeback_mb,
    "AVPIPE_EXTRACT_PROFILE": extract_profile,
    "AVPIPE_EXTRACT_LOADER_MAX_SECONDS": extract_loader_max_seconds,
    "AVPIPE_STORAGE_RETRIES": storage_retries,
    "AVPIPE_STORAGE_TIMEOUT": storage_timeout,
    "AVPIPE_CACHE_DIR": cache_dir,
    "AVPIPE_MAX_IMAGE_PIXELS": max_image_pixels,
    "AVPIPE_IMAGE_ISOLATION": image_isolation,
    "AVPIPE_FEED_DEADLINE": feed_deadline,
    "AVPIPE_EXTRACT_FILE_TIMEOUT": extract_file_timeout,
}
