"""Audio operators and the log-mel presets (numpy on the CPU, cupy on a GPU; one implementation).

Every operator is batched over items of different lengths: signals ``[B, n]`` (zero-padded) with
``lengths [B]`` in samples, features ``[B, C, T]`` with ``frame_lengths [B]``; outputs past an
item's length are exactly 0 and results stay on the input's device.

* waveform: :func:`dither`, :func:`preemphasis`, :func:`resample`
* spectra: :func:`stft`, :func:`spectrogram`, :func:`get_window`, :func:`stft_frame_lengths`
* mel: :func:`mel_filterbank` (librosa-compatible Slaney / HTK), :func:`mel_spectrogram`,
  :func:`hz_to_mel`, :func:`mel_to_hz`
* log: :func:`log_guarded` (add or clamp guard), :func:`power_to_db`, :func:`mfcc`,
  :func:`dct_matrix`
* features: :func:`normalize` (per-feature / all-features over valid frames),
  :func:`stack_frames`, :func:`pad_to_multiple`
* presets: :func:`log_mel` with ``preset="nemo"``, ``"nemo_v1"`` or ``"mlperf_rnnt"`` (:data:`PRESETS`,
  :class:`LogMelConfig`)

1-D input: ``log_mel(x)`` with ``x [n]`` returns ``([1, n_mels, T], [1])`` — always a batch;
the lower-level operators return ``[F, T]`` for ``[n]``.

On the CPU, :func:`log_mel` computes each item alone over its valid frames (float64 filter,
FFT, power and mel filters; float32 log; float64 normalization statistics), on threads over the
items: an item's features are the same bits in any batch (other items, padding, batch size) and
on any number of threads, and within 1e-5 of a float64 transcription of the preset. The mel and
DCT products (:func:`mel_spectrogram`, :func:`mfcc`), :func:`normalize` and :func:`resample` are
likewise functions of each item alone on the CPU (no BLAS, whose sums depend on its threads).

Tolerances: CPU and GPU (float32 ``cupy.fft``) agree to 1e-3 relative on power / mel energies and
1e-3 absolute on log and normalized features.
"""

from __future__ import annotations

import numpy as np

from ..device import array_module
from . import _log_mel, _resample
from ._audio_core import (
    _as_batch,
    _as_lengths,
    _mask_time,
    _noise_seed,
    _normal,
    dct_matrix,
    dither,
    get_window,
    hz_to_mel,
    log_guarded,
    mel_filterbank,
    mel_spectrogram,
    mel_to_hz,
    mfcc,
    normalize,
    pad_to_multiple,
    power_to_db,
    preemphasis,
    spectrogram,
    stack_frames,
    stft,
    stft_frame_lengths,
)
from ._audio_presets import MLPERF_RNNT, NEMO, NEMO_V1, PRESET_DOCS, PRESETS, LogMelConfig
from .registry import register

__all__ = [
    "RESAMPLE_QUALITIES",
    "log_mel",
    "log_mel_frame_lengths",
    "LogMelConfig",
    "PRESETS",
    "PRESET_DOCS",
    "resolve_preset",
    "NEMO",
    "NEMO_V1",
    "MLPERF_RNNT",
    "dither",
    "preemphasis",
    "resample",
    "stft",
    "spectrogram",
    "get_window",
    "stft_frame_lengths",
    "mel_filterbank",
    "mel_spectrogram",
    "hz_to_mel",
    "mel_to_hz",
    "log_guarded",
    "power_to_db",
    "mfcc",
    "dct_matrix",
    "normalize",
    "stack_frames",
    "pad_to_multiple",
]


RESAMPLE_QUALITIES = tuple(sorted(_resample.QUALITIES))  # the ``quality`` names resample takes


def resample(signal, orig_sr, target_sr, *, quality="high", axis=-1):
    """Polyphase windowed-sinc resampling (numpy or cupy); see :mod:`avpipe.ops._resample`."""
    return _resample.resample(signal, orig_sr, target_sr, quality=quality, axis=axis)


def resolve_preset(preset) -> LogMelConfig:
    """The :class:`LogMelConfig` a ``preset`` names (a key of :data:`PRESETS`), or ``preset``
    itself when it is one; anything else raises ``ValueError`` listing the presets."""
    if isinstance(preset, LogMelConfig):
        return preset
    try:
        return PRESETS[preset]
    except (KeyError, TypeError):
        raise ValueError(
            f"preset must be one of {sorted(PRESETS)} or a LogMelConfig, got {preset!r}"
        ) from None


def log_mel_frame_lengths(lengths, *, preset="nemo", frames=None):
    """Valid frames per item for ``lengths`` samples under ``preset`` (host int64 numpy):
    :func:`log_mel`'s ``frame_lengths``, computed on the host. ``frames``: the features' frame
    count ``T`` (no item gets more), as ``log_mel`` clips them."""
    cfg = resolve_preset(preset)
    n = np.asarray(lengths, dtype=np.int64)
    hop = cfg.hop_length
    if cfg.frame_rule == "floor_plus_one":
        fl = n // hop + 1
    elif cfg.frame_rule == "ceil":
        fl = -(-n // hop)
    elif cfg.frame_rule == "floor":
        fl = n // hop
    else:
        raise ValueError(f"frame_rule must be 'floor_plus_one', 'ceil' or 'floor', got {cfg.frame_rule!r}")
    if not cfg.center:
        fl = np.minimum(fl, stft_frame_lengths(n, n_fft=cfg.n_fft, hop_length=hop, center=False))
    if frames is not None:
        fl = np.minimum(fl, int(frames))
    return np.where(n > 0, fl, 0)


def log_mel(signals, lengths=None, *, preset="nemo", training=False, sample_rate=None, seed=None):
    """Log-mel features of a padded batch, as the preset's reference computes them.

    ``signals [B, n]`` (zero-padded) or ``[n]``; ``lengths [B]`` in samples (None: all full
    length). Returns ``(features [B, n_mels, T] float32, frame_lengths [B] int64)`` on the
    signals' device; a 1-D input gives ``B = 1``. ``T >= max(frame_lengths)``; every frame
    past an item's length is exactly 0.

    ``preset``: ``"nemo"`` (current NeMo: ``n // 160`` valid frames), ``"nemo_v1"`` (NeMo 1.x:
    ``n // 160 + 1``) or ``"mlperf_rnnt"`` (documented in
    :data:`avpipe.ops.audio.PRESETS` / ``PRESET_DOCS``), or a :class:`LogMelConfig`.
    ``training``: add the preset's dither (seeded by ``seed``); False: no dither.
    ``sample_rate``: the signals' rate; it must equal the preset's (resample first).

    Steps: dither -> preemphasis -> STFT (centred, per-item padding) -> ``|X|**power`` -> mel
    -> log with a guard -> normalize over valid frames -> mask past the length -> pad_to.
    On the CPU each item is computed alone, over its valid frames only, on up to
    ``min(cores, 8)`` threads: its features are the same bits whatever the batch.
    Short items (documented rule): an empty item gives 0 frames (all zeros); an item shorter
    than one window is zero-padded (``"reflect"`` presets too, when it has no more samples
    than ``n_fft // 2``); an item with a single valid frame normalizes to 0.
    """
    cfg = resolve_preset(preset)
    if sample_rate is not None and int(sample_rate) != cfg.sample_rate:
        raise ValueError(
            f"sample_rate must be the preset's {cfg.sample_rate} Hz (resample first), got {sample_rate!r}"
        )
    xp, x, _ = _as_batch(signals)
    B, n = x.shape
    lens_host, _ = _as_lengths(np, lengths, B, n)
    if xp is not np and _log_mel.supported(cfg, x):  # a GPU: the same steps in few launches
        hop = cfg.hop_length
        T = int(stft_frame_lengths([n], n_fft=cfg.n_fft, hop_length=hop, center=cfg.center)[0])
        T = max(T, int(stft_frame_lengths(lens_host, n_fft=cfg.n_fft, hop_length=hop,
                                          center=cfg.center).max()))  # fmt: skip
        if T > 0:
            # the noise of each item's samples only (the frames kernel reads no other)
            noise = (_normal(xp, seed, x.shape, lengths=lens_host)
                     if training and cfg.dither > 0 else None)  # fmt: skip
            fl_host = log_mel_frame_lengths(lens_host, preset=cfg, frames=T)
            got = _log_mel.log_mel(x, lens_host, fl_host, T, cfg, noise)
            if got is not None:
                return got
    if xp is np:  # the CPU: each item alone, over its valid frames
        hop = cfg.hop_length
        T = int(stft_frame_lengths([n], n_fft=cfg.n_fft, hop_length=hop, center=cfg.center)[0])
        T = max(T, int(stft_frame_lengths(lens_host, n_fft=cfg.n_fft, hop_length=hop,
                                          center=cfg.center).max()) if B else 0)  # fmt: skip
        # the dither's noise: each item draws its own samples' on its thread (the same values
        # as dither()'s rows of this seed)
        noise_seed = (_noise_seed(seed) if training and cfg.dither > 0 and T > 0
                      else None)  # fmt: skip
        fl_host = log_mel_frame_lengths(lens_host, preset=cfg, frames=T)
        return _log_mel.log_mel_cpu(x, lens_host, fl_host, T, cfg,
                                    noise_seed=noise_seed), fl_host
    return _log_mel_array_module(x, lens_host, cfg, training=training, seed=seed)


def _log_mel_array_module(x, lens_host, cfg, *, training=False, seed=None):
    """:func:`log_mel` by the array-module operators over the padded batch: a GPU's path
    where its kernels do not cover ``cfg``, and on the CPU (float64 filter and FFT) the
    reference the CPU path is tested against."""
    xp = array_module(x)
    if xp is np:
        x = x.astype(np.float64)   # CPU: filter and FFT in float64 (see stft's compute_dtype)
    if training and cfg.dither > 0:
        x = dither(x, lens_host, scale=cfg.dither, seed=seed)
    if cfg.preemph is not None:
        x = preemphasis(x, lens_host, coeff=cfg.preemph)
    spec, _ = stft(x, lens_host, n_fft=cfg.n_fft, hop_length=cfg.hop_length,
                   win_length=cfg.win_length, window=cfg.window, periodic=cfg.periodic,
                   center=cfg.center, pad_mode=cfg.pad_mode, power=cfg.power)
    fb = mel_filterbank(sample_rate=cfg.sample_rate, n_fft=cfg.n_fft, n_mels=cfg.n_mels,
                        fmin=cfg.fmin, fmax=cfg.fmax, htk=cfg.mel_htk, norm=cfg.mel_norm)
    mel = mel_spectrogram(spec, filterbank=fb)
    del spec
    feats = log_guarded(mel, guard=cfg.log_guard, guard_value=cfg.log_guard_value)
    fl_host = log_mel_frame_lengths(lens_host, preset=cfg, frames=feats.shape[-1])
    fl = xp.asarray(fl_host)
    if cfg.normalize:
        feats = normalize(feats, fl_host, mode=cfg.normalize, eps=cfg.norm_eps, ddof=cfg.norm_ddof)
    else:
        feats = _mask_time(feats, fl)
    if cfg.pad_to:
        feats = pad_to_multiple(feats, cfg.pad_to)
    return feats, fl


log_mel.__doc__ += "".join(f"\n\n{k} preset:\n{v}" for k, v in PRESET_DOCS.items())


# --- registered operators (avpipe.ops.registry): feature steps on (data, lengths) pairs ---------


@register("mel", kind="audio", stage="signal", gives="features", context=("sample_rate",))
def _op_mel(data, *, sample_rate: int = 16000, n_fft: int = 512, hop_length: int = 160,
            win_length: int | None = None, window: str = "hann", periodic: bool = False,
            center: bool = True, pad_mode: str = "constant", power: float = 2.0,
            n_mels: int = 80, fmin: float = 0.0, fmax: float | None = None, htk: bool = False,
            norm: str | None = "slaney"):  # fmt: skip
    """A mel spectrogram (power 2 by default): :func:`spectrogram` then :func:`mel_spectrogram`."""
    x, lengths = data
    spec, fl = spectrogram(x, lengths, n_fft=n_fft, hop_length=hop_length, win_length=win_length,
                           window=window, periodic=periodic, center=center, pad_mode=pad_mode,
                           power=power)  # fmt: skip
    return mel_spectrogram(spec, fl, sample_rate=sample_rate, n_mels=n_mels, fmin=fmin,
                           fmax=fmax, htk=htk, norm=norm), fl  # fmt: skip


@register("log", kind="audio", stage="features")
def _op_log(data, *, guard: str = "add", guard_value: float = 2.0 ** -24):
    """Natural log with a zero guard (:func:`log_guarded`)."""
    feats, fl = data
    return log_guarded(feats, fl, guard=guard, guard_value=guard_value), fl


@register("power_to_db", kind="audio", stage="features")
def _op_power_to_db(data, *, ref: float = 1.0, amin: float = 1e-10, top_db: float | None = 80.0,
                    multiplier: float = 10.0):  # fmt: skip
    """Decibels, floored ``top_db`` below each item's peak (:func:`power_to_db`)."""
    feats, fl = data
    return power_to_db(feats, ref=ref, amin=amin, top_db=top_db, multiplier=multiplier), fl


@register("mfcc", kind="audio", stage="features")
def _op_mfcc(data, *, n_mfcc: int = 20, norm: str | None = "ortho"):
    """MFCCs: DCT-II over the mel axis (:func:`mfcc`)."""
    feats, fl = data
    return mfcc(feats, fl, n_mfcc=n_mfcc, norm=norm), fl


@register("normalize", kind="audio", stage="features")
def _op_normalize(data, *, mode: str = "per_feature", eps: float = 1e-5, ddof: int = 1):
    """Zero mean, unit variance over each item's valid frames (:func:`normalize`)."""
    feats, fl = data
    return normalize(feats, fl, mode=mode, eps=eps, ddof=ddof), fl


@register("stack_frames", kind="audio", stage="features")
def _op_stack_frames(data, *, stacking: int = 3, subsampling: int = 3):
    """Stack consecutive frames, keep every ``subsampling``-th (:func:`stack_frames`)."""
    return stack_frames(*data, stacking=stacking, subsampling=subsampling)
