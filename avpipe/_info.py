"""``avpipe.info()``: what this installation can do on this machine."""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys

from ._version import __version__
from .device import default_device, gpu_available

__all__ = ["info", "format_info"]

# distribution names whose versions we report (the import may differ from the name)
_DISTS = {
    "numpy": ["numpy"],
    "soundfile": ["soundfile"],
    "av": ["av"],
    "nvidia-dali": ["nvidia-dali-cuda120", "nvidia-dali-cuda130", "nvidia-dali-cuda110"],
    "cupy": ["cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy"],
    "pynvvideocodec": ["pynvvideocodec", "PyNvVideoCodec"],
    "torch": ["torch"],
    "jax": ["jax"],
    "ray": ["ray"],
}

# NVDEC codecs we probe; names follow FFmpeg's
_NVDEC_CODECS = ("h264", "hevc", "vp8", "vp9", "mjpeg", "av1")


def _version(names):
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def _gpu_info():
    if not gpu_available():
        return [], None
    import cupy

    gpus = []
    for i in range(cupy.cuda.runtime.getDeviceCount()):
        p = cupy.cuda.runtime.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        gpus.append(
            {
                "index": i,
                "name": name,
                "compute_capability": f"{p['major']}.{p['minor']}",
                "memory_gib": round(p["totalGlobalMem"] / 2**30, 1),
            }
        )
    drv = cupy.cuda.runtime.driverGetVersion()
    return gpus, f"{drv // 1000}.{(drv % 1000) // 10}"


def _nvdec_codecs():
    """Codecs NVDEC decodes on GPU 0, asked of the driver (cuvidGetDecoderCaps)."""
    from .decoding.video import nvdec_codecs

    return nvdec_codecs(_NVDEC_CODECS)


def _dali_decoders():
    """Whether DALI's GPU ("mixed") and CPU image decoders build and run on a tiny JPEG."""
    from .decoding import image as _image

    return _image.decoder_status()


def info() -> dict:
    """Versions of avpipe and its dependencies, the GPU and driver, NVDEC codecs, DALI decoders.

    Never raises for a missing optional piece: each probe's failure is reported as a string.
    """

    out: dict = {
        "avpipe": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {k: _version(v) for k, v in _DISTS.items()},
        "default_device": str(default_device()),
    }
    gpus, driver = _gpu_info()
    out["gpus"] = gpus
    out["cuda_driver"] = driver
    try:
        out["nvdec_codecs"] = _nvdec_codecs() if gpus else []
    except Exception as e:  # report, don't fail
        out["nvdec_codecs"] = f"unavailable: {type(e).__name__}: {e}"
    try:
        out["dali_image_decoders"] = _dali_decoders()
    except Exception as e:
        out["dali_image_decoders"] = f"unavailable: {type(e).__name__}: {e}"
    return out


def format_info(d: dict) -> str:
    lines = [f"avpipe {d['avpipe']}  (Python {d['python']}, {d['platform']})"]
    lines.append("packages:")
    for k, v in d["versions"].items():
        lines.append(f"  {k:16s} {v or '-'}")
    lines.append(f"default device: {d['default_device']}")
    if d["gpus"]:
        lines.append(f"CUDA driver: {d['cuda_driver']}")
        for g in d["gpus"]:
            lines.append(
                f"  cuda:{g['index']} {g['name']} (sm {g['compute_capability']}, {g['memory_gib']} GiB)"
            )
    else:
        lines.append("GPU: none usable (everything runs on the CPU)")
    codecs = d["nvdec_codecs"]
    lines.append("NVDEC codecs: " + (", ".join(codecs) if isinstance(codecs, list) and codecs else str(codecs or "-")))
    dd = d["dali_image_decoders"]
    if isinstance(dd, dict):
        lines.append("DALI image decoders: " + ", ".join(f"{k}={v}" for k, v in dd.items()))
    else:
        lines.append(f"DALI image decoders: {dd}")
    return "\n".join(lines)
