#!/usr/bin/env python3
"""Where a training batch's time goes: each step of the RNN-T feed's collate and of the video
feed's per-clip train transform, timed alone (a device synchronize around each step, after a
warm-up), on data already in memory.

    python -m benchmarks.probes.profile_stages --out DIR [--iters 20] [--cpu]
    python -m benchmarks.probes.profile_stages --feeds --out DIR [--batches 30]

``--feeds``: the RNN-T and video feeds of ``benchmarks/workloads/feeds.py`` run synchronously (``prefetch=0``,
so collating runs on this thread) under cProfile, with a device synchronize after each batch:
the serial milliseconds per batch, and the 25 functions with the most own time and the most
cumulative time, in DIR/profile_feeds_{rnnt,video}.txt.

RNN-T (64 utterances of the anchor's FLAC set, the feed's training settings): the padded copy
of 64 rows (as ``RnntTask.collate`` builds it), the speed-perturbation draws, the resampling,
the dither seed, ``log_mel`` with and without the dither, SpecAugment. Video (one clip of 16
frames 360x640, as a decoder hands it): the draws (clip start, crop box, flip), the crop +
fused resize + normalize (the flip folded in), and the whole ``VideoTask._train_transform``.

The RNN-T steps are also timed "GPU alone": the calls queued behind a 0.1 s spin kernel, so
that the host is ahead of the device and the events around them count the GPU's work only,
not the gaps while the host issues it (the whole collate with and without the augmentation
among them: their difference is what the augmentation costs the GPU). A step whose host
issued it for longer than the spin (or that waited for the device) is left out.

Prints a table of median milliseconds per step and writes DIR/profile_stages.json. A step that
costs more alone than its share of the feed's batch time is where to look first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np  # noqa: E402

from benchmarks.harness import DEFAULT_DATA, ROOT

SR = 16000


def timer(xp, iters):
    """``run(name, fn)``: median ms of ``fn()`` over ``iters`` runs after one warm-up, with a
    device synchronize before and after each run on a GPU; ``run(name, fn, queued=True)``:
    ``fn()`` called ``iters`` times back to back (one synchronize at the end), as a feed calls
    it: the host's ms per call (the time to queue the work) and the ms per call until the
    device is done. Host ~ total: the host bounds it; total above host: the device does."""
    sync = (lambda: None) if xp is np else xp.cuda.runtime.deviceSynchronize
    table = {}

    def run(name, fn, queued=False, alone=False):
        if alone:
            if xp is not np:
                gpu_alone(xp, name, fn, iters, table)
            return
        fn()
        sync()
        if queued:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            host, total = (t1 - t0) / iters * 1e3, (t2 - t0) / iters * 1e3
            table[f"{name}, queued"] = {"host_ms": round(host, 3), "total_ms": round(total, 3)}
            print(f"  {name:42s} {total:9.3f} ms/call queued (host {host:.3f})", flush=True)
            return
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        table[name] = round(float(np.median(ts)) * 1e3, 3)
        print(f"  {name:42s} {table[name]:9.3f} ms", flush=True)

    return run, table


SPIN_S = 0.1  # the spin kernel's seconds ahead of the timed calls ("GPU alone")


def gpu_alone(xp, name, fn, iters, table, rounds=3):
    """The GPU's ms per call of ``fn`` alone: ``iters`` calls queued behind a spin kernel of
    ``SPIN_S`` seconds, timed by events around them (median of ``rounds``); a round whose
    host took longer than the spin to queue them is dropped (the events would count its gaps)."""
    spin = xp.RawKernel(r"""extern "C" __global__ void avp_spin(long long cycles) {
        long long t0 = clock64(); while (clock64() - t0 < cycles) {} }""", "avp_spin")
    khz = xp.cuda.Device().attributes["ClockRate"]  # the SM clock's peak: the spin is >= SPIN_S
    fn()
    xp.cuda.runtime.deviceSynchronize()
    got = []
    for _ in range(rounds):
        spin((1,), (1,), (np.int64(SPIN_S * khz * 1e3),))
        e0, e1 = xp.cuda.Event(), xp.cuda.Event()
        t0 = time.perf_counter()
        e0.record()
        for _ in range(iters):
            fn()
        e1.record()
        host = time.perf_counter() - t0
        e1.synchronize()
        if host < 0.8 * SPIN_S:
            got.append(xp.cuda.get_elapsed_time(e0, e1) / iters)
    ms = round(float(np.median(got)), 3) if got else None
    table[f"{name}, GPU alone"] = ms
    print(f"  {name:42s} {ms if ms is not None else '(host behind)':>9} ms GPU alone", flush=True)


def rnnt(args, xp, run):
    from avpipe import load_audio
    from avpipe.ops import audio_augment as aug
    from avpipe.ops.audio import log_mel
    from avpipe.recipes.rnnt import SPEC_AUGMENT, _dither_seed
    from benchmarks.workloads import audio as bench_audio

    files, _ = bench_audio.ensure_data(args.data, count=64)
    rows = [xp.asarray(load_audio(f, sample_rate=SR).samples) for f in files[:64]]
    lens = np.array([r.shape[0] for r in rows], np.int64)
    ids = np.arange(len(rows), dtype=np.int64)
    n = int(lens.max())

    def pad():
        x = xp.zeros((len(rows), n), xp.float32)
        for r, v in enumerate(rows):
            x[r, : v.shape[0]] = v
        return x

    x = pad()
    speed = {"factor_range": (0.85, 1.15), "step": 0.01}
    params = aug.sample_speed_params(0, 1, ids, **speed)
    y, ylens = aug.apply_speed_perturb(x, lens, params, sample_rate=SR, quality="fast")
    feats, fl = log_mel(y, ylens, preset="nemo")
    run("rnnt: pad 64 rows into a batch", pad)
    run("rnnt: speed draws", lambda: aug.sample_speed_params(0, 1, ids, **speed))
    run("rnnt: speed perturbation (resample)", lambda: aug.apply_speed_perturb(
        x, lens, params, sample_rate=SR, quality="fast"))
    run("rnnt: dither seed", lambda: _dither_seed(0, 1, ids))
    run("rnnt: log-mel, no dither", lambda: log_mel(y, ylens, preset="nemo"))
    run("rnnt: log-mel with dither", lambda: log_mel(y, ylens, preset="nemo", training=True,
                                                     seed=123))
    fl_h = np.asarray(fl.get() if hasattr(fl, "get") else fl)  # host lengths, as the feed's
    run("rnnt: SpecAugment", lambda: aug.spec_augment(feats, fl_h, seed=0, epoch=1, ids=ids,
                                                      **SPEC_AUGMENT))
    run("rnnt: speed perturbation (resample)", lambda: aug.apply_speed_perturb(
        x, lens, params, sample_rate=SR, quality="fast"), queued=True)
    run("rnnt: log-mel with dither", lambda: log_mel(y, ylens, preset="nemo", training=True,
                                                     seed=123), queued=True)
    run("rnnt: SpecAugment", lambda: aug.spec_augment(feats, fl_h, seed=0, epoch=1, ids=ids,
                                                      **SPEC_AUGMENT), queued=True)
    # the GPU's own time of each step, and of the whole collate with and without augmentation
    run("rnnt: speed perturbation (resample)", lambda: aug.apply_speed_perturb(
        x, lens, params, sample_rate=SR, quality="fast"), alone=True)
    run("rnnt: log-mel with dither", lambda: log_mel(y, ylens, preset="nemo", training=True,
                                                     seed=123), alone=True)
    run("rnnt: SpecAugment", lambda: aug.spec_augment(feats, fl_h, seed=0, epoch=1, ids=ids,
                                                      **SPEC_AUGMENT), alone=True)
    for aug_on in (True, False):
        run(f"rnnt: collate, {'with' if aug_on else 'without'} augmentation",
            _collate_step(xp, x, lens, aug_on), alone=True)


def _collate_step(xp, x, lens, aug_on):
    """One ``RnntTask.collate`` of the padded batch ``x`` (its rows as the GPU loader hands
    them, or host rows on the CPU) a call, new ids each call, with or without the training
    augmentation."""
    import types

    from avpipe.device import resolve_device
    from avpipe.recipes import rnnt as R

    B = x.shape[0]
    task = R.RnntTask(preset="nemo", training=True, sample_rate=SR, seed=0,
                      device=resolve_device("cpu" if xp is np else "cuda"),
                      speed_perturb=(0.85, 1.15) if aug_on else None,
                      spec_augment=R.SPEC_AUGMENT if aug_on else None, batch_size=B)  # fmt: skip
    items = [types.SimpleNamespace(text="x", path=f"item{r}", duration=lens[r] / SR, offset=0)
             for r in range(B)]  # fmt: skip
    step = [0]

    def collate():
        step[0] += 1
        ids = (np.arange(B) + step[0] * B).tolist()
        rows = ([x[r, : int(lens[r])] for r in range(B)] if xp is np else
                [R.LoaderRow(x, r, int(lens[r])) for r in range(B)])  # fmt: skip
        return task.collate(rows, list(zip(ids, items)), 1, step[0])

    return collate


def video(args, xp, run, device):
    from avpipe.ops import image_augment as aug
    from avpipe.ops import random as R
    from avpipe.ops.image import crop, resize_crop_normalize
    from avpipe.recipes.video import VideoTask

    rng = np.random.default_rng(0)
    frames = xp.asarray(rng.integers(0, 256, (16, 360, 640, 3), dtype=np.uint8))
    task = VideoTask(labels=[0], clip_length=16, stride=4, crop_size=224, train=True, seed=0,
                     device=device)  # fmt: skip

    def draws():
        R.integers(0, "clip", 1, [7], high=200)
        aug.sample_resized_crop_params(0, 1, [7], 360, 640)
        aug.sample_flip_params(0, 1, [7])

    p = aug.sample_resized_crop_params(0, 1, [7], 360, 640)
    box = [int(p[k][0]) for k in ("top", "left", "height", "width")]

    def fused():
        return resize_crop_normalize(crop(frames, *box), size=(224, 224), short_side=None,
                                     crop_size=None, dtype="float16", layout="NCHW")

    run("video: draws (start, crop box, flip)", draws)
    run("video: crop + fused resize + normalize", fused)
    run("video: whole train transform", lambda: task._train_transform(frames, 7, 1))
    run("video: whole train transform", lambda: task._train_transform(frames, 7, 1), queued=True)


def chain(args, xp, run):
    """``benchmarks/workloads/augment.py``'s clip chain (8 clips of 16 x 360 x 640): its draws (and the crop
    tables' copy), the application, and each kernel stage alone."""
    from avpipe.ops import _image_augment_kernels as ak
    from avpipe.ops import image_augment as aug
    from benchmarks.workloads import augment as bench_augment

    x = xp.asarray(bench_augment.video_batch(8, 16))
    ch = aug.video_train_chain(224, brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1)
    ops = ch.ops
    params = aug._sample_run(x, ops, seed=0, epoch=1)
    run("chain: draws + tables (8 clips)", lambda: aug._sample_run(x, ops, seed=0, epoch=1))
    run("chain: apply (8 clips)", lambda: aug._clip_ops(x, ops, params))
    run("chain: whole (8 clips)", lambda: ch(x, seed=0, epoch=1))
    run("chain: whole (8 clips)", lambda: ch(x, seed=0, epoch=1), queued=True)
    if xp is np:
        return
    tables, meta = params[0].stashed(aug._crop_tag(224, 224, "bilinear", True))
    y = ak.crop_launch(x, tables, meta, 224, 224, mode=ak.MODE_F32)
    run("chain: resized crop kernels", lambda: ak.crop_launch(x, tables, meta, 224, 224,
                                                              mode=ak.MODE_F32), queued=True)
    a = np.full(3, 1 / 58.0, np.float32)
    b = np.full(3, -2.0, np.float32)
    run("chain: pixels (flip, normalize)", lambda: ak.pixels(
        y, flip=params[1]["flip"], affine=(a, b), nchw=True), queued=True)
    run("chain: pixels (flip, jitter, normalize)", lambda: ak.pixels(
        y, flip=params[1]["flip"], jitter=params[2], affine=(a, b), nchw=True), queued=True)


def image_rebuild(args, run):
    """What a bad image costs on the GPU. A DALI pipeline is invalid after an error, so a bad
    image cost a "mixed" pipeline build; decode_image_batch now calls nvImageCodec's decoder,
    which survives one. Times both builds (once each: a build is seconds) and
    decode_image_batch of [good, good, good] against [good, bad, good]."""
    import glob

    from avpipe.decoding.image import _dali, _nvimgcodec, decode_image_batch

    root = os.path.join(ROOT, "samples", "images")
    good = sorted(glob.glob(os.path.join(root, "**", "*.jp*g"), recursive=True))[0]
    data = open(good, "rb").read()
    bad = data[:200] + bytes(b ^ 0x5A for b in data[200:600]) + data[600:]
    for name, build in (("DALI mixed pipeline", lambda: _dali.DaliDecoder(0, 1, False)),
                        ("nvImageCodec decoder", lambda: _nvimgcodec.Decoder(0, True, 1.0))):
        t0 = time.perf_counter()
        build()
        print(f"  image: {name} build {1e3 * (time.perf_counter() - t0):12.3f} ms", flush=True)
    run("image: decode [good, good, good]", lambda: decode_image_batch([data] * 3, device="cuda"))
    run("image: decode [good, bad, good]", lambda: decode_image_batch([data, bad, data],
                                                                     device="cuda"))


def feeds(args):
    import cProfile
    import io
    import pstats
    from types import SimpleNamespace

    import avpipe
    from benchmarks.workloads import feeds as bench_feeds

    dev = "cpu" if args.cpu else "cuda"
    ns = SimpleNamespace(data=args.data, out=args.out, cpu=args.cpu, threads=16)
    os.makedirs(args.out, exist_ok=True)
    man = bench_feeds.audio_data(ns)[0] if "rnnt" in args.parts else None
    csv = bench_feeds.video_data(ns)[0] if "video" in args.parts else None
    made = {
        "rnnt": lambda: avpipe.recipes.rnnt_feed(man, batch_size=bench_feeds.BATCH, seed=0,
                                                 training=True, device=dev, prefetch=0,
                                                 threads=16),
        "video": lambda: avpipe.recipes.video_classification(
            csv, clip_length=bench_feeds.CLIP, stride=bench_feeds.STRIDE,
            crop_size=bench_feeds.CROP, batch_size=bench_feeds.VBATCH, seed=0, device=dev,
            threads=16, prefetch=0),
    }
    sync = (lambda: None) if args.cpu else __import__("cupy").cuda.runtime.deviceSynchronize
    out = {}
    for name, make in made.items():
        if name not in args.parts:
            continue
        feed = make()
        it = bench_feeds.epochs(feed)
        for _ in range(3):  # warm-up: kernels compiled, loaders started
            next(it)
        sync()
        prof = cProfile.Profile()
        ts = []
        for _ in range(args.batches):
            t0 = time.perf_counter()
            prof.enable()
            next(it)
            sync()
            prof.disable()
            ts.append(time.perf_counter() - t0)
        st = feed.stats()
        feed.close()
        buf = io.StringIO()
        ps = pstats.Stats(prof, stream=buf)
        ps.sort_stats("tottime").print_stats(25)
        ps.sort_stats("cumulative").print_stats(25)
        path = os.path.join(args.out, f"profile_feeds_{name}.txt")
        with open(path, "w") as f:
            f.write(f"{name}: {args.batches} batches, median {np.median(ts) * 1e3:.1f} ms "
                    f"serial per batch\nstats: {json.dumps(st, default=str)}\n")
            f.write(buf.getvalue())
        out[name] = round(float(np.median(ts)) * 1e3, 2)
        print(f"  {name}: median {out[name]} ms serial per batch -> {path}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--out", default=".")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--feeds", action="store_true")
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--parts", default="rnnt,video,image",
                    help="comma-separated: rnnt, video, chain, image (the image part builds "
                         "DALI pipelines for about 3 minutes)")
    args = ap.parse_args()
    args.parts = set(args.parts.split(","))
    if args.feeds:
        feeds(args)
        return 0
    from avpipe.device import resolve_device

    device = resolve_device("cpu" if args.cpu else "cuda")
    xp = device.xp
    run, table = timer(xp, args.iters)
    with device.activate():
        if "rnnt" in args.parts:
            rnnt(args, xp, run)
        if "video" in args.parts:
            video(args, xp, run, device)
        if "chain" in args.parts:
            chain(args, xp, run)
        if not args.cpu and "image" in args.parts:
            image_rebuild(args, run)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "profile_stages.json")
    with open(path, "w") as f:
        json.dump({"device": str(device), "iters": args.iters, "median_ms": table}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
