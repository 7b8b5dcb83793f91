"""Training feeds vs DALI: RNN-T audio, video clips, and how idle a 5 ms model step leaves the GPU.

Data: :func:`benchmarks.data.anchor_data`'s FLAC (16 kHz, 2-16 s) and H.264 640x360 files; a
NeMo manifest and a ``path,label`` CSV over them are written to the data folder.

Contenders (each in its own child process):

* ``avpipe_rnnt`` — ``avpipe.recipes.rnnt_feed`` (batch 64, training: dither + speed
  perturbation by resampling, factor from U(0.85, 1.15) per utterance, + log-mel "nemo"
  preset (preemphasis, STFT 512/400/160, 80 mel, log, per-feature normalize, pad), +
  SpecAugment (the recipe's default: 2 frequency masks <= 27, 10 time masks <= 5 %)), audio s/s.
* ``avpipe_rnnt_noaug`` — the same feed without its train-time augmentation (no speed
  perturbation, no SpecAugment): ``augmentation_share`` = 1 - avpipe_rnnt / avpipe_rnnt_noaug,
  the part of the feed's time the augmentation adds.
* ``avpipe_rnnt_paired`` — both of those in one process, in alternating half-second slices
  over twice the budget (each slice after the batches the idle feed made ahead): the share from
  the same process and moments (``share``; every pair of slices' own in ``pair_shares``),
  where the two separate processes also differ by the host's speed between processes.
* ``dali_rnnt`` — DALI: readers.file -> decoders.audio -> ``fn.audio_resample`` (in_rate =
  16000 * U(0.85, 1.15)) -> preemphasis -> spectrogram(512/400/160) -> mel 80 -> log ->
  normalize -> pad, batch 64, audio s/s. It does less than avpipe_rnnt: no dither and no
  SpecAugment (said beside its ratio).
* ``avpipe_video`` — ``avpipe.recipes.video_classification`` (16 frames, stride 4, random
  resized crop 224 + flip, fp16, batch 8), clips/s.
* ``avpipe_video_noaug`` — the same feed (the same clips decoded) with its per-clip transform
  replaced by the resize of the short side and the centre crop, without the random resized
  crop and flip and their draws (``augmentation_share`` = 1 - avpipe_video /
  avpipe_video_noaug).
* ``avpipe_video_cold`` — the same feed over 512+ distinct copies of the files, dropped from the
  page cache before the feed starts (:func:`benchmarks.cache.cold_copies`), so every open in
  an epoch is the first for that path (the per-file scan cache holds 256) and the first
  epoch reads from the disk: what an epoch over a real dataset sees.
* ``dali_video`` — DALI ``fn.readers.video`` (16 frames, stride 4) -> resize shorter 224 ->
  ``crop_mirror_normalize`` (random crop position, coin-flip mirror, fp16), batch 8, clips/s.
* ``*_idle`` — the same feeds with a stand-in model that takes 5 ms per batch (a GPU spin
  kernel on a GPU, ``time.sleep`` with ``--cpu``): ``gpu_idle_fraction`` = 1 - model time /
  wall time (0: the input keeps up), and the feed's own ``stats()`` verdict.

The augmentation shares (1 - with / without, a ratio of medians) are in the results' checks.
"""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np

SR = 16000
BATCH = 64
VBATCH, CLIP, STRIDE, CROP = 8, 16, 4, 224
STEP_S = 0.005




# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------


def audio_data(args):
    from benchmarks.workloads import audio

    cpu, quick = getattr(args, "cpu", False), getattr(args, "quick", False)
    count = 24 if cpu else 512
    files, how = audio.ensure_data(args.data, count=count, quick=quick)
    files = files[:count]
    durs = audio.durations(files)
    man = os.path.join(args.out, "bench_manifest.jsonl")
    with open(man, "w") as f:
        for p, d in zip(files, durs):
            f.write(json.dumps({"audio_filepath": os.path.abspath(p), "duration": round(d, 4),
                                "text": "x"}) + "\n")
    return man, files, durs, how


def video_data(args):
    from benchmarks import data

    files = data.anchor_data(args.data, getattr(args, "quick", False))["h264"]
    if getattr(args, "cpu", False):
        files = files[:2]
    return _write_csv(os.path.join(args.out, "bench_videos.csv"), files), files


def _write_csv(csv, files):
    """A ``path,label`` list of ``files`` (four classes in turn); returns ``csv``."""
    with open(csv, "w") as f:
        f.write("path,label\n")
        for i, p in enumerate(files):
            f.write(f"{os.path.abspath(p)},class{i % 4}\n")
    return csv


# ---------------------------------------------------------------------------------------------
# a stand-in model step: 5 ms of GPU work (or sleep on the CPU)
# ---------------------------------------------------------------------------------------------

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


def make_model(cpu):
    if cpu:
        return lambda batch: time.sleep(STEP_S), lambda: None
    import cupy

    k = cupy.RawKernel(_SPIN, "spin")
    rate = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0)
    cycles = int(rate * 1000 * STEP_S)  # kHz -> cycles in 5 ms

    def step(batch):
        k((1,), (1,), (np.int64(cycles),))

    def sync():
        cupy.cuda.get_current_stream().synchronize()

    return step, sync


def timed_loop(batches, budget, unit_of, model=None, sync=lambda: None, warmup=2):
    """Consume ``batches`` (an endless iterator) for ``budget`` s; returns units/s, batches, s."""
    for _ in range(warmup):
        b = next(batches)
        if model:
            model(b)
    sync()
    t0 = time.perf_counter()
    units, n = 0.0, 0
    while time.perf_counter() - t0 < budget or n < 3:
        b = next(batches)
        if model:
            model(b)
        units += unit_of(b)
        n += 1
    sync()
    secs = time.perf_counter() - t0
    return units / secs, n, secs


def epochs(feed):
    while True:
        yield from feed


# ---------------------------------------------------------------------------------------------
# contenders
# ---------------------------------------------------------------------------------------------


def _rnnt_feed(args, man, aug):
    """The benchmark's RNN-T training feed over ``man``, with or without its augmentation."""
    import avpipe
    from avpipe.recipes.rnnt import SPEC_AUGMENT

    return avpipe.recipes.rnnt_feed(man, batch_size=BATCH, seed=0, training=True,
                                    device="cpu" if args.cpu else "cuda",
                                    speed_perturb=(0.85, 1.15) if aug else None,
                                    spec_augment=SPEC_AUGMENT if aug else None,
                                    threads=args.threads)  # fmt: skip


def _audio_seconds(files, durs):
    """A batch's manifest seconds (its paths' durations)."""
    dmap = dict(zip([os.path.abspath(f) for f in files], durs))
    return lambda b: sum(dmap[p] for p in b.paths)


def run_avpipe_rnnt(args, idle=False, aug=True):
    man, files, durs, how = audio_data(args)
    feed = _rnnt_feed(args, man, aug)
    model, sync = make_model(args.cpu) if idle else (None, lambda: None)
    if not args.cpu:
        import cupy

        def sync(s=sync):
            s()
            cupy.cuda.get_current_stream().synchronize()
    rate, n, secs = timed_loop(epochs(feed), args.budget, _audio_seconds(files, durs), model,
                               sync)  # fmt: skip
    out = {"value": round(rate, 1), "unit": "audio s/s", "batches": n, "seconds": round(secs, 2),
           "data": how, "decoder": "gpu-flac" if feed.task._loader is not None else "threads",
           "stats": _short(feed.stats())}
    if idle:
        out["gpu_idle_fraction"] = round(1 - n * STEP_S / secs, 3)
    feed.close()
    return out


def run_avpipe_rnnt_paired(args, idle=False, slice_s=0.5, warmup=11):
    """``avpipe_rnnt`` and ``avpipe_rnnt_noaug`` in one process, in alternating slices of
    ``slice_s`` seconds (a b b a a b ...) for 2 x ``budget`` seconds in all: the host's speed,
    which moves between processes and over time, moves both alike. Each slice first takes
    ``warmup`` batches untimed: what the idle feed did while the other ran (its queue of
    ``prefetch``, 2, and the groups its decoding went ahead by, ``Task.MAX_AHEAD`` at most).
    Values: the median slice rate of each; share = 1 - with / without (and each pair's)."""
    man, files, durs, how = audio_data(args)
    feeds = {"with": _rnnt_feed(args, man, True), "without": _rnnt_feed(args, man, False)}
    its = {key: epochs(f) for key, f in feeds.items()}
    if args.cpu:
        sync = lambda: None  # noqa: E731
    else:
        import cupy

        sync = cupy.cuda.get_current_stream().synchronize
    unit = _audio_seconds(files, durs)
    rates = {"with": [], "without": []}
    n_slices = max(2, int(round(args.budget / slice_s)))
    for k in range(n_slices):
        order = ("with", "without") if k % 2 == 0 else ("without", "with")
        for key in order:
            rate, _, _ = timed_loop(its[key], slice_s, unit, sync=sync, warmup=warmup)
            rates[key].append(rate)
    a, b = float(np.median(rates["with"])), float(np.median(rates["without"]))
    for f in feeds.values():
        f.close()
    return {"value": round(a, 1), "without": round(b, 1), "unit": "audio s/s",
            "share": round(1 - a / b, 4), "slices": n_slices, "slice_s": slice_s,
            "pair_shares": [round(1 - x / y, 4) for x, y in zip(rates["with"], rates["without"])],
            "runs_with": [round(v, 1) for v in rates["with"]],
            "runs_without": [round(v, 1) for v in rates["without"]], "data": how}


def run_dali_rnnt(args, idle=False):
    from nvidia.dali import fn, pipeline_def, types

    man, files, durs, how = audio_data(args)
    dmap = dict(zip(files, durs))
    cpu = args.cpu

    @pipeline_def(batch_size=BATCH, num_threads=args.threads, device_id=None if cpu else 0,
                  seed=1)
    def pipe():
        enc, _ = fn.readers.file(files=files, random_shuffle=True, name="Reader")
        audio, _ = fn.decoders.audio(enc, downmix=True, sample_rate=SR, dtype=types.FLOAT)
        speed = fn.random.uniform(range=[0.85, 1.15])
        audio = fn.audio_resample(audio, in_rate=speed * SR, out_rate=SR)
        x = audio if cpu else audio.gpu()
        x = fn.preemphasis_filter(x, preemph_coeff=0.97)
        x = fn.spectrogram(x, nfft=512, window_length=400, window_step=160, power=2)
        x = fn.mel_filter_bank(x, sample_rate=SR, nfilter=80)
        x = fn.to_decibels(x, multiplier=math.log(10), reference=1.0,
                           cutoff_db=math.log(2.0 ** -24))
        x = fn.normalize(x, axes=[1])
        return fn.pad(x, axes=(1,))

    p = pipe()
    p.build()
    mean_d = float(np.mean(durs))
    model, sync = make_model(cpu) if idle else (None, lambda: None)

    def batches():
        while True:
            (out,) = p.run()
            if not cpu:
                import cupy

                out = cupy.asarray(out.as_tensor())  # on the GPU, as a model would take it
            yield out

    rate, n, secs = timed_loop(batches(), args.budget, lambda b: BATCH * mean_d, model, sync)
    res = {"value": round(rate, 1), "unit": "audio s/s (mean duration x items)", "batches": n,
           "seconds": round(secs, 2), "data": how}
    if idle:
        res["gpu_idle_fraction"] = round(1 - n * STEP_S / secs, 3)
    del dmap
    return res


def run_avpipe_video_cold(args, idle=False, copies=512):
    """The video feed over ``copies``+ distinct copies of the files, dropped from the page
    cache before the feed starts (:func:`benchmarks.cache.cold_copies`)."""
    import shutil
    import tempfile

    from benchmarks import cache

    _, files = video_data(args)
    d = tempfile.mkdtemp(prefix="cold_", dir=os.path.dirname(os.path.abspath(files[0])))
    try:
        many = cache.cold_copies(files, d, copies)
        cache.drop_all()
        csv = _write_csv(os.path.join(args.out, "bench_videos_cold.csv"), many)
        out = run_avpipe_video(args, idle=idle, csv=csv, files=many)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out["distinct_paths"] = len(many)
    return out


def run_avpipe_video(args, idle=False, csv=None, files=None, aug=True):
    import avpipe

    if csv is None:
        csv, files = video_data(args)
    dev = "cpu" if args.cpu else "cuda"
    feed = avpipe.recipes.video_classification(csv, clip_length=CLIP, stride=STRIDE,
                                               crop_size=CROP, batch_size=VBATCH, seed=0,
                                               device=dev, threads=args.threads)
    if not aug:  # the same clips, the transform without its draws: short side, centre crop
        from avpipe.ops.image import resize_crop_normalize

        task = feed.task
        task._train_transform = lambda frames, i, epoch: resize_crop_normalize(
            frames, short_side=CROP, crop_size=CROP, mean=task.mean, std=task.std,
            dtype=task.dtype, layout="NCHW")
    model, sync = make_model(args.cpu) if idle else (None, lambda: None)
    rate, n, secs = timed_loop(epochs(feed), args.budget, lambda b: len(b.paths), model, sync)
    out = {"value": round(rate, 2), "unit": "clips/s", "batches": n, "seconds": round(secs, 2),
           "files": len(files), "stats": _short(feed.stats())}
    if idle:
        out["gpu_idle_fraction"] = round(1 - n * STEP_S / secs, 3)
    feed.close()
    return out


def run_dali_video(args, idle=False):
    if args.cpu:
        return {"value": None, "note": "n/a: DALI's video reader needs a GPU"}
    from nvidia.dali import fn, pipeline_def, types

    from avpipe.ops.image import IMAGENET_MEAN, IMAGENET_STD

    csv, files = video_data(args)

    @pipeline_def(batch_size=VBATCH, num_threads=args.threads, device_id=0, seed=1234)
    def pipe():
        video = fn.readers.video(device="gpu", filenames=files, sequence_length=CLIP,
                                 stride=STRIDE, step=64, random_shuffle=True, initial_fill=32,
                                 name="Reader")
        if isinstance(video, (list, tuple)):
            video = video[0]
        video = fn.resize(video, resize_shorter=CROP)
        return fn.crop_mirror_normalize(
            video, crop=(CROP, CROP), crop_pos_x=fn.random.uniform(range=[0, 1]),
            crop_pos_y=fn.random.uniform(range=[0, 1]), mirror=fn.random.coin_flip(),
            dtype=types.FLOAT16, mean=[m * 255 for m in IMAGENET_MEAN],
            std=[s * 255 for s in IMAGENET_STD], output_layout="FCHW")

    p = pipe()
    p.build()
    model, sync = make_model(False) if idle else (None, lambda: None)

    def batches():
        import cupy

        while True:
            (out,) = p.run()
            yield cupy.asarray(out.as_tensor())

    rate, n, secs = timed_loop(batches(), args.budget, lambda b: VBATCH, model, sync)
    res = {"value": round(rate, 2), "unit": "clips/s", "batches": n, "seconds": round(secs, 2),
           "files": len(files)}
    if idle:
        res["gpu_idle_fraction"] = round(1 - n * STEP_S / secs, 3)
    return res


def _short(st):
    keep = {k: {"p50": _r(v.get("p50")), "p99": _r(v.get("p99"))}
            for k, v in st.items() if isinstance(v, dict)}
    keep["wait_fraction"] = round(st["wait_fraction"], 3)
    keep["verdict"] = st["verdict"]
    return keep


def _r(v):
    return None if v is None else round(v, 4)


RUNNERS = {
    "avpipe_rnnt": run_avpipe_rnnt, "dali_rnnt": run_dali_rnnt,
    "avpipe_rnnt_noaug": lambda args, idle=False: run_avpipe_rnnt(args, idle, aug=False),
    "avpipe_rnnt_paired": run_avpipe_rnnt_paired,
    "avpipe_video": run_avpipe_video, "avpipe_video_cold": run_avpipe_video_cold,
    "avpipe_video_noaug": lambda args, idle=False: run_avpipe_video(args, idle, aug=False),
    "dali_video": run_dali_video,
}
# what a feed costs with its train-time augmentation against the same feed without it:
# share = 1 - rate(with) / rate(without), the part of the feed's time the augmentation adds
AUG_SHARE = {"avpipe_rnnt": "avpipe_rnnt_noaug", "avpipe_video": "avpipe_video_noaug"}








# --- harness ----------------------------------------------------------------------------------

NAME = "feeds"
SUITE = "gpu"
UNIT = "audio-s/s or clips/s"
TITLE = ("The training feeds: RNN-T (batch 64: speed perturbation, dither, log-mel, SpecAugment) "
         "in audio-s/s; video classification (16 frames, stride 4, random resized crop 224 + "
         "flip, fp16, batch 8) in clips/s")
CONTENDERS = {
    "avpipe_rnnt": "recipes.rnnt_feed, training (audio-s/s)",
    "dali_rnnt": "DALI audio_resample speed perturbation + log-mel chain; no dither, no "
                 "SpecAugment (audio-s/s)",
    "avpipe_rnnt_noaug": "rnnt_feed without speed perturbation and SpecAugment (audio-s/s)",
    "avpipe_video": "recipes.video_classification, training (clips/s)",
    "dali_video": "DALI readers.video + random crop + mirror + normalize, 1 pipeline (clips/s)",
    "avpipe_video_noaug": "the video feed with a centre-crop transform (clips/s)",
    "avpipe_video_cold": "the video feed over 512+ copies dropped from the page cache first "
                         "(clips/s)",
    "avpipe_rnnt_paired": "avpipe_rnnt and its noaug twin in alternating slices, one process",
    "avpipe_rnnt_idle": "avpipe_rnnt beside a 5 ms stand-in model step",
    "avpipe_video_idle": "avpipe_video beside a 5 ms stand-in model step",
    "dali_rnnt_idle": "dali_rnnt beside a 5 ms stand-in model step",
    "dali_video_idle": "dali_video beside a 5 ms stand-in model step",
}
OPTIONAL = ("avpipe_rnnt_paired", "avpipe_rnnt_idle", "avpipe_video_idle", "dali_rnnt_idle",
            "dali_video_idle")
RATIOS = [("avpipe_rnnt", "dali_rnnt"), ("avpipe_video", "dali_video"),
          ("avpipe_video_cold", "dali_video"), ("avpipe_rnnt", "avpipe_rnnt_noaug"),
          ("avpipe_video", "avpipe_video_noaug")]
NOTES = ["dali_rnnt does less work than avpipe_rnnt: no dither and no SpecAugment.",
         "A ratio avpipe_x / avpipe_x_noaug is 1 - the augmentation's share of the feed's time."]
PARAMS = {"budget": 10.0, "threads": 16, "cpu": False}
QUICK = {"budget": 4.0}
REQUIRES = ("gpu", "cupy")


def _args(ctx):
    from types import SimpleNamespace

    out = os.path.join(ctx.data_dir, "feeds")
    os.makedirs(out, exist_ok=True)
    return SimpleNamespace(data=ctx.data_dir, out=out, quick=ctx.quick, **ctx.params)


def prepare(ctx):
    args = _args(ctx)
    audio_data(args)
    video_data(args)
    return {}


def measure(ctx, name):
    args = _args(ctx)
    if args.cpu:  # small: fewer files, smaller batches
        global BATCH, VBATCH
        os.environ["AVPIPE_DISABLE_GPU"] = "1"
        BATCH, VBATCH = 8, 2
    base, idle = (name[:-5], True) if name.endswith("_idle") else (name, False)
    res = RUNNERS[base](args, idle=idle)
    return res.pop("value", None), res
