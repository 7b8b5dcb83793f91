"""Train-time augmentation stacks on the GPU: avpipe vs DALI, per item, data already in memory.

Workloads (the same data for both; generated, no files):

* audio: 64 utterances of 2-16 s at 16 kHz (white noise with a tone), padded; speed perturbation
  (factor from {0.9, 1.0, 1.1}) -> log-mel (80 mel, 512/400/160, per-feature normalization) ->
  SpecAugment (2 freq masks of width <= 27, 10 time masks of width <= 5 % of the item).

  - ``avpipe_audio``: ``Chain([SpeedPerturb, LogMel("nemo"), SpecAugment])`` on cupy arrays.
  - ``dali_audio``: external source (per-item arrays) -> ``fn.audio_resample(scale=1/f)``
    with ``f`` from ``fn.random.choice`` -> preemphasis -> ``fn.spectrogram`` ->
    ``fn.mel_filter_bank`` -> ``fn.to_decibels`` -> ``fn.normalize`` -> ``fn.erase`` (time masks,
    axis "t") -> ``fn.erase`` (frequency masks, axis "f") -> pad.

* video: 8 clips of 16 x 360 x 640 x 3 uint8; random resized crop to 224 (scale 0.08-1, ratio
  3/4-4/3) -> horizontal flip (p 0.5) -> colour jitter (brightness, contrast, saturation 0.4,
  hue 0.1) -> normalize (ImageNet mean/std) to float32 ``[T, C, H, W]``.

  - ``avpipe_video``: ``video_train_chain(224)`` on cupy clips (the resized crop as two fused
    kernels for the batch, then flip + jitter (random order per clip) + normalize in one pass
    plus the frames' gray means).
  - ``avpipe_video_recipe``: the video recipe's default train stack as it runs it on a GPU
    (the batch's draws in one pass, ``VideoTask.ahead``; these clips' 11 MB of frames are
    under ``DEFER_BYTES``, so its collate crops and resizes them, ``_resize_deferred``: their
    boxes and flips drawn at once, one launch for the batch): the random
    resized crop folded into the fused resize + normalize (float16 ``[T, C, H, W]``), and the
    flip; no colour jitter (off by default there). Its batches are a feed's: new ids every
    batch (an epoch every 64), the draws of 8 batches made at once
    (``VideoTask.drawn_in_groups``, as its producer makes them).
    ``avpipe_video_recipe_per_clip``: the same with each clip transformed alone
    (``VideoTask._train_transform``, then stacked), as the recipe does for larger clips. The
    recipe's defaults except ``scale``, 0.08-1 as above. ``avpipe_video_recipe_cold``: the
    same with the resize tap tables' caches emptied before every batch (what a clip costs when its crop's tables are new; since
    the one-pass kernel computes its taps itself, only crops it leaves to the two passes
    build tables).
  - ``avpipe_video_recipe_jitter``: the recipe's stack with its ``color_jitter`` on
    (brightness, contrast, saturation 0.4, hue 0.1), as it runs on a GPU: the batch's crops in
    one launch in the collate, then the jitter and the normalize in one pass (plus the frames'
    gray means). ``dali_video_recipe_jitter``: ``dali_video_recipe`` with ``dali_video``'s
    ``fn.color_twist`` before the mirror and normalize.
  - ``dali_video``: external source of sequences (``FHWC``) -> ``fn.random_resized_crop`` ->
    ``fn.flip(horizontal=coin)`` -> ``fn.color_twist`` (brightness, contrast, saturation, hue
    in degrees; fixed order) -> ``fn.crop_mirror_normalize`` (``FCHW``, float).
  - ``dali_video_recipe``: the recipe's stack in DALI: ``fn.random_resized_crop`` (scale
    0.08-1) -> ``fn.crop_mirror_normalize`` (coin-flip mirror, ``FCHW``, float16); no colour
    twist (the recipe's default has none). ``avpipe_video_recipe`` is compared with it.

Throughput: items (utterances, clips) per second over ``budget`` seconds after a warm-up; the
input is on the device before timing for both (DALI's external source is fed device arrays).
The parameter ``cpu`` runs avpipe's stacks on numpy and DALI's with its CPU operators (a check
that the code runs, no GPU numbers); ``profile`` N first prints the N functions with the most
host time (cProfile) over 50 steps of each.
"""

from __future__ import annotations

import math
import time

import numpy as np

SR = 16000




def audio_batch(n=64, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(2 * SR, 16 * SR + 1, n)
    x = np.zeros((n, int(lens.max())), np.float32)
    for i, m in enumerate(lens):
        t = np.arange(m) / SR
        x[i, :m] = 0.05 * rng.standard_normal(m) + 0.3 * np.sin(2 * np.pi * (200 + 10 * i) * t)
    return x, lens


def video_batch(n=8, t=16, h=360, w=640, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (n, 1, h, w, 3), dtype=np.uint8)
    noise = rng.integers(0, 8, (n, t, h, w, 3), dtype=np.uint8)
    return base + noise  # frames alike, as in a clip


PROFILE = []  # --profile N: the top N functions of each timed loop by their own time


def run_timed(step, budget, items, sync, warmup=1, min_iters=3):
    for _ in range(warmup):
        step()
    sync()
    if PROFILE:  # the host's time per call by function (cProfile slows every Python call)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(max(min_iters, 50)):
            step()
        sync()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(PROFILE[0])
    t0 = time.perf_counter()
    iters = 0
    while iters < min_iters or time.perf_counter() - t0 < budget:
        step()
        iters += 1
    sync()
    secs = time.perf_counter() - t0
    return items * iters / secs, {"iters": iters, "seconds": round(secs, 3)}


def _xp(cpu):
    if cpu:
        return np, (lambda: None)
    import cupy

    return cupy, cupy.cuda.runtime.deviceSynchronize


# --- avpipe ------------------------------------------------------------------------------------


def bench_avpipe_audio(args):
    from avpipe.ops.audio_augment import Chain, LogMel, SpecAugment, SpeedPerturb

    xp, sync = _xp(args.cpu)
    x, lens = audio_batch(args.audio_batch)
    xd, ld = xp.asarray(x), lens  # lengths on the host (the loader's)
    chain = Chain([SpeedPerturb((0.9, 1.0, 1.1), sample_rate=SR, quality=args.quality),
                   LogMel("nemo"), SpecAugment(2, 27, 10, 0.05)])  # fmt: skip
    ids = np.arange(x.shape[0])
    state = {"epoch": 0}

    def step():
        state["epoch"] += 1
        out, _ = chain((xd, ld), seed=0, epoch=state["epoch"], ids=ids)
        return out

    v, info = run_timed(step, args.budget, x.shape[0], sync)
    return v, {**info, "shape": list(step().shape), "quality": args.quality}


def bench_avpipe_video(args):
    from avpipe.ops.image_augment import video_train_chain

    xp, sync = _xp(args.cpu)
    x = xp.asarray(video_batch(args.video_batch, args.frames))
    chain = video_train_chain(224, brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1)
    state = {"epoch": 0}

    def step():
        state["epoch"] += 1
        return chain(x, seed=0, epoch=state["epoch"])

    v, info = run_timed(step, args.budget, x.shape[0], sync)
    return v, {**info, "shape": list(step().shape)}


def bench_avpipe_video_recipe_cold(args):
    """The recipe's stack with the resize tap tables' caches emptied before every batch (host
    tables per axis, their device copies, the 2-D plans): each clip's crop builds and copies up
    its tables, as the first clips of a run (or every clip before the tables were cached per
    axis) do."""
    from avpipe.ops import _image_resize as rs
    from avpipe.ops import _resize_kernels as ik

    def clear():
        for f in (ik.axis_plan, ik.plan, rs.axis_weights, rs.resize_taps):
            f.cache_clear()
        ik._TABLES.clear()

    return bench_avpipe_video_recipe(args, before=clear)


def bench_avpipe_video_recipe_per_clip(args):
    """The recipe's stack with every clip transformed on its own (``DEFER_BYTES = 0``: what
    it does with clips larger than 32 MiB of frames, or with colour jitter)."""
    return bench_avpipe_video_recipe(args, defer_bytes=0)


def bench_avpipe_video_recipe_jitter(args):
    """The recipe's stack with its colour jitter on (brightness, contrast, saturation 0.4, hue
    0.1): in the collate, the batch's crops in one launch, then the jitter and the normalize
    in one pass (plus the frames' gray means)."""
    return bench_avpipe_video_recipe(args, color_jitter=JITTER)


def bench_avpipe_video_recipe(args, before=None, defer_bytes=None, color_jitter=None):
    from avpipe.device import resolve_device
    from avpipe.recipes.video import VideoTask, _Deferred

    xp, sync = _xp(args.cpu)
    x = xp.asarray(video_batch(args.video_batch, args.frames))
    task = VideoTask(labels=[0] * x.shape[0], clip_length=args.frames, stride=1, crop_size=224,
                     train=True, seed=0, device=resolve_device("cpu" if args.cpu else "cuda"),
                     scale=(0.08, 1.0), color_jitter=color_jitter)  # fmt: skip
    if defer_bytes is not None:
        task.DEFER_BYTES = defer_bytes
    B = x.shape[0]
    clips = [x[i] for i in range(B)]  # an array a clip, made once (as DALI's external source's)

    from avpipe.ops import random as R

    def batches(per_epoch=64):  # a feed's groups: new ids every batch, a new epoch now and then
        e = 0
        while True:
            e += 1
            task.epoch = e  # (set by the feed before an epoch's groups are decoded)
            for k in range(per_epoch):
                yield [(k * B + j, None) for j in range(B)]

    # as the recipe's producer takes them: each DRAW_GROUPS batches' draws made at once
    groups = task.drawn_in_groups(batches())

    def step():
        if before is not None:
            before()
        pairs = next(groups)
        e, ids = task.epoch, [i for i, _ in pairs]
        with R.drawn_from(task.ahead(pairs)):  # the batch's draws; then each decoding thread
            # (a deferred clip carries the table it drew from, which the collate reads again)
            vals = [_Deferred(clips[i % B], R.drawn_table()) if task._defer
                    and clips[i % B].nbytes <= task.DEFER_BYTES
                    else task._train_transform(clips[i % B], i, e) for i in ids]  # fmt: skip
        y = task._resize_deferred(vals, ids, e)  # the collate
        return xp.stack(y) if isinstance(y, list) else y

    v, info = run_timed(step, args.budget, x.shape[0], sync)
    out = step()
    return v, {**info, "shape": list(out.shape), "dtype": str(out.dtype)}


# --- DALI --------------------------------------------------------------------------------------


def _dali_feed(arrays, cpu):
    if cpu:
        return [np.ascontiguousarray(a) for a in arrays]
    import cupy

    return [cupy.asarray(a) for a in arrays]


def bench_dali_audio(args):
    from nvidia.dali import fn, pipeline_def, types

    x, lens = audio_batch(args.audio_batch)
    items = _dali_feed([x[i, : lens[i]] for i in range(len(lens))], args.cpu)
    B = len(items)
    dev = "cpu" if args.cpu else "gpu"

    @pipeline_def(batch_size=B, num_threads=args.threads, device_id=None if args.cpu else 0, seed=1)
    def pipe_fn():
        a = fn.external_source(source=lambda: items, device=dev, dtype=types.FLOAT, layout="t",
                               batch=True)  # fmt: skip
        f = fn.random.choice([0.9, 1.0, 1.1])
        a = fn.audio_resample(a, scale=1.0 / f, quality=50)
        a = fn.preemphasis_filter(a, preemph_coeff=0.97)
        s = fn.spectrogram(a, nfft=512, window_length=400, window_step=160, power=2)
        s = fn.mel_filter_bank(s, sample_rate=SR, nfilter=80)
        s = fn.to_decibels(s, multiplier=math.log(10), reference=1.0, cutoff_db=math.log(2.0**-24))
        s = fn.normalize(s, axes=[1])
        # SpecAugment-style: 10 time masks (<= 5 % of the item), 2 frequency masks (<= 27 bins)
        t_anchor = fn.random.uniform(range=[0.0, 0.95], shape=(10,))
        t_shape = fn.random.uniform(range=[0.0, 0.05], shape=(10,))
        s = fn.erase(s, anchor=t_anchor, shape=t_shape, axis_names="t", normalized=True)
        f_anchor = fn.random.uniform(range=[0.0, 53.0], shape=(2,))
        f_shape = fn.random.uniform(range=[0.0, 27.0], shape=(2,))
        s = fn.erase(s, anchor=f_anchor, shape=f_shape, axis_names="f")
        return fn.pad(s, axes=(1,))

    return _run_dali(pipe_fn, B, args)


JITTER = dict(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1)
_MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
_STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def _dali_clips(args, rest):
    """A DALI pipeline over the benchmark's clips: external source (``FHWC``) -> random
    resized crop (scale 0.08-1) -> ``rest(v)`` (the stack's remaining operators)."""
    from nvidia.dali import fn, pipeline_def, types

    items = _dali_feed(list(video_batch(args.video_batch, args.frames)), args.cpu)
    B = len(items)
    dev = "cpu" if args.cpu else "gpu"

    @pipeline_def(batch_size=B, num_threads=args.threads, device_id=None if args.cpu else 0, seed=1)
    def pipe_fn():
        v = fn.external_source(source=lambda: items, device=dev, dtype=types.UINT8, layout="FHWC",
                               batch=True)  # fmt: skip
        v = fn.random_resized_crop(v, size=(224, 224), random_area=[0.08, 1.0],
                                   random_aspect_ratio=[3 / 4, 4 / 3])  # fmt: skip
        return rest(v)

    return _run_dali(pipe_fn, B, args)


def bench_dali_video(args):
    from nvidia.dali import fn, types

    def rest(v):
        v = fn.flip(v, horizontal=fn.random.coin_flip(probability=0.5))
        v = _color_twist(v)
        return fn.crop_mirror_normalize(v, dtype=types.FLOAT, output_layout="FCHW", mean=_MEAN,
                                        std=_STD)  # fmt: skip

    return _dali_clips(args, rest)


def bench_dali_video_recipe(args, twist=False):
    from nvidia.dali import fn, types

    def rest(v):
        if twist:
            v = _color_twist(v)
        return fn.crop_mirror_normalize(v, dtype=types.FLOAT16, output_layout="FCHW", mean=_MEAN,
                                        std=_STD, mirror=fn.random.coin_flip(probability=0.5))  # fmt: skip

    return _dali_clips(args, rest)


def bench_dali_video_recipe_jitter(args):
    """``dali_video_recipe`` with ``fn.color_twist`` (``dali_video``'s) before the mirror and
    normalize."""
    return bench_dali_video_recipe(args, twist=True)


def _color_twist(v):
    from nvidia.dali import fn

    return fn.color_twist(v, brightness=fn.random.uniform(range=[0.6, 1.4]),
                          contrast=fn.random.uniform(range=[0.6, 1.4]),
                          saturation=fn.random.uniform(range=[0.6, 1.4]),
                          hue=fn.random.uniform(range=[-36.0, 36.0]))  # fmt: skip


def _run_dali(pipe_fn, B, args):
    import nvidia.dali as dali

    pipe = pipe_fn()
    pipe.build()
    shape = []

    def step():
        (out,) = pipe.run()
        shape[:] = [out]

    def sync():
        if shape:
            t = shape[0] if args.cpu else shape[0].as_cpu()
            shape[:] = [list(np.asarray(t.at(0)).shape)]

    v, info = run_timed(step, args.budget, B, sync)
    return v, {**info, "dali": dali.__version__, "shape": shape[0] if shape else None}


# --- driver ------------------------------------------------------------------------------------






# --- harness ----------------------------------------------------------------------------------

NAME = "augment"
SUITE = "gpu"
UNIT = "items/s"
TITLE = ("Train-time augmentation stacks per item, data already on the device: audio (64 "
         "utterances: speed, log-mel, SpecAugment), video (8 clips of 16x360x640)")
CONTENDERS = {
    "avpipe_audio": "Chain([SpeedPerturb, LogMel(nemo), SpecAugment]) on cupy",
    "dali_audio": "DALI audio_resample -> log-mel chain -> erase (time, frequency masks)",
    "avpipe_video": "video_train_chain(224): resized crop, flip, colour jitter, normalize",
    "dali_video": "DALI random_resized_crop -> flip -> color_twist -> crop_mirror_normalize",
    "avpipe_video_recipe": "the video recipe's train stack (crop + flip, fp16), batched",
    "dali_video_recipe": "DALI random_resized_crop -> crop_mirror_normalize (mirror, fp16)",
    "avpipe_video_recipe_jitter": "the recipe's stack with color_jitter on",
    "dali_video_recipe_jitter": "dali_video_recipe with color_twist",
    "avpipe_video_recipe_cold": "the recipe's stack, resize tables' caches emptied every batch",
    "avpipe_video_recipe_per_clip": "the recipe's stack, each clip transformed alone",
}
OPTIONAL = ("avpipe_video_recipe_per_clip",)
RATIOS = [("avpipe_video_recipe", "dali_video_recipe"), ("avpipe_audio", "dali_audio"),
          ("avpipe_video", "dali_video"),
          ("avpipe_video_recipe_jitter", "dali_video_recipe_jitter"),
          ("avpipe_video_recipe_cold", "dali_video_recipe")]
PARAMS = {"budget": 6.0, "cpu": False, "audio_batch": 64, "video_batch": 8, "frames": 16,
          "threads": 8, "quality": "high", "profile": 0}
QUICK = {"budget": 2.0}
REQUIRES = ("gpu", "cupy", "nvidia.dali")


def prepare(ctx):
    return {}  # the data is generated in memory by each measurement


def measure(ctx, name):
    from types import SimpleNamespace

    args = SimpleNamespace(**ctx.params)
    if args.profile:
        PROFILE[:] = [args.profile]
    return globals()[f"bench_{name}"](args)
