#!/usr/bin/env python3
"""The RNN-T training feed on the CPU: avpipe's ``rnnt_feed`` against a lhotse pipeline doing
the same work, in interleaved rounds.

    PYTHONPATH=$PWD:SITE python3 benchmarks/bench_cpu_rnnt_feed.py [--rounds 3] [--batch 32]

SITE: a folder with lhotse (``pip install --no-deps --target SITE lhotse`` plus its missing
pure-Python dependencies: cytoolz, toolz, intervaltree, sortedcontainers, tabulate).

Workload: ``--files`` (256) speech-like FLAC files of 2-16 s at 16 kHz (bench_audio.py's
generator, deterministic, cached in ``--data``) and a NeMo manifest of them (JSON lines:
audio_filepath, duration, text). One epoch per run, batch ``--batch``; the rate is manifest
audio-seconds per second of the epoch's wall time, from building the feed (manifest read
included) to the last batch.

Contenders (each run in a fresh child process, imports not timed):

* ``avpipe``: ``avpipe.recipes.rnnt_feed(manifest, batch_size=B, training=True,
  device="cpu")``: speed perturbation U(0.85, 1.15) on a 0.01 grid, dither 1e-5, NeMo log-mel
  (the "nemo" preset: per-feature normalization), SpecAugment (2 freq masks of <= 27, 10 time
  masks of <= 5 % of the length), default threads and prefetch.
* ``lhotse_wN`` (N = 0, 1, 2 DataLoader workers): a CutSet built from the same manifest
  (Recording + SupervisionSegment per line, durations from the manifest, no header reads),
  ``SimpleCutSampler(max_cuts=B, shuffle=True)``, ``K2SpeechRecognitionDataset`` with the
  ``PerturbSpeed`` cut transform (factors 0.85, 0.86, ..., 1.15, p=1: the same grid as
  avpipe's), ``OnTheFlyFeatures(Fbank)`` (80 filters, 25 ms / 10 ms frames, 512-point FFT,
  symmetric Hann window, preemphasis 0.97, no DC removal, 0-8 kHz, dither 1e-5), then a
  per-feature normalization over each cut's valid frames (NeMo's, as an input transform;
  lhotse has none built in) and lhotse's ``SpecAugment`` (no time warp, 2 feature masks of
  <= 27, 10 frame masks of <= 40 frames and at most half the frames, p=1), through a torch
  DataLoader (``batch_size=None``, the sampler as sampler) with N workers.

What differs in the features, by lhotse's design: Kaldi-style mel filters (HTK mel scale,
triangles in the mel domain, no Slaney area normalization) instead of librosa's Slaney filters;
log(max(x, float eps)) instead of log(x + 2^-24); Kaldi framing with ``snip_edges=False``
(frames = round(n / 160), the signal reflected at its edges) instead of NeMo's centred
zero-padded STFT with n // 160 valid frames; no per-item masked preemphasis; SpecAugment
masks filled with the features' mean (avpipe: 0, NeMo's value) and time masks sized in frames
(<= 40) rather than as a fraction of each item's length. The same steps in the same order
(speed -> dither -> preemphasis -> STFT power -> 80 mel -> log -> normalization -> masks);
``check`` compares un-augmented features of a few files (Pearson correlation, each avpipe
band against the lhotse band of the nearest centre frequency).

Rounds are interleaved (each round runs every contender once, in an order that alternates
between rounds); the result is each contender's median round, and the ratio avpipe / lhotse's
best median. Writes ``benchmarks/results/cpu_rnnt_feed.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

SR = 16000
FACTORS = [round(0.85 + 0.01 * k, 2) for k in range(31)]


def log(*a):
    print(*a, flush=True)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (every thread) and of its waited-for
    children (worker processes, once joined)."""
    import resource

    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


# --- data -------------------------------------------------------------------------------------


def ensure_data(data_dir: str, count: int) -> tuple[str, list[str], list[float]]:
    """``count`` FLAC files (bench_audio.py's speech-like generator, seeded by index) in
    ``data_dir/flac`` and their NeMo manifest ``data_dir/manifest_<count>.jsonl``."""
    import soundfile as sf
    from bench_audio import _gen_one

    d = os.path.join(data_dir, "flac")
    os.makedirs(d, exist_ok=True)
    files = [os.path.join(d, f"utt_{i:04d}.flac") for i in range(count)]
    todo = [(p, i) for i, p in enumerate(files) if not os.path.exists(p)]
    if todo:
        log(f"generating {len(todo)} FLAC files in {d}")
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(2) as ex:
            list(ex.map(_gen_one, todo, chunksize=4))
    manifest = os.path.join(data_dir, f"manifest_{count}.jsonl")
    durs = [sf.info(p).frames / SR for p in files]
    if not os.path.exists(manifest):
        with open(manifest + ".tmp", "w") as f:
            for i, (p, dur) in enumerate(zip(files, durs)):
                f.write(json.dumps({"audio_filepath": p, "duration": dur,
                                    "text": f"utterance number {i}"}) + "\n")
        os.replace(manifest + ".tmp", manifest)
    return manifest, files, durs


def read_manifest(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def environment() -> dict:
    """Commit, date, CPU model and the versions a result depends on."""
    import numpy
    import soundfile
    import torch

    def git(*a):
        try:
            return subprocess.check_output(["git", *a], cwd=ROOT, text=True).strip()
        except Exception:  # noqa: BLE001
            return None

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import lhotse

        lv = lhotse.__version__
    except ImportError:
        lv = None
    import avpipe

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu": cpu,
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "versions": {"numpy": numpy.__version__, "torch": torch.__version__,
                         "lhotse": lv, "soundfile": soundfile.__version__,
                         "avpipe": getattr(avpipe, "__version__", None)},
            "torch_threads": torch.get_num_threads()}


# --- contenders -------------------------------------------------------------------------------


def summarize(feats: list[np.ndarray]) -> dict:
    """Checks of one epoch's features (each [F, T_valid]): item count, frames, finiteness,
    the mean and std of the valid cells."""
    n = sum(f.shape[1] for f in feats)
    s = sum(float(f.sum(dtype=np.float64)) for f in feats)
    ss = sum(float((f.astype(np.float64) ** 2).sum()) for f in feats)
    mean = s / max(n * feats[0].shape[0], 1)
    return {"items": len(feats), "frames": int(n), "n_mels": int(feats[0].shape[0]),
            "finite": bool(all(np.isfinite(f).all() for f in feats)),
            "mean": round(mean, 4),
            "std": round(float(np.sqrt(max(ss / max(n * feats[0].shape[0], 1) - mean ** 2, 0))),
                         4)}


def run_avpipe(args, seed):
    from avpipe.recipes import rnnt_feed

    t0 = time.perf_counter()
    feed = rnnt_feed(args.manifest, batch_size=args.batch, training=True, device="cpu",
                     seed=seed, framework="numpy")
    feats, first = [], None
    for b in feed:
        if first is None:
            first = time.perf_counter() - t0
        f, fl = np.asarray(b.features), np.asarray(b.feature_lengths)
        feats.extend(f[r, :, : int(fl[r])] for r in range(f.shape[0]))
    secs = time.perf_counter() - t0
    errors = list(getattr(feed, "errors", []) or [])
    feed.close()
    return secs, first, feats, {"errors": len(errors)}


class PerFeatureNorm:
    """NeMo's per-feature normalization over each cut's valid frames, as a lhotse input
    transform: ``(features [B, T, F], supervision_segments [S, 3]) -> features``."""

    def __call__(self, x, supervision_segments=None, **_):
        import torch

        out = torch.zeros_like(x)
        for i, start, num in supervision_segments.tolist():
            seg = x[i, start : start + num]
            out[i, start : start + num] = (seg - seg.mean(0)) / (seg.std(0) + 1e-5)
        return out


def fbank_config():
    from lhotse import FbankConfig

    return FbankConfig(sampling_rate=SR, frame_length=0.025, frame_shift=0.01,
                       round_to_power_of_two=True, remove_dc_offset=False, preemph_coeff=0.97,
                       window_type="hanning", dither=1e-5, snip_edges=False, low_freq=0.0,
                       high_freq=8000.0, num_filters=80)


def lhotse_cuts(manifest):
    from lhotse import CutSet, Recording, SupervisionSegment
    from lhotse.audio import AudioSource

    cuts = []
    for i, m in enumerate(read_manifest(manifest)):
        rid = f"utt{i:05d}"
        dur = float(m["duration"])
        rec = Recording(id=rid, sources=[AudioSource(type="file", channels=[0],
                                                     source=m["audio_filepath"])],
                        sampling_rate=SR, num_samples=int(round(dur * SR)), duration=dur)
        cut = rec.to_cut()
        cut.supervisions = [SupervisionSegment(id=rid, recording_id=rid, start=0.0,
                                               duration=dur, text=m.get("text", ""))]
        cuts.append(cut)
    return CutSet.from_cuts(cuts)


def run_lhotse(args, seed, workers):
    import random

    import torch
    from lhotse import Fbank
    from lhotse.dataset import (
        K2SpeechRecognitionDataset,
        OnTheFlyFeatures,
        PerturbSpeed,
        SimpleCutSampler,
        SpecAugment,
    )

    t0 = time.perf_counter()
    cuts = lhotse_cuts(args.manifest)
    sampler = SimpleCutSampler(cuts, max_cuts=args.batch, shuffle=True, seed=seed)
    ds = K2SpeechRecognitionDataset(
        cut_transforms=[PerturbSpeed(factors=FACTORS, p=1.0, randgen=random.Random(seed))],
        input_strategy=OnTheFlyFeatures(Fbank(fbank_config())),
        input_transforms=[PerFeatureNorm(),
                          SpecAugment(time_warp_factor=None, num_feature_masks=2,
                                      features_mask_size=27, num_frame_masks=10,
                                      frames_mask_size=40, max_frames_mask_fraction=0.5,
                                      p=1.0)])
    dl = torch.utils.data.DataLoader(ds, sampler=sampler, batch_size=None, num_workers=workers)
    feats, first = [], None
    for b in dl:
        if first is None:
            first = time.perf_counter() - t0
        x = b["inputs"].numpy()  # [B, T, F]
        seg = b["supervisions"]
        for i, start, num in zip(seg["sequence_idx"].tolist(), seg["start_frame"].tolist(),
                                 seg["num_frames"].tolist()):
            feats.append(x[i, start : start + num].T)
    secs = time.perf_counter() - t0
    return secs, first, feats, {"workers": workers}


def child(args):
    name, seed = args.child, args.seed
    cpu0 = cpu_seconds()
    if name == "avpipe":
        secs, first, feats, extra = run_avpipe(args, seed)
    elif name.startswith("lhotse_w"):
        secs, first, feats, extra = run_lhotse(args, seed, int(name[len("lhotse_w"):]))
    elif name == "profile":
        out, text = profile(args)
        print(text, flush=True)
        print("RESULT " + json.dumps({"name": "profile", **out}), flush=True)
        return
    elif name == "check":
        print("RESULT " + json.dumps(check(args)), flush=True)
        return
    else:
        raise SystemExit(f"unknown contender {name!r}")
    cpu = cpu_seconds() - cpu0
    audio_s = sum(float(m["duration"]) for m in read_manifest(args.manifest))
    out = {"name": name, "value": audio_s / secs, "unit": "audio_s/s", "seconds": round(secs, 3),
           "cpu_s": round(cpu, 3), "audio_s_per_cpu_s": round(audio_s / cpu, 2),
           "first_batch_s": round(first, 3), "audio_seconds": round(audio_s, 1),
           **summarize(feats), **extra}
    print("RESULT " + json.dumps(out), flush=True)


def _band_match(n_mels=80, fmax=8000.0):
    """For each of avpipe's Slaney mel bands, the Kaldi (HTK mel) band whose centre frequency
    is nearest: the two filterbanks put band k at different frequencies."""
    f_sp, min_log_mel, step = 200.0 / 3, 1000.0 / (200.0 / 3), np.log(6.4) / 27

    def slaney_hz(m):
        return np.where(m < min_log_mel, f_sp * m, 1000.0 * np.exp(step * (m - min_log_mel)))

    top = min_log_mel + np.log(fmax / 1000.0) / step
    cs = slaney_hz(np.linspace(0.0, top, n_mels + 2))[1:-1]
    mel_top = 2595 * np.log10(1 + fmax / 700)
    ch = 700 * (10 ** (np.linspace(0.0, mel_top, n_mels + 2) / 2595) - 1)[1:-1]
    return np.abs(ch[None, :] - cs[:, None]).argmin(1)


def check(args):
    """Un-augmented features of a few files, avpipe's nemo preset against the lhotse Fbank
    configuration above (+ the same normalization): frames, and the Pearson correlation over
    every cell and per band (median), each avpipe band paired with the lhotse band of the
    nearest centre frequency (the filter shapes still differ: not an exactness check)."""
    import dataclasses

    import soundfile as sf
    from lhotse import Fbank

    from avpipe.ops.audio import log_mel

    fb = Fbank(dataclasses.replace(fbank_config(), dither=0.0))
    idx = _band_match()
    rows = []
    for m in read_manifest(args.manifest)[:8]:
        x, sr = sf.read(m["audio_filepath"], dtype="float32")
        a, al = log_mel(x[None], np.array([len(x)]), preset="nemo", training=False)
        a = np.asarray(a)[0, :, : int(np.asarray(al)[0])]
        b = fb.extract(x, SR).T  # [F, T]
        b = ((b - b.mean(1, keepdims=True)) / (b.std(1, ddof=1, keepdims=True) + 1e-5))[idx]
        t = min(a.shape[1], b.shape[1])
        per_band = [np.corrcoef(a[k, :t], b[k, :t])[0, 1] for k in range(a.shape[0])]
        rows.append({"file": os.path.basename(m["audio_filepath"]), "avpipe_frames": a.shape[1],
                     "lhotse_frames": b.shape[1],
                     "pearson": round(float(np.corrcoef(a[:, :t].ravel(),
                                                        b[:, :t].ravel())[0, 1]), 4),
                     "pearson_band_median": round(float(np.median(per_band)), 4)})
    return {"name": "check", "files": rows,
            "min_pearson": min(r["pearson"] for r in rows),
            "min_pearson_band_median": min(r["pearson_band_median"] for r in rows)}


# --- profile of avpipe's side -----------------------------------------------------------------

# (owner, attribute, label): calls timed during a pipelined epoch (wall time per call, on
# whichever thread makes it; a call inside another counts in both)
PROFILED = [
    ("avpipe.recipes.rnnt", "load_audio", "decode: load_audio (decode threads)"),
    ("avpipe.recipes.rnnt.RnntTask", "collate", "collate (producer: pad + augment + features)"),
    ("avpipe.ops.audio_augment", "apply_speed_perturb", "speed perturb (resample_rows)"),
    ("avpipe.recipes.rnnt", "log_mel", "log_mel (whole)"),
    ("avpipe.ops.audio", "dither", "  log_mel: dither"),
    ("avpipe.ops.audio", "preemphasis", "  log_mel: preemphasis"),
    ("avpipe.ops.audio", "stft", "  log_mel: stft (pad, frames, float64 rfft, power)"),
    ("avpipe.ops.audio", "mel_spectrogram", "  log_mel: mel matmul"),
    ("avpipe.ops.audio", "log_guarded", "  log_mel: log"),
    ("avpipe.ops.audio", "normalize", "  log_mel: per-feature normalize"),
    ("avpipe.ops.audio_augment", "spec_augment", "spec_augment"),
]


def profile(args):
    """avpipe's epoch with its stages timed (pipelined, as run), then one batch's stages one
    after the other on one thread, next to the same batch's log-mel computed per item in
    float32 torch (valid samples only: what a float32, valid-frames log-mel can approach)."""
    from _timing import report, time_calls

    acc = time_calls(PROFILED)
    secs, first, feats, extra = run_avpipe(args, 0)
    audio_s = sum(float(m["duration"]) for m in read_manifest(args.manifest))
    lines = [f"avpipe rnnt_feed epoch: {secs:.2f} s, {audio_s / secs:.1f} audio-s/s, "
             f"first batch {first:.2f} s; per epoch (seconds summed over threads):",
             report({k: v for k, v in acc.items()}, 1, "epoch").replace(" ms ", " ms ")]
    out = {"epoch_s": round(secs, 3), "audio_s_per_s": round(audio_s / secs, 1),
           "stages_s": {k: round(v[0], 3) for k, v in acc.items()},
           "calls": {k: v[1] for k, v in acc.items()}}
    out["serial_batch"] = _serial_batch(args)
    lines.append("one batch, serial, CPU ms per stage: "
                 + json.dumps(out["serial_batch"]))
    return out, "\n".join(lines)


def _serial_batch(args):
    """The stages of one training batch (the first ``--batch`` files) run one after the
    other, each timed in CPU seconds of this process (best of 3; robust to other processes'
    load, unlike wall time): decode, speed perturbation, log-mel and each of its steps (called
    as ``log_mel`` calls them), SpecAugment; and the same batch's log-mel computed per item
    (valid samples only) in float32 torch at one thread: what a float32, valid-frames log-mel
    can approach."""
    import soundfile as sf
    import torch

    from avpipe.ops import audio as A
    from avpipe.ops import audio_augment as aug
    from avpipe.ops.audio import log_mel

    rows = read_manifest(args.manifest)[: args.batch]
    ids = np.arange(len(rows))
    t = {}

    def clock(name, f, reps=3):
        best = None
        for _ in range(reps):
            t0 = time.process_time()
            r = f()
            d = time.process_time() - t0
            best = d if best is None else min(best, d)
        t[name] = round(1e3 * best, 1)
        return r

    sig = clock("decode (soundfile.read, serial)",
                lambda: [sf.read(r["audio_filepath"], dtype="float32")[0] for r in rows])
    lens = np.array([len(s) for s in sig], np.int64)
    x = np.zeros((len(sig), int(lens.max())), np.float32)
    for i, s in enumerate(sig):
        x[i, : len(s)] = s
    p = aug.sample_speed_params(0, 0, ids, factor_range=(0.85, 1.15))
    y, ylens = clock("speed perturb (apply_speed_perturb, fast)",
                     lambda: aug.apply_speed_perturb(x, lens, p, sample_rate=SR,
                                                     quality="fast"))
    ylens = np.asarray(ylens)
    feats, fl = clock("log_mel nemo (training, padded batch): whole",
                      lambda: log_mel(y, ylens, preset="nemo", training=True, seed=1))
    cfg = A._resolve_preset("nemo")
    x64 = clock("  to float64", lambda: y.astype(np.float64))
    d = clock("  dither", lambda: A.dither(x64, ylens, scale=cfg.dither, seed=1))
    pe = clock("  preemphasis", lambda: A.preemphasis(d, ylens, coeff=cfg.preemph))
    spec, _ = clock("  stft (float64 rfft, power, [B, F, T] float32)", lambda: A.stft(
        pe, ylens, n_fft=512, hop_length=160, win_length=400, window="hann", periodic=False,
        center=True, pad_mode="constant", power=2.0))
    fb = A.mel_filterbank(sample_rate=SR, n_fft=512, n_mels=80, fmin=0.0, fmax=8000.0,
                          htk=False, norm="slaney")
    mel = clock("  mel matmul (float64)", lambda: A.mel_spectrogram(spec, filterbank=fb))
    lg = clock("  log", lambda: A.log_guarded(mel, guard="add", guard_value=2.0 ** -24))
    fl_host = A.log_mel_frame_lengths(ylens, preset=cfg, frames=lg.shape[-1])
    clock("  per-feature normalize", lambda: A.normalize(lg, fl_host, mode="per_feature",
                                                         eps=1e-5, ddof=1))
    clock("spec_augment", lambda: aug.spec_augment(np.array(feats), np.asarray(fl), seed=0,
                                                   epoch=0, ids=ids))
    import librosa

    fbt = torch.from_numpy(librosa.filters.mel(sr=SR, n_fft=512, n_mels=80, fmin=0.0,
                                               fmax=8000.0, norm="slaney")).float()
    win = torch.hann_window(400, periodic=False)

    def torch_items():
        out = []
        for i in range(y.shape[0]):
            v = torch.from_numpy(np.ascontiguousarray(y[i, : ylens[i]]))
            v = v + 1e-5 * torch.randn_like(v)
            v = torch.cat([v[:1], v[1:] - 0.97 * v[:-1]])
            s = torch.stft(v, 512, 160, 400, win, center=True, pad_mode="constant",
                           return_complex=True)
            lm = torch.log(fbt @ (s.real.square() + s.imag.square()) + 2.0 ** -24)
            lm = lm[:, : int(ylens[i]) // 160]
            out.append((lm - lm.mean(1, keepdim=True)) / (lm.std(1, keepdim=True) + 1e-5))
        return out

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    clock("log-mel per item, float32 torch, 1 thread (dither included)", torch_items)
    torch.set_num_threads(threads)
    t["batch_audio_s"] = round(float(ylens.sum()) / SR, 1)
    t["padded_fraction"] = round(1 - float(ylens.sum()) / (len(ylens) * int(ylens.max())), 3)
    return t


def run_child(args, name, seed, env):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--seed", str(seed),
           "--manifest", args.manifest, "--batch", str(args.batch)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - t0
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            r["process_wall_s"] = round(wall, 3)
            return r
    return {"name": name, "value": None, "error": (p.stderr or p.stdout)[-3000:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="/tmp/avpipe_cpu_anchors")
    ap.add_argument("--files", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="avpipe,lhotse_w0,lhotse_w1,lhotse_w2")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_rnnt_feed.json"))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--child", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--manifest", default="")
    ap.add_argument("--profile", action="store_true",
                    help="only profile avpipe's side (DIR of --out: cpu_rnnt_feed_profile.json)")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from _timing import median_run

    args.manifest, files, durs = ensure_data(args.data, args.files)
    if args.profile:
        args.child = "profile"
        out, text = profile(args)
        log(text)
        path = os.path.join(os.path.dirname(args.out), "cpu_rnnt_feed_profile.json")
        with open(path, "w") as f:
            json.dump({"benchmark": "cpu_rnnt_feed_profile", **environment(), **out}, f,
                      indent=1)
        log("wrote", path)
        return
    env = dict(os.environ)
    names = [n for n in args.only.split(",") if n]
    log(f"{len(files)} files, {sum(durs):.1f} s of audio, batch {args.batch}, "
        f"{args.rounds} rounds of {names}")
    chk = run_child(args, "check", 0, env)
    log("check:", json.dumps(chk))
    runs = {n: [] for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            res = run_child(args, n, r, env)
            res["round"] = r
            runs[n].append(res)
            v = res.get("value")
            log(f"round {r} {n:10s} " + (f"{v:8.1f} audio-s/s  ({res['seconds']} s)" if v
                                          else "FAILED " + res.get("error", "")[-800:]))
    med = {n: median_run(rs) for n, rs in runs.items()}
    lh = {n: m for n, m in med.items() if n.startswith("lhotse") and m.get("value")}
    best = max(lh, key=lambda n: lh[n]["value"]) if lh else None
    cpu_med = {n: median_run(rs, key="audio_s_per_cpu_s").get("audio_s_per_cpu_s")
               for n, rs in runs.items()}
    ratio = (med["avpipe"]["value"] / lh[best]["value"]
             if best and med.get("avpipe", {}).get("value") else None)
    out = {"benchmark": "cpu_rnnt_feed", **environment(),
           "workload": {"files": len(files), "audio_seconds": round(sum(durs), 1),
                        "batch": args.batch, "rounds": args.rounds, "data": args.data},
           "medians": {n: (round(m["value"], 2) if m.get("value") else None)
                       for n, m in med.items()},
           "medians_audio_s_per_cpu_s": cpu_med,
           "ratio_cpu_efficiency_avpipe_over_lhotse_best": (
               round(cpu_med["avpipe"] / cpu_med[best], 3)
               if best and cpu_med.get("avpipe") and cpu_med.get(best) else None),
           "lhotse_best": best, "ratio_avpipe_over_lhotse_best": round(ratio, 3) if ratio else None,
           "check": chk, "runs": runs,
           "command": "PYTHONPATH=$PWD:/work/wt/anchors-site python benchmarks/"
                      "bench_cpu_rnnt_feed.py " + " ".join(sys.argv[1:])}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    log(json.dumps({k: out[k] for k in ("medians", "lhotse_best", "medians_audio_s_per_cpu_s",
                                         "ratio_avpipe_over_lhotse_best")}))
    log("wrote", args.out)


if __name__ == "__main__":
    main()
