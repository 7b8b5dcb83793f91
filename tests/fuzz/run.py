"""The fuzz run in one command: make the corpus, run it through every backend, print the counts.

::

    python3 -m tests.fuzz.run --out /tmp/fuzz            # CPU backends
    python3 -m tests.fuzz.run --gpu --out /tmp/fuzz      # GPU backends (NVDEC, DALI GPU, GPU FLAC)
    python3 -m tests.fuzz.run --cpu --gpu --out /tmp/fuzz
    python3 -m tests.fuzz.run --out /tmp/fuzz --backends rnnt_feed_cpu,video_feed_cpu,image_feed_cpu

The backends: the decoders one file at a time (``harness.CPU_BACKENDS`` / ``GPU_BACKENDS``) and
the training feeds over units of files (``harness.FEED_CPU_BACKENDS`` / ``FEED_GPU_BACKENDS``).

Writes ``OUT/corpus/`` (unless it exists with the same seed and size), ``OUT/summary.json`` (every
record, the counts and the failures) and ``OUT/logs/`` (each worker's stderr). Exit status 1
when any case hangs, crashes, raises an untyped error, or a good file fails after bad ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import corpus, harness

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLES = os.path.normpath(os.path.join(HERE, "..", "..", "samples"))


def sequences(cases, seeds, gpu: bool):
    """Bad-then-good runs in one worker. The corpus's HEVC seed is 64x48, under NVDEC's HEVC
    minimum, so on the GPU every HEVC case makes NVDEC's session creation fail (the failure that
    once left a broken session behind); ``circles_hevc.mp4`` (320x240, decoded by NVDEC) and the
    good H.264 and HEVC seeds follow it; and bit-flipped HEVC files, each followed by both."""
    out = []
    kinds = {"video": ("video_cuda" if gpu else "video_cpu")}
    be = kinds["video"]
    good = [harness.good_case(f, seeds, "video") for f in ("h264_mp4", "hevc_mp4")]
    circles = os.path.join(SAMPLES, "video", "circles_hevc.mp4")
    if os.path.exists(circles):
        c = dict(id="circles_hevc", family="hevc_mp4", kind="video", path=circles,
                 damage="good_on_nvdec", detail="", expect="any")  # fmt: skip
        out.append((be, [c, *good, c, *good]))
    flips = [c for c in cases if c["family"] == "hevc_mp4" and c["damage"].startswith("flip")]
    for s in range(0, len(flips), 8):
        seq = []
        for c in flips[s : s + 8]:
            seq += [c, *good]
        out.append((be, seq))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="avpipe reliability fuzz run")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpu", action="store_true", help="the GPU backends")
    ap.add_argument("--cpu", action="store_true", help="the CPU backends (default without --gpu)")
    ap.add_argument("--per-format", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per case (default 60; 180 with --gpu: CUDA start, kernel builds)")
    ap.add_argument("--backends", default=None, help="comma-separated subset of backends")
    ap.add_argument("--chunk", type=int, default=None,
                    help="cases per worker unit (default 16; 48 with --gpu, where a worker's "
                         "start (CUDA, DALI, NVDEC) costs seconds)")
    ap.add_argument("--budget", type=float, default=None,
                    help="wall seconds for the decoder and feed runs; cases not reached by then "
                         "are failing 'not_run' records (default: no limit)")
    ap.add_argument("--no-extract", action="store_true")
    a = ap.parse_args(argv)
    cpu = a.cpu or not a.gpu
    if a.gpu:
        from avpipe.device import gpu_available

        if not gpu_available():
            print("--gpu: no usable CUDA GPU here (cupy + driver)", file=sys.stderr)
            return 2
    if a.timeout is None:
        a.timeout = 180.0 if a.gpu else 60.0
    t0 = time.perf_counter()
    root = os.path.join(a.out, "corpus")
    info = None
    if os.path.exists(os.path.join(root, "cases.json")):
        info = corpus.load(root)
        if info["seed"] != a.seed or info["per_format"] != a.per_format:
            info = None
    if info is None:
        corpus.generate(root, per_format=a.per_format, seed=a.seed)
        info = corpus.load(root)
    cases, seeds = info["cases"], info["seeds"]
    print(f"corpus: {len(cases)} cases in {root} ({time.perf_counter() - t0:.1f} s)", flush=True)
    backends = {}
    if cpu:
        backends.update(harness.CPU_BACKENDS)
        backends.update(harness.FEED_CPU_BACKENDS)
    if a.gpu:
        backends.update(harness.GPU_BACKENDS)
        backends.update(harness.FEED_GPU_BACKENDS)
    if a.backends:
        keep = set(a.backends.split(","))
        backends = {k: v for k, v in backends.items() if k in keep}
    backends, left_out = harness.usable(backends)
    for why in left_out:
        print(f"left out: {why}", flush=True)
    seqs = []
    if cpu and "video_cpu" in backends:
        seqs += sequences(cases, seeds, gpu=False)
    if a.gpu and "video_cuda" in backends:
        seqs += sequences(cases, seeds, gpu=True)
    chunk = a.chunk or (48 if a.gpu else 16)
    units = harness.make_units(cases, backends, seeds, chunk=chunk, sequences=seqs)
    logs = os.path.join(a.out, "logs")
    os.makedirs(logs, exist_ok=True)
    if os.path.exists(os.path.join(logs, "records.jsonl")):  # this run's records only
        os.remove(os.path.join(logs, "records.jsonl"))
    records = harness.run_units(units, workers=a.workers, case_timeout=a.timeout, log_dir=logs,
                                budget_s=a.budget)
    if not a.no_extract:
        for dev in (["cpu"] if cpu else []) + (["cuda"] if a.gpu else []):
            ex = os.path.join(a.out, f"extract_{dev}")
            import shutil

            shutil.rmtree(ex, ignore_errors=True)
            records += harness.run_extract_folder(root, ex, device=dev, cases=cases)
    elapsed = time.perf_counter() - t0
    fails = harness.failures(records)
    c = harness.counts(records)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump({"elapsed_s": elapsed, "cases": len(cases),
                   "counts": {f"{k[0]}|{k[1]}": dict(v) for k, v in c.items()},
                   "failures": fails, "records": records}, f, indent=1)  # fmt: skip
    print(harness.table(records))
    print(f"\n{len(records)} runs, {len(fails)} failing, {elapsed:.0f} s; "
          f"details in {os.path.join(a.out, 'summary.json')}")  # fmt: skip
    for r in fails[:40]:
        print(f"  FAIL {r['backend']} {r['id']} {r['damage']} {r['detail']}: {r['outcome']}: "
              f"{r.get('error', '')[:300]}")  # fmt: skip
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
