"""Log-mel workload: 512 FLAC files (16 kHz mono, 2-16 s), batch 64, 80 mel, padded, on the GPU.

Contenders, all on the same files in one run (each in its own child process, so a crash or
a hang in one library cannot take the others down, and each starts with a clean GPU):

* ``avpipe_logmel``: avpipe's batch loader with its default decoder for FLAC on a GPU: threads
  read the files' bytes into page-locked staging, the GPU decodes the FLAC frames (bit-exact to
  libFLAC) + ``avpipe.ops.log_mel(preset="nemo")`` on cupy.
* ``avpipe_logmel_cpu_decode``: the same loader with ``decoder="cpu"`` (worker processes decode
  int16 straight into a shared ring; 2-D copy of the used block to the GPU; float conversion
  there), decode of the next batches overlapping.
* ``dali_logmel``: DALI's audio pipeline, built here: readers.file -> decoders.audio ->
  preemphasis_filter -> spectrogram(512/400/160) -> mel_filter_bank(80) -> to_decibels (ln)
  -> normalize (per feature) -> pad.
* ``torch_logmel``: soundfile in 16 threads + torchaudio MelSpectrogram on the GPU (torch.stft
  with avpipe's filterbank when torchaudio is missing) + ln + per-feature normalization.
* decode studies (why Python-thread soundfile is slow): ``decode_threads_f32`` (fresh float32
  arrays per read, like the anchor), ``decode_threads_i16_prealloc`` (int16 into preallocated
  buffers), ``decode_procs_i16_shared`` (avpipe's CPU decoder, decode only),
  ``decode_gpu_flac`` (avpipe's GPU decoder: read + decode only); and
  ``avpipe_logmel_gpu_only`` (log_mel on batches already on the GPU: the GPU part's ceiling).

The decode studies and ``avpipe_logmel_gpu_only`` run only when named (``--contenders``).
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

SR = 16000
BATCH = 64




# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------








def durations(files):
    import soundfile as sf

    return [sf.info(f).frames / SR for f in files]


def run_timed(step, budget, min_iters=3, warmup=1, sync=lambda: None):
    """Run ``step()`` (returns audio seconds) warmup times, then until budget / min_iters."""
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    total, iters = 0.0, 0
    while iters < min_iters or time.perf_counter() - t0 < budget:
        total += step()
        iters += 1
        if iters >= 1000:
            break
    sync()
    secs = time.perf_counter() - t0
    return total, secs, iters


def cuda_sync():
    import cupy

    cupy.cuda.runtime.deviceSynchronize()


# ---------------------------------------------------------------------------------------------
# contenders
# ---------------------------------------------------------------------------------------------


def bench_avpipe_logmel(files, durs, args, decoder="auto"):
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    # the loader forks its workers (decoder "cpu") before this process touches CUDA
    loader = AudioBatchLoader(files, batch_size=BATCH, num_workers=args.workers, prefetch=args.prefetch,
                              device="cuda", transport="int16", decoder=decoder)
    import cupy

    from avpipe.ops import log_mel

    shapes = set()
    n_batches = math.ceil(len(files) / BATCH)
    stream = loader.batches(epochs=10 ** 6)

    def epoch():
        secs = 0.0
        for _ in range(n_batches):
            x, lens, _, errors = next(stream)
            if errors:
                raise RuntimeError(f"decode errors: {[str(e) for _, e in errors[:3]]}")
            feats, fl = log_mel(x, lens, preset="nemo")
            shapes.add(tuple(feats.shape[:2]))
            secs += float(lens.sum()) / SR
        return secs

    try:
        audio_s, secs, epochs = run_timed(epoch, args.budget, warmup=1, sync=cuda_sync)
    finally:
        stream.close()
        loader.close()
    return audio_s / secs, {"epochs": epochs, "audio_seconds": round(audio_s, 1), "seconds": round(secs, 3),
                            "decoder": loader.decoder, "workers": loader.num_workers,
                            "prefetch": loader.prefetch,
                            "pinned": bool(loader._registered), "out_BxF": sorted(shapes)[:1],
                            "cupy": cupy.__version__}


def bench_avpipe_logmel_cpu_decode(files, durs, args):
    return bench_avpipe_logmel(files, durs, args, decoder="cpu")


def _decode_only(loader, files, args, sync=lambda: None):
    """Audio-seconds/s of the loader's batches alone (nothing done with them); (rate, passes)."""
    n_batches = math.ceil(len(files) / BATCH)
    stream = loader.batches(epochs=10 ** 6)

    def epoch():
        return sum(float(next(stream)[1].sum()) / SR for _ in range(n_batches))

    try:
        audio_s, secs, n = run_timed(epoch, min(args.budget, 8), sync=sync)
    finally:
        stream.close()
        loader.close()
    return audio_s / secs, n


def bench_decode_gpu_flac(files, durs, args):
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    loader = AudioBatchLoader(files, batch_size=BATCH, prefetch=args.prefetch, device="cuda",
                              decoder="gpu")
    rate, n = _decode_only(loader, files, args, sync=cuda_sync)
    return rate, {"passes": n, "what": "read bytes in threads, FLAC frames decoded on the GPU"}


def bench_avpipe_logmel_gpu_only(files, durs, args):
    import cupy
    import soundfile as sf

    from avpipe.ops import log_mel

    batches = []
    for i in range(0, len(files), BATCH):
        arrs = [sf.read(f, dtype="float32")[0] for f in files[i:i + BATCH]]
        lens = np.array([len(a) for a in arrs])
        x = np.zeros((len(arrs), lens.max()), np.float32)
        for j, a in enumerate(arrs):
            x[j, :len(a)] = a
        batches.append((cupy.asarray(x), lens))

    def epoch():
        s = 0.0
        for x, lens in batches:
            log_mel(x, lens, preset="nemo")
            s += float(lens.sum()) / SR
        return s

    audio_s, secs, epochs = run_timed(epoch, min(args.budget, 8), warmup=1, sync=cuda_sync)
    return audio_s / secs, {"epochs": epochs, "audio_seconds": round(audio_s, 1), "seconds": round(secs, 3)}


def bench_dali_logmel(files, durs, args):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=BATCH, num_threads=args.threads, device_id=0, seed=1)
    def pipe_fn():
        enc, _ = fn.readers.file(files=files, random_shuffle=False, name="Reader")
        audio, _ = fn.decoders.audio(enc, downmix=True, sample_rate=SR, dtype=types.FLOAT)
        x = fn.preemphasis_filter(audio.gpu(), preemph_coeff=0.97)
        x = fn.spectrogram(x, nfft=512, window_length=400, window_step=160, power=2)
        x = fn.mel_filter_bank(x, sample_rate=SR, nfilter=80)
        x = fn.to_decibels(x, multiplier=math.log(10), reference=1.0, cutoff_db=math.log(2.0 ** -24))
        x = fn.normalize(x, axes=[1])
        return fn.pad(x, axes=(1,))

    pipe = pipe_fn()
    pipe.build()
    n_batches = math.ceil(pipe.epoch_size("Reader") / BATCH)
    counter = iter(range(10 ** 12))
    shapes = set()
    last = []

    def epoch():
        s = 0.0
        for _ in range(n_batches):
            (out,) = pipe.run()
            last[:] = [out]
            s += sum(durs[next(counter) % len(files)] for _ in range(BATCH))
        return s

    def sync():
        if last:
            t = last[0].as_cpu()
            try:
                shapes.add(tuple(t.as_array().shape))
            except Exception:
                shapes.add(tuple(np.asarray(t.at(0)).shape))

    audio_s, secs, epochs = run_timed(epoch, args.budget, warmup=1, sync=sync)
    import nvidia.dali as dali

    return audio_s / secs, {"epochs": epochs, "audio_seconds": round(audio_s, 1), "seconds": round(secs, 3),
                            "threads": args.threads, "dali": dali.__version__, "out_shape": sorted(shapes)[:1]}


def bench_torch_logmel(files, durs, args):
    from concurrent.futures import ThreadPoolExecutor

    import soundfile as sf
    import torch

    dev = "cuda"
    try:
        import torchaudio

        mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=512, win_length=400, hop_length=160, n_mels=80,
                                                   power=2.0, norm="slaney", mel_scale="slaney").to(dev)
        impl = f"torchaudio {torchaudio.__version__}"
    except Exception as e:
        from avpipe.ops import mel_filterbank

        fb = torch.from_numpy(mel_filterbank(sample_rate=SR, n_fft=512, n_mels=80)).to(dev)
        win = torch.hann_window(400, periodic=False, device=dev)

        def mel(x):
            spec = torch.stft(x, 512, 160, 400, window=win, center=True, pad_mode="constant", return_complex=True)
            return torch.matmul(fb, spec.abs() ** 2)

        impl = f"torch.stft fallback (no torchaudio: {type(e).__name__})"

    batches = [files[i:i + BATCH] for i in range(0, len(files), BATCH)]

    def read(p):
        return sf.read(p, dtype="float32")[0]

    def process(arrays):
        lens = [len(a) for a in arrays]
        host = torch.zeros(len(arrays), max(lens), pin_memory=True)
        for i, a in enumerate(arrays):
            host[i, :len(a)] = torch.from_numpy(a)
        x = host.to(dev, non_blocking=True)
        x = torch.cat([x[:, :1], x[:, 1:] - 0.97 * x[:, :-1]], dim=1)
        f = torch.log(mel(x) + 2.0 ** -24)
        nv = torch.tensor(lens, device=dev) // 160  # current NeMo: n // 160 valid frames
        m = (torch.arange(f.shape[-1], device=dev)[None] < nv[:, None])[:, None]
        c = nv.float()[:, None]
        mean = (f * m).sum(-1) / c
        var = (((f - mean[..., None]) * m) ** 2).sum(-1) / (c - 1).clamp(min=1)
        return ((f - mean[..., None]) / (var.sqrt()[..., None] + 1e-5)) * m

    with ThreadPoolExecutor(args.threads) as pool:
        futs = []
        k = [0]

        def fill():
            while len(futs) < 3:
                futs.append([pool.submit(read, p) for p in batches[k[0] % len(batches)]])
                k[0] += 1

        def epoch():
            s = 0.0
            for _ in range(len(batches)):
                fill()
                arrays = [f.result() for f in futs.pop(0)]
                process(arrays)
                s += sum(len(a) for a in arrays) / SR
            return s

        audio_s, secs, epochs = run_timed(epoch, args.budget, warmup=1, sync=torch.cuda.synchronize)
    return audio_s / secs, {"epochs": epochs, "audio_seconds": round(audio_s, 1), "seconds": round(secs, 3),
                            "threads": args.threads, "mel_impl": impl, "torch": torch.__version__}


def bench_decode_threads_f32(files, durs, args):
    from concurrent.futures import ThreadPoolExecutor

    import soundfile as sf

    def dec(p):
        x, sr = sf.read(p, dtype="float32")
        return len(x) / sr

    with ThreadPoolExecutor(args.threads) as pool:
        audio_s, secs, n = run_timed(lambda: sum(pool.map(dec, files)), min(args.budget, 8))
    return audio_s / secs, {"passes": n, "threads": args.threads, "what": "sf.read float32, fresh arrays"}


def bench_decode_threads_i16_prealloc(files, durs, args):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import soundfile as sf

    local = threading.local()
    maxn = int(max(durs) * SR) + 16

    def dec(p):
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = np.zeros(maxn, np.int16)
        with sf.SoundFile(p) as f:
            n = min(f.frames, maxn)
            f.read(frames=n, dtype="int16", out=buf[:n])
        return n / SR

    with ThreadPoolExecutor(args.threads) as pool:
        audio_s, secs, n = run_timed(lambda: sum(pool.map(dec, files)), min(args.budget, 8))
    return audio_s / secs, {"passes": n, "threads": args.threads, "what": "SoundFile.read int16 into per-thread buffers"}


def bench_decode_procs_i16_shared(files, durs, args):
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    loader = AudioBatchLoader(files, batch_size=BATCH, num_workers=args.workers, prefetch=args.prefetch,
                              decode_only=True)
    rate, n = _decode_only(loader, files, args)
    return rate, {"passes": n, "workers": loader.num_workers,
                  "what": "worker processes, SoundFile.read int16 into a shared ring"}


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------









# --- harness ----------------------------------------------------------------------------------

NAME = "audio"
SUITE = "gpu"
UNIT = "audio-s/s"
TITLE = "512 FLAC (16 kHz, 2-16 s) -> NeMo log-mel, batch 64, 80 mel, padded, on the GPU"
CONTENDERS = {
    "avpipe_logmel": "AudioBatchLoader (FLAC decoded on the GPU) + ops.log_mel(preset=nemo)",
    "dali_logmel": "DALI readers.file -> decoders.audio -> preemphasis -> spectrogram -> mel(80) "
                   "-> to_decibels -> normalize -> pad; 16 threads",
    "avpipe_logmel_cpu_decode": "the same loader with decoder=cpu (worker processes)",
    "torch_logmel": "soundfile in 16 threads + torchaudio MelSpectrogram on the GPU + ln + "
                    "per-feature normalization",
    "decode_gpu_flac": "study: avpipe's GPU FLAC decoder, read + decode only",
    "decode_threads_f32": "study: soundfile float32 in 16 threads",
    "decode_threads_i16_prealloc": "study: soundfile int16 into preallocated buffers",
    "decode_procs_i16_shared": "study: avpipe's CPU decoder, decode only",
    "avpipe_logmel_gpu_only": "study: log_mel on batches already on the GPU",
}
OPTIONAL = ("decode_gpu_flac", "decode_threads_f32", "decode_threads_i16_prealloc",
            "decode_procs_i16_shared", "avpipe_logmel_gpu_only")
RATIOS = [("avpipe_logmel", "dali_logmel"), ("avpipe_logmel", "torch_logmel"),
          ("avpipe_logmel_cpu_decode", "dali_logmel")]
PARAMS = {"budget": 15.0, "files": 512, "threads": 16, "workers": os.cpu_count(), "prefetch": 4}
QUICK = {"budget": 3.0, "files": 32}
REQUIRES = ("gpu", "cupy")


def ensure_data(data_dir, count=512, quick=False):
    """The first ``count`` FLAC files of the shared data (:func:`benchmarks.data.anchor_data`)."""
    from benchmarks import data

    return data.anchor_data(data_dir, quick)["audio"][:count], "benchmarks.data"


def prepare(ctx):
    files, _ = ensure_data(ctx.data_dir, ctx.params["files"], ctx.quick)
    return {"files": files}


def measure(ctx, name):
    from types import SimpleNamespace

    files = ctx.data["files"]
    args = SimpleNamespace(data=ctx.data_dir, **ctx.params)
    return globals()[f"bench_{name}"](files, durations(files), args)
