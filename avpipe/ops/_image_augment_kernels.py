"""Fused CUDA kernels for the clip augmentations on cupy input (private).

The numpy code of :mod:`avpipe.ops.image_augment` is the reference; these kernels compute the
same float32 arithmetic per element, in a handful of launches per batch:

* **resized crop** (two launches for the whole batch; used for the boxes that the one-pass
  kernel of :mod:`avpipe.ops._resize_kernels` cannot take, large downscales): a horizontal pass reads each clip's crop
  of the input in place (uint8 or float32, any strides) into a float32 intermediate of the rows
  the vertical taps touch, then a vertical pass writes ``[B, T, oh, ow, C]`` (float32, or uint8
  rounded half up once). Each item has its own sparse tap tables (the axes of
  :func:`avpipe.ops._resize_kernels.plan` of its crop, the same taps as the numpy GEMMs, cached
  per axis size: :func:`axis_taps`), built for the batch on the host and copied up in one copy
  (with the batch's parameters when a chain drew them).
* **pixels** (one launch; its per-item parameters read where they are on the device, or
  copied up together): per pixel, an optional per-item horizontal flip, the colour jitter
  (brightness, contrast, saturation, hue in each item's order, torchvision's formulas, each
  clipped to ``0..bound``), rounding to uint8 levels, and ``v * a[c] + b[c]`` (normalize), written
  to a contiguous ``[B, T, H, W, C]`` or ``[B, T, C, H, W]`` uint8 / float32 output. The grid's
  ``y`` is the frames, so a thread reads its item's steps and its frame's mean once, not per
  pixel.
* **gray mean** (one launch, only with a jitter): each frame's mean luma of the image as it is
  when that item's contrast step comes (the previous steps applied on the fly; torchvision's
  rule): each frame's float64 sum in parts (``mean_parts``: a block per 8,192 pixels, so that
  a batch's frames keep every SM busy), which the pixel kernel adds in order.

The source, ``_image_augment_kernels.cu``, is plain C++ with CUDA qualifiers (no CUDA
headers): the CPU tests compile it with g++ behind a small prelude and run it against the numpy
reference. Tolerances (GPU vs numpy): resize within 1e-3 of the value range on float output,
colour jitter within 1e-3 of the range (float) / 1 level (uint8, a value on a rounding
boundary); flip and normalize exact (normalize rounds ``v * a`` and ``+ b`` separately as numpy
does).

If the kernels do not compile (NVRTC missing or failing) a warning is logged once and callers
take the array-module path; ``AVPIPE_IMAGE_KERNELS=0`` selects that path too.
"""

from __future__ import annotations

import logging

import numpy as np

from ..device import NO_TABLE, is_cupy, table_args, upload_many
from ..device.cuda_modules import CudaModule
from . import _resize_kernels as _rk

log = logging.getLogger("avpipe")

_THREADS = 256
_MEAN_THREADS = 256  # AVP_MEAN_THREADS: the gray means' blocks
_MEAN_PIXELS = 8192  # the gray means: a block (a part of a frame) per this many pixels
_MAX_BLOCKS = 1 << 20
_PIXELS_PER_THREAD = 4  # the pixel kernel: a thread's pixels of a frame (its item's steps read once)
MODE_F32, MODE_F16, MODE_U8 = 0, 1, 2  # output modes (as in _resize_kernels)
_OUT_DTYPE = {MODE_F32: np.float32, MODE_F16: np.float16, MODE_U8: np.uint8}

KERNELS = CudaModule(
    __file__, "_image_augment_kernels.cu", table=True, fallback="augmentation",
    names=("avp_gray_mean_u8", "avp_gray_mean_f32", "avp_pixels_u8", "avp_pixels_f32",
           "avp_crop_hpass_u8", "avp_crop_hpass_f32", "avp_crop_vpass"))  # fmt: skip


def enabled() -> bool:
    return _rk.enabled()


def _kernels(device_id: int):
    """The compiled kernels on ``device_id`` (name -> function), or None (warned once)."""
    return KERNELS.get(device_id)


def available(x) -> bool:
    """Whether ``x`` is a cupy array the kernels can take (enabled, and they compile)."""
    return not isinstance(x, np.ndarray) and enabled() and _kernels(int(x.device.id)) is not None


def _grid(total: int):
    return (max(1, min((total + _THREADS - 1) // _THREADS, _MAX_BLOCKS)), 1, 1)


def _pixel_grid(frames: int, npix: int):
    """The pixel kernel's grid: ``y`` the frames (in steps of 65,535), ``x`` enough blocks for
    ``_PIXELS_PER_THREAD`` of a frame's pixels a thread."""
    per = _THREADS * _PIXELS_PER_THREAD
    return (max(1, min(-(-npix // per), _MAX_BLOCKS)), max(1, min(frames, 65535)), 1)


def _strides(x5):
    item = x5.dtype.itemsize
    return tuple(np.int64(s // item) for s in x5.strides)


def _src(cupy, x5):
    """uint8 or float32 input with element strides (other dtypes cast to float32)."""
    if x5.dtype not in (np.uint8, np.float32):
        x5 = x5.astype(cupy.float32)
    if any(s % x5.dtype.itemsize for s in x5.strides):
        x5 = cupy.ascontiguousarray(x5)
    return x5, ("u8" if x5.dtype == np.uint8 else "f32")


# --- host tables for the batched resized crop ---------------------------------------------------


def axis_taps(in_size: int, out_size: int, interpolation: str, antialias: bool) -> _rk.AxisPlan:
    """The sparse taps of resizing one axis of ``in_size`` to ``out_size``: the whole axis's
    :func:`avpipe.ops._resize_kernels.axis_plan` (cached per size: a batch of random crops draws
    its boxes from a few hundred sizes, where a cache of whole 2-D plans would miss nearly
    every time)."""
    return _rk.axis_plan(int(in_size), int(out_size), 0, int(out_size), interpolation,
                         bool(antialias))  # fmt: skip


def crop_tables(top, left, height, width, oh, ow, interpolation, antialias):
    """Per-item sparse taps of each item's crop resize (host numpy, no per-item device work):
    returns ``(tables, meta)``: ``tables = (row0 [B], rows [B], xtab [B, ow, 2], ytab [B, oh,
    2]`` int32 (x starts absolute, y starts relative to the item's ``row0``), ``xw [B, ow, xt],
    yw [B, oh, yt]`` float32), ``meta = (maxrows, xt, yt)``: the kernels' arguments in order."""
    aa = bool(antialias)
    xs = [axis_taps(int(w), ow, interpolation, aa) for w in width]
    ys = [axis_taps(int(h), oh, interpolation, aa) for h in height]
    B = len(xs)
    xt = max((a.weights.shape[1] for a in xs), default=1)
    yt = max((a.weights.shape[1] for a in ys), default=1)
    rows = np.array([a.rows for a in ys], np.int32)
    maxrows = int(rows.max()) if B else 1
    row0 = (np.asarray(top, np.int64).reshape(-1) + np.array([a.row0 for a in ys], np.int64))
    xtab = np.stack([a.table for a in xs]) if B else np.zeros((0, ow, 2), np.int32)
    xtab[:, :, 0] += np.asarray(left, np.int32).reshape(-1, 1)
    ytab = np.stack([a.rel for a in ys]) if B else np.zeros((0, oh, 2), np.int32)
    xw = np.zeros((B, ow, xt), np.float32)
    yw = np.zeros((B, oh, yt), np.float32)
    for b in range(B):  # host copies of cached rows (the taps differ in width per size)
        xw[b, :, : xs[b].weights.shape[1]] = xs[b].weights
        yw[b, :, : ys[b].weights.shape[1]] = ys[b].weights
    return (row0.astype(np.int32), rows, xtab, ytab, xw, yw), (maxrows, xt, yt)


def crop_launch(x5, tables, meta, oh, ow, *, mode):
    """cupy ``x5`` ``[B, T, H, W, C]`` -> ``[B, T, oh, ow, C]`` float32 (``MODE_F32``) or uint8
    (``MODE_U8``, rounded once) with :func:`crop_tables`' ``tables`` already on the device: two
    launches, nothing copied."""
    import cupy

    kern = _kernels(int(x5.device.id))
    B, T, H, W, C = (int(s) for s in x5.shape)
    row0, rows, xtab, ytab, xw, yw = tables
    maxrows, xt, yt = meta
    with cupy.cuda.Device(x5.device.id):
        out = cupy.empty((B, T, oh, ow, C), np.uint8 if mode == MODE_U8 else np.float32)
        if out.size == 0:
            return out
        src, kind = _src(cupy, x5)
        tmp = cupy.empty((B, T, maxrows, ow, C), cupy.float32)
        kern[f"avp_crop_hpass_{kind}"](_grid(tmp.size), (_THREADS, 1, 1), (
            src, *_strides(src), np.int32(B), np.int32(T), np.int32(maxrows), np.int32(ow),
            np.int32(C), row0, rows, xtab, xw, np.int32(xt), tmp))  # fmt: skip
        kern["avp_crop_vpass"](_grid(out.size), (_THREADS, 1, 1), (
            tmp, np.int32(B), np.int32(T), np.int32(maxrows), np.int32(ow), np.int32(C),
            np.int32(oh), ytab, yw, np.int32(yt), np.int32(mode), out))  # fmt: skip
    return out


def resized_crop(x5, top, left, height, width, oh, ow, interpolation, antialias, *, mode):
    """:func:`crop_launch` of host boxes: their :func:`crop_tables` in one host -> device copy,
    then the two launches."""
    import cupy

    tables, meta = crop_tables(top, left, height, width, oh, ow, interpolation, antialias)
    with cupy.cuda.Device(x5.device.id):
        dev = upload_many(cupy, tables)
    return crop_launch(x5, dev, meta, oh, ow, mode=mode)


# --- flip / jitter / normalize ------------------------------------------------------------------

_VECS: dict = {}
_JITTER = ("order", "brightness", "contrast", "saturation", "hue")


def _vec(cupy, v, device_id):
    v = np.ascontiguousarray(v, np.float32)
    key = (v.tobytes(), device_id)
    hit = _VECS.get(key)
    if hit is None:
        if len(_VECS) >= 256:  # full: this call's own copy, on its stream (the cached ones
            (hit,) = upload_many(cupy, [v])  # may still be read by queued kernels: kept)
            return hit
        # cached for every stream (the recipe's decode threads each run on their own): the
        # copy completes before the array is handed out
        (hit,) = upload_many(cupy, [v], wait=True)
        _VECS[key] = hit
    return hit


def on_device(cupy, values, dtypes):
    """``values`` (device or host arrays) as contiguous device arrays of ``dtypes``: device
    arrays of the right kind as they are, the host ones in one host -> device copy."""
    out, pending = list(values), []
    for i, (v, dt) in enumerate(zip(values, dtypes)):
        if not isinstance(v, np.ndarray) and (is_cupy(v) or hasattr(v, "__cuda_array_interface__")):
            if v.dtype != dt or not v.flags.c_contiguous:
                out[i] = cupy.ascontiguousarray(cupy.asarray(v, dtype=dt))
        else:
            pending.append(i)
            out[i] = np.ascontiguousarray(v, dt)
    if pending:
        for i, d in zip(pending, upload_many(cupy, [out[i] for i in pending])):
            out[i] = d
    return out


def mean_parts(npix: int) -> int:
    """The parts each frame's gray sum is split into (``gridDim.y`` of the gray-mean launch):
    one per ``_MEAN_PIXELS`` pixels, 1..64. A function of the frame's size alone, so a frame's
    mean (its parts added in order) is the same in any batch: a clip transformed alone and in
    its batch get the same values."""
    return max(1, min(64, -(-int(npix) // _MEAN_PIXELS)))


def pixels(x5, *, flip=None, jitter=None, bound=255.0, round_u8=False, affine=None, nchw=False,
           mode=MODE_F32):  # fmt: skip
    """cupy ``x5`` ``[B, T, H, W, 3]`` (uint8 / float32, any strides) -> a new contiguous
    ``[B, T, H, W, 3]`` (``nchw``: ``[B, T, 3, H, W]``) array of ``mode``'s dtype (float32,
    float16: the float32 values rounded to nearest even, or uint8): ``flip`` (bool
    [B]) mirrors items, ``jitter`` (the colour-jitter params dict) applies the jitter in each
    item's order, ``round_u8`` rounds to uint8 levels after it, ``affine = (a, b)`` (3 float32
    each) maps ``v * a + b``. The parameters may be on the device (used in place) or the host
    (in the launches' own table where they fit, else copied up together, once:
    :func:`avpipe.device.table_args`). One launch (two with a jitter: the gray means)."""
    import cupy

    dev = int(x5.device.id)
    kern = _kernels(dev)
    B, T, H, W, C = (int(s) for s in x5.shape)
    if C != 3:
        raise ValueError(f"the pixel kernel needs 3 channels, got {C}")
    if jitter is not None and H * W >= 2**31:  # (the gray means count pixels in 32 bits)
        raise ValueError(f"frames of {H}x{W} pixels are too large for the gray means")
    with cupy.cuda.Device(dev):
        src, kind = _src(cupy, x5)
        shape = (B, T, 3, H, W) if nchw else (B, T, H, W, 3)
        out = cupy.empty(shape, _OUT_DTYPE[mode])
        if out.size == 0:
            return out
        st = _strides(src)
        vals, dts = [], []
        if flip is not None:
            vals, dts = [flip], [np.dtype(bool)]  # (bytes of 0 or 1: the kernel's uint8)
        if jitter is not None:
            vals += [jitter[k] for k in _JITTER]
            dts += [np.dtype(np.int64)] + [np.dtype(np.float64)] * 4
        tab, inl = NO_TABLE, 0
        if vals and all(isinstance(v, np.ndarray) for v in vals):  # host params: the table's
            tab, inl, vals = table_args(cupy, [np.ascontiguousarray(v, dt)
                                               for v, dt in zip(vals, dts)])  # fmt: skip
        else:
            vals = on_device(cupy, vals, dts)
        fl = vals.pop(0) if flip is not None else 0
        if flip is not None and not inl:
            fl = fl.view(cupy.uint8)
        if jitter is not None:
            order, *fac = vals
            parts = mean_parts(H * W)
            mean = cupy.empty(B * T * parts, cupy.float64)
            grid = (max(1, min(B * T, _MAX_BLOCKS)), parts, 1)
            kern[f"avp_gray_mean_{kind}"](grid, (_MEAN_THREADS, 1, 1), (
                src, *st, np.int32(B), np.int32(T), np.int32(H), np.int32(W), order, *fac,
                np.float32(bound), mean, tab, np.int32(inl)))  # fmt: skip
        else:
            order, mean, parts = 0, 0, 0
            fac = [0, 0, 0, 0]
        a = b = 0
        if affine is not None:
            a, b = _vec(cupy, affine[0], dev), _vec(cupy, affine[1], dev)
        kern[f"avp_pixels_{kind}"](_pixel_grid(B * T, H * W), (_THREADS, 1, 1), (
            src, *st, np.int32(B), np.int32(T), np.int32(H), np.int32(W), fl, order, *fac, mean,
            np.int32(parts), np.float32(bound), np.int32(1 if round_u8 else 0), a, b,
            np.int32(1 if nchw else 0), np.int32(mode), out, tab, np.int32(inl)))  # fmt: skip
    return out
