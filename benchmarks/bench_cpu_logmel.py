"""CPU log-mel with FLAC decode: 256 utterances (16 kHz mono FLAC, 2-16 s), batch 64, NeMo
features (80 mel), on the CPU only.

    python3 benchmarks/bench_cpu_logmel.py [--data DIR] [--rounds 5] [--threads 2]
        [--out benchmarks/results/cpu_logmel.json]

Contenders (each one pass over the 256 files per round; the rounds interleave the
contenders, in an order rotated every round, so that load from elsewhere on the machine falls
on all of them alike):

* ``avpipe_batched``: ``AudioBatchLoader(device="cpu", decoder="cpu")`` (``--threads`` worker
  processes) + ``avpipe.ops.log_mel(preset="nemo")`` on each padded batch of 64.
* ``nemo_torch``: NeMo's ``FilterbankFeatures`` as written in NeMo (features.py,
  ``FilterbankFeatures.forward`` and ``normalize_batch``, NVIDIA-NeMo/NeMo 009d1c15; the
  settings of avpipe's "nemo" preset): soundfile reads in ``--threads`` threads, a padded
  batch of 64, preemphasis 0.97 masked to the length, ``torch.stft`` (n_fft 512, win 400, hop
  160, symmetric Hann, centred, zero padding), ``|X|`` then ``** 2``, librosa's 80 Slaney mel
  filters (0-8 kHz), ``ln(x + 2^-24)``, per-feature normalization over ``n // 160`` frames
  (n-1 std, + 1e-5), masked to 0 past them; ``torch.set_num_threads(--threads)``.
* ``librosa_per_file``: soundfile + ``librosa.feature.melspectrogram`` per file (the same
  window, padding and filters), ln, the same normalization, in ``--threads`` threads.
* ``avpipe_per_file``: ``avpipe.load_audio`` + ``ops.log_mel`` per file, ``--threads``
  threads.

Before timing, every contender's features of all files are compared with avpipe's
(``--tolerance``, absolute, over each file's valid frames). The result: each contender's
audio-seconds per second in every round and their median; ``ratio_*``: avpipe_batched's
median over the other's median (a ratio of medians, not a median of ratios). Written as JSON
with the commit, date, library versions and CPU model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
from _timing import median_run  # noqa: E402

SR = 16000
BATCH = 64
COUNT = 256
CONTENDERS = ["avpipe_batched", "nemo_torch", "librosa_per_file", "avpipe_per_file"]


def log(*a):
    print(*a, flush=True)


def ensure_data(data_dir):
    """COUNT speech-like FLAC files, 2-16 s (bench_audio's generator: deterministic, made
    once and kept in ``data_dir``)."""
    from bench_audio import _gen_one

    d = os.path.join(data_dir, "audio_flac_16k")
    os.makedirs(d, exist_ok=True)
    paths = [os.path.join(d, f"utt_{i:04d}.flac") for i in range(COUNT)]
    todo = [(p, i) for i, p in enumerate(paths) if not os.path.exists(p)]
    if todo:
        log(f"generating {len(todo)} FLAC files in {d}")
        with ThreadPoolExecutor(os.cpu_count() or 1) as ex:
            list(ex.map(_gen_one, todo))
    return paths


# ---------------------------------------------------------------------------------------------
# contenders: each a function of the files -> (audio seconds, {path: features [80, frames]})
# ---------------------------------------------------------------------------------------------


class AvpipeBatched:
    def __init__(self, files, threads):
        from avpipe.pipeline.audio_loader import AudioBatchLoader

        self.files = files
        self.loader = AudioBatchLoader(files, batch_size=BATCH, num_workers=threads,
                                       device="cpu", decoder="cpu", transport="int16")
        self.stream = self.loader.batches(epochs=10 ** 6)

    def epoch(self, keep=False):
        from avpipe.ops import log_mel

        secs, out, k = 0.0, {}, 0
        for _ in range(-(-len(self.files) // BATCH)):
            x, lens, paths, errors = next(self.stream)
            if errors:
                raise RuntimeError(f"decode errors: {errors[:3]}")
            feats, fl = log_mel(x, lens, preset="nemo")
            secs += float(np.sum(lens)) / SR
            if keep:
                for i, p in enumerate(paths):
                    out[p] = feats[i, :, : int(fl[i])].copy()
            k += len(lens)
        return secs, out

    def close(self):
        self.stream.close()
        self.loader.close()


class NemoTorch:
    """NeMo's FilterbankFeatures (inference: no dither, no pad_to), written out."""

    def __init__(self, files, threads):
        import librosa
        import torch

        torch.set_num_threads(threads)
        self.torch = torch
        self.files = files
        self.pool = ThreadPoolExecutor(threads)
        self.window = torch.hann_window(400, periodic=False)
        fb = librosa.filters.mel(sr=SR, n_fft=512, n_mels=80, fmin=0.0, fmax=8000.0,
                                 norm="slaney")
        self.fb = torch.tensor(fb, dtype=torch.float32).unsqueeze(0)  # [1, 80, 257]

    def features(self, x, seq_len_time):
        torch = self.torch
        n_fft, hop = 512, 160
        # get_seq_len: floor((n + n_fft // 2 * 2 - n_fft) / hop)
        seq_len = torch.floor_divide(seq_len_time + n_fft // 2 * 2 - n_fft, hop).long()
        timemask = torch.arange(x.shape[1]).unsqueeze(0) < seq_len_time.unsqueeze(1)
        x = torch.cat((x[:, 0].unsqueeze(1), x[:, 1:] - 0.97 * x[:, :-1]), dim=1)
        x = x.masked_fill(~timemask, 0.0)
        x = torch.stft(x, n_fft=n_fft, hop_length=hop, win_length=400, center=True,
                       window=self.window, return_complex=True, pad_mode="constant")
        x = torch.view_as_real(x)
        x = torch.sqrt(x.pow(2).sum(-1))
        x = x.pow(2.0)
        x = torch.matmul(self.fb.to(x.dtype), x)
        x = torch.log(x + 2.0 ** -24)
        # normalize_batch(x, seq_len, "per_feature")
        B, _, T = x.shape
        valid = torch.arange(T).unsqueeze(0).expand(B, T) < seq_len.unsqueeze(1)
        num = torch.where(valid.unsqueeze(1), x, 0.0).sum(axis=2)
        den = valid.sum(axis=1)
        mean = num / den.unsqueeze(1)
        std = torch.sqrt(torch.sum(torch.where(valid.unsqueeze(1), x - mean.unsqueeze(2), 0.0)
                                   ** 2, axis=2) / (den.unsqueeze(1) - 1.0))
        std = std.masked_fill(std.isnan(), 0.0) + 1e-5
        x = (x - mean.unsqueeze(2)) / std.unsqueeze(2)
        mask = torch.arange(T).repeat(B, 1) >= seq_len.unsqueeze(1)
        return x.masked_fill(mask.unsqueeze(1), 0.0), seq_len

    def epoch(self, keep=False):
        import soundfile as sf

        torch = self.torch
        secs, out = 0.0, {}
        batches = [self.files[i : i + BATCH] for i in range(0, len(self.files), BATCH)]
        with torch.inference_mode():
            for paths in batches:
                arrays = list(self.pool.map(lambda p: sf.read(p, dtype="float32")[0], paths))
                lens = [len(a) for a in arrays]
                x = torch.zeros(len(arrays), max(lens))
                for i, a in enumerate(arrays):
                    x[i, : len(a)] = torch.from_numpy(a)
                feats, fl = self.features(x, torch.tensor(lens))
                secs += sum(lens) / SR
                if keep:
                    for i, p in enumerate(paths):
                        out[p] = feats[i, :, : int(fl[i])].numpy().copy()
        return secs, out

    def close(self):
        self.pool.shutdown()


def _normalized(f, nv):
    """NeMo's per-feature normalization over ``nv`` frames, masked past them (numpy)."""
    v = f[:, :nv]
    mean = v.mean(axis=1, keepdims=True)
    std = np.sqrt(((v - mean) ** 2).sum(axis=1, keepdims=True) / max(nv - 1, 1)) + 1e-5
    return ((v - mean) / std).astype(np.float32)


class LibrosaPerFile:
    def __init__(self, files, threads):
        import scipy.signal

        self.files = files
        self.pool = ThreadPoolExecutor(threads)
        self.window = scipy.signal.get_window("hann", 400, fftbins=False)  # symmetric

    def one(self, p):
        import librosa
        import soundfile as sf

        y = sf.read(p, dtype="float32")[0]
        n = len(y)
        y = np.concatenate([y[:1], y[1:] - np.float32(0.97) * y[:-1]])
        S = librosa.feature.melspectrogram(y=y, sr=SR, n_fft=512, hop_length=160,
                                           win_length=400, window=self.window, center=True,
                                           pad_mode="constant", power=2.0, n_mels=80,
                                           fmin=0.0, fmax=8000.0, norm="slaney")  # fmt: skip
        f = np.log(S + 2.0 ** -24)
        return n, _normalized(f, n // 160)

    def epoch(self, keep=False):
        secs, out = 0.0, {}
        for p, (n, f) in zip(self.files, self.pool.map(self.one, self.files)):
            secs += n / SR
            if keep:
                out[p] = f
        return secs, out

    def close(self):
        self.pool.shutdown()


class AvpipePerFile:
    def __init__(self, files, threads):
        self.files = files
        self.pool = ThreadPoolExecutor(threads)

    @staticmethod
    def one(p):
        import avpipe
        from avpipe.ops import log_mel

        a = avpipe.load_audio(p)
        feats, fl = log_mel(a.samples, preset="nemo")
        return a.samples.shape[-1], feats[0, :, : int(fl[0])]

    def epoch(self, keep=False):
        secs, out = 0.0, {}
        for p, (n, f) in zip(self.files, self.pool.map(self.one, self.files)):
            secs += n / SR
            if keep:
                out[p] = f
        return secs, out

    def close(self):
        self.pool.shutdown()


MAKERS = {"avpipe_batched": AvpipeBatched, "nemo_torch": NemoTorch,
          "librosa_per_file": LibrosaPerFile, "avpipe_per_file": AvpipePerFile}


# ---------------------------------------------------------------------------------------------


def environment():
    def version(mod):
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001 - missing: reported as such
            return None

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=ROOT, capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    return {"commit": commit, "dirty": dirty,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu, "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            **{m: version(m) for m in ("numpy", "scipy", "torch", "librosa", "soundfile")}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "avpipe_bench_cpu_logmel"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=1e-3)
    ap.add_argument("--only", default=",".join(CONTENDERS))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_logmel.json"))
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds must be at least 3")
    names = [c for c in args.only.split(",") if c]
    for c in names:
        if c not in MAKERS:
            ap.error(f"--only: unknown contender {c!r} (one of {', '.join(CONTENDERS)})")
    files = ensure_data(args.data)
    env = environment()
    log(json.dumps(env))
    contenders, agreement = {}, {}
    try:
        for c in names:
            contenders[c] = MAKERS[c](files, args.threads)
        # one pass each, kept: the features agree (and the first pass warms every path up)
        ref = None
        for c in names:
            _, feats = contenders[c].epoch(keep=True)
            if ref is None:
                ref = feats
                continue
            worst = 0.0
            for p, f in ref.items():
                g = feats[p]
                if g.shape != f.shape:
                    raise SystemExit(f"{c}: {p} has shape {g.shape}, {names[0]} {f.shape}")
                worst = max(worst, float(np.abs(g.astype(np.float64) - f).max()))
            agreement[c] = worst
            log(f"{c}: max |difference| from {names[0]} {worst:.2e}")
            if worst > args.tolerance:
                raise SystemExit(f"{c} disagrees with {names[0]} by {worst:.2e} > {args.tolerance}")
        runs = {c: [] for c in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for c in order:
                t0 = time.perf_counter()
                secs, _ = contenders[c].epoch()
                dt = time.perf_counter() - t0
                runs[c].append({"value": secs / dt, "seconds": dt, "audio_seconds": secs})
                log(f"round {r} {c:18s} {secs / dt:8.1f} audio-s/s ({dt:.2f} s)")
    finally:
        for obj in contenders.values():
            obj.close()
    medians = {c: median_run(runs[c])["value"] for c in names}
    result = {
        "workload": {"files": COUNT, "batch": BATCH, "seconds_2_to": 16, "format": "FLAC 16 kHz "
                     "mono PCM_16", "preset": "nemo", "threads": args.threads,
                     "audio_seconds": round(runs[names[0]][0]["audio_seconds"], 1)},
        "environment": env,
        "rounds": args.rounds,
        "audio_seconds_per_second": {c: [round(x["value"], 1) for x in runs[c]] for c in names},
        "median": {c: round(v, 1) for c, v in medians.items()},
        "max_abs_difference_from_" + names[0]: agreement,
        "tolerance": args.tolerance,
    }
    if "avpipe_batched" in medians:
        for c in names:
            if c != "avpipe_batched":
                result[f"ratio_avpipe_batched_over_{c}"] = round(medians["avpipe_batched"]
                                                                 / medians[c], 3)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    log(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))


if __name__ == "__main__":
    main()
