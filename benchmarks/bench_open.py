#!/usr/bin/env python3
"""First open of never-seen MP4 files: avpipe's scan vs PyAV opening the container.

    python3 benchmarks/bench_open.py [--n 200] [--rounds 5] [--src FILE ...] [--out DIR]

Each measurement runs in a fresh Python process (``--worker``) on N copies of the source files
under new names, so neither avpipe's scan cache nor anything else from an earlier open helps.
The copies are written just before (they sit in the page cache for every contender alike).
Imports (av, avpipe's modules) happen before the clock starts; the time is the whole loop over the N files, reported
per file. Contenders:

* ``avpipe``: ``VideoDecoder(path, device="cpu")`` then ``close()`` (the scan of the stream:
  for MP4 / MOV the sample tables read from the moov box, no demux, no decode; the PyAV
  container is opened lazily, at the first decode).
* ``avpipe_demux``: the previous first open, the demux scan (``decoding.video._scan._scan_stream``):
  every packet through PyAV, slice headers parsed, one frame decoded.
* ``pyav``: ``av.open(path)`` and the video stream's metadata (time base, frame count, rate,
  width, height, pixel format), then ``close()``.

The table gives the median per-file time over the rounds, the ratio avpipe / pyav of the
medians (the issue's target: <= 1.2) and the median of the same-round ratios (contenders run
back to back in each round, which steadies the ratio on a busy machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONTENDERS = ("avpipe", "avpipe_demux", "pyav")


def worker(kind: str, list_file: str) -> None:
    with open(list_file) as f:
        paths = [line.strip() for line in f if line.strip()]
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
    t0 = time.perf_counter()
    for p in paths:
        one(p)
    dt = time.perf_counter() - t0
    print(json.dumps({"kind": kind, "files": len(paths), "seconds": dt}))


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
        with av.open(p, "w") as c:
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
        out.append(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="never-seen files per measurement")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--src", nargs="*", help="MP4 files to copy (default: samples + two 10 s clips)")
    ap.add_argument("--out", default=None, help="folder for bench_open.json")
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "LIST"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    with tempfile.TemporaryDirectory(prefix="bench_open_") as tmp:
        srcs = args.src or _make_sources(tmp)
        per_file: dict[str, list[float]] = {k: [] for k in CONTENDERS}
        counter = 0
        for r in range(args.rounds):
            for kind in CONTENDERS:
                d = os.path.join(tmp, f"r{r}_{kind}")
                os.makedirs(d)
                paths = []
                for i in range(args.n):
                    src = srcs[i % len(srcs)]
                    counter += 1
                    dst = os.path.join(d, f"f{counter:06d}{os.path.splitext(src)[1]}")
                    shutil.copyfile(src, dst)
                    paths.append(dst)
                lst = os.path.join(d, "list.txt")
                with open(lst, "w") as f:
                    f.write("\n".join(paths))
                res = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--worker", kind, lst],
                    capture_output=True, text=True, check=True, cwd=ROOT,
                )
                rec = json.loads(res.stdout.strip().splitlines()[-1])
                per_file[kind].append(rec["seconds"] / rec["files"] * 1e3)
                shutil.rmtree(d)
        med = {k: statistics.median(v) for k, v in per_file.items()}
        result = {
            "n": args.n,
            "rounds": args.rounds,
            "sources": [os.path.basename(s) for s in srcs],
            "ms_per_file": per_file,
            "median_ms_per_file": med,
            "ratio_avpipe_to_pyav": med["avpipe"] / med["pyav"],
            "ratio_demux_scan_to_pyav": med["avpipe_demux"] / med["pyav"],
            "same_round_ratios_avpipe_to_pyav": [a / b for a, b in zip(per_file["avpipe"], per_file["pyav"])],
            "cpus": os.cpu_count(),
        }
    print(f"{'contender':<14} {'median ms/file':>15}")
    for k in CONTENDERS:
        print(f"{k:<14} {med[k]:>15.3f}")
    rr = result["same_round_ratios_avpipe_to_pyav"]
    print(f"avpipe / pyav = {result['ratio_avpipe_to_pyav']:.2f} (median of same-round ratios "
          f"{statistics.median(rr):.2f}, range {min(rr):.2f}-{max(rr):.2f})   "
          f"(demux scan / pyav = {result['ratio_demux_scan_to_pyav']:.2f})")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_open.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
