"""Image and video-frame operators, written once for numpy (CPU) and cupy (GPU).

Layout: arrays are NHWC. A clip ``[T, H, W, C]`` is a batch of frames; an image ``[H, W, C]``
is a clip of one frame and comes back as ``[H, W, C]`` (or ``[C, H, W]`` after a layout change).
Results stay on the input's device (``xp = avpipe.device.array_module(x)``).

Resize (:func:`resize`) is separable resampling with precomputed per-axis weights:

* ``antialias=True`` follows PIL's ``Image.resize`` (bilinear = triangle, bicubic ``a=-0.5``,
  the filter widened when downscaling). On float input (0..255 values) it matches torch
  ``interpolate(..., antialias=True)`` within 0.01; on uint8 input it matches PIL within 2 levels
  (like PIL, uint8 input is rounded and clipped between the two passes; PIL's 22-bit fixed-point
  weights and its fixed pass order leave the remaining differences).
* ``antialias=False`` follows torch ``interpolate(align_corners=False)`` (half-pixel centers,
  bicubic ``a=-0.75``); on float input (0..255 values) within 0.01 of torch.

uint8 in -> uint8 out (rounded half up, clipped); float in -> float32 out (not clipped).
The numpy and cupy paths do the same float32 arithmetic (summation order aside); they agree
within 0.01 on float data (0..255 values) and, on uint8, up to 2 levels where a value sits on a
rounding boundary (rare).

:func:`resize_crop_normalize` is the training hot path: the crop is folded into the resize
weights (only the kept output rows/columns are computed), then mean/std, dtype and layout in one
pass. On cupy input it (and :func:`resize`) runs as two fused CUDA kernels
(:mod:`avpipe.ops._resize_kernels`: a horizontal pass reading the uint8 input in place, then a
vertical pass that also normalizes, casts and writes the layout) with the same taps as the
numpy path, which is their reference (they agree within 1e-3 on float32 output);
``AVPIPE_IMAGE_KERNELS=0`` selects the array-module (cuBLAS) path instead.

:func:`nv12_to_rgb` (defined in :mod:`avpipe.ops.color`, re-exported here) converts NV12 (or
planar 4:2:0) to RGB with the colour tags' matrix and range, in swscale's own fixed-point
arithmetic (bit-exact with PyAV's ``to_ndarray(format="rgb24")`` of the same yuv420p planes).
"""

from __future__ import annotations

import functools
import numbers
import operator

import numpy as np

from .._validate import check_choice, pos_int
from ..device import array_module
from . import _image_resize as _rs
from . import _resize_kernels as _kern
from .color import nv12_to_rgb

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "resize",
    "resize_short_side_size",
    "crop",
    "center_crop",
    "flip",
    "normalize",
    "to_layout",
    "to_chw",
    "to_dtype",
    "nv12_to_rgb",
    "resize_crop_normalize",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

INTERPOLATIONS = ("bilinear", "bicubic")  # the resize filters
_DTYPES = {"float16": np.float16, "float32": np.float32, "uint8": np.uint8}


# --- helpers ----------------------------------------------------------------------------------


def _as_batch(x, param="x"):
    """(xp, x as [N, H, W, C], was_single)."""
    xp = array_module(x)
    if not hasattr(x, "ndim"):
        raise TypeError(f"{param} must be a numpy or cupy array, got {type(x).__name__}")
    if x.ndim == 3:
        return xp, x[None], True
    if x.ndim == 4:
        return xp, x, False
    raise ValueError(f"{param} must be [H, W, C] or [N, H, W, C], got shape {tuple(x.shape)}")


def _hw(size, param="size"):
    if isinstance(size, numbers.Integral) and not isinstance(size, bool):
        s = pos_int(param, size)
        return s, s
    try:
        h, w = size
    except (TypeError, ValueError):
        raise ValueError(f"{param} must be an int or (height, width), got {size!r}") from None
    return pos_int(param, h), pos_int(param, w)


def _dtype(dtype, param="dtype"):
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"{param} must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return np.dtype(_DTYPES[dtype])
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"{param} must be one of {sorted(_DTYPES)}, got {dtype!r}") from None
    if dt.type not in _DTYPES.values():
        raise ValueError(f"{param} must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return dt


def _check_interp(interpolation):
    check_choice("interpolation", interpolation, INTERPOLATIONS)


def resize_short_side_size(height: int, width: int, short_side: int) -> tuple[int, int]:
    """Output (h, w) when the shorter side becomes ``short_side`` (torchvision's rounding:
    the long side is ``int(short_side * long / short)``)."""
    short_side = pos_int("short_side", short_side)
    if height <= width:
        return short_side, max(1, int(short_side * width / height))
    return max(1, int(short_side * height / width)), short_side


def _round_u8(xp, y):
    return xp.clip(xp.floor(y + 0.5), 0, 255).astype(xp.uint8)


def _resample(xp, x, out_h, out_w, interpolation, antialias, rows=None, cols=None, u8=False,
              window=None):  # fmt: skip
    """float32 [N, C, H, W] -> float32 [N, C, len(rows), len(cols)] (rows/cols: output windows
    of the resized image, i.e. a crop folded into the resize).

    ``u8``: round and clip to 0..255 between the passes, as PIL does for 8-bit images (so that
    bicubic overshoot is clipped the same way), and take PIL's pass order (horizontal first).
    ``window``: ``(top, left, full_h, full_w)``: ``x`` is that part of a larger image, which the
    resize geometry refers to (ValueError if the resize reads pixels outside it)."""
    n, c, h, w = x.shape
    full_h, full_w = (h, w) if window is None else window[2:]
    r0, r1 = rows if rows is not None else (0, out_h)
    c0, c1 = cols if cols is not None else (0, out_w)
    (y_idx, y_w), (x_idx, x_w) = _rs.resize_taps(
        h, w, out_h, out_w, (r0, r1), (c0, c1), interpolation, bool(antialias),
        None if window is None else tuple(window),
    )  # fmt: skip
    do_h = (out_h, r0, r1, full_h) != (h, 0, h, h)
    do_w = (out_w, c0, c1, full_w) != (w, 0, w, w)

    def mid(t):
        return xp.clip(xp.floor(t + 0.5), 0.0, 255.0) if (u8 and do_h and do_w) else t

    # the pass that leaves the smaller intermediate goes first
    if not u8 and (r1 - r0) * w <= h * (c1 - c0):
        if do_h:
            x = mid(_rs.apply_axis(xp, x, y_idx, y_w, 2))
        if do_w:
            x = _rs.apply_axis(xp, x, x_idx, x_w, 3)
    else:
        if do_w:
            x = mid(_rs.apply_axis(xp, x, x_idx, x_w, 3))
        if do_h:
            x = _rs.apply_axis(xp, x, y_idx, y_w, 2)
    return x


def _to_nchw_f32(xp, xb):
    return xp.ascontiguousarray(xp.transpose(xb, (0, 3, 1, 2)), dtype=xp.float32)


def _target_size(h, w, size, short_side):
    if (size is None) == (short_side is None):
        raise ValueError(
            f"give exactly one of size or short_side, got size={size!r}, short_side={short_side!r}"
        )
    if size is not None:
        return _hw(size)
    return resize_short_side_size(h, w, short_side)


# --- public operators -------------------------------------------------------------------------


def resize(
    x,
    size=None,
    *,
    short_side: int | None = None,
    interpolation: str = "bilinear",
    antialias: bool = True,
):
    """Resize ``x`` ([H, W, C] or [N, H, W, C]) to ``size=(h, w)`` (or an int for a square), or so
    that its shorter side is ``short_side`` (aspect kept, torchvision's rounding).

    ``interpolation``: ``"bilinear"`` or ``"bicubic"``. ``antialias=True``: PIL's filters (widened
    when downscaling); ``antialias=False``: torch ``interpolate(align_corners=False)``.
    uint8 in -> uint8 out; other dtypes -> float32. Tolerances: see the module docstring.
    """
    _check_interp(interpolation)
    xp, xb, single = _as_batch(x)
    n, h, w, c = xb.shape
    oh, ow = _target_size(h, w, size, short_side)
    if (oh, ow) == (h, w):
        out = xb if xb.dtype == np.uint8 else xb.astype(xp.float32)
    else:
        u8 = xb.dtype == np.uint8
        out = None
        if xp is not np and _kern.enabled():  # two fused CUDA kernels (numpy path = reference)
            mode = _kern.MODE_U8 if u8 else _kern.MODE_F32
            out = _kern.resample(xb, oh, ow, (0, oh), (0, ow), interpolation, antialias,
                                 mode=mode, nchw=False)  # fmt: skip
        if out is None:
            y = _resample(xp, _to_nchw_f32(xp, xb), oh, ow, interpolation, antialias, u8=u8)
            y = xp.transpose(y, (0, 2, 3, 1))
            out = _round_u8(xp, y) if u8 else xp.ascontiguousarray(y)
    return out[0] if single else out


def _crop_box(h, w, top, left, height, width):
    if top < 0 or left < 0 or top + height > h or left + width > w:
        raise ValueError(
            f"crop (top={top}, left={left}, height={height}, width={width}) is outside the "
            f"{h}x{w} image"
        )


def crop(x, top: int, left: int, height: int, width: int):
    """``x[..., top:top+height, left:left+width, :]`` (a view); the box must lie inside."""
    _, xb, single = _as_batch(x)
    height, width = pos_int("height", height), pos_int("width", width)
    _crop_box(xb.shape[1], xb.shape[2], int(top), int(left), height, width)
    out = xb[:, top : top + height, left : left + width]
    return out[0] if single else out


def _one_window(window, n):
    """A single window, or the common one of a per-image sequence."""
    if isinstance(window, (list, tuple)) and window and isinstance(window[0], (list, tuple)):
        if len(window) != n:
            raise ValueError(f"window: got {len(window)} windows for {n} images")
        first = tuple(window[0])
        if any(tuple(wi) != first for wi in window):
            raise ValueError(
                f"window: the images have different windows ({first!r}, ...); resize the "
                "images of each window separately"
            )
        return first
    return window


def _check_window(window, h, w):
    """``(top, left, full_h, full_w)`` of an ``h x w`` input inside its full image, validated."""
    try:
        top, left, full_h, full_w = (operator.index(v) for v in window)
    except (TypeError, ValueError):
        raise ValueError(
            f"window must be (top, left, full_height, full_width) ints, got {window!r}"
        ) from None
    if top < 0 or left < 0 or top + h > full_h or left + w > full_w:
        raise ValueError(
            f"window={window!r} does not fit the {h}x{w} input inside a {full_h}x{full_w} image"
        )
    return top, left, full_h, full_w


def _check_box(box, h, w):
    """``(top, left, height, width)`` inside an ``h x w`` image, validated."""
    try:
        top, left, height, width = (operator.index(v) for v in box)
    except (TypeError, ValueError):
        raise ValueError(f"box must be (top, left, height, width) ints, got {box!r}") from None
    if height < 1 or width < 1:
        raise ValueError(f"box must have a positive height and width, got {box!r}")
    _crop_box(h, w, top, left, height, width)
    return top, left, height, width


def _center_offsets(h, w, ch, cw):
    # torchvision's center_crop rounding
    return int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))


def center_crop(x, size):
    """The central ``size`` (int or (h, w)) window (torchvision's rounding of the offsets)."""
    _, xb, _ = _as_batch(x)
    ch, cw = _hw(size)
    top, left = _center_offsets(xb.shape[1], xb.shape[2], ch, cw)
    return crop(x, top, left, ch, cw)


def flip(x, *, horizontal: bool = True, vertical: bool = False):
    """Mirror left-right (``horizontal``) and/or upside-down (``vertical``); a view."""
    _, xb, single = _as_batch(x)
    if horizontal:
        xb = xb[:, :, ::-1]
    if vertical:
        xb = xb[:, ::-1]
    return xb[0] if single else xb


def _channel_vec(xp, v, c, param):
    arr = np.asarray(v, dtype=np.float64).reshape(-1)
    if arr.size == 1:
        arr = np.repeat(arr, c)
    if arr.size != c:
        raise ValueError(f"{param} must have 1 or {c} values, got {v!r}")
    if param == "std" and np.any(arr == 0):
        raise ValueError(f"std must be nonzero, got {v!r}")
    return arr


def _hashable(v):
    """``v`` (a number or a sequence of them) as a cache key."""
    if isinstance(v, (int, float, tuple)):
        return v
    return tuple(np.asarray(v, np.float64).reshape(-1).tolist())


def _affine(mean, std, scale, c):
    """normalize()'s per-channel float32 ``(a, b)``: ``x * a + b == (x * scale - mean) / std``
    (cached: the same few constants on every call of a run)."""
    return _affine_cached(_hashable(mean), _hashable(std), float(scale), int(c))


@functools.lru_cache(maxsize=256)
def _affine_cached(mean, std, scale, c):
    m = _channel_vec(np, mean, c, "mean")
    s = _channel_vec(np, std, c, "std")
    a, b = (scale / s).astype(np.float32), (-m / s).astype(np.float32)
    a.setflags(write=False)
    b.setflags(write=False)
    return a, b


def normalize(x, mean, std, *, scale: float = 1.0, dtype="float32", layout: str = "NHWC"):
    """``(x * scale - mean) / std`` per channel, as ``dtype`` (float16 or float32).

    ``layout`` says where the channels are (``"NHWC"``/``"HWC"`` last, ``"NCHW"``/``"CHW"`` at
    axis -3). For 0..255 input and ImageNet statistics: ``scale=1/255, mean=IMAGENET_MEAN,
    std=IMAGENET_STD``.
    """
    xp = array_module(x)
    dt = _dtype(dtype)
    if dt == np.uint8:
        raise ValueError(f"dtype must be float16 or float32, got {dtype!r}")
    if layout not in ("NHWC", "HWC", "NCHW", "CHW"):
        raise ValueError(f"layout must be 'NHWC', 'HWC', 'NCHW' or 'CHW', got {layout!r}")
    cl = layout.endswith("C")
    c = x.shape[-1] if cl else x.shape[-3]
    a, b = _affine(mean, std, scale, c)  # x * a + b == (x * scale - mean) / std
    shape = (c,) if cl else (c, 1, 1)
    a = xp.asarray(a).reshape(shape)
    b = xp.asarray(b).reshape(shape)
    return (x.astype(xp.float32) * a + b).astype(dt)


def to_layout(x, layout: str):
    """NHWC -> ``"NCHW"`` (or ``"CHW"`` for one image) or ``"NHWC"`` (no-op); a view."""
    xp, xb, single = _as_batch(x)
    if layout in ("NHWC", "HWC"):
        return x
    if layout not in ("NCHW", "CHW"):
        raise ValueError(f"layout must be 'NCHW', 'CHW', 'NHWC' or 'HWC', got {layout!r}")
    out = xp.transpose(xb, (0, 3, 1, 2))
    return out[0] if single else out


def to_chw(x):
    """[H, W, C] -> [C, H, W], [N, H, W, C] -> [N, C, H, W] (a view)."""
    return to_layout(x, "NCHW")


def to_dtype(x, dtype, *, scale: bool = True):
    """Cast to ``dtype``. With ``scale``: uint8 -> float maps 0..255 to 0..1, float -> uint8 maps
    0..1 to 0..255 (rounded, clipped); without, values are kept (float -> uint8 still rounds and
    clips)."""
    xp = array_module(x)
    dt = _dtype(dtype)
    if x.dtype == dt:
        return x
    if dt == np.uint8:
        y = x.astype(xp.float32)
        if scale and x.dtype != np.uint8:
            y = y * 255.0
        return _round_u8(xp, y)
    y = x.astype(xp.float32)
    if scale and x.dtype == np.uint8:
        y = y * (1.0 / 255.0)
    return y.astype(dt)


# --- fused training path -----------------------------------------------------------------------


def resize_crop_normalize(
    x,
    *,
    short_side: int | None = 224,
    size=None,
    crop_size=224,
    mean=IMAGENET_MEAN,
    std=IMAGENET_STD,
    scale: float = 1.0 / 255.0,
    interpolation: str = "bilinear",
    antialias: bool = True,
    dtype="float16",
    layout: str = "NCHW",
    window=None,
    box=None,
    flip: bool = False,
):
    """resize (short side or size) -> center crop -> normalize -> dtype -> layout, fused.

    The crop is folded into the resize weights, so only the ``crop_size`` output rows and columns
    are computed; the result equals ``normalize(center_crop(resize(x)))`` done in float32 without
    the intermediate uint8 rounding (within 1/255/std of the unfused chain on uint8 input).
    ``crop_size=None`` keeps the whole resized image. Returns ``[N, C, h, w]`` (``"NCHW"``) or
    ``[N, h, w, C]`` (``"NHWC"``); one image in -> one image out (``[C, h, w]``/``[h, w, C]``).

    ``window=(top, left, full_h, full_w)``: ``x`` holds only that part (rows ``top:top + H``,
    columns ``left:left + W``) of each ``full_h x full_w`` image, e.g. a decode-time crop
    (:func:`avpipe.pipeline.image_stream.decode_image_stream`'s ``center_square``); the geometry is the
    full image's and the result is the same as on the full images, as long as the window holds
    every pixel the resize reads (else ValueError). A sequence of windows, one per image (a
    stream batch's ``windows``), is accepted when they are all the same (else ValueError: crops
    of one shape can come from images of different sizes; resize those in groups).

    ``box=(top, left, height, width)``: resize that region of each image, as if ``x`` were
    :func:`crop` of it (torchvision's ``resized_crop``; the region is read in place).

    ``flip=True`` mirrors the result horizontally, folded into the resize (the same values as
    flipping the result afterwards, without the extra pass).
    """
    _check_interp(interpolation)
    if short_side is not None and size is not None:
        raise ValueError(
            f"give exactly one of size or short_side, got size={size!r}, short_side={short_side!r}"
        )
    if layout not in ("NCHW", "NHWC", "CHW", "HWC"):
        raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")
    xp, xb, single = _as_batch(x)
    n, h, w, c = xb.shape
    if box is not None:
        if window is not None:
            raise ValueError(f"give box or window, not both; got box={box!r}, window={window!r}")
        box = _check_box(box, h, w)
        h, w = box[2], box[3]  # the geometry is the box's
    if window is not None:
        window = _check_window(_one_window(window, n), h, w)
        h, w = window[2], window[3]  # the geometry is the full image's
    oh, ow = _target_size(h, w, size, short_side)
    if crop_size is None:
        rows, cols = (0, oh), (0, ow)
    else:
        ch, cw = _hw(crop_size, "crop_size")
        if ch > oh or cw > ow:
            raise ValueError(f"crop_size {crop_size!r} is larger than the resized {oh}x{ow} image")
        top, left = _center_offsets(oh, ow, ch, cw)
        rows, cols = (top, top + ch), (left, left + cw)
    if xp is not np and _kern.enabled():  # the fused CUDA kernels (numpy path = reference)
        dt = _dtype(dtype)
        if dt == np.uint8:
            raise ValueError(f"dtype must be float16 or float32, got {dtype!r}")
        a, b = _affine(mean, std, scale, c)  # the constants of normalize()
        mode = _kern.MODE_F16 if dt == np.float16 else _kern.MODE_F32
        y = _kern.resample(xb, oh, ow, rows, cols, interpolation, antialias, mode=mode,
                           nchw=layout in ("NCHW", "CHW"), a=a, b=b, window=window, box=box,
                           flip=bool(flip))  # fmt: skip
        if y is not None:
            return y[0] if single else y
    if box is not None:
        xb = xb[:, box[0] : box[0] + box[2], box[1] : box[1] + box[3]]
    y = _resample(xp, _to_nchw_f32(xp, xb), oh, ow, interpolation, antialias, rows, cols,
                  window=window)  # fmt: skip
    if flip:
        y = y[..., ::-1]
    y = normalize(y, mean, std, scale=scale, dtype=dtype, layout="NCHW")
    if layout in ("NHWC", "HWC"):
        y = xp.transpose(y, (0, 2, 3, 1))
    y = xp.ascontiguousarray(y)
    return y[0] if single else y
