"""Tiny test videos made on the fly with PyAV encoders (never downloaded).

``make_video(path, codec=..., ...)`` writes a short clip whose frames all differ (moving
gradients and a moving square), so that an off-by-one frame is caught by an exact comparison.
``reference_frames(path)`` is PyAV's own full decode of the same file (display order, rgb24).
"""

from __future__ import annotations

import fractions
import os

import av
import numpy as np

# codec key -> (encoder name, container format, file extension, pix_fmt, extra options)
CODECS = {
    "h264": ("libx264", "mp4", "mp4", "yuv420p",
             {"preset": "ultrafast",
              "x264-params": "bframes=2:b-adapt=0:keyint=10:min-keyint=10:scenecut=0:threads=1"}),
    "hevc": ("libx265", "matroska", "mkv", "yuv420p",
             {"preset": "ultrafast", "x265-params": "log-level=error:keyint=10:min-keyint=10:bframes=2:pools=1:frame-threads=1"}),
    "vp8": ("libvpx", "webm", "webm", "yuv420p", {"deadline": "realtime", "cpu-used": "8", "g": "10"}),
    "vp9": ("libvpx-vp9", "webm", "webm", "yuv420p",
            {"deadline": "realtime", "cpu-used": "8", "g": "10", "row-mt": "0"}),
    "mjpeg": ("mjpeg", "avi", "avi", "yuvj420p", {}),
    "av1": ("libsvtav1", "matroska", "mkv", "yuv420p", {"preset": "12", "g": "10"}),
}

AV1_ENCODERS = ("libaom-av1", "libsvtav1", "librav1e")


def encoder_available(name: str) -> bool:
    try:
        av.codec.Codec(name, "w")
        return True
    except Exception:
        return False


def synth_frame(i: int, width: int, height: int) -> np.ndarray:
    """Frame ``i``: smooth gradients that drift with i plus a bright square that moves with i."""
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    img = np.empty((height, width, 3), np.float32)
    img[..., 0] = 128 + 90 * np.sin(2 * np.pi * (x + 0.03 * i))
    img[..., 1] = 128 + 90 * np.cos(2 * np.pi * (y + 0.05 * i))
    img[..., 2] = 128 + 90 * np.sin(2 * np.pi * (x + y - 0.04 * i))
    s = max(4, min(width, height) // 5)
    cx = (i * 3) % max(1, width - s)
    cy = (i * 2) % max(1, height - s)
    img[cy:cy + s, cx:cx + s] = (240, 240 - 5 * (i % 20), 30)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_video(path, *, codec: str = "h264", num_frames: int = 36, width: int = 128, height: int = 96,
               fps: int = 25, pts: list[int] | None = None, time_base: fractions.Fraction | None = None,
               encoder: str | None = None, container: str | None = None) -> str:
    """Encode ``num_frames`` synthetic frames; ``pts`` (in ``time_base`` units) gives each frame's
    own timestamp (irregular steps make a variable-frame-rate file, a first pts > 0 a shifted one)."""
    enc, fmt, _, pix_fmt, options = CODECS[codec]
    if encoder is not None:
        enc = encoder
    if container is not None:
        fmt = container
    path = os.fspath(path)
    with av.open(path, "w", format=fmt) as out:
        st = out.add_stream(enc, rate=fps)
        st.width, st.height, st.pix_fmt = width, height, pix_fmt
        if time_base is not None:
            st.time_base = time_base
            st.codec_context.time_base = time_base
        st.options = dict(options)
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(synth_frame(i, width, height), format="rgb24")
            frame = frame.reformat(format=pix_fmt)
            if pts is not None:
                frame.pts = int(pts[i])
                frame.time_base = time_base
            for pkt in st.encode(frame):
                out.mux(pkt)
        for pkt in st.encode(None):
            out.mux(pkt)
    return path


def reference_frames(path, stream_index: int | None = None):
    """PyAV's full decode: (list of [H, W, 3] rgb24 arrays, list of pts in seconds)."""
    frames, pts = [], []
    with av.open(os.fspath(path)) as c:
        st = c.streams.video[0] if stream_index is None else c.streams[stream_index]
        for f in c.decode(st):
            frames.append(f.to_ndarray(format="rgb24"))
            pts.append(float(f.pts * st.time_base) if f.pts is not None else None)
    return frames, pts


def truncate(src, dst, fraction: float = 0.5) -> str:
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as f:
        f.write(data[: int(len(data) * fraction)])
    return os.fspath(dst)


def corrupt_middle(src, dst, seed: int = 0) -> str:
    """Overwrite the middle half of a file with random bytes (header kept)."""
    with open(src, "rb") as f:
        data = bytearray(f.read())
    rng = np.random.default_rng(seed)
    a, b = len(data) // 4, 3 * len(data) // 4
    data[a:b] = rng.integers(0, 256, b - a, dtype=np.uint8).tobytes()
    with open(dst, "wb") as f:
        f.write(bytes(data))
    return os.fspath(dst)


def garbage(dst, n: int = 4096, seed: int = 0) -> str:
    with open(dst, "wb") as f:
        f.write(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())
    return os.fspath(dst)
