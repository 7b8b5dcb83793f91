"""Fused CUDA kernels for the separable resize (+ crop + normalize) on cupy input (private;
their source is ``_resize_kernels.cu``).

The numpy path of :mod:`avpipe.ops.image` is the reference; these kernels compute the same
linear map (the per-axis taps of :func:`avpipe.ops._image_resize.axis_weights`, with the crop
window folded in), accumulating in float32, by one of two routes:

* **one pass** (``avp_direct_*``, where :func:`direct_fits`: a few taps per pixel, as a clip's
  crop to 224 has) — one thread per output pixel computes its taps itself (``avp_taps``: the
  float64 steps of ``axis_weights``, its float32 weights bit for bit; a C++ build of it is
  checked against numpy on the CPU), sums each input row's horizontal taps, then the vertical
  ones, then ``v * a + b``: one launch, no host tables, no intermediate. The input's crop box,
  a window of a larger image and a flip are offsets and a reversed order of the taps.
* **two passes** (large downscales, whose taps the passes share):

1. **horizontal pass** — reads the input ``[N, H, W, C]`` (uint8 or float32, any strides) in
   place and writes a float32 intermediate ``[N, rows, out_w, C]`` restricted to the input rows
   ``row0 : row0 + rows`` that the vertical taps touch. For uint8 ``resize`` it rounds and clips
   to 0..255 here, as PIL (and the numpy path) do between the passes.
2. **vertical pass** — reads the intermediate, applies the vertical taps, then
   ``v * a[c] + b[c]`` (``a = scale / std``, ``b = -mean / std``, the numpy ``normalize``
   constants) and writes float32 / float16 (round to nearest even) or uint8 (half up, clipped)
   straight into a contiguous NCHW or NHWC output.

Each output row / column of the two passes has a *sparse tap table*: the first input index, the
number of taps and their weights (the dense ``axis_weights`` taps folded onto a contiguous
window: duplicate indices of the clamped torch-style filters are summed, zero weights at the
window ends dropped). :func:`plan` builds the tables on the host with numpy from the two axes'
:func:`axis_plan` (cached per axis); the device copies are cached per axis and device. A
horizontal flip of the output is the horizontal table in reverse order: no extra pass. One
thread per output element, grid-stride loops, 64-bit index math.

If the kernels do not compile (NVRTC missing or failing) a warning is logged once and callers
fall back to the array-module (cuBLAS) path; ``AVPIPE_IMAGE_KERNELS=0`` selects that path too.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import numpy as np

from .. import settings
from ..device import NO_TABLE, table_args, upload_many
from ..device.cuda_modules import CudaModule
from . import _image_resize as _rs

log = logging.getLogger("avpipe")

_THREADS = 256
_MAX_BLOCKS = 1 << 20

# Output modes of the vertical pass.
MODE_F32, MODE_F16, MODE_U8 = 0, 1, 2
_OUT_DTYPE = {MODE_F32: np.float32, MODE_F16: np.float16, MODE_U8: np.uint8}

_KERNELS = CudaModule(
    __file__, "_resize_kernels.cu", table=True, fallback="image resize",
    names=("avp_hpass_u8", "avp_hpass_f32", "avp_vpass", "avp_direct_u8", "avp_direct_f32",
           "avp_direct_items_u8", "avp_direct_items_f32"))  # fmt: skip


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

_TABLES: dict = {}
_EVICTED: list = []  # the last generation of _TABLES cleared (see _device_tables)
_VECS: dict = {}


def _kernels(device_id: int):
    """The compiled kernels on ``device_id`` (a dict name -> function), or None if they do not
    compile (warned once; callers take the array-module path)."""
    return _KERNELS.get(device_id)


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


MAX_DIRECT_TAPS = 16  # AVP_MAXTAP: taps per axis the one-pass kernel holds
_FRAMES = 8  # AVP_FRAMES: the images a block of the one-pass kernel computes
_TILE = 16  # AVP_TILE: a block's output pixels are AVP_TILE x AVP_TILE
_DIRECT_ROWS = 144  # AVP_ROWS: the input rows of a tile's first pass at most
_DIRECT_WORK = 64  # the one-pass kernel's taps per pixel (rows x columns) at most


def axis_taps_bound(in_size: int, out_size: int, interpolation: str, antialias: bool) -> int:
    """At most how many taps an output position of this axis reads (``2 * ceil(support) + 1``
    for PIL's widened filters; 2 or 4 for torch's)."""
    if not antialias:
        return 2 if interpolation == "bilinear" else 4
    support = _rs._SUPPORT[interpolation] * max(in_size / out_size, 1.0)
    return 2 * math.ceil(support) + 1


def direct_fits(y_in, out_h, x_in, out_w, interpolation, antialias, c) -> bool:
    """Whether the one-pass kernel takes this resize: at most 16 taps an axis and 4 channels,
    and the input rows that a tile's 16 output rows read fit its shared memory
    (``_DIRECT_ROWS``). ``_DIRECT_WORK`` bounds the taps per pixel (the two passes are left
    the large filters)."""
    return _fits(int(y_in), int(out_h), int(x_in), int(out_w), interpolation, bool(antialias),
                 int(c), _DIRECT_WORK, _DIRECT_ROWS)  # fmt: skip


@functools.lru_cache(maxsize=8192)
def _fits(y_in, out_h, x_in, out_w, interpolation, antialias, c, work, max_rows) -> bool:
    """:func:`direct_fits` (cached: a batch of random crops meets a few hundred box sizes)."""
    if min(y_in, out_h, x_in, out_w) < 1:
        return False
    ty = axis_taps_bound(y_in, out_h, interpolation, antialias)
    tx = axis_taps_bound(x_in, out_w, interpolation, antialias)
    rows = math.ceil((_TILE - 1) * y_in / out_h) + ty + 2  # the centres' spread, the taps
    return c <= 4 and max(ty, tx) <= MAX_DIRECT_TAPS and ty * tx <= work and rows <= max_rows


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
    box=None,
    flip=False,
):
    """Resize cupy ``xb`` ``[N, H, W, C]``; returns a new contiguous cupy array (``[N, C, h, w]``
    if ``nchw`` else ``[N, h, w, C]``, float32 / float16 / uint8 by ``mode``), or None when the
    kernels are unavailable (then the caller takes the array-module path).

    ``a``, ``b``: per-channel float32 ``v * a + b`` for the float modes (default 1, 0); the
    uint8 mode also rounds/clips between the passes (PIL's 8-bit behaviour). ``window``:
    ``(top, left, full_h, full_w)``: ``xb`` holds that part of a larger image, which is what
    ``out_h``/``rows``/``cols`` refer to (see :func:`plan`). ``box``: ``(top, left, height,
    width)``: resize that region of ``xb`` (a crop folded into the resize, no view of it).
    ``flip``: the output mirrored horizontally.

    One launch with the taps computed in the kernel (no tables) where :func:`direct_fits`;
    else the two passes with the host's tap tables."""
    import cupy

    device_id = int(xb.device.id)
    kern = _kernels(device_id)
    if kern is None:
        return None
    if box is not None and window is not None:
        raise ValueError("give a box or a window, not both")
    out_dtype = _OUT_DTYPE[mode]
    c = int(xb.shape[3])
    # the geometry: an axis of y_in (x_in) positions, position t at input row t + y_off
    if box is not None:
        y_off, x_off, y_in, x_in = (int(v) for v in box)
    elif window is not None:
        top, left, y_in, x_in = (int(v) for v in window)
        y_off, x_off = -top, -left
    else:
        y_off, x_off, y_in, x_in = 0, 0, int(xb.shape[1]), int(xb.shape[2])
    if direct_fits(y_in, out_h, x_in, out_w, interpolation, antialias, c):
        if window is not None:  # ValueError if the taps reach outside the window
            _rs.resize_taps(int(xb.shape[1]), int(xb.shape[2]), int(out_h), int(out_w),
                            tuple(rows), tuple(cols), interpolation, bool(antialias),
                            tuple(int(v) for v in window))  # fmt: skip
        return _direct(cupy, kern, xb, (y_in, y_off, x_in, x_off), int(out_h), int(out_w), rows,
                       cols, interpolation, antialias, mode, nchw, a, b, flip, out_dtype,
                       device_id)  # fmt: skip
    if box is not None:
        xb = xb[:, y_off : y_off + y_in, x_off : x_off + x_in]
    n, h, w = (int(s) for s in xb.shape[:3])
    p = plan(h, w, int(out_h), int(out_w), tuple(rows), tuple(cols), interpolation, antialias,
             None if window is None else tuple(int(v) for v in window), bool(flip))  # fmt: skip
    oh, ow = p.y.table.shape[0], p.x.table.shape[0]
    with cupy.cuda.Device(device_id):
        shape = (n, c, oh, ow) if nchw else (n, oh, ow, c)
        out = cupy.empty(shape, dtype=out_dtype)
        if out.size == 0:
            return out
        xb, hk, (sn, sh, sw, sc) = _source(cupy, kern, xb, "avp_hpass")
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


def _source(cupy, kern, xb, prefix):
    """``xb`` as the kernels read it (uint8 or float32, element strides), the kernel of
    ``prefix`` for its type and the strides in elements."""
    if xb.dtype == np.uint8:
        k = kern[prefix + "_u8"]
    else:
        if xb.dtype != np.float32:
            xb = xb.astype(cupy.float32)
        k = kern[prefix + "_f32"]
    item = xb.dtype.itemsize
    if any(s % item for s in xb.strides):
        xb = cupy.ascontiguousarray(xb)
    return xb, k, tuple(np.array(xb.strides, np.int64) // item)


def _affine_args(a, b, c):
    """The one-pass kernels' ``a0..a3, b0..b3``: float32 ``v * a + b`` per channel (default 1,
    0), padded to 4 channels."""
    av = [1.0] * c if a is None else np.asarray(a, np.float32).reshape(-1).tolist()
    bv = [0.0] * c if b is None else np.asarray(b, np.float32).reshape(-1).tolist()
    if len(av) != c or len(bv) != c:
        raise ValueError(f"a and b must have {c} values, got {len(av)} and {len(bv)}")
    return np.array(av + [1.0] * (4 - c) + bv + [0.0] * (4 - c), np.float32)


def _direct(cupy, kern, xb, geometry, out_h, out_w, rows, cols, interpolation, antialias, mode,
            nchw, a, b, flip, out_dtype, device_id):  # fmt: skip
    """The one-pass kernel (see :func:`resample`); ``geometry``: ``(y_in, y_off, x_in,
    x_off)``, each axis resized as ``*_in`` positions, position ``t`` at input index
    ``t + *_off``."""
    n, h, w, c = (int(s) for s in xb.shape)
    y_in, y_off, x_in, x_off = geometry
    (r0, r1), (c0, c1) = rows, cols
    oh, ow = int(r1) - int(r0), int(c1) - int(c0)
    floats = _affine_args(a, b, c)
    with cupy.cuda.Device(device_id):
        out = cupy.empty((n, c, oh, ow) if nchw else (n, oh, ow, c), dtype=out_dtype)
        if out.size == 0:
            return out
        xb, k, strides = _source(cupy, kern, xb, "avp_direct")
        # the scalars in the kernel's order, made by one array each (a numpy scalar apiece
        # costs more than the launch's other work)
        ints = np.array([n, c, y_in, out_h, r0, y_off, h, oh, x_in, out_w, c0, x_off, w, ow,
                         bool(flip), interpolation == "bicubic", bool(antialias),
                         mode == MODE_U8], np.int32)  # fmt: skip
        tail = np.array([bool(nchw), mode], np.int32)
        chunks = -(-n // _FRAMES)
        tiles = -(-oh // _TILE) * -(-ow // _TILE)
        k((tiles, min(chunks, 65535), 1), (_TILE * _TILE, 1, 1),
          (xb, *strides, *ints, *floats, *tail, out, np.int64(c * oh * ow)))
    return out


def resample_boxes(clips, boxes, flips, out_h: int, out_w: int, interpolation: str,
                   antialias: bool, *, mode: int, nchw: bool, a=None, b=None, round_mid=None):
    """The one-pass kernel over cupy ``clips`` (a list of ``[N, H, W, C]`` clips, the same
    ``N``, ``C`` and dtype, any sizes and strides; or one ``[B, N, H, W, C]`` array), clip
    ``i``'s ``boxes[i]`` (top, left, height, width) resized to ``out_h x out_w``, mirrored where
    ``flips[i]``: one launch and one small copy for all of them. ``round_mid``: round the
    first pass to uint8 levels (PIL's 8-bit two passes; by default in the uint8 mode, whose
    output is otherwise the float sums rounded once). Returns ``[B, N, C, out_h, out_w]``
    (``nchw``) or ``[B, N, out_h, out_w, C]``, or None where the kernels are unavailable or a
    box needs the two passes (then the caller resizes the clips one by one)."""
    got = box_items(clips, boxes, flips, out_h, out_w, interpolation, antialias, mode=mode)
    if got is None:
        return None
    rows, geometry = got
    return launch_boxes(rows, geometry, out_h, out_w, interpolation, antialias, mode=mode,
                        nchw=nchw, a=a, b=b, round_mid=round_mid)  # fmt: skip


def box_items(clips, boxes, flips, out_h: int, out_w: int, interpolation: str, antialias: bool,
              *, mode: int):  # fmt: skip
    """:func:`resample_boxes`' table of items (host int64 ``[B, 14]``: each clip's address,
    strides, geometry, flip and output offset) and ``geometry = (B, N, C, dtype, device id)``;
    None where it cannot take the clips. The table holds the clips' addresses: it is valid
    for these arrays only."""
    if isinstance(clips, (list, tuple)):
        B = len(clips)
        first = clips[0] if B else None
        items = [(x.data.ptr, x.shape, x.strides, x.dtype) for x in clips]
    else:  # one batch: its items' addresses without a view of each
        B, first = int(clips.shape[0]), clips
        base, st0 = clips.data.ptr, clips.strides[0]
        items = [(base + k * st0, clips.shape[1:], clips.strides[1:], clips.dtype)
                 for k in range(B)]  # fmt: skip
    if len(boxes) != B or len(flips) != B:
        raise ValueError(f"box_items: {B} clips, {len(boxes)} boxes and {len(flips)} flips; "
                         "one box and one flip a clip")
    if B == 0 or B > 65535:
        return None
    n, _, _, c = (int(v) for v in first.shape[-4:])
    device_id = int(first.device.id)
    if _kernels(device_id) is None:
        return None
    dtype = first.dtype
    if dtype != np.uint8 and dtype != np.float32:
        return None
    item = dtype.itemsize
    per = n * c * out_h * out_w * np.dtype(_OUT_DTYPE[mode]).itemsize
    rows = []
    for k, ((ptr, shape, st, dt), (top, left, bh, bw), f) in enumerate(zip(items, boxes, flips)):
        if (len(shape) != 4 or dt != dtype or shape[0] != n or shape[3] != c
                or st[0] % item or st[1] % item or st[2] % item or st[3] % item
                or not direct_fits(bh, out_h, bw, out_w, interpolation, antialias, c)):
            return None  # fmt: skip
        rows.append([ptr, st[0] // item, st[1] // item, st[2] // item, st[3] // item, n,
                     bh, top, shape[1], bw, left, shape[2], bool(f), k * per])  # fmt: skip
    return np.array(rows, np.int64), (B, n, c, dtype, device_id)


def launch_boxes(table, geometry, out_h: int, out_w: int, interpolation: str, antialias: bool,
                 *, mode: int, nchw: bool, a=None, b=None, round_mid=None):  # fmt: skip
    """The one launch of :func:`resample_boxes` for :func:`box_items`' rows and geometry: the
    rows ``table`` on the host (sent in the launch's own table where they fit,
    :func:`avpipe.device.table_args`, else copied up) or already on the device."""
    import cupy

    B, n, c, dtype, device_id = geometry
    if round_mid is None:
        round_mid = mode == MODE_U8
    floats = _affine_args(a, b, c)
    with cupy.cuda.Device(device_id):
        shape = (B, n, c, out_h, out_w) if nchw else (B, n, out_h, out_w, c)
        out = cupy.empty(shape, dtype=_OUT_DTYPE[mode])
        if out.size == 0:
            return out
        tab, inl = NO_TABLE, 0
        if isinstance(table, np.ndarray):
            tab, inl, (table,) = table_args(cupy, [table])
        ints = np.array([c, out_h, out_h, out_w, out_w, interpolation == "bicubic",
                         bool(antialias), bool(round_mid)], np.int32)  # fmt: skip
        tail = np.array([bool(nchw), mode], np.int32)
        k = _kernels(device_id)["avp_direct_items_u8" if dtype == np.uint8 else
                                "avp_direct_items_f32"]  # fmt: skip
        tiles = -(-out_h // _TILE) * -(-out_w // _TILE)
        k((tiles, min(-(-n // _FRAMES), 65535), B), (_TILE * _TILE, 1, 1),
          (table, *ints, *floats, *tail, out, np.int64(c * out_h * out_w), tab, np.int32(inl)))
    return out
