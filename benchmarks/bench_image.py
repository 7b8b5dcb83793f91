#!/usr/bin/env python3
"""Image decode + resize + crop + normalize throughput: avpipe vs a plain DALI pipeline vs PIL.

    python3 benchmarks/bench_image.py --data /tmp/bench --out DIR [--budget 15] [--formats jpeg,png]

Workload (per format: JPEG, PNG, TIFF, JPEG 2000; 500x375 pictures from the anchor benchmark's
layout /tmp/bench/images/<kind>/img_NNNN.<ext>, generated here when missing): decode -> resize
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

Batch 128 for JPEG, 32 for the others (as the anchor). ``avpipe``, ``avpipe_roi``, ``dali`` and
``dali_hw1`` run ``--rounds`` times, interleaved; the table gives each one's median and the median
of the per-round avpipe/dali ratios. Writes DIR/bench_image.json and prints a table last. Without a GPU everything runs on the CPU (a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import avpipe  # noqa: E402
from avpipe.decoding.image import decode_image_batch  # noqa: E402
from avpipe.ops import image as ops  # noqa: E402
from avpipe.pipeline.image_stream import decode_image_stream  # noqa: E402

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


def _smooth_noise(rng, h, w, cutoff=0.08):
    z = rng.standard_normal((h, w))
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    t = np.fft.irfft2(np.fft.rfft2(z) * np.exp(-(fx**2 + fy**2) / (2 * cutoff**2)), s=(h, w))
    return t / (t.std() + 1e-6)


def _picture(rng, w=IMG_W, h=IMG_H):
    """Gradients + smooth texture + soft blobs + noise: photo-like entropy for the codecs."""
    y = np.linspace(0, 1, h)[:, None]
    x = np.linspace(0, 1, w)[None, :]
    img = np.empty((h, w, 3))
    tex = _smooth_noise(rng, h, w) * 30
    for c in range(3):
        fx, fy = rng.uniform(0.5, 2.0, 2)
        img[..., c] = (
            128
            + 70 * np.cos(2 * np.pi * fy * y) * np.sin(2 * np.pi * fx * x + rng.uniform(0, 6))
            + tex
        )
    yy, xx = np.mgrid[0:h, 0:w]
    for _ in range(6):
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        r = rng.uniform(0.05, 0.18) * min(w, h)
        a = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * (0.6 * r) ** 2))[..., None]
        img = img * (1 - a) + rng.uniform(0, 255, 3) * a
    img += rng.standard_normal((h, w, 3)) * 7
    return np.clip(img, 0, 255).astype(np.uint8)


def data_files(data_dir, kind, quick):
    ext, fmt, kw, count, _ = KINDS[kind]
    count = min(count, 32 if kind == "jpeg" else 8) if quick else count
    paths = [os.path.join(data_dir, "images", kind, f"img_{i:04d}.{ext}") for i in range(count)]
    missing = [i for i, p in enumerate(paths) if not os.path.exists(p)]
    if missing:
        from PIL import Image, features

        print(f"generating {len(missing)} {kind} files in {os.path.dirname(paths[0])}", flush=True)
        os.makedirs(os.path.dirname(paths[0]), exist_ok=True)
        for i in missing:
            rng = np.random.default_rng([SEED, 4 if kind == "jpeg" else 5, i])
            img = _picture(rng)
            tmp = paths[i] + ".tmp"
            if kind == "jp2" and not features.check("jpg_2000"):
                import av

                cc = av.CodecContext.create("jpeg2000", "w")
                cc.width, cc.height, cc.pix_fmt = IMG_W, IMG_H, "rgb24"
                frame = av.VideoFrame.from_ndarray(img, format="rgb24")
                with open(tmp, "wb") as f:
                    f.write(b"".join(bytes(p) for p in cc.encode(frame) + cc.encode(None)))
            else:
                Image.fromarray(img).save(tmp, format=fmt, **kw)
            os.replace(tmp, paths[i])
    return paths


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", default="/tmp/bench")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=15.0, help="seconds per measurement")
    ap.add_argument("--formats", default="jpeg,png,tiff,jp2")
    ap.add_argument("--only", default="avpipe,avpipe_roi,avpipe_sync,dali,dali_hw1,pil16")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (see above)")
    ap.add_argument("--quick", action="store_true", help="few files, short budget (smoke test)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gpu = avpipe.device.gpu_available()
    device = "cuda" if gpu else "cpu"
    budget = 2.0 if args.quick else args.budget
    only = set(args.only.split(","))
    results = {
        "meta": {
            "device": device,
            "python": platform.python_version(),
            "budget_s": budget,
            "avpipe": avpipe.__version__,
            "host": platform.node(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },  # fmt: skip
        "images_per_s": {},
        "extra": {},
    }
    try:
        import nvidia.dali

        results["meta"]["dali"] = nvidia.dali.__version__
    except Exception:  # noqa: BLE001
        pass
    for kind in args.formats.split(","):
        files = data_files(args.data, kind, args.quick)
        batch = KINDS[kind][4] if not args.quick else 8
        # one stream long enough for the whole measurement (a new stream builds a new pipeline)
        reps = max(1, int(budget * 40000) // len(files))
        row, extra, samples = {}, {}, {}
        runs = [
            ("avpipe", bench_avpipe, (files, batch, budget, device, gpu, reps)),
            # decode-time crop of the centred square + the filter's reach (center_square):
            # the same output as "avpipe" (the op takes the crop's window), less decoded
            ("avpipe_roi", bench_avpipe, (files, batch, budget, device, gpu, reps, True)),
            ("avpipe_sync", bench_avpipe_sync, (files, batch, budget, device, gpu)),
            ("dali", bench_dali, (files, batch, budget, gpu)),
            ("dali_hw1", bench_dali, (files, batch, budget, gpu, 1.0)),
            ("pil16", bench_pil, (files, budget)),
        ]
        repeated = {"avpipe", "avpipe_roi", "dali", "dali_hw1"}
        for rnd in range(max(1, args.rounds)):
            for name, fn_, fargs in runs:
                if name not in only or (rnd and name not in repeated):
                    continue
                if name == "dali_hw1" and (kind != "jpeg" or not gpu):
                    continue
                samples.setdefault(name, []).append(None)  # None: this round failed
                try:
                    ips, ex = fn_(*fargs)
                    samples[name][-1] = round(ips, 1)
                    extra.setdefault(name, []).append(ex)
                    print(f"{kind:5s} {name:12s} {ips:10.1f} images/s  round {rnd}  {ex}",
                          flush=True)  # fmt: skip
                except Exception as e:  # noqa: BLE001 - one failure must not stop the rest
                    extra.setdefault(name, []).append({"error": f"{type(e).__name__}: {e}"[:500]})
                    print(f"{kind:5s} {name:12s} FAILED {type(e).__name__}: {e}", flush=True)
                    traceback.print_exc()
                if gpu:
                    import cupy

                    cupy.get_default_memory_pool().free_all_blocks()
        for name, vals in samples.items():
            ok = [v for v in vals if v is not None]
            if ok:
                row[name] = float(np.median(ok))
        extra["rounds"] = samples
        for name, ref in (("avpipe", "dali"), ("avpipe_roi", "dali"), ("avpipe", "dali_hw1")):
            # rounds where both ran (a failed round of either is skipped, never re-paired)
            pairs = [(a, d) for a, d in zip(samples.get(name, []), samples.get(ref, []))
                     if a is not None and d is not None]  # fmt: skip
            if pairs:  # the ratio within each round (side by side), then the median over rounds
                extra[f"{name}_over_{ref}_per_round"] = [round(a / d, 3) for a, d in pairs]
                row[f"{name}_over_{ref}"] = round(float(np.median([a / d for a, d in pairs])), 3)
        try:
            extra["agreement_vs_dali"] = check_agreement(files, device, gpu)
        except Exception as e:  # noqa: BLE001
            extra["agreement_vs_dali"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        extra["files"], extra["batch"] = len(files), batch
        results["images_per_s"][kind], results["extra"][kind] = row, extra
        with open(os.path.join(args.out, "bench_image.json"), "w") as f:
            json.dump(results, f, indent=1)

    names = ("avpipe", "avpipe_roi", "avpipe_sync", "dali", "dali_hw1", "pil16")
    print(f"\nimages/s on {device} (decode + resize 224 + crop 224 + normalize fp16 CHW; "
          f"medians of {max(1, args.rounds)} interleaved rounds)")  # fmt: skip
    print(f"{'format':7s} " + " ".join(f"{n:>11s}" for n in names) + f" {'avp/dali':>9s}"
          f" {'roi/dali':>9s}")  # fmt: skip
    for kind, row in results["images_per_s"].items():
        cells = [f"{row[k]:11.1f}" if k in row else f"{'-':>11s}" for k in names]
        ratios = [f"{row[k]:9.3f}" if row.get(k) else f"{'-':>9s}"
                  for k in ("avpipe_over_dali", "avpipe_roi_over_dali")]  # fmt: skip
        print(f"{kind:7s} " + " ".join(cells) + " " + " ".join(ratios))
        if row.get("avpipe_over_dali_hw1"):
            print(f"{'':7s} avpipe / dali_hw1 (DALI with avpipe's hardware-decoder share): "
                  f"{row['avpipe_over_dali_hw1']:.3f}")  # fmt: skip
    with open(os.path.join(args.out, "bench_image.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
