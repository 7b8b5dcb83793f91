#!/usr/bin/env python3
"""``avpipe index`` over a dataset of never-seen files: files/s, in a fresh process each run.

    python3 benchmarks/bench_index.py [--files 1000] [--rounds 3] [--workers N] [--src DIR]

Makes ``--files`` distinct files (copies under new names, so nothing is cached per path) of the
video files under ``--src`` (default: the repository's ``samples/video``; on the GPU machine the
anchor data's ``/tmp/bench/videos_*``), then times ``python -m avpipe index DIR --out FILE`` from
process start to exit (imports and the worker processes' start included) ``--rounds`` times,
each into a new index file, with the default workers (the CPU count) and with one. Prints the
median files/s of each and writes OUT/bench_index.json when ``--out`` is given. No GPU needed.
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def make_files(src: str, n: int, dst: str) -> int:
    from avpipe.formats import VIDEO_EXTENSIONS

    seeds = sorted(os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs
                   if f.lower().endswith(VIDEO_EXTENSIONS))  # fmt: skip
    if not seeds:
        raise SystemExit(f"no video files under {src}")
    for i in range(n):
        s = seeds[i % len(seeds)]
        shutil.copyfile(s, os.path.join(dst, f"v{i:06d}{os.path.splitext(s)[1]}"))
    return len(seeds)


def run_once(folder: str, out: str, workers) -> float:
    cmd = [sys.executable, "-m", "avpipe", "index", folder, "--out", out]
    if workers:
        cmd += ["--workers", str(workers)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    secs = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"avpipe index failed:\n{r.stderr[-2000:]}")
    return secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None, help="default: the CPU count")
    ap.add_argument("--src", default=os.path.join(ROOT, "samples", "video"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="avpipe-index-") as tmp:
        data = os.path.join(tmp, "videos")
        os.makedirs(data)
        seeds = make_files(args.src, args.files, data)
        res = {"files": args.files, "seed_files": seeds, "cpus": os.cpu_count(), "rounds": {}}
        for label, w in ((f"workers={args.workers or os.cpu_count()}", args.workers),
                         ("workers=1", 1)):
            secs = [run_once(data, os.path.join(tmp, f"index-{label}-{k}.npz"), w)
                    for k in range(args.rounds)]
            med = statistics.median(secs)
            res["rounds"][label] = {"seconds": [round(s, 3) for s in secs],
                                    "files_per_s": round(args.files / med, 1)}
            print(f"{label:12s} {args.files / med:8.1f} files/s  (median of {args.rounds}: "
                  f"{med:.2f} s, process start included)", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_index.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
