"""Image decode + resize + crop + normalize throughput: avpipe vs a plain DALI pipeline vs PIL.

Workload (per format: JPEG, PNG, TIFF, JPEG 2000; the 500x375 pictures of
:func:`benchmarks.data.anchor_data`): decode -> resize
the short side to 224 (bilinear, antialias) -> center crop 224 -> ImageNet normalize -> fp16 CHW.

* ``avpipe``       decode_image_stream (DALI "mixed" decode, prefetching) + the fused
                   ops.image.resize_crop_normalize on cupy (crop folded into the resize: only the
                   224x224 kept pixels are computed; reads DALI's output buffer in place).
* ``avpipe_roi``   the same with ``center_square=True``: only the centred square plus a margin
                   for the filter's reach is decoded (a crop while decoding) and the op takes
                   the crops' ``window``: the same output as ``avpipe``, exactly.
* ``avpipe_sync``  decode_image_batch (synchronous, copies out) + the same op: the simple API.
* ``dali``         fn.readers.file -> fn.decoders.image(mixed) -> fn.resize(resize_shorter=224)
                   -> fn.crop_mirror_normalize(224, fp16, CHW), 16 threads (as the anchor, with
                   DALI's defaults).
* ``dali_hw1``     the same with ``hw_decoder_load=1.0``, avpipe's default share for the hardware
                   JPEG decoder (JPEG only): what a DALI user who tunes that setting gets.
* ``pil16``        PIL decode + resize (bilinear) + crop + numpy normalize, 16 threads.

JPEG runs both tools at both hardware-decoder shares: ``avpipe_hw1`` / ``dali_hw1`` at 1.0
(avpipe's default; the headline) and ``avpipe_hw065`` / ``dali`` at DALI's default 0.65
(``AVPIPE_JPEG_HW_LOAD=0.65`` for avpipe), so every headline ratio compares one setting.
A contender is named ``<contender>@<format>``. Batch 128 for JPEG, 32 for the others.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import avpipe
from avpipe.decoding.image import decode_image_batch
from avpipe.ops import image as ops
from avpipe.pipeline.image_stream import decode_image_stream

SEED = 20240601
IMG_W, IMG_H = 500, 375
CROP = 224
THREADS = 16
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
KINDS = {  # kind -> (extension, PIL format, PIL options, files, batch)
    "jpeg": ("jpg", "JPEG", dict(quality=90), 512, 128),
    "png": ("png", "PNG", dict(), 64, 32),
    "tiff": ("tif", "TIFF", dict(), 64, 32),
    "jp2": ("jp2", "JPEG2000", dict(irreversible=True, quality_mode="rates", quality_layers=[10]),
            64, 32),
}  # fmt: skip


# --- data ---------------------------------------------------------------------------------------








# --- timing -------------------------------------------------------------------------------------


def cupy_sync(gpu):
    def sync():
        if gpu:
            import cupy

            cupy.cuda.runtime.deviceSynchronize()

    return sync


def timed_stream(batches, budget, warmup, sync):
    """Consume an iterator of per-batch image counts: warm up, then time until ``budget``; the
    clock stops after ``sync()`` (all queued GPU work done)."""
    for _ in range(warmup):
        next(batches)
    sync()
    n, iters = 0, 0
    t0 = time.perf_counter()
    for k in batches:
        n += k
        iters += 1
        if time.perf_counter() - t0 >= budget:
            break
    sync()
    return n, time.perf_counter() - t0, iters


def transform(x, window=None):
    return ops.resize_crop_normalize(
        x, short_side=CROP, crop_size=CROP, mean=MEAN, std=STD, scale=1 / 255,
        interpolation="bilinear", antialias=True, dtype="float16", layout="NCHW", window=window,
    )  # fmt: skip


def _apply(batch):
    """The op on one decoded batch: one call when all shapes (and decode-time crop windows)
    agree, else one per group."""
    wins = batch.windows or [None] * len(batch.images)
    if batch.stacked is not None and len(set(wins)) == 1:
        out = transform(batch.stacked, wins[0])
        return out.shape[0], out
    groups = {}
    for im, win in zip(batch.images, wins):
        if im is not None:
            groups.setdefault((tuple(im.shape), win), []).append(im)
    xp = avpipe.device.array_module(*[g[0] for g in groups.values()]) if groups else np
    outs = [transform(xp.stack(g), key[1]) for key, g in groups.items()]
    return sum(o.shape[0] for o in outs), outs


def bench_avpipe(files, batch, budget, device, gpu, reps, center_square=False):
    stacked = []

    def gen():
        while True:
            for b in decode_image_stream(files * reps, batch_size=batch, device=device,
                                         exact_jpeg=False, center_square=center_square):  # fmt: skip
                if not stacked:
                    stacked.append(b.stacked is not None)
                n, _ = _apply(b)
                yield n

    ips, ex = _measure(gen(), budget, gpu)
    return ips, dict(ex, stacked=stacked[0] if stacked else None)


def _measure(g, budget, gpu):
    """Images/s of an endless generator of per-batch image counts, over ``budget`` seconds."""
    n, secs, iters = timed_stream(g, budget, 3, cupy_sync(gpu))
    g.close()
    return n / secs, dict(images=n, seconds=round(secs, 3), batches=iters)


def bench_avpipe_sync(files, batch, budget, device, gpu):
    def gen():
        while True:
            for i in range(0, len(files), batch):
                b = decode_image_batch(files[i : i + batch], device=device, exact_jpeg=False)
                n, _ = _apply(b)
                yield n

    return _measure(gen(), budget, gpu)


def bench_dali(files, batch, budget, gpu, hw_load=None):
    from nvidia.dali import fn, pipeline_def, types

    opts = {} if hw_load is None or not gpu else {"hw_decoder_load": hw_load}

    mean = [m * 255 for m in MEAN]
    std = [s * 255 for s in STD]

    @pipeline_def(batch_size=batch, num_threads=THREADS, device_id=0 if gpu else None, seed=SEED)
    def pipe_fn():
        enc, _ = fn.readers.file(files=files, random_shuffle=False, name="Reader")
        img = fn.decoders.image(enc, device="mixed" if gpu else "cpu", output_type=types.RGB,
                                **opts)  # fmt: skip
        img = fn.resize(img, resize_shorter=CROP)
        return fn.crop_mirror_normalize(img, crop=(CROP, CROP), dtype=types.FLOAT16, mean=mean,
                                        std=std, output_layout="CHW")  # fmt: skip

    pipe = pipe_fn()
    pipe.build()
    last = []

    def gen():
        while True:
            (out,) = pipe.run()
            last[:] = [out]
            yield len(out)

    def sync():
        if last:
            last[0].as_cpu()  # waits for the GPU work of the newest batch (as the anchor)

    n, secs, iters = timed_stream(gen(), budget, 3, sync)
    return n / secs, dict(images=n, seconds=round(secs, 3), batches=iters)


def bench_pil(files, budget):
    from PIL import Image

    mean = np.array(MEAN, np.float32) * 255
    std = np.array(STD, np.float32) * 255

    def load(path):
        with Image.open(path) as im:
            im = im.convert("RGB")
            w, h = im.size
            nw, nh = (round(w * CROP / h), CROP) if h <= w else (CROP, round(h * CROP / w))
            im = im.resize((nw, nh), Image.BILINEAR)
            left, top = (nw - CROP) // 2, (nh - CROP) // 2
            a = np.asarray(im.crop((left, top, left + CROP, top + CROP)), np.float32)
            ((a - mean) / std).astype(np.float16).transpose(2, 0, 1)
        return 1

    with ThreadPoolExecutor(THREADS) as pool:

        def gen():
            while True:
                yield sum(pool.map(load, files))

        n, secs, iters = timed_stream(gen(), budget, 1, cupy_sync(False))
    return n / secs, dict(images=n, seconds=round(secs, 3), passes=iters, threads=THREADS)


def check_agreement(files, device, gpu):
    """avpipe's output vs DALI's on the first images (how close the two pipelines are)."""
    from nvidia.dali import fn, pipeline_def, types

    n = min(8, len(files))
    b = decode_image_batch(files[:n], device=device, exact_jpeg=False)
    xp = avpipe.device.array_module(b.images[0])
    x = xp.stack(b.images)
    h, w = x.shape[1:3]
    # DALI's geometry: the long side rounded (torchvision truncates), then the center crop
    size = (CROP, round(w * CROP / h)) if h <= w else (round(h * CROP / w), CROP)
    ours = avpipe.device.to_numpy(
        ops.resize_crop_normalize(
            x, short_side=None, size=size, crop_size=CROP, mean=MEAN, std=STD, dtype="float32"
        )  # fmt: skip
    )
    mean = [m * 255 for m in MEAN]
    std = [s * 255 for s in STD]

    @pipeline_def(batch_size=n, num_threads=2, device_id=0 if gpu else None)
    def p():
        enc, _ = fn.readers.file(files=files[:n], random_shuffle=False)
        img = fn.decoders.image(enc, device="mixed" if gpu else "cpu", output_type=types.RGB)
        img = fn.resize(img, resize_shorter=CROP)
        return fn.crop_mirror_normalize(img, crop=(CROP, CROP), dtype=types.FLOAT, mean=mean,
                                        std=std, output_layout="CHW")  # fmt: skip

    pipe = p()
    pipe.build()
    (out,) = pipe.run()
    if gpu:
        out = out.as_cpu()
    ref = np.stack([np.asarray(out[i]) for i in range(n)])
    if ours.shape != ref.shape:
        return {"shapes": [list(ours.shape), list(ref.shape)]}
    d = np.abs(ours.astype(np.float32) - ref) * 0.226 * 255  # in 0..255 levels (about)
    res = {"max_levels": round(float(d.max()), 2), "mean_levels": round(float(d.mean()), 3)}
    # avpipe_roi (decode-time crop + window) against avpipe (whole decode), the benchmark's op
    outs = {}
    for sq in (False, True):
        got = []
        for b in decode_image_stream(files[:n], batch_size=n, device=device, exact_jpeg=False,
                                     center_square=sq):  # fmt: skip
            o = _apply(b)[1]
            got += [avpipe.device.to_numpy(a).astype(np.float32)
                    for a in (o if isinstance(o, list) else [o])]  # fmt: skip
        outs[sq] = np.concatenate(got)
    res["roi_vs_whole_max_abs"] = float(np.abs(outs[True] - outs[False]).max())
    return res


# --- main ---------------------------------------------------------------------------------------






# --- harness ----------------------------------------------------------------------------------

NAME = "image"
SUITE = "gpu"
UNIT = "images/s"
TITLE = ("500x375 JPEG / PNG / TIFF / JPEG 2000 -> short side 224, centre crop 224, fp16 CHW, "
         "ImageNet-normalized")
_BASE = {
    "avpipe": "decode_image_stream (DALI mixed decode) + ops.image.resize_crop_normalize",
    "avpipe_roi": "the same, decoding only the centred square (center_square), same output",
    "avpipe_sync": "decode_image_batch + the same op (the simple API)",
    "dali": "DALI readers.file -> decoders.image(mixed) -> resize -> crop_mirror_normalize, 16 "
            "threads, DALI's defaults",
    "pil16": "PIL decode + resize + crop + numpy normalize, 16 threads",
}
CONTENDERS = {
    "avpipe_hw1@jpeg": "avpipe, hw_decoder_load 1.0 (its default)",
    "dali_hw1@jpeg": "DALI, hw_decoder_load 1.0",
    "avpipe_hw065@jpeg": "avpipe, hw_decoder_load 0.65 (AVPIPE_JPEG_HW_LOAD=0.65)",
    "dali@jpeg": "DALI, hw_decoder_load 0.65 (its default)",
    "avpipe_roi@jpeg": _BASE["avpipe_roi"] + ", hw_decoder_load 1.0",
    "avpipe_sync@jpeg": _BASE["avpipe_sync"] + ", hw_decoder_load 1.0",
    "pil16@jpeg": _BASE["pil16"],
    **{f"{c}@{k}": _BASE[c] for k in ("png", "tiff", "jp2") for c in ("avpipe", "dali")},
}
OPTIONAL = ("avpipe_sync@jpeg",)
RATIOS = [("avpipe_hw1@jpeg", "dali_hw1@jpeg"), ("avpipe_hw065@jpeg", "dali@jpeg"),
          ("avpipe_hw1@jpeg", "dali@jpeg"), ("avpipe_roi@jpeg", "dali_hw1@jpeg"),
          ("avpipe@png", "dali@png"), ("avpipe@tiff", "dali@tiff"), ("avpipe@jp2", "dali@jp2")]
PARAMS = {"budget": 5.0}
QUICK = {"budget": 2.0}
REQUIRES = ("gpu", "cupy", "nvidia.dali")


def prepare(ctx):
    from benchmarks import data

    d = data.anchor_data(ctx.data_dir, ctx.quick)
    return {k: d[k] for k in KINDS}


def measure(ctx, name):
    if name == "_check":
        gpu = avpipe.device.gpu_available()
        return None, {k: check_agreement(ctx.data[k], "cuda" if gpu else "cpu", gpu)
                      for k in KINDS if ctx.data.get(k)}
    contender, kind = name.split("@")
    files, budget = ctx.data[kind], ctx.params["budget"]
    batch = 8 if ctx.quick else KINDS[kind][4]
    gpu = avpipe.device.gpu_available()
    device = "cuda" if gpu else "cpu"
    reps = max(1, int(budget * 40000) // len(files))
    if contender == "avpipe_hw065":
        os.environ["AVPIPE_JPEG_HW_LOAD"] = "0.65"
    if contender in ("avpipe", "avpipe_hw1", "avpipe_hw065"):
        ips, ex = bench_avpipe(files, batch, budget, device, gpu, reps)
    elif contender == "avpipe_roi":
        ips, ex = bench_avpipe(files, batch, budget, device, gpu, reps, True)
    elif contender == "avpipe_sync":
        ips, ex = bench_avpipe_sync(files, batch, budget, device, gpu)
    elif contender == "dali":
        ips, ex = bench_dali(files, batch, budget, gpu)
    elif contender == "dali_hw1":
        ips, ex = bench_dali(files, batch, budget, gpu, 1.0)
    elif contender == "pil16":
        ips, ex = bench_pil(files, budget)
    else:
        raise ValueError(f"unknown contender {name!r}")
    from avpipe.decoding.image import _dali

    return ips, dict(ex, files=len(files), batch=batch,
                     avpipe_hw_decoder_load=_dali.hw_decoder_load())


def check(ctx):
    """avpipe's output against DALI's on the first images of each format (a child process)."""
    from benchmarks.harness import measure_in_child

    return measure_in_child(NAME, "_check", ctx, 600).get("extra") or {}
