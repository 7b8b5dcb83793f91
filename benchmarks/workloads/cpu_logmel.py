"""CPU log-mel with FLAC decode: 256 utterances (16 kHz mono FLAC, 2-16 s), batch 64, NeMo
features (80 mel), on the CPU only.

Contenders (each one pass over the 256 files per round; the rounds interleave the
contenders, in an order rotated every round, so that load from elsewhere on the machine falls
on all of them alike):

* ``avpipe_batched``: ``AudioBatchLoader(device="cpu", decoder="cpu")`` (``threads`` worker
  processes) + ``avpipe.ops.log_mel(preset="nemo")`` on each padded batch of 64.
* ``nemo_torch``: NeMo's ``FilterbankFeatures`` as written in NeMo (features.py,
  ``FilterbankFeatures.forward`` and ``normalize_batch``, NVIDIA-NeMo/NeMo 009d1c15; the
  settings of avpipe's "nemo" preset): soundfile reads in ``threads`` threads, a padded
  batch of 64, preemphasis 0.97 masked to the length, ``torch.stft`` (n_fft 512, win 400, hop
  160, symmetric Hann, centred, zero padding), ``|X|`` then ``** 2``, librosa's 80 Slaney mel
  filters (0-8 kHz), ``ln(x + 2^-24)``, per-feature normalization over ``n // 160`` frames
  (n-1 std, + 1e-5), masked to 0 past them; ``torch.set_num_threads(--threads)``.
* ``librosa_per_file``: soundfile + ``librosa.feature.melspectrogram`` per file (the same
  window, padding and filters), ln, the same normalization, in ``threads`` threads.
* ``avpipe_per_file``: ``avpipe.load_audio`` + ``ops.log_mel`` per file, ``threads``
  threads.

Before timing, every contender's features of all files are compared with avpipe's
(``tolerance``, absolute, over each file's valid frames). The contenders live in this process across the rounds.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks import data as bdata
from benchmarks.harness import log

NAME = "cpu_logmel"
SUITE = "cpu"
UNIT = "audio-s/s"
TITLE = ("NeMo log-mel (80 mel) with FLAC decode, batch 64, 256 utterances of 2-16 s, on the "
         "CPU")
SR = 16000
BATCH = 64
CONTENDERS = {
    "avpipe_batched": "AudioBatchLoader(device=cpu, decoder=cpu, threads worker processes) + "
                      "ops.log_mel(preset=nemo) per padded batch of 64",
    "nemo_torch": "NeMo FilterbankFeatures written out in torch; soundfile in 2 threads, "
                  "torch.set_num_threads(2)",
    "librosa_per_file": "soundfile + librosa.feature.melspectrogram per file, 2 threads",
    "avpipe_per_file": "avpipe.load_audio + ops.log_mel per file, 2 threads",
}
RATIOS = [("avpipe_batched", "nemo_torch"), ("avpipe_batched", "librosa_per_file"),
          ("avpipe_batched", "avpipe_per_file")]
PARAMS = {"files": 256, "threads": 2, "tolerance": 1e-3}
QUICK = {"files": 32}
REQUIRES = ("torch", "librosa", "scipy")


def prepare(ctx):
    return {"files": bdata.cpu_flac(ctx.data_dir, ctx.params["files"])["files"]}


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


class _PerFile:
    """A file at a time (``one(path) -> (samples, features)``) on ``threads`` threads."""

    def __init__(self, files, threads):
        self.files = files
        self.pool = ThreadPoolExecutor(threads)

    def epoch(self, keep=False):
        secs, out = 0.0, {}
        for p, (n, f) in zip(self.files, self.pool.map(self.one, self.files)):
            secs += n / SR
            if keep:
                out[p] = f
        return secs, out

    def close(self):
        self.pool.shutdown()


class LibrosaPerFile(_PerFile):
    def __init__(self, files, threads):
        import scipy.signal

        super().__init__(files, threads)
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


class AvpipePerFile(_PerFile):
    @staticmethod
    def one(p):
        import avpipe
        from avpipe.ops import log_mel

        a = avpipe.load_audio(p)
        feats, fl = log_mel(a.samples, preset="nemo")
        return a.samples.shape[-1], feats[0, :, : int(fl[0])]


MAKERS = {"avpipe_batched": AvpipeBatched, "nemo_torch": NemoTorch,
          "librosa_per_file": LibrosaPerFile, "avpipe_per_file": AvpipePerFile}


class Session:
    """Every contender built once; one pass each, kept, checks the features agree (and warms
    every path up) before the rounds."""

    def __init__(self, ctx):
        self.names = list(ctx.contenders or CONTENDERS)
        files, threads = ctx.data["files"], ctx.params["threads"]
        self.objs = {}
        try:
            for c in self.names:
                self.objs[c] = MAKERS[c](files, threads)
            self.agreement = agreement(self.objs, self.names, ctx.params["tolerance"])
        except BaseException:
            self.close()
            raise

    def measure(self, name):
        import time

        t0 = time.perf_counter()
        secs, _ = self.objs[name].epoch()
        dt = time.perf_counter() - t0
        return secs / dt, {"seconds": round(dt, 3), "audio_seconds": round(secs, 1),
                           "max_abs_difference_from_first":
                               self.agreement.get(name)}

    def close(self):
        for obj in self.objs.values():
            obj.close()
        self.objs = {}


def agreement(objs, names, tolerance):
    """The largest difference of each contender's features from the first's, over each file's
    valid frames; a contender beyond ``tolerance`` stops the run."""
    ref, out = None, {}
    for c in names:
        _, feats = objs[c].epoch(keep=True)
        if ref is None:
            ref = feats
            continue
        worst = 0.0
        for p, f in ref.items():
            g = feats[p]
            if g.shape != f.shape:
                raise RuntimeError(f"{c}: {p} has shape {g.shape}, {names[0]} {f.shape}")
            worst = max(worst, float(np.abs(g.astype(np.float64) - f).max()))
        out[c] = worst
        log(f"{c}: max |difference| from {names[0]} {worst:.2e}")
        if worst > tolerance:
            raise RuntimeError(f"{c} disagrees with {names[0]} by {worst:.2e} > {tolerance}")
    return out


_LAST = {}


def session(ctx):
    _LAST["session"] = Session(ctx)
    return _LAST["session"]


def finish(ctx):
    sess = _LAST.pop("session", None)
    return {} if sess is None else {
        f"max_abs_difference_from_{sess.names[0]}": sess.agreement,
        "tolerance": ctx.params["tolerance"]}
