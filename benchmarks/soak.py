#!/usr/bin/env python3
"""Soak: run each workload for a while and watch memory. It must stay flat.

Every workload (the decoders in a loop, the audio batch loader, the training feeds) runs alone
for ``--minutes``; every ``--interval`` seconds the process's RSS (``/proc/self/status`` VmRSS)
and, on a GPU, this process's device memory (``nvidia-smi``'s per-process figure, which also
counts PyNvVideoCodec's and DALI's own allocations; where it is not available, the whole
device's use by ``cudaMemGetInfo``, which counts every other process too: only meaningful for a
workload alone on the GPU) are sampled. The first ``--warmup`` share of the
samples is warm-up (pools fill, caches fill); growth is the median of the last fifth of the
samples over the median of the fifth right after warm-up, minus 1. The verdict: growth under 5 % on every
series.

    python3 benchmarks/soak.py --out DIR [--minutes 30] [--interval 10] [--device cpu|cuda]
                               [--only video,audio,...] [--data DIR]

Media: ``--data`` (the anchor benchmark's folders, see ../shared/benchmarks/README.md) when it
holds them, else small files made here (PyAV, soundfile, PIL). Writes DIR/soak.json and prints a
table last.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import avpipe  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def log(*a):
    print(*a, flush=True)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def gpu_used_bytes(device) -> int | None:
    """This process's GPU memory (nvidia-smi, per process), else the device's use."""
    if not device.startswith("cuda"):
        return None
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout  # fmt: skip
        for line in out.splitlines():
            pid, mib = (v.strip() for v in line.split(","))
            if int(pid) == os.getpid():
                return int(float(mib)) << 20
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    return int(total - free)


# ---------------------------------------------------------------------------------------------
# media
# ---------------------------------------------------------------------------------------------


def make_media(work: str, data: str | None) -> dict:
    """{kind: [paths]}: the anchor data where present, else small files made here."""
    media = {}
    if data:
        media["video"] = sorted(glob.glob(os.path.join(data, "videos_640x360_*f", "h264_*.mp4")))
        media["flac"] = sorted(glob.glob(os.path.join(data, "**", "*.flac"), recursive=True))
        media["image"] = sorted(glob.glob(os.path.join(data, "**", "*.jpg"), recursive=True))[:512]
    os.makedirs(work, exist_ok=True)
    if not media.get("video"):
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from video_media import make_video

        media["video"] = [
            make_video(os.path.join(work, f"v{i}.mp4"), codec="h264", num_frames=90,
                       width=320, height=240)
            for i in range(4)
        ]
    if not media.get("flac"):
        import soundfile as sf

        rng = np.random.default_rng(0)
        paths = []
        for i in range(64):
            p = os.path.join(work, f"a{i:03d}.flac")
            n = int(16000 * (2 + 6 * rng.random()))
            t = np.arange(n) / 16000
            x = 0.3 * np.sin(2 * np.pi * (200 + 10 * i) * t) + 0.01 * rng.standard_normal(n)
            sf.write(p, x.astype(np.float32), 16000, subtype="PCM_16")
            paths.append(p)
        media["flac"] = paths
    if not media.get("image"):
        from PIL import Image

        rng = np.random.default_rng(1)
        paths = []
        for i in range(32):
            p = os.path.join(work, f"i{i:03d}.jpg")
            Image.fromarray(rng.integers(0, 255, (375, 500, 3), dtype=np.uint8)).save(p)
            paths.append(p)
        media["image"] = paths
    # a manifest and a class list for the feeds
    man = os.path.join(work, "manifest.jsonl")
    with open(man, "w") as f:
        for p in media["flac"]:
            import soundfile as sf

            dur = float(sf.info(p).duration)
            f.write(json.dumps({"audio_filepath": os.path.abspath(p), "duration": dur,
                                "text": "soak"}) + "\n")
    media["manifest"] = man
    csv = os.path.join(work, "videos.csv")
    with open(csv, "w") as f:
        f.write("path,label\n")
        for i, p in enumerate(media["video"]):
            f.write(f"{os.path.abspath(p)},c{i % 2}\n")
    media["video_csv"] = csv
    return media


# ---------------------------------------------------------------------------------------------
# workloads: each returns a callable that runs one step (a few hundred ms of work)
# ---------------------------------------------------------------------------------------------


def w_video(media, device):
    files = media["video"]
    rng = np.random.default_rng(0)

    def step():
        p = files[int(rng.integers(len(files)))]
        with avpipe.VideoDecoder(p, device=device) as d:
            n = d.metadata.num_frames
            start = int(rng.integers(0, max(1, n - 61)))
            d.get_frames(list(range(start, min(n, start + 61), 4)))

    return step


def w_audio(media, device):
    files = media["flac"]
    rng = np.random.default_rng(0)

    def step():
        sigs = [avpipe.load_audio(files[int(rng.integers(len(files)))], sample_rate=16000).samples
                for _ in range(8)]
        n = max(len(s) for s in sigs)
        x = np.zeros((len(sigs), n), np.float32)
        for i, s in enumerate(sigs):
            x[i, : len(s)] = s
        if device.startswith("cuda"):
            import cupy

            x = cupy.asarray(x)
        avpipe.ops.log_mel(x, [len(s) for s in sigs], preset="nemo")

    return step


def w_images(media, device):
    files = media["image"]
    rng = np.random.default_rng(0)

    def step():
        pick = [files[int(rng.integers(len(files)))] for _ in range(16)]
        avpipe.decode_images(pick, device=device)

    return step


def _audio_loader_cls():
    try:
        from avpipe.pipeline.audio_loader import AudioBatchLoader
    except ImportError:
        from avpipe.pipeline.audio_loader import AudioBatchLoader
    return AudioBatchLoader


def w_audio_loader(media, device):
    loader = _audio_loader_cls()(media["flac"], batch_size=16, device=device, num_workers=2)
    it = iter(())

    def step():
        nonlocal it
        for _ in range(4):
            try:
                next(it)
            except StopIteration:
                it = iter(loader.batches())
                next(it)

    step.close = loader.close
    return step


def _feed_step(feed):
    it = iter(())

    def step():
        nonlocal it
        try:
            next(it)
        except StopIteration:
            it = iter(feed)
            next(it)

    return step


def w_rnnt_feed(media, device):
    from avpipe.recipes import rnnt_feed

    return _feed_step(rnnt_feed(media["manifest"], batch_size=8, device=device))


def w_video_feed(media, device):
    from avpipe.recipes import video_classification

    return _feed_step(video_classification(media["video_csv"], batch_size=2, clip_length=8,
                                           stride=2, crop_size=112, device=device))


WORKLOADS = {
    "video": w_video,
    "audio": w_audio,
    "images": w_images,
    "audio_loader": w_audio_loader,
    "rnnt_feed": w_rnnt_feed,
    "video_feed": w_video_feed,
}


def growth(samples, warmup: float) -> float | None:
    """The median of the last fifth of the samples over the median of the fifth right after
    warm-up, minus 1 (medians over windows, so a series that oscillates with the prefetch
    buffers is judged by its level, not by where one sample fell)."""
    vals = [s for s in samples if s is not None]
    if len(vals) < 10:
        return None
    k = max(1, int(len(vals) * warmup))
    w = max(1, len(vals) // 5)
    base = float(np.median(vals[k : k + w]))
    last = float(np.median(vals[-w:]))
    return last / base - 1.0 if base > 0 else None


def soak(name, make, media, device, minutes, interval, warmup):
    try:
        step = make(media, device)
    except Exception as e:  # noqa: BLE001 — a workload that does not exist yet is reported
        return {"name": name, "error": f"{type(e).__name__}: {e}"}
    t_end = time.monotonic() + 60 * minutes
    rows, steps, next_sample = [], 0, 0.0
    t0 = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            if now >= next_sample:
                rows.append((round(now - t0, 1), rss_bytes(), gpu_used_bytes(device), steps))
                next_sample = now + interval
            if now >= t_end:
                break
            step()
            steps += 1
    except Exception as e:  # noqa: BLE001
        return {"name": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    finally:
        close = getattr(step, "close", None)
        if close is not None:
            close()
    rss = [r[1] for r in rows]
    gpu = [r[2] for r in rows]
    g_rss, g_gpu = growth(rss, warmup), growth(gpu, warmup)
    ok = all(g is None or g < 0.05 for g in (g_rss, g_gpu)) and g_rss is not None
    return {
        "name": name,
        "device": device,
        "minutes": minutes,
        "steps": steps,
        "samples": rows,
        "rss_growth": g_rss,
        "gpu_growth": g_gpu,
        "rss_mb_after_warmup": rss[max(1, int(len(rss) * warmup))] / 2**20 if rss else None,
        "rss_mb_end": rss[-1] / 2**20 if rss else None,
        "flat": ok,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=0.2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", default="")
    ap.add_argument("--data", default=None)
    ap.add_argument("--parallel", action="store_true",
                    help="run every workload at once, each in its own process (its own RSS)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    media = make_media(os.path.join(a.out, "media"), a.data)
    names = [n for n in a.only.split(",") if n] or list(WORKLOADS)
    results = []
    if a.parallel:
        import subprocess

        procs = []
        for n in names:
            sub = os.path.join(a.out, n)
            cmd = [sys.executable, os.path.abspath(__file__), "--out", sub, "--only", n,
                   "--minutes", str(a.minutes), "--interval", str(a.interval),
                   "--warmup", str(a.warmup), "--device", a.device]
            if a.data:
                cmd += ["--data", a.data]
            procs.append((n, sub, subprocess.Popen(cmd, stdout=subprocess.DEVNULL)))
        for n, sub, p in procs:
            p.wait()
            try:
                with open(os.path.join(sub, "soak.json")) as f:
                    results += json.load(f)
            except OSError:
                results.append({"name": n, "error": f"exit {p.returncode}, no result"})
    else:
        for n in names:
            log(f"soak {n} on {a.device} for {a.minutes} min ...")
            results.append(soak(n, WORKLOADS[n], media, a.device, a.minutes, a.interval,
                                a.warmup))
            with open(os.path.join(a.out, "soak.json"), "w") as f:
                json.dump(results, f, indent=1)
    with open(os.path.join(a.out, "soak.json"), "w") as f:
        json.dump(results, f, indent=1)
    log(f"{'workload':14} {'device':7} {'steps':>7} {'RSS MB':>14} {'RSS growth':>11} "
        f"{'GPU growth':>11}  verdict")
    for r in results:
        if "error" in r:
            log(f"{r['name']:14} {a.device:7} error: {r['error']}")
            continue

        def pct(g):
            return "n/a" if g is None else f"{100 * g:+.2f}%"

        mb = f"{r['rss_mb_after_warmup']:.0f}->{r['rss_mb_end']:.0f}"
        log(f"{r['name']:14} {r['device']:7} {r['steps']:7d} {mb:>14} {pct(r['rss_growth']):>11} "
            f"{pct(r['gpu_growth']):>11}  {'flat' if r['flat'] else 'GROWS'}")


if __name__ == "__main__":
    main()
