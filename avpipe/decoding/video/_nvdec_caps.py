"""Ask the driver which codecs NVDEC decodes (cuvidGetDecoderCaps through PyNvVideoCodec).
"""

from __future__ import annotations

import functools

__all__ = ["supported_codecs", "nvdec_supports", "pynvc"]

# FFmpeg codec name -> PyNvVideoCodec's cudaVideoCodec member
_CUVID_NAMES = {
    "h264": "H264",
    "hevc": "HEVC",
    "vp8": "VP8",
    "vp9": "VP9",
    "mjpeg": "JPEG",
    "av1": "AV1",
    "mpeg2video": "MPEG2",
    "mpeg4": "MPEG4",
}


@functools.lru_cache(maxsize=1)
def pynvc():
    """The PyNvVideoCodec module, or raise ImportError with a useful message."""
    try:
        import PyNvVideoCodec as nvc  # noqa: N813
    except Exception as e:  # ImportError, or its loader failing on a driverless machine
        raise ImportError(f"PyNvVideoCodec is not usable here: {type(e).__name__}: {e}") from e
    return nvc


@functools.cache
def nvdec_supports(codec: str, *, gpu: int = 0, bit_depth: int = 8, chroma: str = "420") -> bool:
    """True when NVDEC on ``gpu`` decodes ``codec`` (FFmpeg name) at that depth and chroma."""
    nvc = pynvc()
    member = _CUVID_NAMES.get(codec)
    if member is None or not hasattr(nvc.cudaVideoCodec, member):
        return False
    chroma_fmt = getattr(nvc.cudaVideoChromaFormat, "_" + chroma, None) or getattr(
        nvc.cudaVideoChromaFormat, chroma, None
    )
    kwargs = dict(gpuid=gpu, codec=getattr(nvc.cudaVideoCodec, member), bitdepth=bit_depth)
    if chroma_fmt is not None:
        kwargs["chromaformat"] = chroma_fmt
    try:
        caps = nvc.GetDecoderCaps(**kwargs)
    except Exception:
        return False
    if isinstance(caps, dict):
        return bool(
            caps.get("supported", caps.get("is_supported", caps.get("num_decoder_engines", 0)))
        )
    return bool(caps)


def supported_codecs(codecs, *, gpu: int = 0) -> list[str]:
    return [c for c in codecs if nvdec_supports(c, gpu=gpu)]
