#!/usr/bin/env python3
"""Where the RNN-T training feed's time goes while it runs pipelined (prefetch on, as a user runs
it), not stepped one batch at a time as ``profile_stages.py --feeds`` does.

    python -m benchmarks.probes.probe_rnnt_feed --out DIR [--budget 4]

Each variant of ``rnnt_feed`` (benchmarks/workloads/feeds.py's RNN-T settings: batch 64, speed perturbation
U(0.85, 1.15), dither, SpecAugment, GPU FLAC) runs in its own child process for ``--budget``
seconds after a warm-up, and reports audio-s/s: ``full`` (the benchmark's feed), ``eval``
(``training=False``: no speed perturbation, dither or SpecAugment), ``no_speed``, ``no_spec``,
``prefetch4``, ``threads4``, ``win2`` (the GPU FLAC loader reading two windows ahead instead
of four), ``switch05`` (the interpreter's thread switch interval 0.5 ms instead of 5 ms: how
much the producer waits for the GIL). Each variant also reports the GPU's utilisation
(nvidia-smi, median of 100 ms samples over the timed run: the share of time a kernel ran).
``--upload`` times ``device.upload_many`` alone (one thread; an idle GPU, then a stream kept
busy), per call and per step. ``full`` also samples the producer thread's Python stack every 2 ms and writes the
lines it was on and the functions it was in most often (own and cumulative samples) to
DIR/probe_rnnt_feed.txt: a sampling profile of the real, pipelined run (samples are taken when
the sampling thread holds the GIL, so time spent outside Python, in a kernel launch, a read or
waiting for the GIL, is charged to the line that made the call).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time

from benchmarks.harness import DEFAULT_DATA

VARIANTS = {
    "full": {},
    "eval": {"training": False},
    "no_speed": {"speed_perturb": None},
    "no_spec": {"spec_augment": None},
    "prefetch4": {"prefetch": 4},
    "threads4": {"threads": 4},
    "win2": {},
    "switch05": {},
    "no_dither": {},
    "dither_once": {},
}

# (module, attribute, label): the calls whose host time on the producer thread ``--timed``
# adds up (a call inside another is counted in both)
TIMED = [
    ("avpipe.ops._log_mel", "upload_many", "upload_many (log_mel)"),
    ("avpipe.ops._resample", "upload_many", "upload_many (resample)"),
    ("avpipe.ops.audio_augment", "upload_many", "upload_many (spec_augment)"),
    ("avpipe.decoding.audio._flac_cuda", "upload_many", "upload_many (flac)"),
    ("avpipe.ops.audio", "_normal", "dither noise (_normal)"),
    ("avpipe.recipes.rnnt", "log_mel", "log_mel"),
    ("avpipe.ops.audio_augment", "spec_augment", "spec_augment"),
    ("avpipe.ops.audio_augment", "apply_speed_perturb", "apply_speed_perturb"),
    ("avpipe.ops.audio_augment", "sample_speed_params", "sample_speed_params"),
    ("avpipe.ops._resample", "resample_rows", "resample_rows"),
    ("avpipe.ops._resample", "row_args", "row_args (resample)"),
    ("avpipe.ops._resample._TapBank", "get", "_TapBank.get"),
    ("avpipe.recipes.rnnt", "log_mel_frame_lengths", "log_mel_frame_lengths"),
    ("avpipe.ops.random", "words_many", "words_many"),
    ("avpipe.recipes.rnnt", "_dither_seed", "_dither_seed"),
    ("avpipe.recipes.rnnt.RnntTask", "collate", "collate"),
    ("avpipe.recipes.rnnt.RnntTask", "decode_groups", "decode_groups (generator set-up)"),
    ("avpipe.decoding.audio._flac_cuda", "launch", "flac launch"),
    ("avpipe.decoding.audio._flac_cuda", "collect", "flac collect"),
    ("avpipe.pipeline._flac_windows.GpuFlacBatches", "_finish", "flac _finish"),
    ("concurrent.futures._base.Future", "result", "Future.result (waiting)"),
    ("cupy", "empty", "cupy.empty"),
    ("cupy", "zeros", "cupy.zeros"),
    ("cupy", "matmul", "cupy.matmul"),
    ("cupy.fft", "rfft", "cupy.fft.rfft"),
]


class Sampler:
    """Counts the functions on the feed producer thread's stack every ``interval`` s: per
    function (cumulative) and per line of the innermost frame (own). Only that thread's stack
    is walked, so the sampler holds the GIL briefly (walking every thread's stack, as it once
    did, slowed the feed by a quarter and charged the wait for the GIL to whatever function had
    just released it)."""

    def __init__(self, interval=0.002):
        self.interval, self.stop = interval, threading.Event()
        self.own = collections.defaultdict(collections.Counter)
        self.cum = collections.defaultdict(collections.Counter)
        self.samples = collections.Counter()
        self.thread = threading.Thread(target=self._run, name="probe-sampler", daemon=True)

    def _producer(self):
        for t in threading.enumerate():
            if t.name.startswith("avpipe-feed-producer"):
                return t.ident
        return None

    def _run(self):
        ident = None
        while not self.stop.wait(self.interval):
            if ident is None:
                ident = self._producer()
                if ident is None:
                    continue
            frame = sys._current_frames().get(ident)
            if frame is None:
                ident = None
                continue
            group = "avpipe-feed-producer"
            self.samples[group] += 1
            co = frame.f_code
            self.own[group][f"{os.path.basename(co.co_filename)}:{frame.f_lineno} "
                            f"{co.co_name}"] += 1
            seen = set()
            f = frame
            while f is not None:
                co = f.f_code
                key = f"{os.path.basename(co.co_filename)}:{co.co_firstlineno} {co.co_name}"
                if key not in seen:
                    self.cum[group][key] += 1
                    seen.add(key)
                f = f.f_back

    def report(self, n=25) -> str:
        lines = []
        for group in sorted(self.samples):
            total = self.samples[group]
            lines.append(f"== thread {group}: {total} samples")
            for title, table in (("own", self.own[group]), ("cumulative", self.cum[group])):
                lines.append(f"  -- {title}")
                for key, c in table.most_common(n):
                    lines.append(f"  {100 * c / total:6.1f} %  {key}")
        return "\n".join(lines)


def child(name, args):
    import cupy

    import avpipe
    from benchmarks import _timing
    from benchmarks.workloads import feeds as bench_feeds

    man, files, durs, _ = bench_feeds.audio_data(args)
    dmap = dict(zip([os.path.abspath(f) for f in files], durs))
    kw = dict(batch_size=bench_feeds.BATCH, seed=0, training=True, device="cuda",
              speed_perturb=(0.85, 1.15), threads=16)
    kw.update(VARIANTS[name])
    if name == "switch05":
        sys.setswitchinterval(0.0005)
    if name == "no_dither":  # log_mel without its noise (everything else of training)
        import avpipe.ops.audio as _audio

        _audio._normal = lambda xp, seed, shape: None
    if name == "dither_once":  # the noise from one cuRAND generator per thread, re-seeded
        import avpipe.ops.audio as _audio

        local = threading.local()

        def once(xp, seed, shape):
            rs = getattr(local, "rs", None)
            if rs is None:
                rs = local.rs = xp.random.RandomState(seed, method=161)
            else:
                rs.seed(seed)
            return rs.standard_normal(shape, dtype=xp.float32)

        _audio._normal = once
    acc = {}
    if args.timed and name == "full":
        acc = _timing.time_calls(TIMED, _timing.on_thread("avpipe-feed-producer"))
    if name == "win2":  # the loader's windows read ahead: 2 instead of 4
        from avpipe.pipeline import _flac_windows

        init = _flac_windows.GpuFlacBatches.__init__

        def two(self, *a, **k):
            init(self, *a, **{**k, "prefetch": 2})

        _flac_windows.GpuFlacBatches.__init__ = two
    feed = avpipe.recipes.rnnt_feed(man, **kw)
    it = bench_feeds.epochs(feed)
    for _ in range(4):
        next(it)
    cupy.cuda.runtime.deviceSynchronize()
    sampler = Sampler() if name == "full" and not args.timed else None
    if sampler:
        sampler.thread.start()
    smi = _smi()
    t0, audio, n = time.perf_counter(), 0.0, 0
    while time.perf_counter() - t0 < args.budget or n < 3:
        b = next(it)
        audio += sum(dmap[p] for p in b.paths)
        n += 1
    cupy.cuda.runtime.deviceSynchronize()
    secs = time.perf_counter() - t0
    util = _smi_median(smi)
    if acc:
        with open(os.path.join(args.out, "probe_rnnt_timed.txt"), "w") as f:
            f.write(f"{name}: host ms per batch on the producer thread ({n} batches, "
                    f"{1e3 * secs / n:.2f} ms each)\n")
            f.write(_timing.report(acc, n, "batch") + "\n")
    if sampler:
        sampler.stop.set()
        sampler.thread.join()
        with open(os.path.join(args.out, "probe_rnnt_feed.txt"), "w") as f:
            f.write(f"full: {audio / secs:.0f} audio-s/s, {n} batches in {secs:.2f} s\n")
            f.write(f"stats: {json.dumps(feed.stats(), default=str)}\n")
            f.write(sampler.report())
    feed.close()
    print("RESULT " + json.dumps({"value": round(audio / secs, 1), "batches": n,
                                  "seconds": round(secs, 2), "gpu_util_pct": util}), flush=True)


def _smi():
    try:
        return subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu",
                                 "--format=csv,noheader,nounits", "-lms", "100"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None


def _smi_median(smi):
    if smi is None:
        return None
    smi.terminate()
    vals = [float(v) for v in smi.communicate(timeout=10)[0].split() if v.strip().isdigit()]
    return float(sorted(vals)[len(vals) // 2]) if vals else None


def upload(args):
    """``upload_many`` alone: per call, and its steps, idle GPU and busy stream."""
    import cupy
    import numpy as np

    from avpipe import device as D

    arrays = [np.arange(64, dtype=np.int64), np.ones(64, np.float32), np.zeros((64, 6), np.int32)]
    out = {}
    s = cupy.cuda.Stream(non_blocking=True)
    big = cupy.zeros(1 << 26, cupy.float32)
    for busy in (False, True):
        with s:
            for _ in range(50):
                D.upload_many(cupy, arrays)
            s.synchronize()
            n, t0 = 2000, time.perf_counter()
            for k in range(n):
                if busy and k % 20 == 0:
                    for _ in range(20):
                        big += 1.0  # about a millisecond of work queued ahead
                D.upload_many(cupy, arrays)
            t1 = time.perf_counter()
            s.synchronize()
            out[f"upload_many_us_{'busy' if busy else 'idle'}"] = round(1e6 * (t1 - t0) / n, 2)
            buf = np.frombuffer(cupy.cuda.alloc_pinned_memory(4096), np.uint8, 4096)
            dev = cupy.empty(4096, cupy.uint8)
            steps = {
                "alloc_pinned": lambda: cupy.cuda.alloc_pinned_memory(4096),
                "empty": lambda: cupy.empty(4096, cupy.uint8),
                "set": lambda dev=dev, buf=buf: dev.set(buf, stream=s),
                "memcpyAsync": lambda dev=dev, buf=buf: cupy.cuda.runtime.memcpyAsync(
                    dev.data.ptr, buf.ctypes.data, 4096,
                    cupy.cuda.runtime.memcpyHostToDevice, s.ptr),
                "record": lambda: s.record(),
                "slice_view": lambda dev=dev: dev[8:520].view(np.int64),
            }
            for name, f in steps.items():
                t0 = time.perf_counter()
                for k in range(n):
                    if busy and k % 20 == 0:
                        for _ in range(20):
                            big += 1.0
                    f()
                t1 = time.perf_counter()
                s.synchronize()
                out[f"{name}_us_{'busy' if busy else 'idle'}"] = round(1e6 * (t1 - t0) / n, 2)
    # cuFFT plans: the log-mel's rfft over [B * T, 512] with T changing every batch (cupy
    # keeps 16 plans) against the same T every time
    with s:
        for label, ts in (("fft_same_T_us", [1500] * 200), ("fft_new_T_us",
                                                            list(range(1000, 1600, 3)))):
            frames = cupy.zeros((64 * 1600, 512), cupy.float32)
            cupy.fft.rfft(frames[: 64 * ts[0]], axis=-1)
            s.synchronize()
            t0 = time.perf_counter()
            for t in ts:
                cupy.fft.rfft(frames[: 64 * t], axis=-1)
            t1 = time.perf_counter()
            s.synchronize()
            out[label] = round(1e6 * (t1 - t0) / len(ts), 1)
            out[label.replace("_us", "_with_gpu_us")] = round(
                1e6 * (time.perf_counter() - t0) / len(ts), 1)
    with open(os.path.join(args.out, "probe_upload.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("upload", json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=4.0)
    ap.add_argument("--only", default=None)
    ap.add_argument("--child", default=None)
    ap.add_argument("--upload", action="store_true", help="time upload_many alone, then exit")
    ap.add_argument("--timed", action="store_true",
                    help="full: time the producer's calls (TIMED) instead of sampling")
    args = ap.parse_args()
    args.cpu, args.threads = False, 16
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        child(args.child, args)
        return 0
    if args.upload:
        upload(args)
        return 0
    names = args.only.split(",") if args.only else list(VARIANTS)
    results = {}
    for name in names:
        cmd = [sys.executable, __file__, "--child", name, "--data", args.data, "--out", args.out,
               "--budget", str(args.budget)] + (["--timed"] if args.timed else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.budget * 4 + 120)
        got = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        results[name] = json.loads(got[-1][7:]) if got else {"error": r.stderr[-800:]}
        print(f"{name:10s} {results[name]}", flush=True)
    with open(os.path.join(args.out, "probe_rnnt_feed.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
