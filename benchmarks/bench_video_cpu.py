#!/usr/bin/env python3
"""Clip decoding on the CPU (no GPU needed): avpipe's PyAV backend vs plain PyAV.

    python3 benchmarks/bench_video_cpu.py --data /tmp/bench [--clips 64] [--out DIR]

The clip workload of bench_video.py (16 frames, stride 4, random start) decoded to RGB on the
CPU, one thread, same files and same clip starts for both:

* ``avpipe_cpu``: ``VideoDecoder(device="cpu").get_frames`` (seek to the keyframe, decode forward,
  disposable packets that no target needs are not decoded).
* ``pyav``: seek to the keyframe before the clip, decode every frame up to the clip's last, keep
  the 16 wanted ones (what a plain PyAV loader does).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CLIP_LEN, STRIDE = 16, 4


_PTS: dict = {}  # per file, display-order pts (a loader would index its files once, too)


def _pts(path):
    import av

    if path not in _PTS:
        with av.open(path) as c:
            _PTS[path] = sorted(p.pts for p in c.demux(c.streams.video[0]) if p.size)
    return _PTS[path]


def pyav_clip(path, idx):
    import av

    pts = _pts(path)
    with av.open(path) as c:
        st = c.streams.video[0]
        want = {pts[i] for i in idx}
        c.seek(pts[idx[0]], stream=st, backward=True, any_frame=False)
        out = {}
        for f in c.decode(st):
            if f.pts in want:
                out[f.pts] = f.to_ndarray(format="rgb24")
            if f.pts >= pts[idx[-1]]:
                break
    return [out[pts[i]] for i in idx]


def avpipe_clip(path, idx):
    import avpipe

    with avpipe.VideoDecoder(path, device="cpu") as d:
        return d.get_frames(idx).data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/tmp/bench")
    ap.add_argument("--clips", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    files = sorted(glob.glob(os.path.join(a.data, "videos_*", "h264_*.mp4")))
    if not files:
        sys.exit(f"no H.264 files under {a.data}/videos_*/ (make them with anchors.py --gen-only)")
    import avpipe

    n = {f: avpipe.VideoDecoder(f, device="cpu").metadata.num_frames for f in files}
    for f in files:  # both sides start with their per-file index built
        _pts(f)
    rng = random.Random(0)
    work = []
    for k in range(a.clips):
        f = files[k % len(files)]
        s = rng.randrange(n[f] - (CLIP_LEN - 1) * STRIDE)
        work.append((f, list(range(s, s + CLIP_LEN * STRIDE, STRIDE))))
    res = {}
    for name, fn in (("pyav", pyav_clip), ("avpipe_cpu", avpipe_clip)):
        fn(*work[0])  # warm-up
        t = time.perf_counter()
        for f, idx in work:
            fn(f, idx)
        res[name] = len(work) / (time.perf_counter() - t)
    import numpy as np

    same = all(np.array_equal(np.asarray(x), y) for x, y in zip(avpipe_clip(*work[1]), pyav_clip(*work[1])))
    out = {"clips_per_s": {k: round(v, 2) for k, v in res.items()},
           "avpipe_over_pyav": round(res["avpipe_cpu"] / res["pyav"], 3),
           "frames_identical": same, "files": len(files), "clips": len(work), "threads": 1}
    print(json.dumps(out, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_video_cpu.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
