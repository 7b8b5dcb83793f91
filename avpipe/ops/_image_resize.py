"""Separable resampling weights (private).

Each axis of a resize is a sparse linear map ``out[i] = sum_k w[i, k] * in[idx[i, k]]``. The
taps ``idx`` and weights ``w`` are computed once per (input size, output size, filter, antialias,
output window) in float64 with numpy and cached; applying them is a gather plus a weighted sum,
written once against the array module (numpy or cupy), so the CPU and GPU paths do the same
arithmetic in float32.

Two conventions:

* ``antialias=True`` — PIL's ``Image.resize`` (and torchvision's ``antialias=True``): pixel
  centers at ``(i + 0.5) * scale``, the filter widened by ``scale`` when downscaling so every
  input pixel contributes; bilinear = triangle filter, bicubic = Keys cubic with ``a = -0.5``.
  Taps that fall outside the image are dropped and the remaining weights renormalized.
* ``antialias=False`` — torch ``interpolate(align_corners=False)`` / torchvision
  ``antialias=False``: source coordinate ``(i + 0.5) * scale - 0.5``; bilinear clamps negative
  coordinates to 0 and the upper tap to the last pixel; bicubic uses ``a = -0.75`` and replicates
  the border.
"""

from __future__ import annotations

import functools
import math

import numpy as np


def _triangle(x):
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


def _cubic(x, a):
    x = np.abs(x)
    x2, x3 = x * x, x * x * x
    return np.where(
        x < 1.0,
        (a + 2.0) * x3 - (a + 3.0) * x2 + 1.0,
        np.where(x < 2.0, a * x3 - 5.0 * a * x2 + 8.0 * a * x - 4.0 * a, 0.0),
    )


_SUPPORT = {"bilinear": 1.0, "bicubic": 2.0}


def _aa_weights(in_size: int, out_size: int, interpolation: str):
    """PIL's precompute_coeffs, in float64, for all output pixels at once.

    Row ``i`` holds the taps ``xmin .. xmax - 1`` around ``center = (i + 0.5) * scale`` (padded
    with the last index and zero weights), normalized by their sum. Every step is the
    elementwise float64 operation of the per-pixel loop it replaces, and each row's sum is numpy's
    sum over exactly its ``n`` taps (rows grouped by ``n``): a sum over a zero-padded row can
    differ in the last bit (numpy's pairwise summation blocks by 8)."""
    scale = in_size / out_size
    fscale = max(scale, 1.0)
    support = _SUPPORT[interpolation] * fscale
    ksize = int(math.ceil(support)) * 2 + 1
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    # int() of the loop truncates toward zero, as astype does
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)
    xmax = np.minimum((center + support + 0.5).astype(np.int64), in_size)
    n = np.maximum(xmax - xmin, 0)
    col = np.arange(ksize)
    xs = xmin[:, None] + col
    t = (xs - center[:, None] + 0.5) / fscale
    k = _triangle(t) if interpolation == "bilinear" else _cubic(t, -0.5)
    total = np.zeros(out_size, np.float64)
    for m in range(int(n.min()), int(n.max()) + 1):  # a few tap counts (by 1 apart)
        rows = np.flatnonzero(n == m)
        if rows.size:
            total[rows] = k[rows, :m].sum(axis=1)
    valid = col < n[:, None]
    # rows summing to 0 stay as they are (divided by 1); +0.0 past each row's taps
    w = np.where(valid, k / np.where(total != 0.0, total, 1.0)[:, None], 0.0)
    last = np.where(n > 0, xmin + n - 1, 0)
    idx = np.where(valid, xs, last[:, None])
    return idx, w


def _plain_weights(in_size: int, out_size: int, interpolation: str):
    """torch.nn.functional.interpolate(align_corners=False, antialias=False)."""
    scale = in_size / out_size
    i = np.arange(out_size, dtype=np.float64)
    src = (i + 0.5) * scale - 0.5
    if interpolation == "bilinear":
        src = np.maximum(src, 0.0)
        x0 = np.floor(src).astype(np.int64)
        x0 = np.minimum(x0, in_size - 1)
        lam = src - x0
        x1 = np.minimum(x0 + 1, in_size - 1)
        idx = np.stack([x0, x1], 1)
        w = np.stack([1.0 - lam, lam], 1)
    else:
        x0 = np.floor(src).astype(np.int64)
        t = src - x0
        offs = np.arange(-1, 3)
        idx = np.clip(x0[:, None] + offs[None, :], 0, in_size - 1)
        w = _cubic(t[:, None] - offs[None, :], -0.75)
    return idx, w


@functools.lru_cache(maxsize=512)
def axis_weights(
    in_size: int,
    out_size: int,
    interpolation: str,
    antialias: bool,
    start: int = 0,
    stop: int | None = None,
):
    """``(idx [n, K] int64, w [n, K] float32)`` for output positions ``start:stop`` of a resize
    of ``in_size`` to ``out_size`` (a window of the output = a crop folded into the resize)."""
    if antialias:
        idx, w = _aa_weights(in_size, out_size, interpolation)
    else:
        idx, w = _plain_weights(in_size, out_size, interpolation)
    stop = out_size if stop is None else stop
    idx = np.ascontiguousarray(idx[start:stop])
    w = np.ascontiguousarray(w[start:stop].astype(np.float32))
    idx.setflags(write=False)
    w.setflags(write=False)
    return idx, w


_DEVICE_CACHE: dict = {}


def _dense(idx, w, in_size):
    """The [out, in] matrix of a tap list (duplicate taps add up, in tap order)."""
    m = np.zeros((idx.shape[0], in_size), np.float32)
    rows = np.arange(idx.shape[0])
    for k in range(idx.shape[1]):  # one tap per row each time: no repeated element in one +=
        m[rows, idx[:, k]] += w[:, k]
    return m


def _device_dense(xp, idx, w, in_size, transpose=False):
    """The dense weight matrix (or its transpose) on cupy's current device, cached."""
    key = (id(idx), id(w), in_size, transpose, int(xp.cuda.runtime.getDevice()))
    hit = _DEVICE_CACHE.get(key)
    if hit is None or hit[0] is not idx:
        m = _dense(idx, w, in_size)
        hit = (idx, w, xp.asarray(np.ascontiguousarray(m.T) if transpose else m))
        if len(_DEVICE_CACHE) > 1024:
            _DEVICE_CACHE.clear()
        _DEVICE_CACHE[key] = hit
    return hit[2]


def apply_axis(xp, x, idx, w, axis: int):
    """Resample float32 ``x`` [N, C, H, W] along ``axis`` (2: H, 3: W) with taps ``idx``/``w``.

    The same linear map on both array modules: numpy gathers each tap and accumulates (work
    proportional to the taps); cupy multiplies by the dense weight matrix (one cuBLAS GEMM, no
    gathered temporaries). They agree to float32 rounding.
    """
    if xp is np:
        # one gather + multiply-add per tap: work proportional to the taps, no K-wide temporary
        shape = (-1, 1) if axis == 2 else (-1,)
        out = np.take(x, idx[:, 0], axis=axis) * w[:, 0].reshape(shape)
        for k in range(1, idx.shape[1]):
            out += np.take(x, idx[:, k], axis=axis) * w[:, k].reshape(shape)
        return out
    if axis == 2:
        return xp.matmul(_device_dense(xp, idx, w, x.shape[2]), x)  # [O, H] @ [N, C, H, W]
    return xp.matmul(x, _device_dense(xp, idx, w, x.shape[3], True))  # [N, C, H, W] @ [W, O]


@functools.lru_cache(maxsize=512)
def resize_taps(h, w, out_h, out_w, rows, cols, interpolation, antialias, window=None):
    """``((y_idx, y_w), (x_idx, x_w))``: :func:`axis_weights` of both axes of a resize to
    ``out_h x out_w`` keeping output ``rows``/``cols``, for an ``h x w`` input.

    ``window=(top, left, full_h, full_w)``: the input is that part of a larger image, which the
    resize geometry refers to; the taps are moved into the window (:func:`shift_into`), and a
    ValueError says which source rows and columns it lacks if they reach outside it."""
    top, left, full_h, full_w = (0, 0, h, w) if window is None else window
    y = axis_weights(full_h, out_h, interpolation, antialias, *rows)
    x = axis_weights(full_w, out_w, interpolation, antialias, *cols)
    if window is None:
        return y, x
    yi, xi = shift_into(*y, top, h), shift_into(*x, left, w)
    if yi is None or xi is None:
        live_y, live_x = y[0][y[1] != 0], x[0][x[1] != 0]
        raise ValueError(
            f"window={tuple(window)!r} does not hold source rows {live_y.min()}..{live_y.max()} "
            f"and columns {live_x.min()}..{live_x.max()}, which the resize reads; decode a wider "
            "window (e.g. a larger center_square margin)"
        )
    return (yi, y[1]), (xi, x[1])


def shift_into(idx, w, offset: int, size: int):
    """Taps of a resize of a larger axis moved into the window ``offset : offset + size`` that
    the input holds: ``(idx - offset)``, or None if a tap with a nonzero weight falls outside
    (taps of zero weight are clamped into the window; they add nothing)."""
    j = np.asarray(idx, np.int64) - int(offset)
    live = np.asarray(w) != 0
    if live.any() and (j[live].min() < 0 or j[live].max() >= size):
        return None
    j = np.clip(j, 0, size - 1)
    j.setflags(write=False)
    return j

