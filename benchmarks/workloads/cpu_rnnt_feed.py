#!/usr/bin/env python3
"""The RNN-T training feed on the CPU: avpipe's ``rnnt_feed`` against a lhotse pipeline doing
the same work, in interleaved rounds.

lhotse comes with the dev extras (or ``pip install --no-deps --target SITE lhotse`` plus its
pure-Python dependencies cytoolz, toolz, intervaltree, sortedcontainers, tabulate, then
``PYTHONPATH=$PWD:SITE``).

Workload: ``files`` (256) speech-like FLAC files of 2-16 s at 16 kHz (:func:`benchmarks.data.cpu_flac`,
deterministic, cached in the data folder) and a NeMo manifest of them (JSON lines:
audio_filepath, duration, text). One epoch per run, batch ``batch``; the rate is manifest
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

The headline ratio is avpipe's median over the median of lhotse's best worker count
(``lhotse_best``). ``check`` runs once before the rounds; ``avpipe_profiled`` (only when named:
``--contenders avpipe_profiled``) is avpipe's epoch with its stages timed, and one batch's
stages run serially.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import numpy as np

from benchmarks import data as bdata
from benchmarks.data import read_manifest
from benchmarks.harness import cpu_seconds

NAME = "cpu_rnnt_feed"
SUITE = "cpu"
UNIT = "audio-s/s"
TITLE = ("The RNN-T training feed on the CPU (256 FLAC of 2-16 s, batch 32: speed perturbation, "
         "dither, log-mel, SpecAugment), one epoch per fresh process, from building the feed to "
         "the last batch")
SR = 16000
FACTORS = [round(0.85 + 0.01 * k, 2) for k in range(31)]
CONTENDERS = {
    "avpipe": "rnnt_feed(device=cpu, training=True): speed U(0.85, 1.15), dither 1e-5, NeMo "
              "log-mel, SpecAugment; default threads",
    "lhotse_w0": "lhotse K2SpeechRecognitionDataset: PerturbSpeed, OnTheFlyFeatures(Fbank, "
                 "dither 1e-5), per-feature norm, SpecAugment; DataLoader 0 workers",
    "lhotse_w1": "the same lhotse pipeline, DataLoader 1 worker",
    "lhotse_w2": "the same lhotse pipeline, DataLoader 2 workers",
    "avpipe_profiled": "avpipe's epoch with its stages timed (a profile, not a contender)",
}
OPTIONAL = ("avpipe_profiled",)
BEST_OF = {"lhotse_best": ["lhotse_w0", "lhotse_w1", "lhotse_w2"]}
RATIOS = [("avpipe", "lhotse_best"), ("avpipe", "lhotse_w0"), ("avpipe", "lhotse_w1"),
          ("avpipe", "lhotse_w2")]
PARAMS = {"files": 256, "batch": 32}
QUICK = {"files": 32, "batch": 8}
REQUIRES = ("torch", "lhotse")
NOTES = ["lhotse's features differ by design (Kaldi mel filters, framing, mask fill); the "
         "steps are the same: check's Pearson correlations say how close they are."]


def prepare(ctx):
    d = bdata.cpu_flac(ctx.data_dir, ctx.params["files"])
    return {"manifest": d["manifest"], "audio_seconds": sum(d["durations"])}


def _args(ctx):
    return SimpleNamespace(manifest=ctx.data["manifest"], batch=ctx.params["batch"])


def measure(ctx, name):
    args, seed = _args(ctx), ctx.round
    cpu0 = cpu_seconds()
    if name == "avpipe":
        secs, first, feats, extra = run_avpipe(args, seed)
    elif name.startswith("lhotse_w"):
        secs, first, feats, extra = run_lhotse(args, seed, int(name[len("lhotse_w"):]))
    elif name == "avpipe_profiled":
        out, _ = profile(args)
        return out["audio_s_per_s"], out
    else:
        raise ValueError(f"unknown contender {name!r}")
    cpu = cpu_seconds() - cpu0
    audio_s = sum(float(m["duration"]) for m in read_manifest(args.manifest))
    return audio_s / secs, {"seconds": round(secs, 3), "cpu_s": round(cpu, 3),
                            "audio_s_per_cpu_s": round(audio_s / cpu, 2),
                            "first_batch_s": round(first, 3), "audio_seconds": round(audio_s, 1),
                            **summarize(feats), **extra}


def check(ctx):
    """Un-augmented features of a few files against lhotse's (:func:`compare`), in a child
    process (lhotse and torch stay out of the parent)."""
    import subprocess
    import sys

    from benchmarks.harness import ROOT

    code = ("import json,sys; from benchmarks.harness import Context; "
            "from benchmarks.workloads import cpu_rnnt_feed as w; "
            "print(json.dumps(w.compare(w._args(Context.from_json(sys.argv[1])))))")
    p = subprocess.run([sys.executable, "-c", code, ctx.to_json()], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": (p.stderr or p.stdout)[-800:]}


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


def compare(args):
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
    return {"files": rows,
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
    from benchmarks._timing import report, time_calls

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
    cfg = A.resolve_preset("nemo")
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


