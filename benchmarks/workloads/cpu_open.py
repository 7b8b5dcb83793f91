"""First open of never-seen MP4 files: avpipe's scan vs PyAV opening the container.

Each measurement runs in a fresh Python process on ``n`` copies of the source files under new
names, so neither avpipe's scan cache nor anything else from an earlier open helps. The copies
are written just before (they sit in the page cache for every contender alike). Imports (av,
avpipe's modules) happen before the clock starts; the rate is files per second over the loop.
Contenders:

* ``avpipe``: ``VideoDecoder(path, device="cpu")`` then ``close()`` (the scan of the stream:
  for MP4 / MOV the sample tables read from the moov box, no demux, no decode; the PyAV
  container is opened lazily, at the first decode).
* ``avpipe_demux``: the demux scan (``decoding.video._scan._scan_stream``): every packet
  through PyAV, slice headers parsed, one frame decoded.
* ``pyav``: ``av.open(path)`` and the video stream's metadata (time base, frame count, rate,
  width, height, pixel format), then ``close()``.

Sources: the repository's sample MP4s plus two 10 s 640x360 clips (H.264 with B-frames, HEVC)
made once in the data folder.
"""

from __future__ import annotations

import os
import shutil
import time

from benchmarks.harness import ROOT

NAME = "cpu_open"
SUITE = "cpu"
UNIT = "files/s"
TITLE = "First open of 200 never-seen MP4 files (new names each measurement), a fresh process each"
CONTENDERS = {"avpipe": "VideoDecoder(path, device=cpu).close(): sample tables from the moov box",
              "avpipe_demux": "avpipe's demux scan (every packet through PyAV)",
              "pyav": "av.open + the video stream's metadata, close"}
RATIOS = [("avpipe", "pyav"), ("avpipe_demux", "pyav")]
PARAMS = {"n": 200}
QUICK = {"n": 20}
REQUIRES = ("av",)


def opener(kind: str):
    """The one-file open of ``kind``, its imports done."""
    if kind == "pyav":
        import av

        def one(p):
            with av.open(p) as c:
                st = c.streams.video[0]
                cc = st.codec_context
                return (st.time_base, st.frames, st.average_rate, cc.width, cc.height, cc.pix_fmt)
    elif kind == "avpipe":
        from avpipe.decoding.video import (
            VideoDecoder,
            _mp4,  # noqa: F401 — imported here, not on the first open
        )

        def one(p):
            VideoDecoder(p, device="cpu").close()
    else:
        from avpipe._source import open_source
        from avpipe.decoding.video import _scan as _video_scan

        def one(p):
            src = open_source(p)
            _video_scan._scan_stream(src, src.name)
    return one


def _make_sources(d: str) -> list[str]:
    """The sample MP4s plus two 10 s 640x360 clips (H.264 with B-frames, HEVC)."""
    import av
    import numpy as np

    out = [os.path.join(ROOT, "samples", "video", n) for n in ("circles_h264.mp4", "circles_hevc.mp4", "squares_h264.mp4")]
    for name, codec, opts in (
        ("h264_640x360.mp4", "libx264", {"preset": "veryfast", "x264-params": "bframes=2:keyint=60:threads=1"}),
        ("hevc_640x360.mp4", "libx265", {"preset": "ultrafast", "x265-params": "log-level=error:pools=1:frame-threads=1:bframes=3:keyint=60"}),
    ):
        p = os.path.join(d, name)
        out.append(p)
        if os.path.exists(p):
            continue
        with av.open(p + ".tmp", "w", format="mp4") as c:
            st = c.add_stream(codec, rate=25)
            st.width, st.height, st.pix_fmt = 640, 360, "yuv420p"
            st.options = opts
            y = np.linspace(0, 255, 640, dtype=np.float32)[None, :]
            for i in range(250):
                img = np.empty((360, 640, 3), np.uint8)
                img[...] = ((y + 3 * i) % 256).astype(np.uint8)[..., None]
                img[(i * 2) % 300 : (i * 2) % 300 + 60, (i * 5) % 560 : (i * 5) % 560 + 80] = (250, 40, 40)
                for pkt in st.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    c.mux(pkt)
            for pkt in st.encode(None):
                c.mux(pkt)
        os.replace(p + ".tmp", p)
    return out


def prepare(ctx):
    d = os.path.join(ctx.data_dir, "open_sources")
    os.makedirs(d, exist_ok=True)
    return {"sources": _make_sources(d)}


def measure(ctx, name):
    one = opener(name)
    srcs, n = ctx.data["sources"], ctx.params["n"]
    d = os.path.join(ctx.data_dir, f"open_{name}_{os.getpid()}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    try:
        paths = []
        for i in range(n):
            src = srcs[i % len(srcs)]
            dst = os.path.join(d, f"f{ctx.round}_{i:06d}{os.path.splitext(src)[1]}")
            shutil.copyfile(src, dst)
            paths.append(dst)
        t0 = time.perf_counter()
        for p in paths:
            one(p)
        dt = time.perf_counter() - t0
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return n / dt, {"files": n, "seconds": round(dt, 4), "ms_per_file": round(1e3 * dt / n, 4)}
