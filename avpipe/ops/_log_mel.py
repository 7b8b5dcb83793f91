"""``log_mel`` on a GPU in a few launches, and on the CPU item by item (private;
:func:`avpipe.ops.audio.log_mel` calls them).

The CPU path (:func:`log_mel_cpu`, at the end) computes each item alone, over its valid frames,
in arrays shaped by that item only, and applies the mel filters as fixed-order sums over each
filter's few nonzero bins (:class:`SparseRows`) instead of a BLAS product: an item's features
are the same bits in any batch and on any number of threads.

The array-module code of :mod:`avpipe.ops._audio_core` runs a log-mel batch as about seventy
cupy operations, each a launch and a Python call: the host's time to issue them exceeded the
GPU's time to run them, and bounded the RNN-T feed (docs/how-it-works.md, "Measured trade-offs").
Here the same steps run as: one kernel for the windowed frames (dither, preemphasis, centring
pad and window; ``_log_mel.cu``), cupy's rFFT, one elementwise kernel for ``|X|^2``, one GEMM
with the mel filterbank (these four over each item's valid frames alone, packed one after
another), and one kernel for the log, the per-feature normalization, the mask past each
item's length and the transpose. The array-module code stays the reference (and
the path for everything this does not cover: reflect padding, other powers, "all_features"
normalization, float64 input); the two agree within float32 rounding (tests/ops/test_log_mel_
kernels_cpu.py runs the kernels as C++ against it; the GPU tests compare with the CPU).
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np

from ..device import round_up_eighth, upload_many
from ..device.cuda_modules import CudaModule, elementwise, read_fragments
from ._audio_core import _normal_row, _window_np, mel_filterbank, normalized
from ._sparse_rows import SparseRows

log = logging.getLogger("avpipe")


def supported(cfg, x) -> bool:
    """Whether the fused path computes ``cfg`` for the cupy batch ``x``."""
    return (
        x.dtype.name == "float32"
        and x.ndim == 2
        and x.shape[0] > 0
        and x.shape[1] > 0
        and (cfg.pad_mode == "constant" or not cfg.center)
        and cfg.power in (1, 1.0, 2, 2.0)
        and cfg.normalize in (None, "per_feature")
        and int(cfg.norm_ddof) >= 0
        and cfg.log_guard in ("add", "clamp")
    )


_KERNELS = CudaModule(__file__, "_log_mel.cu", fallback="log-mel",
                      names=("avpipe_log_mel_frames", "avpipe_log_mel_finish"))
KERNEL_FILE = _KERNELS.paths[0]  # the source (the CPU tests build it as C++)
_POWER = ("complex64 X, int32 p", "float32 P")  # the power kernel's parameters


def _kernels(device_id: int):
    """(frames, finish, power) on ``device_id``, or None where they do not compile (warned
    once; log_mel then runs the array-module code)."""
    ks = _KERNELS.get(device_id)
    if ks is None:
        return None
    return ks["avpipe_log_mel_frames"], ks["avpipe_log_mel_finish"], elementwise(
        *_POWER, read_fragments(__file__, "_log_mel_power.cu")["power"], "avpipe_log_mel_power")


@functools.lru_cache(maxsize=16)
def _tables(device_id, window, win_length, periodic, n_fft, sample_rate, n_mels, fmin, fmax,
            htk, norm):
    """The window (float32 [n_fft]) and the transposed filterbank (float32 [F, n_mels]) on
    the device, built once per configuration."""
    import cupy

    w = _window_np(window, win_length, bool(periodic), n_fft).astype(np.float32)
    fb = mel_filterbank(sample_rate=sample_rate, n_fft=n_fft, n_mels=n_mels, fmin=fmin,
                        fmax=fmax, htk=htk, norm=norm)  # fmt: skip
    with cupy.cuda.Device(device_id):
        return cupy.asarray(w), cupy.asarray(np.ascontiguousarray(fb.T))


def fft_rows(n: int) -> int:
    """``n`` rounded up by at most 1/8 to one of eight sizes an octave
    (:func:`~avpipe.device.round_up_eighth`), so the lengths of a feed's batches meet a few
    cuFFT plans again and again."""
    return round_up_eighth(n)


# the frames kernel's threads per block at most (over the taps of a frame)
FRAMES_THREADS = 256
# about how many blocks the frames kernel is launched with: fewer, longer-lived blocks (each
# looping over several frames) run faster than one block row a frame, and both faster than a
# flat one-thread-an-element launch (docs/how-it-works.md, "Measured trade-offs")
FRAMES_BLOCKS = 16384
# the finish kernel's threads per block (one block per output row (b, m), its threads over
# the frames; at most 1,024, the size of the kernel's reduction buffer). 128 and 256 are the
# fastest; 256 lets an SM hold 2,048 threads in 8 blocks of 4 KiB of shared memory
FINISH_THREADS = 256
# CUDA's limit on gridDim.y and gridDim.z (the frames kernel strides past it)
_GRID_YZ = 65535


def frames_launch(n_fft: int, T: int, B: int):
    """(grid, block) of the frames kernel for ``B`` items of ``T`` frames of ``n_fft`` taps:
    threads over the taps (a multiple of 32, at most FRAMES_THREADS; enough blocks in x to cover
    n_fft), blocks over the items (z) and the frames (y: as many as make about FRAMES_BLOCKS
    blocks in all, at most T), y and z capped at CUDA's 65535; the kernel strides over the
    rest."""
    threads = min(FRAMES_THREADS, -(-n_fft // 32) * 32)
    gx = -(-n_fft // threads)
    gz = max(min(B, _GRID_YZ), 1)
    gy = max(min(T, _GRID_YZ, -(-FRAMES_BLOCKS // (gx * gz))), 1)
    return (gx, gy, gz), (threads,)


def packed_rows(fl_host, T: int):
    """``(off, R)``: each item's first row in the packed frames (int64 ``[B]``) and their
    count, item ``b`` holding ``min(fl[b], T)`` rows."""
    nv = np.minimum(np.asarray(fl_host, np.int64), int(T))
    off = np.zeros(nv.shape[0], np.int64)
    np.cumsum(nv[:-1], out=off[1:])
    return off, int(nv.sum())


def log_mel(x, lens_host, fl_host, T, cfg, noise):
    """Features ``[B, n_mels, T_out]`` of the cupy float32 batch ``x [B, n]`` (``lens_host``
    samples; ``fl_host`` valid frames, at most ``T`` STFT frames; ``noise``: the dither's
    standard normal draws ``[B, n]`` or None), or None where the kernels are unavailable."""
    import cupy

    dev = x.device.id
    ks = _kernels(dev)
    if ks is None:
        return None
    frames_k, finish_k, power_k = ks
    B, n = x.shape
    n_fft, hop = int(cfg.n_fft), int(cfg.hop_length)
    win = n_fft if cfg.win_length is None else int(cfg.win_length)
    w, fbT = _tables(dev, cfg.window, win, bool(cfg.periodic), n_fft, int(cfg.sample_rate),
                     int(cfg.n_mels), float(cfg.fmin), cfg.fmax, bool(cfg.mel_htk),
                     cfg.mel_norm)  # fmt: skip
    x = cupy.ascontiguousarray(x)
    fl_host = np.asarray(fl_host, np.int64)
    # the valid frames only, packed (item b's at rows off[b] ..): a padded batch's frames past
    # each length are never computed, transformed or multiplied (a batch of random 2-16 s
    # utterances padded to its longest holds about 1.7 times its valid frames)
    off_host, R = packed_rows(fl_host, T)
    lens, fl, off = upload_many(cupy, [np.asarray(lens_host, np.int64), fl_host,
                                       off_host])  # one copy, not waited for
    pad = n_fft // 2 if cfg.center else 0
    # the rFFT's row count rounded up to one of a few sizes: cuFFT plans (cupy keeps 16) are
    # reused across batches of different lengths instead of built for each (building a plan
    # costs the host ~0.4 ms a batch); the extra rows are never read
    rows_fft = fft_rows(max(R, 1))
    flat = cupy.empty((rows_fft, n_fft), cupy.float32)
    has_noise = noise is not None
    frames_k(*frames_launch(n_fft, T, B),
             (x, cupy.ascontiguousarray(noise) if has_noise else np.uint64(0),
              np.float32(cfg.dither if has_noise else 0.0), np.int64(n), lens, fl, off,
              np.float32(cfg.preemph if cfg.preemph is not None else 0.0),
              np.int32(cfg.preemph is not None), w, np.int32(n_fft), np.int32(hop),
              np.int32(pad), np.int64(B), np.int64(T), flat))  # fmt: skip
    X = cupy.fft.rfft(flat, axis=-1)[:R]  # [R, F] complex64
    del flat
    P = power_k(X, np.int32(1 if cfg.power in (1, 1.0) else 2))
    del X
    mel = cupy.matmul(P, fbT)  # [R, n_mels]
    del P
    M = mel.shape[1]
    pad_to = int(cfg.pad_to or 0)
    T_out = T + ((-T) % pad_to if pad_to > 1 else 0)
    out = cupy.empty((B, M, T_out), cupy.float32)
    finish_k((B * M,), (FINISH_THREADS,),  # one block per row (b, m) of out
             (mel, np.int64(B), np.int64(T), np.int32(M), fl, off,
              np.int32(cfg.log_guard == "add"),
              np.float32(cfg.log_guard_value), np.int32(cfg.normalize == "per_feature"),
              np.int32(cfg.norm_ddof), np.float32(cfg.norm_eps), out,
              np.int64(T_out)))  # fmt: skip
    return out, fl


# --------------------------------------------------------------------------------------------
# the CPU path
# --------------------------------------------------------------------------------------------

# frames an item's FFT, power and mel run over at a time (its own frames, counted from its
# first): the temporaries stay small enough for the caches (1 MiB of float64 frames, 1 MiB
# of complex128 spectra)
CPU_CHUNK_FRAMES = 256
# the most threads the CPU path runs items on
CPU_MAX_THREADS = 8


def cpu_threads() -> int:
    """Threads for the CPU path: the cores this process may run on, at most CPU_MAX_THREADS."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, CPU_MAX_THREADS))


@functools.lru_cache(maxsize=16)
def _cpu_tables(window, win_length, periodic, n_fft, sample_rate, n_mels, fmin, fmax, htk,
                norm):
    """The window's first nonzero tap ``left``, its float64 taps ``[win]``, and the
    filterbank as :class:`SparseRows`."""
    w = _window_np(window, win_length, bool(periodic), n_fft)
    left = (n_fft - win_length) // 2
    taps = np.ascontiguousarray(w[left:left + win_length])
    fb = mel_filterbank(sample_rate=sample_rate, n_fft=n_fft, n_mels=n_mels, fmin=fmin,
                        fmax=fmax, htk=htk, norm=norm, dtype=np.float64)  # fmt: skip
    return left, taps, SparseRows(fb)


def _cpu_item(x, n, fl, cfg, tables, noise, out):
    """One item's features into ``out [M, >= fl]`` (float32, zeros given): ``x`` its samples
    (1-D, at least ``n``), ``fl`` its valid frames, ``noise`` its dither (``[n]`` standard
    normal draws) or None. Every array here is the item's own, shaped by ``n`` and ``fl``
    alone, so the result is a function of the item and ``cfg``, whatever the batch.

    The filter, frames, FFT and power run in float64: a float32 FFT loses ~3e-4 in the log
    of the weakest mel bands of speech (the lowest, which preemphasis attenuates ~30-fold),
    and pocketfft's float64 FFT costs under 1.5x its float32 one. The mel filters' sums (at
    most 18 terms at 16 kHz) and the log run in float32, the normalization's statistics in
    float64: within 1e-5 of a float64 transcription of the preset."""
    import scipy.fft

    if fl <= 0:
        return
    left, taps, fb = tables
    n_fft, hop, win = int(cfg.n_fft), int(cfg.hop_length), taps.shape[0]
    pad = n_fft // 2 if cfg.center else 0
    need = (fl - 1) * hop + n_fft  # the padded samples the valid frames read
    padded = np.zeros(max(need, n + 2 * pad), np.float64)
    y = padded[pad : pad + n]  # the signal is filtered where the frames read it
    y[:] = x[:n]
    if noise is not None:
        y += float(np.float32(cfg.dither)) * noise[:n]
    if cfg.preemph is not None:
        y[1:] -= float(cfg.preemph) * y[:-1]  # the product is taken first
    if pad and cfg.pad_mode == "reflect" and n > pad:  # mirrored at the item's own ends
        padded[: n + 2 * pad] = np.pad(y.copy(), pad, mode="reflect")
    del y
    frames = np.lib.stride_tricks.as_strided(padded, shape=(fl, n_fft),
                                             strides=(hop * 8, 8))  # fmt: skip
    M = out.shape[0]
    F = n_fft // 2 + 1
    mel = np.empty((M, fl), np.float32)
    c = min(fl, CPU_CHUNK_FRAMES)
    buf = np.zeros((c, n_fft), np.float64)  # zero outside the window's taps
    P = np.empty((c, F), np.float64)
    for t0 in range(0, fl, CPU_CHUNK_FRAMES):
        t1 = min(fl, t0 + CPU_CHUNK_FRAMES)
        k = t1 - t0
        np.multiply(frames[t0:t1, left : left + win], taps, out=buf[:k, left : left + win])
        X = scipy.fft.rfft(buf[:k], axis=-1, workers=1)  # [k, F] complex128, ours
        # re^2 and im^2 squared in place over X's contiguous floats, then summed: one pass
        # each instead of two strided products and a temporary
        v = X.view(np.float64)
        np.multiply(v, v, out=v)
        v = v.reshape(k, F, 2)
        p = P[:k]
        np.add(v[..., 0], v[..., 1], out=p)
        del X, v
        if cfg.power in (1, 1.0):
            np.sqrt(p, out=p)
        elif cfg.power not in (2, 2.0):
            p **= cfg.power / 2.0
        fb.apply(p.T.astype(np.float32, order="C"), out=mel[:, t0:t1])
    g = np.float32(cfg.log_guard_value)
    if cfg.log_guard == "add":
        mel += g
    else:
        np.maximum(mel, g, out=mel)
    np.log(mel, out=mel)
    if cfg.normalize is None:
        out[:, :fl] = mel
    else:
        out[:, :fl] = normalized(mel, mode=cfg.normalize, eps=cfg.norm_eps, ddof=cfg.norm_ddof)


def log_mel_cpu(x, lens_host, fl_host, T, cfg, noise=None, threads=None, noise_seed=None):
    """Features ``[B, n_mels, T_out]`` float32 of the numpy batch ``x [B, n]`` (``lens_host``
    samples, ``fl_host`` valid frames each, ``T`` frames in all; the dither's standard normal
    draws: ``noise [B, n]``, or ``noise_seed``: each item draws its own valid samples' on its
    thread, row ``b`` of :func:`avpipe.ops._audio_core._normal`'s noise of that seed; neither:
    no dither), each item computed alone over its valid frames
    (:func:`_cpu_item`), the items spread over ``threads`` threads (None:
    :func:`cpu_threads`), longest first. An item's features are the same bits in any batch,
    on any number of threads; frames past its valid ones are 0."""
    B = x.shape[0]
    M = int(cfg.n_mels)
    pad_to = int(cfg.pad_to or 0)
    T_out = T + ((-T) % pad_to if pad_to > 1 else 0)
    out = np.zeros((B, M, T_out), np.float32)
    if B == 0 or T == 0:
        return out
    win = int(cfg.n_fft) if cfg.win_length is None else int(cfg.win_length)
    tables = _cpu_tables(cfg.window, win, bool(cfg.periodic), int(cfg.n_fft),
                         int(cfg.sample_rate), M, float(cfg.fmin), cfg.fmax, bool(cfg.mel_htk),
                         cfg.mel_norm)  # fmt: skip
    lens = np.asarray(lens_host, np.int64)
    fl = np.minimum(np.asarray(fl_host, np.int64), T)

    def one(b):
        n = int(lens[b])
        if noise is not None:
            nz = noise[b]
        elif noise_seed is not None:  # this item's samples only, drawn on its thread
            nz = _normal_row(noise_seed, b, n)
        else:
            nz = None
        _cpu_item(x[b], n, int(fl[b]), cfg, tables, nz, out[b])

    order = [int(b) for b in np.argsort(-fl, kind="stable") if fl[b] > 0]  # longest first
    n_threads = min(cpu_threads() if threads is None else max(1, int(threads)), len(order))
    if n_threads <= 1:
        for b in order:
            one(b)
    else:  # a pool for this call (none survives it: a forked child would inherit a dead one)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(n_threads, thread_name_prefix="avpipe-log-mel") as ex:
            for f in [ex.submit(one, b) for b in order]:
                f.result()
    return out
