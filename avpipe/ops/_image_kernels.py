"""Fused CUDA kernels for the separable resize (+ crop + normalize) on cupy input (private).

The numpy path of :mod:`avpipe.ops.image` is the reference; these kernels compute the same
linear map (the per-axis taps of :func:`avpipe.ops._image_resize.axis_weights`, with the crop
window folded in) in two launches, accumulating in float32:

1. **horizontal pass** — reads the input ``[N, H, W, C]`` (uint8 or float32, any strides) in
   place and writes a float32 intermediate ``[N, rows, out_w, C]`` restricted to the input rows
   ``row0 : row0 + rows`` that the vertical taps touch. For uint8 ``resize`` it rounds and clips
   to 0..255 here, as PIL (and the numpy path) do between the passes.
2. **vertical pass** — reads the intermediate, applies the vertical taps, then
   ``v * a[c] + b[c]`` (``a = scale / std``, ``b = -mean / std``, the numpy ``normalize``
   constants) and writes float32 / float16 (round to nearest even) or uint8 (half up, clipped)
   straight into a contiguous NCHW or NHWC output.

Each output row / column has a *sparse tap table*: the first input index, the number of taps and
their weights (the dense ``axis_weights`` taps folded onto a contiguous window: duplicate
indices of the clamped torch-style filters are summed, zero weights at the window ends dropped).
:func:`plan` builds the tables on the host with numpy from the two axes' :func:`axis_plan`
(cached per axis); the device copies are cached per axis and device. A horizontal flip of the
output is the horizontal table in reverse order: no extra pass. One thread per output element, grid-stride loops, 64-bit index math.

If the kernels do not compile (NVRTC missing or failing) a warning is logged once and callers
fall back to the array-module (cuBLAS) path; ``AVPIPE_IMAGE_KERNELS=0`` selects that path too.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np

from .. import settings
from ..device import upload_many
from . import _image_resize as _rs

log = logging.getLogger("avpipe")

_THREADS = 256
_MAX_BLOCKS = 1 << 20

# Output modes of the vertical pass.
MODE_F32, MODE_F16, MODE_U8 = 0, 1, 2

_SOURCE = r"""
// flat indices below this (with the grid-stride step added) fit in 32 bits
#define AVP_SMALL 0x7fffffffLL

template <typename T> __device__ __forceinline__ float avp_load(const T* p);
template <> __device__ __forceinline__ float avp_load<unsigned char>(const unsigned char* p) {
    return (float)(*p);
}
template <> __device__ __forceinline__ float avp_load<float>(const float* p) { return *p; }

__device__ __forceinline__ unsigned short avp_f2h(float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}

// tmp[b, r, ox, ch] = sum_k xw[ox, k] * src[b, row0 + r, xtab[ox].start + k, ch]
// I: the type of the flat index (32-bit division is much cheaper; 64-bit past 2^31 elements)
template <typename T, typename I>
__device__ __forceinline__ void avp_hpass(
    const T* __restrict__ src, long long sn, long long sh, long long sw, long long sc,
    int n, int row0, int rows, int ow, int c,
    const int* __restrict__ xtab, const float* __restrict__ xw, int taps,
    int round_mid, float* __restrict__ dst)
{
    const I total = (I)n * (I)rows * (I)ow * (I)c;
    const I step = (I)blockDim.x * (I)gridDim.x;
    for (I i = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x; i < total; i += step) {
        const int ch = (int)(i % (I)c);
        I t = i / (I)c;
        const int ox = (int)(t % (I)ow);
        t /= (I)ow;
        const int r = (int)(t % (I)rows);
        const long long b = (long long)(t / (I)rows);
        const int start = xtab[2 * ox];
        const int cnt = xtab[2 * ox + 1];
        const T* p = src + b * sn + (long long)(row0 + r) * sh + (long long)start * sw
                     + (long long)ch * sc;
        const float* w = xw + (long long)ox * taps;
        float acc = 0.0f;
        for (int k = 0; k < cnt; ++k) {
            acc += w[k] * avp_load<T>(p + (long long)k * sw);
        }
        if (round_mid) {
            acc = fminf(fmaxf(floorf(acc + 0.5f), 0.0f), 255.0f);
        }
        dst[i] = acc;
    }
}

// out[b, oy, ox, ch] = cast(a[ch] * sum_k yw[oy, k] * tmp[b, ytab[oy].start + k, ox, ch] + bb[ch])
// written at its linear index of a contiguous NCHW (nchw=1) or NHWC output.
// mode 0: float32, 1: float16 (bits), 2: uint8 (floor(v + 0.5) clipped to 0..255, a/bb unused).
template <typename I>
__device__ __forceinline__ void avp_vpass_impl(
    const float* __restrict__ tmp, int n, int rows, int ow, int c, int oh,
    const int* __restrict__ ytab, const float* __restrict__ yw, int taps,
    const float* __restrict__ a, const float* __restrict__ bb, int nchw, int mode,
    void* __restrict__ out)
{
    const I total = (I)n * (I)oh * (I)ow * (I)c;
    const I step = (I)blockDim.x * (I)gridDim.x;
    const long long rstride = (long long)ow * c;
    for (I i = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x; i < total; i += step) {
        int ch, ox, oy;
        long long b;
        I t;
        if (nchw) {
            ox = (int)(i % (I)ow);
            t = i / (I)ow;
            oy = (int)(t % (I)oh);
            t /= (I)oh;
            ch = (int)(t % (I)c);
            b = (long long)(t / (I)c);
        } else {
            ch = (int)(i % (I)c);
            t = i / (I)c;
            ox = (int)(t % (I)ow);
            t /= (I)ow;
            oy = (int)(t % (I)oh);
            b = (long long)(t / (I)oh);
        }
        const int start = ytab[2 * oy];
        const int cnt = ytab[2 * oy + 1];
        const float* p = tmp + ((b * rows + start) * ow + ox) * (long long)c + ch;
        const float* w = yw + (long long)oy * taps;
        float acc = 0.0f;
        for (int k = 0; k < cnt; ++k) {
            acc += w[k] * p[(long long)k * rstride];
        }
        if (mode == 2) {
            const float v = fminf(fmaxf(floorf(acc + 0.5f), 0.0f), 255.0f);
            ((unsigned char*)out)[i] = (unsigned char)v;
        } else {
            // (v * a) + b rounded separately, as numpy's normalize does
            const float v = __fadd_rn(__fmul_rn(acc, a[ch]), bb[ch]);
            if (mode == 1) {
                ((unsigned short*)out)[i] = avp_f2h(v);
            } else {
                ((float*)out)[i] = v;
            }
        }
    }
}

extern "C" __global__ void avp_hpass_u8(
    const unsigned char* __restrict__ src, long long sn, long long sh, long long sw, long long sc,
    int n, int row0, int rows, int ow, int c,
    const int* __restrict__ xtab, const float* __restrict__ xw, int taps,
    int round_mid, float* __restrict__ dst)
{
    if ((long long)n * rows * ow * c < AVP_SMALL)
        avp_hpass<unsigned char, unsigned int>(src, sn, sh, sw, sc, n, row0, rows, ow, c, xtab,
                                               xw, taps, round_mid, dst);
    else
        avp_hpass<unsigned char, long long>(src, sn, sh, sw, sc, n, row0, rows, ow, c, xtab,
                                            xw, taps, round_mid, dst);
}

extern "C" __global__ void avp_hpass_f32(
    const float* __restrict__ src, long long sn, long long sh, long long sw, long long sc,
    int n, int row0, int rows, int ow, int c,
    const int* __restrict__ xtab, const float* __restrict__ xw, int taps,
    int round_mid, float* __restrict__ dst)
{
    if ((long long)n * rows * ow * c < AVP_SMALL)
        avp_hpass<float, unsigned int>(src, sn, sh, sw, sc, n, row0, rows, ow, c, xtab, xw, taps,
                                       round_mid, dst);
    else
        avp_hpass<float, long long>(src, sn, sh, sw, sc, n, row0, rows, ow, c, xtab, xw, taps,
                                    round_mid, dst);
}

extern "C" __global__ void avp_vpass(
    const float* __restrict__ tmp, int n, int rows, int ow, int c, int oh,
    const int* __restrict__ ytab, const float* __restrict__ yw, int taps,
    const float* __restrict__ a, const float* __restrict__ bb, int nchw, int mode,
    void* __restrict__ out)
{
    if ((long long)n * oh * ow * c < AVP_SMALL)
        avp_vpass_impl<unsigned int>(tmp, n, rows, ow, c, oh, ytab, yw, taps, a, bb, nchw, mode,
                                     out);
    else
        avp_vpass_impl<long long>(tmp, n, rows, ow, c, oh, ytab, yw, taps, a, bb, nchw, mode,
                                  out);
}
"""

_KERNEL_NAMES = ("avp_hpass_u8", "avp_hpass_f32", "avp_vpass")


def enabled() -> bool:
    """False when ``AVPIPE_IMAGE_KERNELS=0`` (use the array-module / cuBLAS path)."""
    return settings.image_kernels()


# --- host-side tap tables ------------------------------------------------------------------------


@dataclass(frozen=True)
class AxisTaps:
    """Sparse taps of one axis: output ``i`` = ``sum_k weights[i, k] * in[start[i] + k]`` for
    ``k < count[i]``. ``table`` is ``[n, 2]`` int32 (start, count) as the kernels read it."""

    table: np.ndarray  # [n_out, 2] int32
    weights: np.ndarray  # [n_out, taps] float32 (zero past count)

    @property
    def start(self) -> np.ndarray:
        return self.table[:, 0]

    @property
    def count(self) -> np.ndarray:
        return self.table[:, 1]

    @property
    def taps(self) -> int:
        return int(self.weights.shape[1])


@dataclass(frozen=True)
class Plan:
    """Both axes of a resize restricted to an output window. ``y`` starts are relative to
    ``row0``: the horizontal pass computes input rows ``row0 : row0 + rows`` only."""

    x: AxisTaps
    y: AxisTaps
    row0: int
    rows: int
    key: tuple


def sparse_taps(idx: np.ndarray, w: np.ndarray) -> AxisTaps:
    """Fold dense taps (``idx``/``w`` of ``axis_weights``: [n, K]) onto contiguous windows."""
    idx = np.asarray(idx, np.int64)
    w = np.asarray(w, np.float64)
    n = idx.shape[0]
    if n == 0:
        return AxisTaps(np.zeros((0, 2), np.int32), np.zeros((0, 1), np.float32))
    lo = idx.min(axis=1)
    width = int((idx.max(axis=1) - lo).max()) + 1
    # add the taps into their rows' windows, in tap order (bincount adds in input order, as
    # np.add.at does, in float64)
    flat = (np.arange(n)[:, None] * width + (idx - lo[:, None])).reshape(-1)
    dense = np.bincount(flat, weights=w.reshape(-1), minlength=n * width).reshape(n, width)
    dense = dense.astype(np.float32)
    nz = dense != 0
    has = nz.any(axis=1)
    first = np.where(has, nz.argmax(axis=1), 0)
    last = np.where(has, width - 1 - nz[:, ::-1].argmax(axis=1), -1)
    count = (last - first + 1).astype(np.int64)
    taps = max(int(count.max()), 1)
    k = np.arange(taps)
    src = np.minimum(first[:, None] + k, width - 1)
    weights = np.where(k < count[:, None], dense[np.arange(n)[:, None], src], 0.0)
    weights = np.ascontiguousarray(weights, np.float32)
    start = np.where(has, lo + first, 0)
    table = np.ascontiguousarray(np.stack([start, count], axis=1).astype(np.int32))
    table.setflags(write=False)
    weights.setflags(write=False)
    return AxisTaps(table, weights)


@dataclass(frozen=True)
class AxisPlan:
    """One axis of a resize: ``table`` [out, 2] int32 (start, count; starts absolute),
    ``weights`` [out, taps] float32, and ``rel``: the table with its starts relative to
    ``row0``, the first input index read (``rows`` of them: the span the horizontal pass
    computes when this is the vertical axis). ``key``: what it was built from (the device cache's
    key). None of :func:`axis_plan` when a window lacks taps it needs."""

    table: np.ndarray
    rel: np.ndarray
    weights: np.ndarray
    row0: int
    rows: int
    key: tuple


@functools.lru_cache(maxsize=4096)
def axis_plan(in_size, out_size, lo, hi, interpolation, antialias, offset=0, full=None,
              flip=False) -> AxisPlan | None:
    """The sparse taps of output positions ``lo:hi`` of resizing an axis of ``full`` (default
    ``in_size``) to ``out_size``, the input holding positions ``offset : offset + in_size`` of it;
    ``flip``: the positions in reverse order (a mirrored output, folded into the taps). Cached
    per axis: a random resized crop draws its boxes from a few hundred sizes per axis, where a
    cache of whole 2-D plans would miss nearly every time. None if the window lacks a tap with
    a nonzero weight."""
    idx, w = _rs.axis_weights(in_size if full is None else full, out_size, interpolation,
                              bool(antialias), lo, hi)  # fmt: skip
    if full is not None:
        idx = _rs.shift_into(idx, w, offset, in_size)
        if idx is None:
            return None
    t = sparse_taps(idx, w)
    table, weights = t.table, t.weights
    if flip:
        table, weights = np.ascontiguousarray(table[::-1]), np.ascontiguousarray(weights[::-1])
    start, count = table[:, 0].astype(np.int64), table[:, 1].astype(np.int64)
    used = count > 0
    row0 = int(start[used].min()) if used.any() else 0
    span = int((start + count)[used].max()) - row0 if used.any() else 1
    rel = table.copy()
    rel[:, 0] = np.where(used, start - row0, 0)
    for a in (table, weights, rel):
        a.setflags(write=False)
    key = (in_size, out_size, lo, hi, interpolation, bool(antialias), offset, full, bool(flip))
    return AxisPlan(table, rel, weights, row0, max(span, 1), key)


@functools.lru_cache(maxsize=512)
def plan(h, w, out_h, out_w, rows, cols, interpolation, antialias, window=None,
         flip=False) -> Plan:
    """Tap tables for resizing ``h x w`` to ``out_h x out_w`` and keeping output rows
    ``rows = (r0, r1)`` and columns ``cols = (c0, c1)`` (``flip``: those columns mirrored).
    ``window=(top, left, full_h, full_w)``: the input is that part of a larger image (see
    :func:`avpipe.ops._image_resize.resize_taps`; ValueError if the taps reach outside it).
    Built from the two axes' :func:`axis_plan`."""
    antialias = bool(antialias)
    top, left, full_h, full_w = (0, 0, None, None) if window is None else window
    y = axis_plan(h, out_h, *rows, interpolation, antialias, top, full_h)
    x = axis_plan(w, out_w, *cols, interpolation, antialias, left, full_w, bool(flip))
    if x is None or y is None:  # the error that names what the window lacks
        _rs.resize_taps(h, w, out_h, out_w, tuple(rows), tuple(cols), interpolation, antialias,
                        window)  # fmt: skip
        raise AssertionError("resize_taps accepted a window that axis_plan did not")
    return Plan(x=AxisTaps(x.table, x.weights), y=AxisTaps(y.rel, y.weights), row0=y.row0,
                rows=y.rows, key=(x.key, y.key))  # fmt: skip


# --- device side ---------------------------------------------------------------------------------

_WARNED = []
_TABLES: dict = {}
_EVICTED: list = []  # the last generation of _TABLES cleared (see _device_tables)
_VECS: dict = {}


@functools.cache
def _kernels(device_id: int):
    """The compiled kernels on ``device_id`` (a dict name -> function), or None if they do not
    compile (warned once)."""
    import cupy

    try:
        with cupy.cuda.Device(device_id):
            mod = cupy.RawModule(code=_SOURCE)  # NVRTC defaults; plain C++ templates only
            return {name: mod.get_function(name) for name in _KERNEL_NAMES}
    except Exception as e:  # noqa: BLE001 - any compile/load failure -> the cuBLAS path
        if not _WARNED:
            _WARNED.append(True)
            log.warning(
                "avpipe: image resize kernels failed to compile (%s: %s); using the slower "
                "array-module path", type(e).__name__, e,
            )  # fmt: skip
        return None


def _device_tables(cupy, p: Plan, device_id: int):
    """``(x table, x weights, y table, y weights)`` of plan ``p`` on the device, cached per
    axis (a random resized crop's plan is new, its axes rarely are); the axes not cached yet
    go up in one copy, cached for every thread's stream: complete when this returns."""
    axes = ((p.x.table, p.x.weights), (p.y.table, p.y.weights))
    # the role is part of the key: a vertical table's starts are relative to its row0
    keys = [(role, k, device_id) for role, k in zip("xy", p.key)]
    got = [_TABLES.get(k) for k in keys]
    missing = [i for i, g in enumerate(got) if g is None]
    if missing:
        up = iter(upload_many(cupy, [a for i in missing for a in axes[i]], wait=True))
        if len(_TABLES) > 2048:  # evicted tables live one more generation: a kernel queued
            _EVICTED[:] = [dict(_TABLES)]  # on another stream may still read one
            _TABLES.clear()
        for i in missing:
            got[i] = _TABLES[keys[i]] = (next(up), next(up))
    return (*got[0], *got[1])


def _device_vec(cupy, v: np.ndarray, device_id: int):
    v = np.ascontiguousarray(v, np.float32)
    key = (v.tobytes(), device_id)
    hit = _VECS.get(key)
    if hit is None:
        hit = cupy.asarray(v)
        if len(_VECS) > 256:
            _VECS.clear()
        _VECS[key] = hit
    return hit


def _grid(total: int):
    return (min((total + _THREADS - 1) // _THREADS, _MAX_BLOCKS), 1, 1)


def resample(
    xb,
    out_h: int,
    out_w: int,
    rows,
    cols,
    interpolation: str,
    antialias: bool,
    *,
    mode: int,
    nchw: bool,
    a=None,
    b=None,
    window=None,
    flip=False,
):
    """Run both passes on cupy ``xb`` ``[N, H, W, C]``; returns a new contiguous cupy array
    (``[N, C, h, w]`` if ``nchw`` else ``[N, h, w, C]``, float32 / float16 / uint8 by ``mode``),
    or None when the kernels are unavailable (then the caller takes the array-module path).

    ``a``, ``b``: per-channel float32 ``v * a + b`` for the float modes (default 1, 0); the
    uint8 mode also rounds/clips between the passes (PIL's 8-bit behaviour). ``window``:
    ``(top, left, full_h, full_w)``: ``xb`` holds that part of a larger image, which is what
    ``out_h``/``rows``/``cols`` refer to (see :func:`plan`). ``flip``: the output mirrored
    horizontally (the horizontal taps in reverse order)."""
    import cupy

    device_id = int(xb.device.id)
    kern = _kernels(device_id)
    if kern is None:
        return None
    n, h, w, c = (int(s) for s in xb.shape)
    p = plan(h, w, int(out_h), int(out_w), tuple(rows), tuple(cols), interpolation, antialias,
             None if window is None else tuple(int(v) for v in window), bool(flip))  # fmt: skip
    oh, ow = p.y.table.shape[0], p.x.table.shape[0]
    out_dtype = {MODE_F32: np.float32, MODE_F16: np.float16, MODE_U8: np.uint8}[mode]
    with cupy.cuda.Device(device_id):
        shape = (n, c, oh, ow) if nchw else (n, oh, ow, c)
        out = cupy.empty(shape, dtype=out_dtype)
        if out.size == 0:
            return out
        if xb.dtype == np.uint8:
            hk = kern["avp_hpass_u8"]
        else:
            if xb.dtype != np.float32:
                xb = xb.astype(cupy.float32)
            hk = kern["avp_hpass_f32"]
        item = xb.dtype.itemsize
        if any(s % item for s in xb.strides):
            xb = cupy.ascontiguousarray(xb)
        sn, sh, sw, sc = (np.int64(s // item) for s in xb.strides)
        xtab, xw, ytab, yw = _device_tables(cupy, p, device_id)
        av = _device_vec(cupy, np.ones(c, np.float32) if a is None else a, device_id)
        bv = _device_vec(cupy, np.zeros(c, np.float32) if b is None else b, device_id)
        if av.size != c or bv.size != c:
            raise ValueError(f"a and b must have {c} values, got {av.size} and {bv.size}")
        tmp = cupy.empty((n, p.rows, ow, c), dtype=cupy.float32)
        total = tmp.size
        hk(
            _grid(total),
            (_THREADS, 1, 1),
            (
                xb, sn, sh, sw, sc,
                np.int32(n), np.int32(p.row0), np.int32(p.rows), np.int32(ow), np.int32(c),
                xtab, xw, np.int32(p.x.taps),
                np.int32(1 if mode == MODE_U8 else 0), tmp,
            ),
        )  # fmt: skip
        kern["avp_vpass"](
            _grid(out.size),
            (_THREADS, 1, 1),
            (
                tmp, np.int32(n), np.int32(p.rows), np.int32(ow), np.int32(c), np.int32(oh),
                ytab, yw, np.int32(p.y.taps), av, bv,
                np.int32(1 if nchw else 0), np.int32(mode), out,
            ),
        )  # fmt: skip
    return out
