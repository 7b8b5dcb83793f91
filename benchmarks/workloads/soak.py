"""Soak: run each workload for a while and watch memory. It must stay flat.

Every workload (the decoders in a loop, the audio batch loader, the training feeds) runs alone
for ``minutes``; every ``interval`` seconds the process's RSS (``/proc/self/status`` VmRSS)
and, on a GPU, this process's device memory (``nvidia-smi``'s per-process figure, which also
counts PyNvVideoCodec's and DALI's own allocations; where it is not available, the whole
device's use by ``cudaMemGetInfo``, which counts every other process too: only meaningful for a
workload alone on the GPU) are sampled. The first ``warmup`` share of the
samples is warm-up (pools fill, caches fill); growth is the median of the last fifth of the
samples over the median of the fifth right after warm-up, minus 1. The verdict: growth under 5 % on every
series.

Media: :func:`benchmarks.data.anchor_data`. In the harness every workload runs at once, each in
its own process (its own RSS), for one round (a soak repeats itself over time); the value is
the largest growth in percent, every workload's series in the extra.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

import avpipe


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


def make_media(work: str, data: str, quick: bool = False) -> dict:
    """{kind: [paths]} of the shared data, a manifest and a class list over them."""
    from benchmarks import data as bdata

    d = bdata.anchor_data(data, quick)
    media = {"video": d["h264"], "flac": d["audio"], "image": d["jpeg"][:512]}
    os.makedirs(work, exist_ok=True)
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


def w_image_stream(media, device):
    """decode_image_stream over the images, stream after stream (its pipeline rebuilt each)."""
    from avpipe.pipeline.image_stream import decode_image_stream

    files = media["image"][:128]
    return _feed_step(_Restart(lambda: decode_image_stream(files, batch_size=32, device=device,
                                                           exact_jpeg=False)))


def w_extract(media, device):
    """run_extract (the nemo preset) over 32 of the FLAC files into a fresh folder each step."""
    import shutil
    import tempfile

    from avpipe.recipes.extract import run_extract

    work = tempfile.mkdtemp(prefix="soak_extract_")
    lst = os.path.join(work, "files.txt")
    with open(lst, "w") as f:
        f.write("\n".join(media["flac"][:32]) + "\n")
    k = [0]

    def step():
        out = os.path.join(work, f"out{k[0] % 2}")
        shutil.rmtree(out, ignore_errors=True)
        k[0] += 1
        s = run_extract(lst, preset="nemo", out_dir=out, shard_size=16, progress=False,
                        devices=None if device.startswith("cuda") else "cpu")
        assert s.complete and s.errors == 0, s.format()

    step.close = lambda: shutil.rmtree(work, ignore_errors=True)
    return step


class _Restart:
    """An iterable calling ``make()`` for each pass (a stream that ends after one pass)."""

    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return iter(self.make())


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
    "image_stream": w_image_stream,
    "extract": w_extract,
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






# --- harness ----------------------------------------------------------------------------------

NAME = "soak"
SUITE = "gpu"
UNIT = "largest memory growth %"
TITLE = ("Every soak workload (decoders, audio, images, image stream, audio loader, RNN-T feed, "
         "video feed, extraction) side by side, each in its own process, RSS and per-process GPU "
         "memory every 10 s")
CONTENDERS = {"all": "every workload at once, each in its own process"}
RATIOS = []
ROUNDS = 1
PARAMS = {"minutes": 8.0, "interval": 10.0, "warmup": 0.2, "device": "cuda"}
QUICK = {"minutes": 0.5, "interval": 2.0}
REQUIRES = ("gpu",)


def prepare(ctx):
    return make_media(os.path.join(ctx.data_dir, "soak"), ctx.data_dir, ctx.quick)


def _one(name, ctx_json):
    """One workload's soak (run in its own process)."""
    from benchmarks.harness import Context

    ctx = Context.from_json(ctx_json)
    p = ctx.params
    print("SOAK " + json.dumps(soak(name, WORKLOADS[name], ctx.data, p["device"], p["minutes"],
                                    p["interval"], p["warmup"]), default=str), flush=True)


def measure(ctx, name):
    import subprocess

    from benchmarks.harness import ROOT

    code = "import sys; from benchmarks.workloads import soak; soak._one(sys.argv[1], sys.argv[2])"
    procs = [(n, subprocess.Popen([sys.executable, "-c", code, n, ctx.to_json()], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True))
             for n in WORKLOADS]
    results = []
    for n, proc in procs:
        out, _ = proc.communicate()
        got = [ln[5:] for ln in out.splitlines() if ln.startswith("SOAK ")]
        results.append(json.loads(got[-1]) if got else
                       {"name": n, "error": f"exit {proc.returncode}, no result"})
    growths = [100 * g for r in results for g in (r.get("rss_growth"), r.get("gpu_growth"))
               if g is not None]
    summary = {r["name"]: {k: r.get(k) for k in ("rss_growth", "gpu_growth", "flat", "steps",
                                                  "rss_mb_after_warmup", "rss_mb_end", "error")}
               for r in results}
    return (max(growths) if growths else None), {"workloads": summary,
                                                 "all_flat": all(r.get("flat") for r in results),
                                                 "series": results}
