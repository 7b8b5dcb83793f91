"""``avpipe index`` over a dataset of never-seen files: files/s, a fresh ``python -m avpipe
index DIR --out FILE`` process per measurement, timed from process start to exit (imports and
the worker processes' start included), each into a new index file.

The data: ``files`` distinct copies (new names, so nothing is cached per path) of the
repository's ``samples/video`` files. Contenders: the default workers (the CPU count) and one
worker. No anchor: the index rate itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from benchmarks.harness import ROOT

NAME = "cpu_index"
SUITE = "cpu"
UNIT = "files/s"
TITLE = "avpipe index over 1,000 never-seen video files (copies of samples/video), process start included"
CONTENDERS = {"workers_default": "avpipe index, default workers (the CPU count)",
              "workers_1": "avpipe index --workers 1"}
# every contender runs avpipe: --baseline measures each with the other avpipe too
OURS = ("workers_default", "workers_1")
RATIOS = [("workers_default", "workers_1")]
PARAMS = {"files": 1000}
QUICK = {"files": 20}


def prepare(ctx):
    n = ctx.params["files"]
    dst = os.path.join(ctx.data_dir, f"index_videos_{n}")
    if not os.path.exists(os.path.join(dst, ".done")):
        shutil.rmtree(dst, ignore_errors=True)
        os.makedirs(dst)
        make_files(os.path.join(ROOT, "samples", "video"), n, dst)
        open(os.path.join(dst, ".done"), "w").close()
    return {"folder": dst, "files": n}


def measure(ctx, name):
    out = os.path.join(ctx.data_dir, f"index-{name}-{ctx.round}-{os.getpid()}.npz")
    try:
        secs = run_once(ctx.data["folder"], out, 1 if name == "workers_1" else None)
    finally:
        if os.path.exists(out):
            os.remove(out)
    return ctx.data["files"] / secs, {"seconds": round(secs, 3)}


def make_files(src: str, n: int, dst: str) -> int:
    from avpipe.formats import VIDEO_EXTENSIONS

    seeds = sorted(os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs
                   if f.lower().endswith(VIDEO_EXTENSIONS))  # fmt: skip
    if not seeds:
        raise RuntimeError(f"no video files under {src}")
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
        raise RuntimeError(f"avpipe index failed:\n{r.stderr[-2000:]}")
    return secs


