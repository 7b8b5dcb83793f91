"""Audio operators, written once against the array module (numpy on the CPU, cupy on a GPU).

Conventions shared by every function here:

* a batch of signals is ``[B, n]`` (zero-padded to the longest item) with ``lengths [B]`` in
  samples; features are ``[B, F, T]`` with ``frame_lengths [B]`` in frames;
* samples past an item's length never influence that item's valid outputs, and every output
  position past an item's length is exactly ``0``;
* results stay on the input's device and are float32 unless stated otherwise.

Private: the public names are re-exported by :mod:`avpipe.ops.audio`.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .._validate import check_choice, pos_float
from .._validate import pos_int as _pos_int
from ..device import array_module
from ._sparse_rows import SparseRows

# --------------------------------------------------------------------------------------------
# argument helpers
# --------------------------------------------------------------------------------------------


def _as_batch(signals, name="signals"):
    """``[n]`` -> ``[1, n]`` (returns the flag), ``[B, n]`` as is; float32 (float64 stays)."""
    xp = array_module(signals)
    x = xp.asarray(signals)
    if x.ndim not in (1, 2):
        raise ValueError(f"{name} must be [n] or [B, n], got shape {tuple(x.shape)}")
    single = x.ndim == 1
    if single:
        x = x[None, :]
    if x.dtype not in (xp.float32, xp.float64):
        if x.dtype.kind not in "fiu":
            raise TypeError(f"{name} must be a real array, got dtype {x.dtype}")
        x = x.astype(xp.float32)
    return xp, x, single


def _as_batch3(x, name, dims):
    """``[C, T]`` -> ``[1, C, T]`` (returns the flag), ``[B, C, T]`` as is; float32.
    ``dims`` names the axes for the error message, e.g. ``"F, T"``."""
    xp = array_module(x)
    s = xp.asarray(x, dtype=xp.float32)
    single = s.ndim == 2
    if single:
        s = s[None]
    if s.ndim != 3:
        raise ValueError(f"{name} must be [{dims}] or [B, {dims}], got shape {tuple(s.shape)}")
    return xp, s, single


def _as_lengths(xp, lengths, batch, limit, name="lengths"):
    """Host int64 numpy lengths (validated) and the same on the array's device."""
    if lengths is None:
        host = np.full(batch, limit, dtype=np.int64)
    else:
        host = np.asarray(lengths.get() if hasattr(lengths, "get") else lengths)
        if host.ndim == 0:
            host = host[None]
        if host.shape != (batch,):
            raise ValueError(f"{name} must have shape [{batch}], got {tuple(host.shape)}")
        if host.dtype.kind not in "iu":
            if host.dtype.kind == "f" and np.all(host == np.round(host)):
                host = host.astype(np.int64)
            else:
                raise TypeError(f"{name} must hold integers, got dtype {host.dtype}")
        host = host.astype(np.int64)
        if host.size and (host.min() < 0 or host.max() > limit):
            raise ValueError(f"{name} must lie in [0, {limit}], got {host.tolist()}")
    return host, xp.asarray(host)


def time_mask(xp, lengths_dev, size):
    """Boolean ``[B, size]``: True where the position is inside the item."""
    return xp.arange(size)[None, :] < lengths_dev[:, None]


def _mask_time(x, lengths_dev):
    """Zero every position of the last axis past each item's length (x: [B, ..., T])."""
    xp = array_module(x)
    m = time_mask(xp, lengths_dev, x.shape[-1])
    if x.ndim == 3:
        m = m[:, None, :]
    return xp.where(m, x, xp.zeros((), x.dtype))


# --------------------------------------------------------------------------------------------
# waveform operators
# --------------------------------------------------------------------------------------------


def _normal(xp, seed, shape, lengths=None):
    """float32 standard normal noise: numpy's PCG64 (ziggurat) on the CPU, the counter-based
    :func:`avpipe.ops.random.standard_normal` on a GPU (one kernel, nothing to set up: a cuRAND
    generator made per call waits for the whole device, which holds a feed's producer to the
    GPU's pace every batch). The two devices draw different values from the same seed (the
    counter-based draws cost the CPU 15x PCG64's time). ``seed`` None: fresh noise.
    ``lengths`` (host, one per row of a 2-D shape): the rows' elements past them are 0, not
    drawn (they are masked anyway). On the CPU each row of a 2-D shape is its own PCG64 stream
    (:func:`_normal_row`), so a row's draws can be made alone, on any thread."""
    if xp is np:
        if len(shape) != 2:
            return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
        seed = _noise_seed(seed)
        out = np.zeros(shape, np.float32)
        lens = np.full(shape[0], shape[1]) if lengths is None else np.asarray(lengths)
        for b in range(shape[0]):
            m = min(int(lens[b]), shape[1])
            out[b, :m] = _normal_row(seed, b, m)
        return out
    import secrets

    from . import random as _random

    if seed is None:
        seed = secrets.randbits(64)
    return _random.standard_normal(int(seed), "dither", shape, lengths=lengths, xp=xp)


def _noise_seed(seed):
    """``seed``, or fresh entropy for None (one value for every row of a batch)."""
    if seed is None:
        import secrets

        return secrets.randbits(64)
    return seed


def _normal_row(seed, row, n):
    """Row ``row`` of the CPU's noise of ``seed`` (see :func:`_normal`): ``n`` float32 standard
    normal draws of the PCG64 stream seeded by ``(seed, row)``, the row's first ``n``
    elements whatever its length."""
    return np.random.default_rng([seed, row]).standard_normal(n, dtype=np.float32)


def dither(signals, lengths=None, *, scale=1e-5, seed=None):
    """Add white Gaussian noise of standard deviation ``scale`` inside each item's length.

    ``seed``: an int for reproducible noise (drawn on the signals' device), None for fresh noise.
    Returns ``[B, n]`` (or ``[n]`` for 1-D input) float32.
    """
    if not (isinstance(scale, (int, float)) and scale >= 0):
        raise ValueError(f"scale must be a non-negative number, got {scale!r}")
    xp, x, single = _as_batch(signals)
    _, lens = _as_lengths(xp, lengths, x.shape[0], x.shape[1])
    if scale == 0:
        out = _mask_time(x, lens)
    else:
        # the CPU draws each item's samples only (a GPU's noise past them is masked)
        noise = _normal(xp, seed, x.shape, lengths=np.asarray(lens) if xp is np else None)
        out = _mask_time(x + x.dtype.type(scale) * noise.astype(x.dtype), lens)
    return out[0] if single else out


def preemphasis(signals, lengths=None, *, coeff=0.97):
    """``y[0] = x[0]``, ``y[t] = x[t] - coeff * x[t-1]``, zero past each item's length.

    (NeMo's and MLPerf's form: the first sample is kept, not filtered against a zero.)
    """
    if not isinstance(coeff, (int, float)):
        raise ValueError(f"coeff must be a number, got {coeff!r}")
    xp, x, single = _as_batch(signals)
    _, lens = _as_lengths(xp, lengths, x.shape[0], x.shape[1])
    y = xp.empty_like(x)
    y[:, :1] = x[:, :1]
    y[:, 1:] = x[:, 1:] - x.dtype.type(coeff) * x[:, :-1]
    y = _mask_time(y, lens)
    return y[0] if single else y


# --------------------------------------------------------------------------------------------
# windows, framing and the STFT
# --------------------------------------------------------------------------------------------

_WINDOWS = ("hann", "hamming", "blackman", "ones", "rectangular")


@functools.lru_cache(maxsize=64)
def _window_np(name, win_length, periodic, n_fft):
    """The window (float64), zero-padded on both sides to ``n_fft`` (centred as torch.stft)."""
    check_choice("window", name, list(_WINDOWS))
    N = win_length
    if name in ("ones", "rectangular"):
        w = np.ones(N)
    else:
        denom = N if periodic else N - 1
        k = np.arange(N, dtype=np.float64)
        ph = 2 * np.pi * k / denom if denom > 0 else np.zeros(N)
        if name == "hann":
            w = 0.5 - 0.5 * np.cos(ph)
        elif name == "hamming":
            w = 0.54 - 0.46 * np.cos(ph)
        else:
            w = 0.42 - 0.5 * np.cos(ph) + 0.08 * np.cos(2 * ph)
        if N == 1:
            w = np.ones(1)
    left = (n_fft - N) // 2
    full = np.zeros(n_fft)
    full[left:left + N] = w
    return full


def get_window(name="hann", win_length=400, *, periodic=False, n_fft=None):
    """A window as float32 numpy ``[n_fft or win_length]``.

    ``periodic=False``: symmetric (``torch.hann_window(N, periodic=False)``, NeMo, MLPerf);
    ``periodic=True``: the DFT-even window (librosa / scipy ``get_window("hann", N)``).
    With ``n_fft`` the window is centred in ``n_fft`` samples (zeros both sides).
    """
    win_length = _pos_int("win_length", win_length)
    n_fft = win_length if n_fft is None else _pos_int("n_fft", n_fft)
    if win_length > n_fft:
        raise ValueError(f"win_length must be <= n_fft ({n_fft}), got {win_length}")
    return _window_np(name, win_length, bool(periodic), n_fft).astype(np.float32)


def stft_frame_lengths(lengths, *, n_fft, hop_length, center=True):
    """Frames an item of ``lengths`` samples yields (host int64 numpy).

    centre: ``1 + n // hop`` (``0`` for an empty item); else ``1 + (n - n_fft) // hop`` for
    ``n >= n_fft``, and ``0`` frames below one window.
    """
    n = np.asarray(lengths, dtype=np.int64)
    if center:
        return np.where(n > 0, 1 + n // hop_length, 0)
    return np.where(n >= n_fft, 1 + (n - n_fft) // max(hop_length, 1), 0)


def _pad_items(xp, x, lens_host, lens_dev, pad, pad_mode):
    """Pad each item by ``pad`` samples on both sides of *its own* length -> ``[B, n + 2 pad]``.

    ``constant``: zeros. ``reflect``: mirror without repeating the edge sample (numpy/torch
    'reflect'); an item with fewer than ``pad + 1`` samples is zero-padded instead (documented
    rule: reflection needs more samples than the pad). Past ``length + pad`` it is zero.
    """
    B, n = x.shape
    L = n + 2 * pad
    if pad_mode == "constant" or pad == 0:
        out = xp.zeros((B, L), dtype=x.dtype)
        out[:, pad:pad + n] = _mask_time(x, lens_dev)
        return out
    if pad_mode != "reflect":
        raise ValueError(f"pad_mode must be 'constant' or 'reflect', got {pad_mode!r}")
    q = xp.arange(L, dtype=xp.int64)[None, :] - pad                     # [1, L]
    nn = lens_dev[:, None]                                              # [B, 1]
    can = (nn > pad)
    qr = xp.where(q < 0, -q, q)
    qr = xp.where(qr >= nn, 2 * (nn - 1) - qr, qr)
    reflected_ok = can & (qr >= 0) & (qr < nn) & (q < nn + pad)
    plain_ok = (q >= 0) & (q < nn)
    idx = xp.where(can, qr, q)
    ok = xp.where(can, reflected_ok, plain_ok)
    idx = xp.clip(idx, 0, max(n - 1, 0))
    if n == 0:
        return xp.zeros((B, L), dtype=x.dtype)
    vals = xp.take_along_axis(x, idx, axis=1)
    return xp.where(ok, vals, xp.zeros((), x.dtype))


def _frames(xp, padded, n_fft, hop, T):
    """A strided ``[B, T, n_fft]`` view of ``padded`` (no copy)."""
    B, L = padded.shape
    padded = xp.ascontiguousarray(padded)
    need = (T - 1) * hop + n_fft
    if need > L:
        padded = xp.concatenate([padded, xp.zeros((B, need - L), padded.dtype)], axis=1)
    s0, s1 = padded.strides
    if xp is np:
        from numpy.lib.stride_tricks import as_strided
    else:
        from cupy.lib.stride_tricks import as_strided
    return as_strided(padded, shape=(B, T, n_fft), strides=(s0, hop * s1, s1))


def stft(signals, lengths=None, *, n_fft=512, hop_length=160, win_length=None, window="hann",
         periodic=False, center=True, pad_mode="constant", power=None, compute_dtype=None):
    """Short-time Fourier transform, batched over items of different lengths.

    Returns ``(spec [B, n_fft//2 + 1, T], frame_lengths [B])`` (``[F, T]`` for 1-D input);
    ``spec`` is complex64 for ``power=None``, else float32 ``|X| ** power`` (1: magnitude,
    2: power). Frames start every ``hop_length`` samples; with ``center`` each item is padded
    by ``n_fft // 2`` on both sides of its own length (``pad_mode`` "constant" or "reflect").
    The ``win_length`` window (``periodic=False``: symmetric) is centred in ``n_fft`` as in
    torch.stft / librosa. ``T = max over the padded batch``; frames past an item's
    ``frame_lengths`` are 0. An item shorter than one window without ``center`` yields 0 frames.

    ``compute_dtype``: the FFT's precision — None: float64 on the CPU (numpy; its float32 FFT
    loses ~2e-4 in the log of the weakest mel bands), float32 on a GPU (cupy); outputs are
    complex64 / float32 either way.
    """
    n_fft = _pos_int("n_fft", n_fft)
    hop = _pos_int("hop_length", hop_length)
    win = n_fft if win_length is None else _pos_int("win_length", win_length)
    if win > n_fft:
        raise ValueError(f"win_length must be <= n_fft ({n_fft}), got {win}")
    if power is not None and not (isinstance(power, (int, float)) and power > 0):
        raise ValueError(f"power must be None or a positive number, got {power!r}")
    xp, x, single = _as_batch(signals)
    B, n = x.shape
    lens_host, lens_dev = _as_lengths(xp, lengths, B, n)
    pad = n_fft // 2 if center else 0
    flen_host = stft_frame_lengths(lens_host, n_fft=n_fft, hop_length=hop, center=center)
    T = int(stft_frame_lengths([n], n_fft=n_fft, hop_length=hop, center=center)[0]) if n else 0
    T = max(T, int(flen_host.max()) if B else 0)
    F = n_fft // 2 + 1
    flen_dev = xp.asarray(flen_host)
    if T == 0:
        dt = xp.complex64 if power is None else xp.float32
        spec = xp.zeros((B, F, 0), dtype=dt)
        return (spec[0] if single else spec), (flen_dev[0] if single else flen_dev)
    padded = _pad_items(xp, x, lens_host, lens_dev, pad, pad_mode)
    frames = _frames(xp, padded, n_fft, hop, T)                       # [B, T, n_fft] view
    if compute_dtype is None:
        cdt = np.float64 if xp is np else np.float32
    else:
        cdt = np.dtype(compute_dtype).type
        if cdt not in (np.float32, np.float64):
            raise ValueError(f"compute_dtype must be float32, float64 or None, got {compute_dtype!r}")
    w = xp.asarray(_window_np(window, win, bool(periodic), n_fft).astype(cdt))
    X = xp.fft.rfft(frames.astype(cdt) * w, axis=-1)                   # [B, T, F]
    if power is None:
        out = X.astype(xp.complex64)
    else:
        out = X.real * X.real + X.imag * X.imag
        if power == 1:
            out = xp.sqrt(out)
        elif power != 2:
            out = out ** (power / 2.0)
        out = out.astype(xp.float32)
    out = xp.ascontiguousarray(xp.swapaxes(out, 1, 2))                 # [B, F, T]
    out = _mask_time(out, flen_dev)
    return (out[0] if single else out), (flen_dev[0] if single else flen_dev)


def spectrogram(signals, lengths=None, *, n_fft=512, hop_length=160, win_length=None,
                window="hann", periodic=False, center=True, pad_mode="constant", power=2.0,
                compute_dtype=None):
    """:func:`stft` with ``power`` (default 2: the power spectrogram), float32."""
    if power is None:
        raise ValueError("power must be a positive number for spectrogram, got None")
    return stft(signals, lengths, n_fft=n_fft, hop_length=hop_length, win_length=win_length,
                window=window, periodic=periodic, center=center, pad_mode=pad_mode, power=power,
                compute_dtype=compute_dtype)


# --------------------------------------------------------------------------------------------
# mel filterbank (librosa-compatible)
# --------------------------------------------------------------------------------------------


def hz_to_mel(freqs, *, htk=False):
    """Hz -> mel. ``htk``: ``2595 log10(1 + f/700)``; else Slaney's (linear below 1 kHz, log above)."""
    f = np.asarray(freqs, dtype=np.float64)
    if htk:
        return 2595.0 * np.log10(1.0 + f / 700.0)
    f_sp = 200.0 / 3
    mels = f / f_sp
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0
    return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-300) / min_log_hz) / logstep,
                    mels)


def mel_to_hz(mels, *, htk=False):
    """mel -> Hz (the inverse of :func:`hz_to_mel`)."""
    m = np.asarray(mels, dtype=np.float64)
    if htk:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    f_sp = 200.0 / 3
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


@functools.lru_cache(maxsize=32)
def _mel_fb_np(sample_rate, n_fft, n_mels, fmin, fmax, htk, norm):
    fftfreqs = np.linspace(0, sample_rate / 2.0, n_fft // 2 + 1)
    mel_pts = mel_to_hz(np.linspace(hz_to_mel(fmin, htk=htk), hz_to_mel(fmax, htk=htk), n_mels + 2),
                        htk=htk)
    fdiff = np.diff(mel_pts)
    ramps = mel_pts[:, None] - fftfreqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    if norm == "slaney":
        weights *= (2.0 / (mel_pts[2:n_mels + 2] - mel_pts[:n_mels]))[:, None]
    elif norm is not None:
        p = float(norm)
        weights /= np.maximum(np.sum(np.abs(weights) ** p, axis=1, keepdims=True) ** (1.0 / p),
                              np.finfo(np.float64).tiny)
    return weights


def mel_filterbank(*, sample_rate=16000, n_fft=512, n_mels=80, fmin=0.0, fmax=None, htk=False,
                   norm="slaney", dtype=np.float32):
    """Triangular mel filters ``[n_mels, n_fft // 2 + 1]`` as numpy (``librosa.filters.mel``).

    ``htk``: the HTK mel scale, else Slaney's; ``norm``: ``"slaney"`` (area 1 per filter,
    librosa's default), None, or a number p (unit p-norm per filter).
    """
    sample_rate = _pos_int("sample_rate", sample_rate)
    n_fft = _pos_int("n_fft", n_fft)
    n_mels = _pos_int("n_mels", n_mels)
    fmax = sample_rate / 2.0 if fmax is None else float(fmax)
    if not 0 <= float(fmin) < fmax:
        raise ValueError(f"fmin must be >= 0 and < fmax ({fmax}), got {fmin!r}")
    if not (norm is None or norm == "slaney" or isinstance(norm, (int, float))):
        raise ValueError(f"norm must be 'slaney', None or a number, got {norm!r}")
    return _mel_fb_np(sample_rate, n_fft, n_mels, float(fmin), fmax, bool(htk), norm).astype(dtype)


_SPARSE_ROWS: dict = {}


def _weights_times(xp, w, s):
    """``w[None] @ s`` (``[K, F] x [B, F, T] -> [B, K, T]``) float32. On the CPU each output
    is a function of its own column of ``s`` (float64 sums over ``w``'s nonzero span, in a
    fixed order: :class:`avpipe.ops._sparse_rows.SparseRows`), the same bits whatever the
    batch's size and padding and the number of threads (a BLAS product's order of sums
    depends on the matrices' shapes and on its threads; extraction must write the same bytes
    for a file in any batch, in any process). cupy's matmul does not depend on threads:
    float32 there."""
    if xp is np:
        w64 = np.asarray(w, np.float64)
        key = (w64.shape, w64.tobytes())
        rows = _SPARSE_ROWS.get(key)
        if rows is None:
            if len(_SPARSE_ROWS) >= 32:
                _SPARSE_ROWS.clear()
            rows = _SPARSE_ROWS[key] = SparseRows(w64)
        return rows.apply(np.asarray(s, np.float64)).astype(np.float32)
    return xp.matmul(w[None], s)


def mel_spectrogram(power_spec, frame_lengths=None, *, filterbank=None, sample_rate=16000,
                    n_mels=80, fmin=0.0, fmax=None, htk=False, norm="slaney"):
    """Mel energies ``filterbank @ power_spec``: ``[B, F, T] -> [B, n_mels, T]`` float32."""
    xp, s, single = _as_batch3(power_spec, "power_spec", "F, T")
    n_fft = 2 * (s.shape[1] - 1)
    fb = filterbank if filterbank is not None else mel_filterbank(
        sample_rate=sample_rate, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax, htk=htk, norm=norm)
    fb = xp.asarray(fb, dtype=xp.float32)
    if fb.shape[1] != s.shape[1]:
        raise ValueError(f"filterbank has {fb.shape[1]} bins, power_spec {s.shape[1]}")
    out = _weights_times(xp, fb, s)
    if frame_lengths is not None:
        _, fl = _as_lengths(xp, frame_lengths, out.shape[0], out.shape[2], "frame_lengths")
        out = _mask_time(out, fl)
    return out[0] if single else out


# --------------------------------------------------------------------------------------------
# log, dB, MFCC
# --------------------------------------------------------------------------------------------


def log_guarded(x, frame_lengths=None, *, guard="add", guard_value=2.0 ** -24):
    """Natural log with a zero guard: ``ln(x + v)`` (guard="add") or ``ln(max(x, v))`` ("clamp")."""
    check_choice("guard", guard, ("add", "clamp"))
    pos_float("guard_value", guard_value)
    xp = array_module(x)
    x = xp.asarray(x, dtype=xp.float32)
    v = xp.float32(guard_value)
    y = xp.log(x + v) if guard == "add" else xp.log(xp.maximum(x, v))
    if frame_lengths is not None:
        b = y if y.ndim == 3 else y[None]
        _, fl = _as_lengths(xp, frame_lengths, b.shape[0], b.shape[-1], "frame_lengths")
        b = _mask_time(b, fl)
        y = b if y.ndim == 3 else b[0]
    return y


def power_to_db(x, *, ref=1.0, amin=1e-10, top_db=80.0, multiplier=10.0):
    """``multiplier * log10(max(x, amin) / ref)``, floored at ``max - top_db`` (per item) when
    ``top_db`` is not None (``librosa.power_to_db``; use multiplier 20 for amplitudes)."""
    pos_float("amin", amin)
    xp = array_module(x)
    x = xp.asarray(x, dtype=xp.float32)
    db = xp.float32(multiplier) * xp.log10(xp.maximum(x, xp.float32(amin)))
    db = db - xp.float32(multiplier * math.log10(max(float(ref), amin)))
    if top_db is not None:
        if top_db < 0:
            raise ValueError(f"top_db must be non-negative, got {top_db!r}")
        axes = tuple(range(1, db.ndim)) if db.ndim == 3 else tuple(range(db.ndim))
        peak = db.max(axis=axes, keepdims=True)
        db = xp.maximum(db, peak - xp.float32(top_db))
    return db


@functools.lru_cache(maxsize=16)
def _dct_np(n_mfcc, n_in, norm):
    n = np.arange(n_in, dtype=np.float64)
    k = np.arange(n_mfcc, dtype=np.float64)[:, None]
    basis = 2.0 * np.cos(np.pi * k * (2 * n + 1) / (2.0 * n_in))
    if norm == "ortho":
        basis[0] *= math.sqrt(1.0 / (4 * n_in))
        basis[1:] *= math.sqrt(1.0 / (2 * n_in))
    return basis


def dct_matrix(n_mfcc, n_in, *, norm="ortho"):
    """DCT-II matrix ``[n_mfcc, n_in]`` (scipy.fft.dct type 2; ``norm`` "ortho" or None)."""
    if norm not in ("ortho", None):
        raise ValueError(f"norm must be 'ortho' or None, got {norm!r}")
    return _dct_np(_pos_int("n_mfcc", n_mfcc), _pos_int("n_in", n_in), norm).astype(np.float32)


def mfcc(log_mel_db, frame_lengths=None, *, n_mfcc=20, norm="ortho"):
    """MFCCs: DCT-II over the mel axis of log-mel features ``[B, n_mels, T] -> [B, n_mfcc, T]``.

    ``librosa.feature.mfcc(S=power_to_db(mel))`` equals ``mfcc(power_to_db(mel))``.
    """
    xp, s, single = _as_batch3(log_mel_db, "log_mel_db", "n_mels, T")
    D = xp.asarray(dct_matrix(n_mfcc, s.shape[1], norm=norm))
    out = _weights_times(xp, D, s)
    if frame_lengths is not None:
        _, fl = _as_lengths(xp, frame_lengths, out.shape[0], out.shape[2], "frame_lengths")
        out = _mask_time(out, fl)
    return out[0] if single else out


# --------------------------------------------------------------------------------------------
# normalization, stacking, padding
# --------------------------------------------------------------------------------------------


def normalize(features, frame_lengths=None, *, mode="per_feature", eps=1e-5, ddof=1):
    """``(x - mean) / (std + eps)`` over each item's valid frames only; 0 past its length.

    ``mode``: "per_feature" (statistics per channel) or "all_features" (one per item).
    ``ddof=1``: the n-1 standard deviation (NeMo, MLPerf). Rule for short items: an item with
    ``frames <= ddof`` gets std 0 (so its features become ``(x - mean) / eps``, i.e. 0 for a
    single frame); an item with 0 frames is all zeros.
    """
    if mode not in ("per_feature", "all_features"):
        raise ValueError(f"mode must be 'per_feature' or 'all_features', got {mode!r}")
    xp, x, single = _as_batch3(features, "features", "C, T")
    B, C, T = x.shape
    fl_host, fl = _as_lengths(xp, frame_lengths, B, T, "frame_lengths")
    if xp is np:  # each item over its own frames (float64 statistics): batch-independent
        out = np.zeros_like(x)
        for b in range(B):
            k = int(fl_host[b])
            if k:
                out[b, :, :k] = normalized(x[b, :, :k], mode=mode, eps=eps, ddof=ddof)
        return out[0] if single else out
    m = time_mask(xp, fl, T)[:, None, :]
    zero = xp.zeros((), xp.float32)
    xm = xp.where(m, x, zero)
    if mode == "per_feature":
        cnt = xp.maximum(fl, 1).astype(xp.float32)[:, None, None]
        mean = xm.sum(axis=2, keepdims=True) / cnt
        d = xp.where(m, x - mean, zero)
        den = xp.maximum(fl - ddof, 1).astype(xp.float32)[:, None, None]
        var = (d * d).sum(axis=2, keepdims=True) / den
        var = xp.where((fl > ddof)[:, None, None], var, zero)
    else:
        cnt = xp.maximum(fl * C, 1).astype(xp.float32)[:, None, None]
        mean = xm.sum(axis=(1, 2), keepdims=True) / cnt
        d = xp.where(m, x - mean, zero)
        den = xp.maximum(fl * C - ddof, 1).astype(xp.float32)[:, None, None]
        var = (d * d).sum(axis=(1, 2), keepdims=True) / den
        var = xp.where((fl * C > ddof)[:, None, None], var, zero)
    out = xp.where(m, d / (xp.sqrt(var) + xp.float32(eps)), zero)
    return out[0] if single else out


def normalized(v, *, mode="per_feature", eps=1e-5, ddof=1):
    """One item's valid features ``v [C, k]`` (numpy, ``k >= 1``) normalized as
    :func:`normalize` does, statistics in float64 over exactly these frames (float64 out).
    A function of ``v`` alone: its sums run over arrays of ``v``'s own shape."""
    C, k = v.shape
    d = np.array(v, dtype=np.float64)  # a C-ordered copy, whatever v's layout
    if mode == "per_feature":
        cnt = k
        d -= d.sum(axis=1, keepdims=True) / cnt
        ss = np.square(d).sum(axis=1, keepdims=True)
    else:
        cnt = k * C
        d -= d.sum() / cnt
        ss = np.square(d).sum()
    var = ss / (cnt - ddof) if cnt > ddof else ss * 0.0
    d /= np.sqrt(var) + float(eps)
    return d


def stack_frames(features, frame_lengths=None, *, stacking=3, subsampling=3):
    """Stack ``stacking`` consecutive frames along channels, then keep every ``subsampling``-th.

    ``[B, C, T] -> [B, C * stacking, ceil(T / subsampling)]`` (trimmed to the longest item);
    output frame t holds input frames ``t*s, t*s+1, ...`` (zeros past the item's end, since
    frames past an item's length are 0). ``frame_lengths -> ceil(frame_lengths / subsampling)``
    (MLPerf RNN-T's rule). Returns ``(features, frame_lengths)``.
    """
    stacking = _pos_int("stacking", stacking)
    subsampling = _pos_int("subsampling", subsampling)
    xp = array_module(features)
    x = xp.asarray(features, dtype=xp.float32)
    if x.ndim != 3:
        raise ValueError(f"features must be [B, C, T], got shape {tuple(x.shape)}")
    B, C, T = x.shape
    fl_host, fl = _as_lengths(xp, frame_lengths, B, T, "frame_lengths")
    x = _mask_time(x, fl)
    parts = [x]
    for k in range(1, stacking):
        sh = xp.zeros_like(x)
        if k < T:
            sh[:, :, :T - k] = x[:, :, k:]
        parts.append(sh)
    y = xp.concatenate(parts, axis=1)[:, :, ::subsampling]
    new_host = -(-fl_host // subsampling)
    Tn = int(new_host.max()) if B else 0
    y = xp.ascontiguousarray(y[:, :, :max(Tn, 0)])
    new = xp.asarray(new_host)
    return _mask_time(y, new), new


def pad_to_multiple(features, multiple, *, value=0.0, axis=-1):
    """Pad ``axis`` at the end with ``value`` up to a multiple of ``multiple`` (0: unchanged)."""
    if isinstance(multiple, bool) or not isinstance(multiple, (int, np.integer)) or multiple < 0:
        raise ValueError(f"multiple must be a non-negative int, got {multiple!r}")
    xp = array_module(features)
    x = xp.asarray(features)
    if multiple in (0, 1):
        return x
    size = x.shape[axis]
    extra = (-size) % multiple
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return xp.pad(x, widths, mode="constant", constant_values=value)
