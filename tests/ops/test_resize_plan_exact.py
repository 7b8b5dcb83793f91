"""The vectorized resize-plan construction (``_image_resize._aa_weights``, ``_dense``,
``_resize_kernels.sparse_taps``) gives exactly the tables of the per-pixel loops it replaced.

The loops are kept here as the reference. Equality is bitwise (``tobytes``) on the float64
weights, the float32 tables the kernels read and the int tables, over many (input, output,
interpolation, antialias, window) combinations: downscales whose rows have more than 8 taps (numpy's
pairwise summation changes its order there), upscales, 1-pixel axes, identity.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from avpipe.ops import _image_resize as R
from avpipe.ops import _resize_kernels as K

# --- the reference: the per-pixel loops as they were --------------------------------------------


def _ref_aa_weights(in_size, out_size, interpolation):
    scale = in_size / out_size
    fscale = max(scale, 1.0)
    support = R._SUPPORT[interpolation] * fscale
    ksize = int(math.ceil(support)) * 2 + 1
    idx = np.zeros((out_size, ksize), np.int64)
    w = np.zeros((out_size, ksize), np.float64)
    for i in range(out_size):
        center = (i + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size)
        xs = np.arange(xmin, xmax)
        t = (xs - center + 0.5) / fscale
        k = R._triangle(t) if interpolation == "bilinear" else R._cubic(t, -0.5)
        total = k.sum()
        if total != 0.0:
            k = k / total
        n = len(xs)
        idx[i, :n] = xs
        idx[i, n:] = xs[-1] if n else 0
        w[i, :n] = k
    return idx, w


def _ref_dense(idx, w, in_size):
    m = np.zeros((idx.shape[0], in_size), np.float32)
    np.add.at(m, (np.repeat(np.arange(idx.shape[0]), idx.shape[1]), idx.reshape(-1)),
              w.reshape(-1))  # fmt: skip
    return m


def _ref_sparse_taps(idx, w):
    idx = np.asarray(idx, np.int64)
    w = np.asarray(w, np.float64)
    n = idx.shape[0]
    if n == 0:
        return np.zeros((0, 2), np.int32), np.zeros((0, 1), np.float32)
    lo = idx.min(axis=1)
    width = int((idx.max(axis=1) - lo).max()) + 1
    dense = np.zeros((n, width), np.float64)
    np.add.at(dense, (np.repeat(np.arange(n), idx.shape[1]), (idx - lo[:, None]).reshape(-1)),
              w.reshape(-1))  # fmt: skip
    dense = dense.astype(np.float32)
    nz = dense != 0
    has = nz.any(axis=1)
    first = np.where(has, nz.argmax(axis=1), 0)
    last = np.where(has, width - 1 - nz[:, ::-1].argmax(axis=1), -1)
    count = (last - first + 1).astype(np.int64)
    taps = max(int(count.max()), 1)
    weights = np.zeros((n, taps), np.float32)
    for i in range(n):
        weights[i, : count[i]] = dense[i, first[i] : first[i] + count[i]]
    start = np.where(has, lo + first, 0)
    table = np.ascontiguousarray(np.stack([start, count], axis=1).astype(np.int32))
    return table, weights


def _same(a, b):
    """Bitwise equal (dtype, shape, bytes: -0.0 and 0.0 differ)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _sizes():
    """(in, out) pairs: fixed edge cases, the video feed's crops (up to 640 -> 224) and random
    ones up to 16x downscales (rows of up to ~67 bicubic taps) and 8x upscales."""
    pairs = [(1, 1), (1, 7), (7, 1), (2, 1), (3, 2), (64, 64), (375, 224), (500, 298), (640, 224),
             (360, 224), (1920, 224), (1080, 7), (224, 640), (19, 7), (7, 19), (17, 1), (9, 1),
             (16, 1), (33, 2), (100, 6), (129, 1), (300, 1)]  # fmt: skip
    rng = np.random.default_rng(1234)
    for _ in range(120):
        out = int(rng.integers(1, 300))
        pairs.append((int(rng.integers(1, 16 * out + 1)), out))
    for _ in range(60):  # the random resized crop: crops of a 360x640 frame to 224
        pairs.append((int(rng.integers(90, 641)), 224))
    for _ in range(30):
        inp = int(rng.integers(1, 200))
        pairs.append((inp, int(rng.integers(inp, 8 * inp + 1))))
    return pairs


SIZES = _sizes()


@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
def test_aa_weights_equal_the_per_pixel_loop(interp):
    for in_size, out_size in SIZES:
        idx, w = R._aa_weights(in_size, out_size, interp)
        ridx, rw = _ref_aa_weights(in_size, out_size, interp)
        assert _same(idx, ridx) and _same(w, rw), (in_size, out_size, interp)


@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [True, False])
def test_sparse_taps_and_dense_equal_the_loops(interp, antialias):
    rng = np.random.default_rng(7)
    for in_size, out_size in SIZES[::3]:
        a = int(rng.integers(0, out_size))
        windows = [(0, out_size), (a, int(rng.integers(a + 1, out_size + 1))), (a, a)]
        for start, stop in windows:
            R.axis_weights.cache_clear()
            idx, w = R.axis_weights(in_size, out_size, interp, antialias, start, stop)
            if antialias:  # the float32 tables from the reference weights
                ridx, rw = _ref_aa_weights(in_size, out_size, interp)
                assert _same(idx, ridx[start:stop])
                assert _same(w, rw[start:stop].astype(np.float32))
            t = K.sparse_taps(idx, w)
            rtable, rweights = _ref_sparse_taps(idx, w)
            key = (in_size, out_size, interp, antialias, start, stop)
            assert _same(t.table, rtable) and _same(t.weights, rweights), key
            assert _same(R._dense(idx, w, in_size), _ref_dense(idx, w, in_size)), key


def test_sparse_taps_with_repeated_and_unordered_taps():
    # duplicate indices (summed in tap order), unsorted rows, zero and negative weights
    rng = np.random.default_rng(3)
    for _ in range(200):
        n, k = int(rng.integers(1, 30)), int(rng.integers(1, 12))
        base = rng.integers(0, 50, (n, 1))
        idx = base + rng.integers(0, 9, (n, k))
        w = rng.normal(size=(n, k)).astype(np.float32)
        w[rng.random((n, k)) < 0.3] = 0
        w[rng.random((n, k)) < 0.1] = 1e-8
        t = K.sparse_taps(idx, w)
        rtable, rweights = _ref_sparse_taps(idx, w)
        assert _same(t.table, rtable) and _same(t.weights, rweights)
        size = int(idx.max()) + 1
        assert _same(R._dense(idx, w, size), _ref_dense(idx, w, size))
