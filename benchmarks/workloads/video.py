"""The clip workload: per file a random clip of 16 frames, stride 4,
RGB -> short side 224 (bilinear) -> center crop 224 -> ImageNet-normalized fp16 [16, 3, 224, 224],
16 threads over the H.264 640x360 files of --data. Measured, in one run:

* avpipe_clip_cps — avpipe.pipeline.clips.ClipFeed: VideoDecoder (NVDEC packet path: only the
  packets a clip needs, read from the MP4 by position; NV12 + our RGB kernel; a session per
  thread) + samplers.sample_random_clips + ops.image.resize_crop_normalize. avpipe_simple_clip_cps: the same through PyNvVideoCodec's
  SimpleDecoder (AVPIPE_NVDEC_PACKETS=0); avpipe_packets_chunk1_clip_cps / _chunk16_: one / 16
  packets per Decode (the default here is 64).
  Cold contenders: avpipe_pagecold_clip_cps runs on 512+ distinct copies of the files, each
  pass starting with every copy dropped from the page cache (fsync + posix_fadvise DONTNEED,
  :mod:`benchmarks.cache`): every open misses the 256-entry scan cache and every read goes to
  the disk; avpipe_nocache_clip_cps switches the scan cache off. avpipe_clip_cps and
  pynvc_clip_cps also report NVDEC's utilisation (nvidia-smi, median over the run);
  avpipe_clip_nosmi_cps is avpipe_clip_cps without that sampling.
  Timing: 16 workers take clips from one sequence of shuffled passes over the files, each as
  soon as its last clip is done (run_passes' "stream"). avpipe_clip_passes_cps and
  pynvc_clip_passes_cps time pass by pass instead: with 32 files every thread waits for each
  pass's slowest clip every two clips.
  avpipe_feed_iter_cps iterates ClipFeed itself (batches of 8) over the files listed 16 times.
* pynvc_clip_cps  — plain PyNvVideoCodec SimpleDecoder (RGB output, get_batch_frames_by_index)
  + the same transform.
* dali_video_reader_cps — DALI fn.readers.video (GPU) + resize + crop_mirror_normalize, one
  pipeline (one NVDEC session). dali_video_pN_cps: N such pipelines (each over its shard of the
  files, its own NVDEC session) run side by side from N threads; "dali_video_tuned" is the best
  of 1, 2, 4 and 8 (as many as saturate the GPU).

Each measurement runs in a fresh process (:mod:`benchmarks.harness`).
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

CLIP_LEN, STRIDE, CROP, THREADS = 16, 4, 224, 16
SPAN = (CLIP_LEN - 1) * STRIDE + 1
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)




# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------



# ---------------------------------------------------------------------------------------------
# the transform: one fused cupy kernel (uint8 HWC frames -> fp16 CHW normalized crops)
# ---------------------------------------------------------------------------------------------

_TRANSFORM = r"""
#include <cuda_fp16.h>
extern "C" __global__ void clip_transform(const unsigned char* __restrict__ src, int T, int H, int W,
    int nh, int nw, int top, int left, int size, __half* __restrict__ dst,
    float m0, float m1, float m2, float s0, float s1, float s2)
{
    long long n = (long long)T * 3 * size * size;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int x = i % size; long long r = i / size;
    int y = r % size; r /= size;
    int c = r % 3; int t = r / 3;
    // bilinear, align_corners=False, no antialias (as torch F.interpolate)
    float sy = ((y + top) + 0.5f) * ((float)H / nh) - 0.5f;
    float sx = ((x + left) + 0.5f) * ((float)W / nw) - 0.5f;
    sy = fmaxf(sy, 0.f); sx = fmaxf(sx, 0.f);
    int y0 = min((int)sy, H - 1), x0 = min((int)sx, W - 1);
    int y1 = min(y0 + 1, H - 1), x1 = min(x0 + 1, W - 1);
    float wy = sy - y0, wx = sx - x0;
    const unsigned char* f = src + (long long)t * H * W * 3;
    float v00 = f[((long long)y0 * W + x0) * 3 + c], v01 = f[((long long)y0 * W + x1) * 3 + c];
    float v10 = f[((long long)y1 * W + x0) * 3 + c], v11 = f[((long long)y1 * W + x1) * 3 + c];
    float v = (v00 * (1 - wx) + v01 * wx) * (1 - wy) + (v10 * (1 - wx) + v11 * wx) * wy;
    float m = c == 0 ? m0 : (c == 1 ? m1 : m2);
    float s = c == 0 ? s0 : (c == 1 ? s1 : s2);
    dst[i] = __float2half((v - m) / s);
}
"""
_kern = {}


def cupy_transform(x):
    """[T, H, W, 3] uint8 cupy -> [T, 3, 224, 224] float16 cupy."""
    import cupy

    k = _kern.get("k")
    if k is None:
        k = _kern["k"] = cupy.RawKernel(_TRANSFORM, "clip_transform")
    x = cupy.ascontiguousarray(x)
    T, H, W, _ = x.shape
    nh, nw = (CROP, round(W * CROP / H)) if H <= W else (round(H * CROP / W), CROP)
    top, left = (nh - CROP) // 2, (nw - CROP) // 2
    out = cupy.empty((T, 3, CROP, CROP), cupy.float16)
    n = out.size
    f32 = np.float32
    k(((n + 255) // 256,), (256,), (x, np.int32(T), np.int32(H), np.int32(W), np.int32(nh), np.int32(nw),
                                    np.int32(top), np.int32(left), np.int32(CROP), out,
                                    *(f32(m * 255) for m in MEAN), *(f32(s * 255) for s in STD)))
    return out


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

def run_passes(clip_fn, files, budget, max_passes=40):
    """Warm-up pass, then ``THREADS`` workers until ``budget`` seconds (:data:`HARNESS`):

    * ``"stream"`` (default): each worker takes the next ``(file, seed)`` of one sequence of
      passes over ``files`` (each pass in a new seeded order) as soon as its last clip is done;
      the clips finished by the end count. What a feed that keeps its threads busy sees.
    * ``"passes"``: ``pool.map`` over one pass at a time, as a plain loader times its
      PyNvVideoCodec clips. Over 32 files a pass is two clips a thread, and every thread waits
      for the pass's slowest clip before the next pass starts (the barrier costs the rate
      more the fewer files a pass has)."""
    import cupy

    errors = []

    def safe(args):
        try:
            return clip_fn(*args)
        except Exception as e:  # noqa: BLE001 — count and keep going
            if len(errors) < 5:
                errors.append(f"{args[0]}: {type(e).__name__}: {e}")
            return 0

    def pass_items(p):
        order = random.Random(p).sample(files, len(files))
        return [(f, p * 100003 + i) for i, f in enumerate(order)]

    with ThreadPoolExecutor(THREADS) as pool:
        sum(pool.map(safe, pass_items(10 ** 6)))  # warm-up
        cupy.cuda.runtime.deviceSynchronize()
        if HARNESS["mode"] == "passes":
            clips, passes, t0 = 0, 0, time.perf_counter()
            while passes < max_passes:
                clips += sum(pool.map(safe, pass_items(passes)))
                passes += 1
                if time.perf_counter() - t0 >= budget:
                    break
        else:
            lock = threading.Lock()
            state = {"items": iter(()), "pass": 0, "clips": 0, "taken": 0}

            def take():
                with lock:
                    item = next(state["items"], None)
                    if item is None:
                        if HARNESS.get("evict"):  # each pass starts with the files cold
                            from benchmarks.cache import evict

                            evict(files)
                        state["items"] = iter(pass_items(state["pass"]))
                        state["pass"] += 1
                        item = next(state["items"])
                    state["taken"] += 1
                    return item

            def worker(deadline):
                while time.perf_counter() < deadline:
                    n = safe(take())
                    with lock:
                        state["clips"] += n

            t0 = time.perf_counter()
            for f in [pool.submit(worker, t0 + budget) for _ in range(THREADS)]:
                f.result()
            clips, passes = state["clips"], state["taken"] / max(1, len(files))
        cupy.cuda.runtime.deviceSynchronize()
        secs = time.perf_counter() - t0
    return clips / secs, {"clips": clips, "seconds": round(secs, 3), "passes": passes,
                          "harness": HARNESS["mode"], "errors": errors}


HARNESS = {"mode": "stream", "evict": False}


def _passes(bench):
    """``bench`` timed pass by pass (:func:`run_passes`' ``"passes"``)."""

    def run(files, budget):
        old = HARNESS["mode"]
        HARNESS["mode"] = "passes"
        try:
            return bench(files, budget)
        finally:
            HARNESS["mode"] = old

    return run


def bench_avpipe(files, budget):
    """avpipe's public clip feed (:class:`avpipe.pipeline.clips.ClipFeed`), one clip per call of
    its ``clip`` from this benchmark's threads (the same passes as the other contenders)."""
    import cupy

    from avpipe.pipeline.clips import ClipFeed

    feed = ClipFeed(files, clip_length=CLIP_LEN, stride=STRIDE, crop_size=CROP, threads=THREADS,
                    device="cuda")
    # the feed's transform must agree with the reference kernel the other contenders use
    x = cupy.asarray(np.random.default_rng(0).integers(0, 256, (2, 360, 640, 3), dtype=np.uint8))
    a, b = feed.transform(x), cupy_transform(x)
    diff = float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max())
    stats = {"nvdec": 0, "fallback": 0, "mismatch": 0}
    lock = threading.Lock()

    def clip(path, seed):
        c = feed.clip(path, seed)
        with lock:
            stats["nvdec" if c.backend == "nvdec" else "fallback"] += 1
            stats["mismatch"] += c.pts_mismatches
        assert c.data.shape == (CLIP_LEN, 3, CROP, CROP) and c.data.dtype == np.float16
        return 1

    cps, extra = run_passes(clip, files, budget)
    extra.update(transform="avpipe.pipeline.clips.ClipFeed (ops.image.resize_crop_normalize)",
                 transform_max_diff_vs_reference=diff, backends=stats)
    return cps, extra


def bench_avpipe_feed(files, budget):
    """``ClipFeed`` iterated (batches of 8, 16 threads) over ``files`` listed 16 times, epoch
    after epoch, until ``budget`` seconds after a warm-up epoch."""
    import cupy

    from avpipe.pipeline.clips import ClipFeed

    feed = ClipFeed(files * 16, clip_length=CLIP_LEN, stride=STRIDE, crop_size=CROP,
                    threads=THREADS, batch_size=8, device="cuda")
    errors = 0
    for b in feed:
        errors += len(b.errors)
    cupy.cuda.runtime.deviceSynchronize()
    clips, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget:
        for b in feed:
            clips += len(b.paths)
            errors += len(b.errors)
            assert b.clips is None or b.clips.shape[1:] == (CLIP_LEN, 3, CROP, CROP)
    cupy.cuda.runtime.deviceSynchronize()
    secs = time.perf_counter() - t0
    feed.close()
    return clips / secs, {"clips": clips, "seconds": round(secs, 3), "epochs": feed.epoch - 1,
                          "errors": errors, "batch": 8}


def bench_pynvc(files, budget):
    import cupy
    import PyNvVideoCodec as nvc

    local = threading.local()

    def clip(path, seed):
        st = getattr(local, "st", None)
        if st is None:
            st = local.st = {"stream": cupy.cuda.Stream(non_blocking=True), "dec": None, "src": None}
        with st["stream"]:
            if st["dec"] is None:
                st["dec"] = nvc.SimpleDecoder(path, gpu_id=0, use_device_memory=True,
                                              output_color_type=nvc.OutputColorType.RGB,
                                              cuda_stream=st["stream"].ptr)
            elif st["src"] != path:
                st["dec"].reconfigure_decoder(path)
            st["src"] = path
            dec = st["dec"]
            n = len(dec)
            start = random.Random(seed).randrange(max(1, n - SPAN + 1))
            frames = dec.get_batch_frames_by_index(list(range(start, start + SPAN, STRIDE)))
            x = cupy.stack([cupy.from_dlpack(f) for f in frames])
            out = cupy_transform(x)
        st["stream"].synchronize()
        assert out.shape == (CLIP_LEN, 3, CROP, CROP)
        return 1

    return run_passes(clip, files, budget)


def bench_dali(files, budget):
    from nvidia.dali import fn, pipeline_def, types

    batch = 8

    @pipeline_def(batch_size=batch, num_threads=8, device_id=0, seed=1234)
    def pipe_fn():
        video = fn.readers.video(device="gpu", filenames=files, sequence_length=CLIP_LEN, stride=STRIDE,
                                 step=64, random_shuffle=True, initial_fill=32, name="Reader")
        if isinstance(video, (list, tuple)):
            video = video[0]
        video = fn.resize(video, resize_shorter=CROP)
        return fn.crop_mirror_normalize(video, crop=(CROP, CROP), dtype=types.FLOAT16,
                                        mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD],
                                        output_layout="FCHW")

    pipe = pipe_fn()
    pipe.build()
    for _ in range(4):
        out = pipe.run()[0]
    out.as_cpu()
    clips, iters, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < budget and iters < 2000:
        out = pipe.run()[0]
        clips += batch
        iters += 1
    out.as_cpu()
    secs = time.perf_counter() - t0
    return clips / secs, {"clips": clips, "seconds": round(secs, 3), "iters": iters, "batch": batch}


def _page_cold(bench, copies=512):
    """``bench`` on at least ``copies`` distinct copies of the files (not links: a link shares
    its inode's cached pages), every copy dropped from the page cache before the measurement
    and again at the start of each pass: every open misses the scan cache, every read goes to
    the disk."""

    def run(files, budget):
        import shutil
        import tempfile

        from benchmarks import cache

        d = tempfile.mkdtemp(prefix="cold_", dir=os.path.dirname(os.path.abspath(files[0])))
        try:
            many = cache.cold_copies(files, d, copies)
            dropped = cache.drop_all()
            resident = max(cache.resident_fraction(p) or 0.0 for p in many[:64])
            HARNESS["evict"] = True
            try:
                cps, extra = bench(many, budget)
            finally:
                HARNESS["evict"] = False
        finally:
            shutil.rmtree(d, ignore_errors=True)
        extra.update(distinct_paths=len(many), resident_fraction_before=resident,
                     drop_caches=dropped, evicted_each_pass=True)
        return cps, extra

    return run


def bench_dali_pipes(files, budget, pipes):
    """``pipes`` DALI video pipelines side by side (each over its shard of ``files``, its own
    NVDEC session, run from its own thread), clips summed. No more pipelines than files (a
    shard must hold one)."""
    from nvidia.dali import fn, pipeline_def, types

    batch = 8
    pipes = max(1, min(pipes, len(files)))

    def build(i):
        @pipeline_def(batch_size=batch, num_threads=max(2, 8 // pipes), device_id=0,
                      seed=1234 + i, prefetch_queue_depth=2)
        def pipe_fn():
            video = fn.readers.video(device="gpu", filenames=files, sequence_length=CLIP_LEN,
                                     stride=STRIDE, step=64, random_shuffle=True,
                                     initial_fill=32, shard_id=i, num_shards=pipes,
                                     name="Reader")
            if isinstance(video, (list, tuple)):
                video = video[0]
            video = fn.resize(video, resize_shorter=CROP)
            return fn.crop_mirror_normalize(video, crop=(CROP, CROP), dtype=types.FLOAT16,
                                            mean=[m * 255 for m in MEAN],
                                            std=[s * 255 for s in STD], output_layout="FCHW")

        p = pipe_fn()
        p.build()
        return p

    ps = [build(i) for i in range(pipes)]
    for p in ps:
        for _ in range(4):
            out = p.run()[0]
        out.as_cpu()
    counts = [0] * pipes

    def loop(i, deadline):
        out = None
        while time.perf_counter() < deadline:
            out = ps[i].run()[0]
            counts[i] += batch
        if out is not None:
            out.as_cpu()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(pipes) as pool:
        list(pool.map(loop, range(pipes), [t0 + budget] * pipes))
    secs = time.perf_counter() - t0
    return sum(counts) / secs, {"clips": sum(counts), "seconds": round(secs, 3),
                                "pipelines": pipes, "batch": batch,
                                "per_pipeline": counts}


def _no_scan_cache(bench):
    """``bench`` with avpipe's per-file scan cache off (every open scans the file)."""

    def run(files, budget):
        from avpipe.decoding.video import _scan

        old = _scan._CACHE_SIZE
        _scan._CACHE_SIZE = 0
        try:
            return bench(files, budget)
        finally:
            _scan._CACHE_SIZE = old

    return run


def _nvdec_utilisation(bench):
    """``bench`` with NVDEC's utilisation sampled by nvidia-smi every 200 ms (median, %)."""

    def run(files, budget):
        import subprocess

        try:
            smi = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.decoder,utilization.gpu",
                 "--format=csv,noheader,nounits", "-lms", "200"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return bench(files, budget)
        try:
            cps, extra = bench(files, budget)
        finally:
            smi.terminate()
            out = smi.communicate(timeout=10)[0]
        rows = [[float(v) for v in ln.split(",")] for ln in out.splitlines() if "," in ln]
        busy = [r for r in rows if r[0] > 0] or rows
        if busy:
            extra["nvdec_util_median_pct"] = float(np.median([r[0] for r in busy]))
            extra["gpu_util_median_pct"] = float(np.median([r[1] for r in busy]))
        return cps, extra

    return run


def _with_env(bench, **env):
    """``bench`` with environment variables set for its duration."""

    def run(files, budget):
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return bench(files, budget)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return run


BENCHES = {
    # the default: the NVDEC packet path (MP4 packets read by position, a native-latency session
    # fed 16-64 packets per Decode by frame size: 64 here)
    "avpipe_clip_cps": _nvdec_utilisation(bench_avpipe),
    # cold: 512+ distinct copies dropped from the page cache, and the scan cache switched off
    "avpipe_pagecold_clip_cps": _page_cold(bench_avpipe),
    "avpipe_nocache_clip_cps": _no_scan_cache(bench_avpipe),
    # the SimpleDecoder path (every picture from the keyframe on), as before the packet path
    "avpipe_simple_clip_cps": _with_env(bench_avpipe, AVPIPE_NVDEC_PACKETS="0"),
    # the packet path with one packet per Decode call (each picture comes out at the next call)
    "avpipe_packets_chunk1_clip_cps": _with_env(bench_avpipe, AVPIPE_NVDEC_CHUNK="1"),
    # ... and with 16 packets per call
    "avpipe_packets_chunk16_clip_cps": _with_env(bench_avpipe, AVPIPE_NVDEC_CHUNK="16"),
    "pynvc_clip_cps": _nvdec_utilisation(bench_pynvc),
    # both timed pass by pass, with a barrier every 32 clips
    "avpipe_clip_passes_cps": _passes(bench_avpipe),
    "avpipe_clip_nosmi_cps": bench_avpipe,
    "pynvc_clip_passes_cps": _passes(bench_pynvc),
    # the feed itself: ClipFeed's batches of 8 (its threads busy across batches) over the
    # files listed 16 times (warm: 32 distinct paths)
    "avpipe_feed_iter_cps": bench_avpipe_feed,
    "dali_video_reader_cps": bench_dali,
    "dali_video_p2_cps": lambda files, budget: bench_dali_pipes(files, budget, 2),
    "dali_video_p4_cps": lambda files, budget: bench_dali_pipes(files, budget, 4),
    "dali_video_p8_cps": lambda files, budget: bench_dali_pipes(files, budget, 8),
    # the plain PyNvVideoCodec contender on page-cold copies too
    "pynvc_pagecold_clip_cps": _page_cold(bench_pynvc),
}

# --- harness ----------------------------------------------------------------------------------

NAME = "video"
SUITE = "gpu"
UNIT = "clips/s"
TITLE = ("16-frame clips, stride 4, random start, short side 224 + centre crop 224, "
         "ImageNet-normalized fp16, 16 threads, 32 H.264 640x360 files")
CONTENDERS = {
    "avpipe_clip_cps": "ClipFeed.clip from 16 threads (NVDEC packet path); NVDEC utilisation "
                       "sampled",
    "pynvc_clip_cps": "plain PyNvVideoCodec SimpleDecoder (RGB), same transform, 16 threads",
    "dali_video_reader_cps": "DALI fn.readers.video, 1 pipeline (1 NVDEC session), batch 8, "
                             "8 threads",
    "dali_video_p2_cps": "DALI fn.readers.video, 2 pipelines side by side",
    "dali_video_p4_cps": "DALI fn.readers.video, 4 pipelines side by side",
    "dali_video_p8_cps": "DALI fn.readers.video, 8 pipelines side by side",
    "avpipe_pagecold_clip_cps": "avpipe on 512+ copies dropped from the page cache before each "
                                "pass (every read from the disk, every open a scan-cache miss)",
    "pynvc_pagecold_clip_cps": "plain PyNvVideoCodec on the same page-cold copies",
    "avpipe_nocache_clip_cps": "avpipe with the scan cache off",
    "avpipe_simple_clip_cps": "avpipe through the SimpleDecoder (AVPIPE_NVDEC_PACKETS=0)",
    "avpipe_packets_chunk1_clip_cps": "avpipe, one packet per Decode call",
    "avpipe_packets_chunk16_clip_cps": "avpipe, 16 packets per Decode call",
    "avpipe_clip_passes_cps": "avpipe timed pass by pass (a barrier every pass)",
    "pynvc_clip_passes_cps": "plain PyNvVideoCodec timed pass by pass",
    "avpipe_clip_nosmi_cps": "avpipe_clip_cps without the nvidia-smi sampling",
    "avpipe_feed_iter_cps": "ClipFeed iterated, batches of 8, files listed 16 times",
}
OPTIONAL = ("avpipe_nocache_clip_cps", "avpipe_simple_clip_cps", "avpipe_packets_chunk1_clip_cps",
            "avpipe_packets_chunk16_clip_cps", "avpipe_clip_passes_cps", "pynvc_clip_passes_cps",
            "avpipe_clip_nosmi_cps")
BEST_OF = {"dali_video_tuned": ["dali_video_reader_cps", "dali_video_p2_cps",
                                "dali_video_p4_cps", "dali_video_p8_cps"]}
RATIOS = [("avpipe_clip_cps", "dali_video_tuned"), ("avpipe_clip_cps", "pynvc_clip_cps"),
          ("avpipe_clip_cps", "dali_video_reader_cps"),
          ("avpipe_pagecold_clip_cps", "pynvc_pagecold_clip_cps"),
          ("avpipe_pagecold_clip_cps", "avpipe_clip_cps")]
PARAMS = {"budget": 8.0, "max_files": 0}
QUICK = {"budget": 3.0}
REQUIRES = ("gpu", "cupy", "PyNvVideoCodec")


def prepare(ctx):
    from benchmarks import data

    return {"h264": data.anchor_data(ctx.data_dir, ctx.quick)["h264"]}


def measure(ctx, name):
    files = ctx.data["h264"]
    if ctx.params.get("max_files"):
        files = files[: ctx.params["max_files"]]
    value, extra = BENCHES[name](files, ctx.params["budget"])
    return value, extra




