"""Audio augmentations on padded, variable-length batches (numpy on the CPU, cupy on a GPU).

Data: waveforms ``signals [B, n]`` (zero-padded) with ``lengths [B]`` in samples, or features
``[B, n_mels, T]`` with frame lengths; a 1-D ``[n]`` signal is a batch of one. Every op is
vectorized over the batch with lengths and masks (no per-item Python loop; speed perturbation
loops over its distinct rates, at most the number of factors configured).

Each op is a parameter sampler (``sample_*_params(seed, epoch, ids, ..., xp=)``, drawing only
through :mod:`avpipe.ops.random`, keyed by ``(seed, stream, epoch, sample id)``) plus a pure
``apply_*(data, params)``; the convenience functions (:func:`speed_perturb`,
:func:`spec_augment`, ...) do both and can return the params (``return_params=True``). The
:class:`Augment` classes (:class:`SpeedPerturb`, :class:`Gain`, :class:`AddNoise`,
:class:`Reverb`, :class:`TimeShift`, :class:`RandomCropPad`, :class:`LogMel`,
:class:`SpecAugment`) compose into a :class:`Chain`, e.g. ``speed -> noise -> RIR -> log-mel
-> SpecAugment`` (:func:`train_chain`)::

    chain = Chain.from_config([
        {"op": "speed_perturb", "factors": [0.9, 1.0, 1.1], "sample_rate": 16000},
        {"op": "noise", "noise": [noise_a, noise_b], "snr_db": (10, 30)},
        {"op": "reverb", "rirs": [rir], "p": 0.5},
        {"op": "log_mel", "preset": "nemo"},
        {"op": "spec_augment", "time_width": 0.05},
    ])
    feats, frame_lengths = chain((signals, lengths), seed=1, epoch=3, ids=sample_ids)

Params are dicts of arrays (one row per item; on the sampler's ``xp``).

Tolerances (GPU vs CPU): the draws are identical (integers and uniform floats are exact; what
goes through a transcendental function is computed on the host); masks (SpecAugment, crop,
shift) are exactly equal; resampling, noise and FFT convolution agree within 1e-4 relative to
the signal's peak (float32 arithmetic, different summation order / FFT).
"""

from __future__ import annotations

import math

import numpy as np

from .._validate import nonneg_float, nonneg_int
from ..device import array_module
from . import random as R
from ._augment_base import (
    Augment,
    Chain,
    applied,
    as_ids,
    below,
    host,
    on,
    uniform_range,
)
from ._spec_augment import (
    SPEC_FUSED_MAX_MASKS,
    spec_augment_apply,
    spec_augment_draws,
    spec_augment_fused,
    spec_augment_kernel,
    spec_params_of,
)
from .registry import Param, register

__all__ = [
    "Chain",
    "speed_perturb",
    "sample_speed_params",
    "apply_speed_perturb",
    "sample_gain_params",
    "apply_gain",
    "NoiseBank",
    "sample_noise_params",
    "apply_noise",
    "RirBank",
    "sample_rir_params",
    "apply_rir",
    "sample_time_shift_params",
    "apply_time_shift",
    "sample_crop_pad_params",
    "apply_crop_pad",
    "spec_augment",
    "sample_spec_augment_params",
    "apply_spec_augment",
    "SpeedPerturb",
    "Gain",
    "AddNoise",
    "Reverb",
    "TimeShift",
    "RandomCropPad",
    "LogMel",
    "SpecAugment",
    "train_chain",
]


# --- helpers -------------------------------------------------------------------------------------


def _batch(signals):
    """(xp, x [B, n], was_1d)."""
    xp = array_module(signals)
    x = xp.asarray(signals)
    if x.ndim == 1:
        return xp, x[None], True
    if x.ndim != 2:
        raise ValueError(f"signals must be [n] or [B, n], got shape {tuple(x.shape)}")
    return xp, x, False


def _lengths(lengths, B, n):
    """Host int64 [B] lengths (None: all ``n``), checked against ``n``."""
    if lengths is None:
        return np.full(B, n, dtype=np.int64)
    lens = host(np.asarray(lengths) if isinstance(lengths, (list, tuple)) else lengths)
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    if lens.shape[0] != B:
        raise ValueError(f"lengths must have {B} entries, got {lens.shape[0]}")
    if lens.size and (lens.min() < 0 or lens.max() > n):
        raise ValueError(f"lengths must be in [0, {n}], got {lens.min()}..{lens.max()}")
    return lens


def _like(lengths, new):
    """New host lengths as the caller gave lengths: on the GPU if they were a cupy array."""
    if lengths is None or isinstance(lengths, (np.ndarray, list, tuple)):
        return new
    return array_module(lengths).asarray(new)


def _valid(xp, lens_host, n):
    return xp.arange(n)[None, :] < xp.asarray(lens_host)[:, None]


def _float(xp, x):
    return x if x.dtype.kind == "f" else x.astype(xp.float32)


# --- speed perturbation --------------------------------------------------------------------------


def sample_speed_params(seed, epoch, ids, *, factors=None, factor_range=None, step=0.01,
                        p=1.0, stream="speed_perturb", xp=np):  # fmt: skip
    """``{"factor": float64 [B]}``: one of ``factors`` (uniformly), or uniform on
    ``factor_range=(low, high)`` rounded to a multiple of ``step`` (so that the resampling ratio
    stays a small rational: the source rate ``sample_rate * factor`` is an integer). With
    probability ``1 - p`` an item keeps factor 1."""
    ids = as_ids(ids, len(ids), xp)
    if (factors is None) == (factor_range is None):
        raise ValueError("give exactly one of factors or factor_range")
    if factors is not None:
        fs = np.asarray(factors, dtype=np.float64).reshape(-1)
        if fs.size == 0 or np.any(fs <= 0):
            raise ValueError(f"factors must be positive numbers, got {factors!r}")
        k = R.integers(seed, stream, epoch, ids, 1, high=fs.size, xp=xp)[:, 0]
        f = xp.asarray(fs)[k]
    else:
        lo, hi = uniform_range(factor_range, "factor_range")
        if lo <= 0:
            raise ValueError(f"factor_range must be positive, got {factor_range!r}")
        u = R.uniform(seed, stream, epoch, ids, 1, xp=xp)[:, 0]
        f = xp.rint((lo + (hi - lo) * u) / step) * step
        f = xp.clip(f, math.ceil(lo / step - 1e-9) * step, math.floor(hi / step + 1e-9) * step)
    if p < 1.0:
        f = xp.where(applied(seed, stream, epoch, ids, p, xp), f, 1.0)
    return {"factor": f}


def apply_speed_perturb(signals, lengths, params, *, sample_rate, quality="high"):
    """Speed-perturb each item by its ``params["factor"]`` (see :func:`speed_perturb`)."""
    xp, x, one = _batch(signals)
    x = _float(xp, x)
    B, n = x.shape
    lens = _lengths(lengths, B, n)
    f = np.asarray(host(params["factor"]), dtype=np.float64).reshape(-1)
    if f.size == 1:
        f = np.repeat(f, B)
    if f.size != B or np.any(f <= 0):
        raise ValueError(f"factor must be positive, a scalar or one per item ({B})")
    sr = int(sample_rate)
    src = np.rint(sr * f).astype(np.int64)  # the item is read as if sampled at src Hz
    src = np.maximum(src, 1)
    from ._resample import resample_rows

    # one launch for the whole batch on cupy (each row at its own rate); on numpy each row
    # alone over its own length, the rows on the cores' threads
    out, new = resample_rows(x, lens, src, sr, quality=quality)  # x's float dtype
    new_lens = _like(lengths, new)
    if one:
        return out[0], new_lens
    return out, new_lens


def speed_perturb(signals, lengths=None, *, factor, sample_rate, quality="high",
                  return_params=False):  # fmt: skip
    """Speed perturbation by resampling: ``factor`` 1.1 gives an item about 1/1.1 as long
    (``ceil(length / factor)`` samples), its pitch 1.1x higher (as ``sox speed``).

    ``signals [B, n]`` (zero-padded) or ``[n]``; ``lengths [B]`` samples (None: all ``n``);
    ``factor``: a scalar or one per item ``[B]`` (draw them with :func:`sample_speed_params`).
    Each item is resampled from ``round(sample_rate * factor)`` Hz to ``sample_rate`` with
    :func:`avpipe.ops.audio.resample` (windowed sinc, ``quality``); on the CPU each item alone
    over its own length (the same bits in any batch), the items on the cores' threads. Returns ``(signals [B, max new length], lengths [B])``, zeros past
    each new length (``[n']`` for a 1-D input)."""
    params = {"factor": factor}
    out = apply_speed_perturb(signals, lengths, params, sample_rate=sample_rate, quality=quality)
    return (*out, params) if return_params else out


# --- gain ----------------------------------------------------------------------------------------


def sample_gain_params(seed, epoch, ids, *, gain_db=(-6.0, 6.0), p=1.0, stream="gain", xp=np):
    """``{"gain_db": float64 [B]}`` uniform on ``gain_db``; 0 dB with probability ``1 - p``."""
    ids = as_ids(ids, len(ids), xp)
    lo, hi = uniform_range(gain_db, "gain_db")
    g = R.uniform(seed, stream, epoch, ids, 1, low=lo, high=hi, xp=xp)[:, 0]
    if p < 1.0:
        g = xp.where(applied(seed, stream, epoch, ids, p, xp), g, 0.0)
    return {"gain_db": g}


def apply_gain(signals, lengths, params):
    """``signals * 10 ** (gain_db / 20)`` per item; lengths unchanged."""
    xp, x, one = _batch(signals)
    x = _float(xp, x)
    g = on(xp, params["gain_db"], xp.float64).reshape(-1, 1)
    y = (x * (10.0 ** (g / 20.0))).astype(x.dtype)
    return (y[0] if one else y), lengths


# --- additive noise ------------------------------------------------------------------------------


class NoiseBank:
    """Noise clips for :func:`apply_noise`: a list of 1-D arrays (files and manifests:
    :func:`avpipe.pipeline.banks.noise_bank`). Stored as one flat
    float32 array with each clip's start and length, so that the per-item gather is one
    vectorized index (a device copy is made once per array module)."""

    def __init__(self, clips, *, sample_rate=None):
        arrays = []
        for c in clips:
            if isinstance(c, (str, bytes)) or hasattr(c, "__fspath__"):
                raise TypeError(
                    "this bank takes arrays; for files or a manifest use "
                    f"avpipe.pipeline.banks.noise_bank(...), got {c!r}"
                )
            a = np.asarray(host(c), dtype=np.float32).reshape(-1)
            if a.size == 0:
                raise ValueError("noise clips must not be empty")
            arrays.append(a)
        if not arrays:
            raise ValueError("a NoiseBank needs at least one clip")
        self.lengths = np.array([a.size for a in arrays], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.flat = np.concatenate(arrays)
        self._dev = {}

    def __len__(self):
        return self.lengths.size

    def on(self, xp):
        if xp is np:
            return self.flat, self.starts, self.lengths
        if xp not in self._dev:
            self._dev[xp] = tuple(xp.asarray(a) for a in (self.flat, self.starts, self.lengths))
        return self._dev[xp]


def sample_noise_params(seed, epoch, ids, *, clip_lengths, snr_db=(10.0, 30.0), p=1.0,
                        stream="noise", xp=np):  # fmt: skip
    """``{"clip": int64 [B], "offset": int64 [B], "snr_db": float64 [B], "apply": bool [B]}``:
    the noise clip (uniform over the bank), the start sample inside it (uniform over the clip),
    the SNR (uniform on ``snr_db``), applied with probability ``p``. ``clip_lengths``: the
    bank's clip lengths (``NoiseBank.lengths``)."""
    ids = as_ids(ids, len(ids), xp)
    cl = xp.asarray(np.asarray(clip_lengths, dtype=np.int64))
    w = R.words(seed, stream, epoch, ids, 3, xp=xp)
    clip = below(w[:, 0], cl.shape[0], xp)
    offset = below(w[:, 1], cl[clip], xp)
    lo, hi = uniform_range(snr_db, "snr_db")
    snr = lo + (hi - lo) * (w[:, 2].astype(xp.float64) * 2.0**-32)
    return {"clip": clip, "offset": offset, "snr_db": snr,
            "apply": applied(seed, stream, epoch, ids, p, xp)}  # fmt: skip


def apply_noise(signals, lengths, params, bank: NoiseBank):
    """Add each item's noise at its SNR: ``noise[t] = clip[(offset + t) mod len(clip)]`` over
    the item's valid samples (a short clip loops), scaled so that ``10 log10(P_signal /
    P_noise) = snr_db`` with powers the mean square over the valid samples. Items not applied,
    silent items and silent noise are left unchanged; zeros past each length stay zeros."""
    xp, x, one = _batch(signals)
    x = _float(xp, x)
    B, n = x.shape
    lens = _lengths(lengths, B, n)
    flat, starts, clen = bank.on(xp)
    clip = on(xp, params["clip"], xp.int64)
    off = on(xp, params["offset"], xp.int64)
    t = xp.arange(n, dtype=xp.int64)[None, :]
    valid = _valid(xp, lens, n)
    pos = starts[clip][:, None] + (off[:, None] + t) % clen[clip][:, None]
    noise = xp.where(valid, flat[pos], 0).astype(xp.float64)
    denom = xp.maximum(xp.asarray(lens), 1).astype(xp.float64)
    ps = (x.astype(xp.float64) ** 2).sum(axis=1) / denom
    pn = (noise**2).sum(axis=1) / denom
    snr = on(xp, params["snr_db"], xp.float64)
    ok = on(xp, params["apply"], bool) & (pn > 0)
    scale = xp.where(ok, xp.sqrt(ps / xp.where(pn > 0, pn, 1.0) / 10.0 ** (snr / 10.0)), 0.0)
    y = (x + scale[:, None] * noise).astype(x.dtype)
    return (y[0] if one else y), lengths


# --- room impulse response -----------------------------------------------------------------------


class RirBank:
    """Room impulse responses for :func:`apply_rir` (1-D arrays; files and manifests:
    :func:`avpipe.pipeline.banks.rir_bank`). ``align_peak``: drop the samples before each response's peak (the direct
    path), so the reverberant item is not delayed; ``normalize``: scale each to unit energy.
    Stored as a zero-padded ``[n_rirs, max_len]`` matrix."""

    def __init__(self, rirs, *, sample_rate=None, align_peak=True, normalize=True):
        arrays = []
        for r in rirs:
            if isinstance(r, (str, bytes)) or hasattr(r, "__fspath__"):
                raise TypeError(
                    "this bank takes arrays; for files or a manifest use "
                    f"avpipe.pipeline.banks.rir_bank(...), got {r!r}"
                )
            a = np.asarray(host(r), dtype=np.float64).reshape(-1)
            if a.size == 0 or not np.any(a):
                raise ValueError("impulse responses must not be empty or silent")
            if align_peak:
                a = a[int(np.argmax(np.abs(a))):]
            if normalize:
                a = a / np.sqrt(np.sum(a * a))
            arrays.append(a.astype(np.float32))
        if not arrays:
            raise ValueError("a RirBank needs at least one impulse response")
        self.lengths = np.array([a.size for a in arrays], dtype=np.int64)
        self.matrix = np.zeros((len(arrays), int(self.lengths.max())), np.float32)
        for i, a in enumerate(arrays):
            self.matrix[i, : a.size] = a
        self._dev = {}

    def __len__(self):
        return self.lengths.size

    def on(self, xp):
        if xp is np:
            return self.matrix
        if xp not in self._dev:
            self._dev[xp] = xp.asarray(self.matrix)
        return self._dev[xp]


def sample_rir_params(seed, epoch, ids, *, n_rirs, p=1.0, stream="reverb", xp=np):
    """``{"rir": int64 [B], "apply": bool [B]}``: a response uniformly, applied with
    probability ``p``."""
    ids = as_ids(ids, len(ids), xp)
    rir = R.integers(seed, stream, epoch, ids, 1, high=int(n_rirs), xp=xp)[:, 0]
    return {"rir": rir, "apply": applied(seed, stream, epoch, ids, p, xp)}


def _fft_size(n):
    """The smallest 2**a * 3**b >= n (fast on both numpy's pocketfft and cuFFT)."""
    best = 1 << max(0, (n - 1).bit_length())
    p3 = 1
    while p3 < best:
        v = p3
        while v < n:
            v *= 2
        best = min(best, v)
        p3 *= 3
    return best


def apply_rir(signals, lengths, params, bank: RirBank):
    """Reverberate each item: ``y[t] = sum_k h[k] x[t - k]`` for ``t`` below its length (the
    linear convolution cut to the item's length), by batched real FFTs of one size. Items not
    applied are unchanged; zeros past each length stay zeros."""
    xp, x, one = _batch(signals)
    x = _float(xp, x)
    B, n = x.shape
    lens = _lengths(lengths, B, n)
    if B == 0 or n == 0:
        return (x[0] if one else x), lengths
    mat = bank.on(xp)
    rir = on(xp, params["rir"], xp.int64)
    L = int(bank.lengths[host(rir)].max())
    h = mat[rir, :L]
    nfft = _fft_size(n + L - 1)
    valid = _valid(xp, lens, n)
    xv = xp.where(valid, x, 0)
    y = xp.fft.irfft(xp.fft.rfft(xv, nfft, axis=1) * xp.fft.rfft(h, nfft, axis=1), nfft, axis=1)
    y = xp.where(valid, y[:, :n], 0).astype(x.dtype)
    y = xp.where(on(xp, params["apply"], bool)[:, None], y, x)
    return (y[0] if one else y), lengths


# --- time shift ----------------------------------------------------------------------------------


def sample_time_shift_params(seed, epoch, ids, lengths, *, max_shift, p=1.0,
                             stream="time_shift", xp=np):  # fmt: skip
    """``{"shift": int64 [B]}`` uniform on ``[-m, m]`` samples, ``m = max_shift`` (int), or
    ``floor(max_shift * length)`` for a float below 1 (a fraction of the item); 0 with
    probability ``1 - p``."""
    ids = as_ids(ids, len(ids), xp)
    lens = on(xp, lengths, xp.int64).reshape(-1)
    if isinstance(max_shift, float) and max_shift < 1.0:
        m = xp.floor(lens.astype(xp.float64) * max_shift).astype(xp.int64)
    else:
        m = xp.full(lens.shape, int(max_shift), dtype=xp.int64)
    w = R.words(seed, stream, epoch, ids, 1, xp=xp)[:, 0]
    s = below(w, 2 * m + 1, xp) - m
    if p < 1.0:
        s = xp.where(applied(seed, stream, epoch, ids, p, xp), s, 0)
    return {"shift": s}


def apply_time_shift(signals, lengths, params, *, mode="zero"):
    """Shift each item's content by ``shift`` samples inside its valid length: ``y[t] =
    x[t - shift]``; ``mode="zero"`` fills the vacated samples with 0, ``"roll"`` wraps around
    the item's length. Lengths unchanged."""
    if mode not in ("zero", "roll"):
        raise ValueError(f"mode must be 'zero' or 'roll', got {mode!r}")
    xp, x, one = _batch(signals)
    B, n = x.shape
    lens = _lengths(lengths, B, n)
    L = xp.asarray(lens)[:, None]
    t = xp.arange(n, dtype=xp.int64)[None, :]
    src = t - on(xp, params["shift"], xp.int64)[:, None]
    if mode == "roll":
        src = src % xp.maximum(L, 1)
    ok = (src >= 0) & (src < L) & (t < L)
    y = xp.where(ok, xp.take_along_axis(x, xp.clip(src, 0, max(n - 1, 0)), axis=1), 0)
    return (y[0] if one else y).astype(x.dtype), lengths


# --- random crop / pad ---------------------------------------------------------------------------


def sample_crop_pad_params(seed, epoch, ids, lengths, *, length, stream="crop_pad", xp=np):
    """``{"offset": int64 [B]}``: the start of a ``length``-sample window, uniform over
    ``[0, item length - length]`` (0 for items not longer than ``length``)."""
    ids = as_ids(ids, len(ids), xp)
    lens = on(xp, lengths, xp.int64).reshape(-1)
    w = R.words(seed, stream, epoch, ids, 1, xp=xp)[:, 0]
    return {"offset": below(w, lens - int(length) + 1, xp)}


def apply_crop_pad(signals, lengths, params, *, length):
    """Every item to exactly ``length`` samples: a longer item is cut to ``[offset, offset +
    length)``, a shorter one zero-padded at the end. Returns ``(signals [B, length], lengths
    min(length, item length))``."""
    xp, x, one = _batch(signals)
    B, n = x.shape
    lens = _lengths(lengths, B, n)
    length = int(length)
    new = np.minimum(lens, length)
    t = xp.arange(length, dtype=xp.int64)[None, :]
    src = on(xp, params["offset"], xp.int64)[:, None] + t
    ok = t < xp.asarray(new)[:, None]
    if n == 0:
        y = xp.zeros((B, length), x.dtype)
    else:
        y = xp.where(ok, xp.take_along_axis(x, xp.clip(src, 0, n - 1), axis=1), 0).astype(x.dtype)
    new_lens = _like(lengths, new)
    return (y[0] if one else y), new_lens


# --- SpecAugment ---------------------------------------------------------------------------------


def sample_spec_augment_params(seed, epoch, ids, lengths, n_mels, *, freq_masks=2, freq_width=27,
                               time_masks=10, time_width=0.05, adaptive_time_masks=None,
                               stream="spec_augment", xp=np):  # fmt: skip
    """Mask positions for :func:`apply_spec_augment` (NeMo's SpecAugment draws):

    * each of ``freq_masks`` frequency masks: width uniform on ``0..F`` (``F = min(freq_width,
      n_mels)``), start uniform on ``0..n_mels - F``;
    * each of ``time_masks`` time masks: width uniform on ``0..W`` with ``W = time_width``
      frames, or ``max(1, floor(time_width * length))`` for ``time_width < 1``; start uniform on
      ``0..max(0, length - W)``; the mask is cut at the item's length.
    * ``adaptive_time_masks=r`` (masks per frame, Park et al. 2020): an item gets
      ``min(time_masks, floor(r * length))`` masks (the others get width 0).

    Returns ``{"freq_start", "freq_width": int64 [B, freq_masks], "time_start",
    "time_width": int64 [B, time_masks]}``. On cupy one kernel draws them all
    (``_spec_augment.cu``; this code is its reference, equal exactly), the four arrays views of
    one table."""
    kf, F, kt, time_width, adaptive_time_masks = _spec_settings(
        n_mels, freq_masks, freq_width, time_masks, time_width, adaptive_time_masks)
    if xp is not np:
        table, _ = spec_augment_draws(xp, seed, epoch, ids, lengths, n_mels, kf, F, kt,
                                      time_width, adaptive_time_masks, stream)
        return spec_params_of(table, kf, kt)
    ids = as_ids(ids, len(ids), xp)
    lens = on(xp, lengths, xp.int64).reshape(-1)
    wf = R.words(seed, stream + ".freq", epoch, ids, 2 * kf, xp=xp)
    fw = below(wf[:, :kf], F + 1, xp)
    fs = below(wf[:, kf:], int(n_mels) - F + 1, xp)
    if time_width < 1:
        W = xp.maximum(xp.floor(lens.astype(xp.float64) * float(time_width)).astype(xp.int64), 1)
    else:
        W = xp.full(lens.shape, int(time_width), dtype=xp.int64)
    wt = R.words(seed, stream + ".time", epoch, ids, 2 * kt, xp=xp)
    tw = below(wt[:, :kt], (W + 1)[:, None], xp)
    ts = below(wt[:, kt:], xp.maximum(lens - W + 1, 1)[:, None], xp)
    if adaptive_time_masks is not None:
        count = xp.minimum(
            xp.floor(lens.astype(xp.float64) * float(adaptive_time_masks)).astype(xp.int64), kt)
        tw = xp.where(xp.arange(kt)[None, :] < count[:, None], tw, 0)
    return {"freq_start": fs, "freq_width": fw, "time_start": ts, "time_width": tw}


def _spec_settings(n_mels, freq_masks, freq_width, time_masks, time_width, adaptive_time_masks):
    """The masks' settings, checked: ``(kf, F = min(freq_width, n_mels), kt, time_width,
    adaptive_time_masks)``."""
    kf = nonneg_int("freq_masks", freq_masks)
    kt = nonneg_int("time_masks", time_masks)
    fw = nonneg_float("freq_width", freq_width)
    tw = nonneg_float("time_width", time_width)
    r = None if adaptive_time_masks is None else nonneg_float("adaptive_time_masks",
                                                              adaptive_time_masks)
    return kf, min(int(fw), int(n_mels)), kt, tw, r


def apply_spec_augment(features, lengths, params, *, mask_value=0.0):
    """Set the masked cells of ``features [B, n_mels, T]`` to ``mask_value``: frequency masks
    over the item's valid frames, time masks over all channels; frames at or past an item's
    length are untouched. Vectorized (boolean masks ``[B, K, F]`` / ``[B, K, T]``); float32
    features on a GPU go through one CUDA kernel (``_spec_augment.cu``, this code its
    reference; equal exactly)."""
    xp = array_module(features)
    x = xp.asarray(features)
    if x.ndim != 3:
        raise ValueError(f"features must be [B, n_mels, T], got shape {tuple(x.shape)}")
    B, F, T = x.shape
    if xp is not np and x.dtype == xp.float32 and x.size:
        return spec_augment_kernel(xp, x, _lengths(lengths, B, T), params, mask_value)
    m = _spec_cells(xp, x.shape, _lengths(lengths, B, T), params)
    return xp.where(m, xp.asarray(mask_value, dtype=x.dtype), x)


def _spec_cells(xp, shape, lens_host, params):
    """The masked cells of a ``[B, F, T]`` batch: boolean ``[B, F, T]`` (the array-module
    reference of the kernels)."""
    B, F, T = shape
    lens = xp.asarray(lens_host)[:, None]
    f = xp.arange(F)[None, None, :]
    t = xp.arange(T)[None, None, :]
    fs = on(xp, params["freq_start"], xp.int64)[:, :, None]
    fw = on(xp, params["freq_width"], xp.int64)[:, :, None]
    ts = on(xp, params["time_start"], xp.int64)[:, :, None]
    tw = on(xp, params["time_width"], xp.int64)[:, :, None]
    fmask = ((f >= fs) & (f < fs + fw)).any(axis=1)  # [B, F]
    valid = xp.arange(T)[None, :] < lens  # [B, T]
    tmask = ((t >= ts) & (t < xp.minimum(ts + tw, lens[:, :, None]))).any(axis=1) & valid
    return (fmask[:, :, None] & valid[:, None, :]) | tmask[:, None, :]


def spec_augment(features, lengths=None, *, freq_masks=2, freq_width=27, time_masks=10,
                 time_width=0.05, seed=0, epoch=0, ids=None, adaptive_time_masks=None,
                 mask_value=0.0, return_params=False, inplace=False):  # fmt: skip
    """SpecAugment (Park et al. 2019; NeMo's draws): frequency and time masks set to 0.

    ``features [B, n_mels, T]``; ``lengths [B]`` frames (None: all ``T``); frames at or past an
    item's length are untouched. ``time_width < 1``: a fraction of the item's length, else
    frames. ``adaptive_time_masks``: masks per frame (count ``min(time_masks, floor(r *
    length))``). Draws keyed by ``(seed, epoch, ids)`` (``ids`` default ``arange(B)``): the same
    seed gives the same masks on CPU and GPU. ``return_params``: also the mask positions
    (:func:`sample_spec_augment_params`; replay with :func:`apply_spec_augment`).
    ``inplace``: mask ``features`` itself and return it (on a GPU, float32 and contiguous,
    only the masked cells are written; a read-only array is refused)."""
    xp = array_module(features)
    B, F, T = features.shape
    if inplace and xp is np and not (isinstance(features, np.ndarray)
                                     and features.flags.writeable):  # fmt: skip
        raise ValueError("inplace=True needs a writeable features array, got a read-only "
                         f"{type(features).__name__}")
    lens = _lengths(lengths, B, T)
    kw = dict(freq_masks=freq_masks, freq_width=freq_width, time_masks=time_masks,
              time_width=time_width, adaptive_time_masks=adaptive_time_masks,
              stream="spec_augment")
    if xp is not np and features.dtype == xp.float32 and features.size:
        kf, fcap, kt, tw, r = _spec_settings(F, freq_masks, freq_width, time_masks, time_width,
                                             adaptive_time_masks)
        if not return_params and kf + kt <= SPEC_FUSED_MAX_MASKS:
            # drawn and applied in one launch, the ids and lengths in its parameters
            return spec_augment_fused(xp, features, seed, epoch, _host_ids(features, ids), lens,
                                      kf, fcap, kt, tw, r, "spec_augment", mask_value, inplace)
        # the draws' table on the device (handed back), then the masks: two kernels
        table, lens_d = spec_augment_draws(xp, seed, epoch, _host_ids(features, ids), lens,
                                           F, kf, fcap, kt, tw, r, "spec_augment")
        out = spec_augment_apply(xp, features, lens_d, table, kf, kt, mask_value)
        if inplace and out is not features:
            features[...] = out
            out = features
        return (out, spec_params_of(table, kf, kt)) if return_params else out
    params = sample_spec_augment_params(seed, epoch, _host_ids(features, ids), lens, F, **kw)
    if inplace:  # (the CPU, or a GPU array not float32): the masked cells alone written
        features[_spec_cells(xp, features.shape, lens, params)] = mask_value
        out = features
    else:
        out = apply_spec_augment(features, lens, params, mask_value=mask_value)
    if return_params:
        return out, {k: xp.asarray(v) for k, v in params.items()}
    return out


# --- ops for chains ------------------------------------------------------------------------------


def _data(data):
    try:
        x, lens = data
    except (TypeError, ValueError):
        raise TypeError("audio ops take (signals, lengths) pairs") from None
    return x, lens


def _ids_for(x, ids):
    xp = array_module(x)
    n = 1 if x.ndim == 1 else x.shape[0]
    return xp, as_ids(ids, n, xp)


def _host_ids(x, ids):
    """Sample ids on the host (for draws whose parameters are read on the host)."""
    n = 1 if x.ndim == 1 else x.shape[0]
    return as_ids(None if ids is None else host(ids), n, np)


def _on_host(lens):
    """Whether lengths are held on the host (None: the full length, known on the host)."""
    return lens is None or isinstance(lens, (np.ndarray, list, tuple, int, np.integer))


def _lens_for(x, lens):
    xb = x[None] if x.ndim == 1 else x
    return _lengths(lens, xb.shape[0], xb.shape[-1])


def _log_mel_fields():
    """LogMel's keyword overrides: the fields of LogMelConfig (its name and rate aside)."""
    import dataclasses
    import typing

    from ._audio_presets import LogMelConfig
    from .registry import INHERITED, _types_of

    hints = typing.get_type_hints(LogMelConfig)
    return [Param(f.name, INHERITED, _types_of(hints[f.name]))
            for f in dataclasses.fields(LogMelConfig) if f.name not in ("name", "sample_rate")]


_LOG_MEL_FIELDS = _log_mel_fields()


def _check_log_mel(args):
    from .audio import PRESETS, LogMelConfig

    p = args.get("preset", "nemo")
    if not isinstance(p, LogMelConfig) and p not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {p!r}")


@register(kind="audio", stage="signal")
class SpeedPerturb(Augment):
    """Speed perturbation (:func:`sample_speed_params`, :func:`apply_speed_perturb`)."""

    name = "speed_perturb"

    def __init__(self, factors=None, factor_range=None, *, sample_rate=16000, step=0.01, p=1.0,
                 quality="high", stream=None):  # fmt: skip
        super().__init__(stream)
        if factors is None and factor_range is None:
            factors = (0.9, 1.0, 1.1)
        self.factors, self.factor_range = factors, factor_range
        self.sample_rate, self.step, self.p, self.quality = sample_rate, step, p, quality

    def sample(self, data, *, seed, epoch=0, ids=None):
        # drawn on the host: the resampler reads the factors there (the same draws as on the
        # device: ops.random), so a GPU batch waits for no device copy
        x, _ = _data(data)
        return sample_speed_params(seed, epoch, _host_ids(x, ids), factors=self.factors,
                                   factor_range=self.factor_range, step=self.step, p=self.p,
                                   stream=self.stream, xp=np)  # fmt: skip

    def apply(self, data, params):
        x, lens = _data(data)
        return apply_speed_perturb(x, lens, params, sample_rate=self.sample_rate,
                                   quality=self.quality)  # fmt: skip


@register(kind="audio", stage="signal")
class Gain(Augment):
    """A random gain per item, uniform in ``gain_db`` decibels (:func:`sample_gain_params`,
    :func:`apply_gain`)."""

    name = "gain"

    def __init__(self, gain_db=(-6.0, 6.0), *, p=1.0, stream=None):
        super().__init__(stream)
        self.gain_db, self.p = gain_db, p

    def sample(self, data, *, seed, epoch=0, ids=None):
        x, _ = _data(data)
        xp, ids = _ids_for(x, ids)
        return sample_gain_params(seed, epoch, ids, gain_db=self.gain_db, p=self.p,
                                  stream=self.stream, xp=xp)  # fmt: skip

    def apply(self, data, params):
        return apply_gain(*_data(data), params)


@register(kind="audio", stage="signal")
class AddNoise(Augment):
    """Additive noise at an SNR drawn from ``snr_db``, from ``noise`` (a :class:`NoiseBank`, or
    a list of arrays / files, the noise manifest)."""

    name = "noise"

    def __init__(self, noise, *, snr_db=(10.0, 30.0), p=1.0, sample_rate=None, stream=None):
        super().__init__(stream)
        self.bank = noise if isinstance(noise, NoiseBank) else NoiseBank(noise, sample_rate=sample_rate)
        self.snr_db, self.p = snr_db, p

    def sample(self, data, *, seed, epoch=0, ids=None):
        x, _ = _data(data)
        xp, ids = _ids_for(x, ids)
        return sample_noise_params(seed, epoch, ids, clip_lengths=self.bank.lengths,
                                   snr_db=self.snr_db, p=self.p, stream=self.stream, xp=xp)  # fmt: skip

    def apply(self, data, params):
        return apply_noise(*_data(data), params, self.bank)


@register(kind="audio", stage="signal")
class Reverb(Augment):
    """Room-impulse convolution by FFT, from ``rirs`` (a :class:`RirBank` or a list)."""

    name = "reverb"

    def __init__(self, rirs, *, p=1.0, sample_rate=None, align_peak=True, normalize=True,
                 stream=None):  # fmt: skip
        super().__init__(stream)
        self.bank = rirs if isinstance(rirs, RirBank) else RirBank(
            rirs, sample_rate=sample_rate, align_peak=align_peak, normalize=normalize)
        self.p = p

    def sample(self, data, *, seed, epoch=0, ids=None):
        x, _ = _data(data)
        xp, ids = _ids_for(x, ids)
        return sample_rir_params(seed, epoch, ids, n_rirs=len(self.bank), p=self.p,
                                 stream=self.stream, xp=xp)  # fmt: skip

    def apply(self, data, params):
        return apply_rir(*_data(data), params, self.bank)


@register(kind="audio", stage="signal")
class TimeShift(Augment):
    """A random shift of each item's content inside its length (:func:`sample_time_shift_params`,
    :func:`apply_time_shift`)."""

    name = "time_shift"

    def __init__(self, max_shift=0.1, *, mode="zero", p=1.0, stream=None):
        super().__init__(stream)
        self.max_shift, self.mode, self.p = max_shift, mode, p

    def sample(self, data, *, seed, epoch=0, ids=None):
        x, lens = _data(data)
        xp, ids = _ids_for(x, ids)
        return sample_time_shift_params(seed, epoch, ids, _lens_for(x, lens),
                                        max_shift=self.max_shift, p=self.p, stream=self.stream,
                                        xp=xp)  # fmt: skip

    def apply(self, data, params):
        return apply_time_shift(*_data(data), params, mode=self.mode)


@register(kind="audio", stage="signal")
class RandomCropPad(Augment):
    """Every item to ``length`` samples: a random window of a longer one, zeros after a shorter one
    (:func:`sample_crop_pad_params`, :func:`apply_crop_pad`)."""

    name = "crop_pad"

    def __init__(self, length, *, stream=None):
        super().__init__(stream)
        self.length = int(length)

    def sample(self, data, *, seed, epoch=0, ids=None):
        x, lens = _data(data)
        xp, ids = _ids_for(x, ids)
        return sample_crop_pad_params(seed, epoch, ids, _lens_for(x, lens), length=self.length,
                                      stream=self.stream, xp=xp)  # fmt: skip

    def apply(self, data, params):
        return apply_crop_pad(*_data(data), params, length=self.length)


@register(kind="audio", stage="signal", gives="features", context=("sample_rate",),
          params=_LOG_MEL_FIELDS, validate=_check_log_mel)
class LogMel(Augment):
    """:func:`avpipe.ops.audio.log_mel` as a chain step: ``(signals, lengths) -> (features,
    frame_lengths)`` (deterministic: no dither). ``preset`` (a name or a
    :class:`~avpipe.ops.audio.LogMelConfig`), with any of its fields overridden by keyword;
    ``sample_rate``: the signals' rate, set into the config (None: the preset's)."""

    name = "log_mel"

    def __init__(self, preset="nemo", *, sample_rate=None, stream=None, **overrides):
        super().__init__(stream)
        self.preset = preset
        if overrides or sample_rate is not None:
            from .audio import resolve_preset

            cfg = resolve_preset(preset)
            cfg = cfg.replace(**overrides) if overrides else cfg
            if sample_rate is not None and cfg.sample_rate != sample_rate:
                cfg = cfg.replace(sample_rate=sample_rate)
            self.preset = cfg

    def apply(self, data, params):
        from .audio import log_mel, log_mel_frame_lengths

        x, lens = _data(data)
        feats, fl = log_mel(x, lens, preset=self.preset)
        if _on_host(lens):  # frame lengths where the lengths were: the next op reads them
            n = np.full(1 if x.ndim == 1 else x.shape[0], x.shape[-1]) if lens is None else lens
            fl = log_mel_frame_lengths(np.asarray(n).reshape(-1), preset=self.preset,
                                       frames=feats.shape[-1])
        return feats, fl


@register(kind="audio", stage="features")
class SpecAugment(Augment):
    """SpecAugment on ``(features, frame_lengths)`` (:func:`spec_augment`)."""

    name = "spec_augment"

    def __init__(self, freq_masks=2, freq_width=27, time_masks=10, time_width=0.05, *,
                 adaptive_time_masks=None, mask_value=0.0, stream=None):  # fmt: skip
        super().__init__(stream)
        self.freq_masks, self.freq_width = freq_masks, freq_width
        self.time_masks, self.time_width = time_masks, time_width
        self.adaptive_time_masks, self.mask_value = adaptive_time_masks, mask_value

    def sample(self, data, *, seed, epoch=0, ids=None):
        # on the features' device (on a GPU one kernel draws them: the same draws as the host's)
        x, lens = _data(data)
        B, F, T = x.shape
        return sample_spec_augment_params(
            seed, epoch, _host_ids(x, ids), _lengths(lens, B, T), F,
            freq_masks=self.freq_masks, freq_width=self.freq_width, time_masks=self.time_masks,
            time_width=self.time_width, adaptive_time_masks=self.adaptive_time_masks,
            stream=self.stream, xp=array_module(x))  # fmt: skip

    def apply(self, data, params):
        x, lens = _data(data)
        return apply_spec_augment(x, lens, params, mask_value=self.mask_value), lens


def train_chain(*, sample_rate=16000, factors=(0.9, 1.0, 1.1), noise=None, snr_db=(10.0, 30.0),
                noise_p=0.5, rirs=None, rir_p=0.5, preset="nemo", freq_masks=2, freq_width=27,
                time_masks=10, time_width=0.05):  # fmt: skip
    """The usual ASR training stack: speed -> noise -> RIR -> log-mel -> SpecAugment (the noise
    and RIR steps only when ``noise`` / ``rirs`` are given)."""
    ops = [SpeedPerturb(factors, sample_rate=sample_rate)]
    if noise is not None:
        ops.append(AddNoise(noise, snr_db=snr_db, p=noise_p))
    if rirs is not None:
        ops.append(Reverb(rirs, p=rir_p))
    ops += [LogMel(preset), SpecAugment(freq_masks, freq_width, time_masks, time_width)]
    return Chain(ops)
