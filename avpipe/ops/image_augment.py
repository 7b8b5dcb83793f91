"""Image and video-clip augmentations (numpy on the CPU, cupy on a GPU; one implementation).

Inputs: clips ``[B, T, H, W, C]`` (``layout="BTHWC"``, the default for 5-D) or ``[B, T, C, H, W]``
(``"BTCHW"``), images ``[B, H, W, C]`` (``"BHWC"``, the default for 4-D) or ``[B, C, H, W]``
(``"BCHW"``); uint8 or float. Every frame of a clip gets its clip's parameters; outputs keep the
input's layout. Each op is a sampler (``sample_*_params(seed, epoch, ids, ..., xp=)``, drawing
only through :mod:`avpipe.ops.random`, keyed by ``(seed, stream, epoch, sample id)``) plus a
pure ``apply_*(x, params)``; the :class:`Augment` classes compose into a :class:`Chain`
(``Chain.from_config([{"op": "random_resized_crop", "size": 224}, {"op": "flip"},
{"op": "color_jitter", "brightness": 0.4}, {"op": "normalize"}])``).

* :func:`sample_resized_crop_params` / :func:`apply_resized_crop`: torchvision's
  ``RandomResizedCrop`` (scale / ratio draws, 10 attempts, then its centre-crop fallback); the
  resize is :mod:`avpipe.ops.image`'s (the same per-axis taps as :func:`avpipe.ops.image.resize`
  of the crop: PIL's antialiased filters, or torch's ``interpolate``), applied to the whole
  batch at once as per-item dense weight matrices (batched GEMMs; no per-item loop on the
  device). The box ``(top, left, height, width)`` is also the argument of
  :func:`avpipe.ops.image.crop`, so a recipe can instead feed ``crop(x, ...)`` of each clip to
  the fused :func:`avpipe.ops.image.resize_crop_normalize` (:func:`fused_resized_crop_normalize`).
* :func:`center_crop`, :func:`n_crop` (3 along the long side, 5, 10 as torchvision).
* :func:`sample_flip_params` / :func:`apply_flip`; :func:`sample_grayscale_params` /
  :func:`apply_grayscale`; :func:`sample_color_jitter_params` / :func:`apply_color_jitter`
  (torchvision ``ColorJitter``: factors uniform on ``[max(0, 1 - b), 1 + b]``, hue on
  ``[-h, h]``, the four in a random order per clip, or a fixed order).
* :func:`sample_temporal_jitter_params` / :func:`apply_temporal_jitter` on frame indices.
* :func:`sample_mixup_params` / :func:`apply_mixup`, :func:`sample_cutmix_params` /
  :func:`apply_cutmix` (torchvision v2's MixUp / CutMix, one lambda per item, paired with the
  previous item of the batch).
* :func:`nv12_crop_box` / :func:`crop_nv12`: a crop taken on NV12 before colour conversion.

Value range: the colour ops treat values as ``0..bound`` (``bound`` 255 for uint8 input, 1.0
for float input, or given); uint8 input is computed in float32 and rounded once at the end
(torchvision rounds after each op on uint8 tensors; the float results match torchvision's).

On cupy (uint8 / float32, 3 channels) the resized crop, flip, colour jitter and normalize run
as fused CUDA kernels (:mod:`avpipe.ops._image_augment_kernels`; the numpy code here is their
reference): the resized crop in one launch for the batch (the one-pass resize of
:mod:`avpipe.ops._resize_kernels`, each item's box read in place and its taps computed in the
kernel; boxes past its limits take two launches with per-item host tap tables), flip / jitter /
normalize in one launch each (the jitter plus one for the frames' gray means), and a
:class:`Chain` runs a resized crop followed by flip, colour jitter and normalize ops as one run
(their ``fuse``): the flip folded into the crop's launch, then one for the gray means and one
for the pixels, three launches a batch. The parameters are drawn on the host (one vectorized
Philox pass for all the run's streams) and go to the device in one copy (with the crop's tap
tables where it needs them); the params dicts remember those host arrays, so applying them (or
replaying them) never reads the device back and never waits for it. ``AVPIPE_IMAGE_KERNELS=0``:
the array-module path.

Tolerances (GPU vs CPU): the parameters are identical (integer and uniform draws are exact on
both; the crop box and the mixup lambdas, which go through log/exp/sqrt, are computed on the
host); crop/flip/grayscale/N-crop/NV12 crop are exact; resize and colour jitter agree within
1e-3 of the value range on float output (1 level on uint8 where a value sits on a rounding
boundary).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from .._validate import check_choice, pos_int
from ..device import array_module, upload_many
from . import _image_augment_kernels as _ak
from . import _image_resize as _rs
from . import _resize_kernels as _ik
from . import random as R
from ._augment_base import (
    Augment,
    Chain,
    applied,
    as_ids,
    below,
    gamma,
    host,
    on,
    uniform_range,
    unit,
)
from .image import (
    INTERPOLATIONS,
    _center_offsets,  # torchvision's rounding
    resize,
)
from .registry import register

__all__ = [
    "Chain",
    "sample_resized_crop_params",
    "apply_resized_crop",
    "random_resized_crop",
    "fused_resized_crop_normalize",
    "center_crop_clips",
    "n_crop",
    "sample_flip_params",
    "apply_flip",
    "sample_grayscale_params",
    "apply_grayscale",
    "sample_color_jitter_params",
    "apply_color_jitter",
    "sample_temporal_jitter_params",
    "apply_temporal_jitter",
    "sample_mixup_params",
    "apply_mixup",
    "sample_cutmix_params",
    "apply_cutmix",
    "nv12_crop_box",
    "crop_nv12",
    "RandomResizedCrop",
    "CenterCrop",
    "RandomFlip",
    "RandomGrayscale",
    "ColorJitter",
    "Normalize",
    "video_train_chain",
]

GRAY = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights
_ORDER = ("brightness", "contrast", "saturation", "hue")


# --- layouts -------------------------------------------------------------------------------------

_LAYOUTS = ("BTHWC", "BTCHW", "BHWC", "BCHW", "HWC", "CHW")


def _canon(x, layout):
    """(xp, x as a [B, T, H, W, C] view, layout). ``layout`` None: by ndim (5: BTHWC, 4: BHWC,
    3: HWC)."""
    xp = array_module(x)
    if layout is None:
        layout = {5: "BTHWC", 4: "BHWC", 3: "HWC"}.get(x.ndim)
        if layout is None:
            raise ValueError(f"x must be [B, T, H, W, C], [B, H, W, C] or [H, W, C], got {x.shape}")
    check_choice("layout", layout, list(_LAYOUTS))
    if x.ndim != len(layout):
        raise ValueError(f"layout {layout!r} needs a {len(layout)}-D array, got shape {x.shape}")
    if layout == "BTCHW":
        x = xp.moveaxis(x, 2, -1)
    elif layout == "BCHW":
        x = xp.moveaxis(x, 1, -1)[:, None]
    elif layout == "BHWC":
        x = x[:, None]
    elif layout == "HWC":
        x = x[None, None]
    elif layout == "CHW":
        x = xp.moveaxis(x, 0, -1)[None, None]
    return xp, x, layout


def _back(xp, y, layout):
    """[B, T, H, W, C] -> ``layout`` (a view)."""
    if layout == "BTCHW":
        return xp.moveaxis(y, -1, 2)
    if layout == "BCHW":
        return xp.moveaxis(y[:, 0], -1, 1)
    if layout == "BHWC":
        return y[:, 0]
    if layout == "HWC":
        return y[0, 0]
    if layout == "CHW":
        return xp.moveaxis(y[0, 0], -1, 0)
    return y


def _size(size):
    if isinstance(size, (int, np.integer)):
        return int(size), int(size)
    h, w = size
    return int(h), int(w)


def _kernel_ok(x5, channels=3):
    """Whether cupy ``x5`` goes to :mod:`avpipe.ops._image_augment_kernels` (uint8 / float32 input;
    ``channels``: the channel count they need, 0 any)."""
    return (not isinstance(x5, np.ndarray) and x5.dtype in (np.uint8, np.float32)
            and (channels == 0 or x5.shape[-1] == channels) and _ak.available(x5))  # fmt: skip


def _finish(xp, y, in_dtype, dtype):
    """float32 result -> uint8 (rounded half up, clipped) for uint8 input, else float32; or
    ``dtype`` if given."""
    dt = np.dtype(dtype) if dtype is not None else (np.dtype(np.uint8) if in_dtype == np.uint8 else np.dtype(np.float32))
    if dt == np.uint8:
        return xp.clip(xp.floor(y + 0.5), 0, 255).astype(xp.uint8)
    return y.astype(dt)


# --- parameters on the device, draws in one pass -------------------------------------------------


class _DeviceParams(dict):
    """A params dict of device arrays made by one host -> device copy of host arrays, which it
    remembers: applying the params reads those (no device -> host copy, no sync). A value
    replaced in the dict is read from the device again; arrays are not expected to be changed
    in place. ``stash``: host-built kernel inputs (a crop's tap tables, on the device) that
    hold while the dict's values are the ones it was made with."""

    def __init__(self, dev: dict, host_arrays: dict):
        super().__init__(dev)
        self._host = {k: (dev[k], host_arrays[k]) for k in dev}
        self._stash: dict = {}

    def intact(self) -> bool:
        return len(self) == len(self._host) and all(self.get(k) is d for k, (d, _) in self._host.items())

    def host(self, key):
        d, h = self._host.get(key, (None, None))
        return h if d is not None and self.get(key) is d else host(self[key])

    def stashed(self, tag):
        return self._stash.get(tag) if self.intact() else None


def _param_on_host(params, key):
    """``params[key]`` on the host (without a device -> host copy for :class:`_DeviceParams`)."""
    return params.host(key) if isinstance(params, _DeviceParams) else host(params[key])


def _known_on_host(params, key):
    """``params[key]`` on the host if that needs no device -> host copy, else None."""
    if isinstance(params, _DeviceParams):
        d, h = params._host.get(key, (None, None))
        return h if d is not None and params.get(key) is d else None
    v = params[key]
    return None if hasattr(v, "__cuda_array_interface__") else np.asarray(v)


def _to_xp(xp, params: dict):
    """A params dict of host arrays on ``xp``: itself (numpy) or a :class:`_DeviceParams` of one
    copy for all its arrays (to the current device)."""
    if xp is np:
        return {k: np.asarray(v) for k, v in params.items()}
    return _DeviceParams(dict(zip(params, upload_many(xp, list(params.values())))), params)


def _check_p(p):
    """:func:`avpipe.ops.random.bernoulli`'s check of a probability."""
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p!r}")
    return float(p)


# --- random resized crop -------------------------------------------------------------------------


def sample_resized_crop_params(seed, epoch, ids, height, width, *, scale=(0.08, 1.0),
                               ratio=(3.0 / 4.0, 4.0 / 3.0), stream="random_resized_crop",
                               xp=np):  # fmt: skip
    """torchvision ``RandomResizedCrop.get_params`` for each item of an ``height x width`` batch:
    up to 10 attempts of ``area * U(scale)`` and ``exp(U(log ratio))``, ``w = round(sqrt(area *
    ratio))``, ``h = round(sqrt(area / ratio))``; the first that fits gives the box, with ``top``
    uniform on ``0..H - h`` and ``left`` on ``0..W - w``; none fits: the centre crop of the
    ratio clamped into ``ratio``. ``height``/``width`` may be per-item arrays.

    Returns ``{"top", "left", "height", "width": int64 [B]}`` on ``xp`` (one copy to a GPU).
    The draws are :mod:`avpipe.ops.random` words; the log/exp/sqrt of the box are computed on
    the host, so every device gets the same boxes."""
    ids_h = _host_ids(ids)
    w = R.words(seed, stream, epoch, ids_h, 40)  # 10 attempts x (scale, ratio, top, left)
    return _to_xp(xp, _rrc_boxes(w, height, width, scale, ratio))


def _rrc_boxes(w, height, width, scale, ratio):
    """:func:`sample_resized_crop_params`' boxes (host int64) from each item's 40 words.

    Per item in Python floats, stopping at the first attempt that fits (usually the first):
    a clip's box costs a few microseconds where a numpy pass over one item's 10 attempts cost
    over 100 (the recipes draw one clip at a time). The arithmetic is numpy's float64 step for
    step (``round`` is ``rint``'s half to even; ``sqrt`` is correctly rounded on both); the
    attempts' ``exp`` is numpy's, one call for the batch."""
    B = w.shape[0]
    H, W = (_per_item(v, B) for v in (height, width))
    s0, s1 = uniform_range(scale, "scale")
    r0, r1 = uniform_range(ratio, "ratio")
    if not (0.0 <= s0 and math.isfinite(s1)):
        raise ValueError(f"scale must be finite fractions of the area >= 0, got {scale!r}")
    if not (0.0 < r0 and math.isfinite(r1)):
        raise ValueError(f"ratio must be finite aspect ratios > 0, got {ratio!r}")
    lr0, lr1 = math.log(r0), math.log(r1)
    aspect = np.exp(lr0 + (lr1 - lr0) * unit(w[:, 10:20], np)).tolist()
    first = w[:, _FIRST_ATTEMPT].tolist()  # attempt 0's scale, top and left words (it mostly
    span = s1 - s0  # fits: an item's other words are read only when it does not)
    out = []  # (top, left, height, width) per item
    for b, (h, wd, asp) in enumerate(zip(H, W, aspect)):
        area = float(h * wd)
        row = None
        for k in range(10):
            if k == 0:
                ws, wt, wl = first[b]
            else:
                if row is None:
                    row = w[b].tolist()
                ws, wt, wl = row[k], row[20 + k], row[30 + k]
            target = area * (s0 + span * (ws * 2.0**-32))
            cw = round(math.sqrt(target * asp[k]))
            ch = round(math.sqrt(target / asp[k]))
            if 0 < cw <= wd and 0 < ch <= h:  # below(): multiply-shift of the word
                out.append(((wt * (h - ch + 1)) >> 32, (wl * (wd - cw + 1)) >> 32, ch, cw))
                break
        else:  # none fits: torchvision's centre crop of the ratio clamped into range
            in_ratio = wd / h if h else (math.inf if wd else math.nan)  # numpy's w / 0
            fw = wd if in_ratio < r0 else (round(h * r1) if in_ratio > r1 else wd)
            fh = round(wd / r0) if in_ratio < r0 else h
            out.append(((h - fh) // 2, (wd - fw) // 2, fh, fw))
    t = np.array(out, np.int64).reshape(B, 4).T
    return {"top": t[0], "left": t[1], "height": t[2], "width": t[3]}


_FIRST_ATTEMPT = [0, 20, 30]  # the random resized crop's words of its first attempt


def _per_item(v, B):
    """``v`` (an int, or one per item) as a list of ``B`` Python ints."""
    if isinstance(v, (int, np.integer)):
        return [int(v)] * B
    if type(v) is np.ndarray and v.shape == (B,) and v.dtype.kind in "iu":
        return v.tolist()
    return np.broadcast_to(np.asarray(host(v), np.int64), (B,)).tolist()


@functools.lru_cache(maxsize=4096)
def _axis_matrix(in_size, out_size, interpolation, antialias):
    idx, w = _rs.axis_weights(in_size, out_size, interpolation, antialias)
    return _rs._dense(idx, w, in_size)  # [out, in], duplicate taps summed


def _crop_matrices(top, size, full, out, interpolation, antialias):
    """[B, out, full] float32: each item's resize of ``full[top:top + size]`` to ``out``."""
    m = np.zeros((top.shape[0], out, full), np.float32)
    for b in range(top.shape[0]):  # host: small weight tables, no device work
        t, s = int(top[b]), int(size[b])
        m[b, :, t : t + s] = _axis_matrix(s, out, interpolation, antialias)
    return m


def _crop_tag(oh, ow, interpolation, antialias):
    """The key of a crop's device tap tables in its params' stash."""
    return ("crop_tables", int(oh), int(ow), interpolation, bool(antialias))


def apply_resized_crop(x, params, size, *, interpolation="bilinear", antialias=True, layout=None,
                       dtype=None):  # fmt: skip
    """Crop each clip to its box (``params``: top, left, height, width [B]) and resize it to
    ``size`` (int or (h, w)): equal to :func:`avpipe.ops.image.resize` of
    :func:`avpipe.ops.image.crop` on float input (the same taps: ``antialias=True`` PIL's
    filters, ``False`` torch's ``interpolate``), within float32 rounding. All items at once:
    out = Ry[b] @ frame @ Rx[b]^T with per-item dense weight matrices (the crop is their
    nonzero columns): two batched GEMMs over the items, no per-item device work. cupy: one
    launch of the one-pass kernel for the batch, each item's taps computed in the kernel
    (:func:`avpipe.ops._resize_kernels.resample_boxes`); boxes past its limits (large
    downscales) take two launches with per-item sparse taps from the host (their copy to the
    device skipped for params a :class:`RandomResizedCrop` drew: they went up with them).
    Either reads the crops in place, within 1e-3 of the value range of numpy on float output,
    1 level on uint8. uint8 in -> uint8 out (rounded once), else float32; ``dtype``
    overrides."""
    return _resized_crop(x, params, size, interpolation, antialias, layout, dtype)[0]


def _resized_crop(x, params, size, interpolation, antialias, layout, dtype, flip=None):
    """:func:`apply_resized_crop`, and ``flip`` (host bool [B], or None) folded into the
    one-pass kernel where it takes the batch: returns ``(y, whether y is flipped)``."""
    if interpolation not in ("bilinear", "bicubic"):
        raise ValueError(f"interpolation must be 'bilinear' or 'bicubic', got {interpolation!r}")
    xp, x5, layout = _canon(x, layout)
    B, T, H, W, C = x5.shape
    oh, ow = _size(size)
    top, left, hh, ww = (_param_on_host(params, k) for k in ("top", "left", "height", "width"))
    if ((top < 0) | (left < 0) | (top + hh > H) | (left + ww > W) | (hh <= 0) | (ww <= 0)).any():
        raise ValueError(f"crop boxes must lie inside the {H}x{W} frames")
    if _kernel_ok(x5, 0):  # cupy: one launch for the batch (two past the one-pass kernel's
        dt = np.dtype(np.uint8 if x5.dtype == np.uint8 else np.float32)  # limits), reading
        dt = np.dtype(dtype) if dtype is not None else dt  # the crops in place
        mode = _ak.MODE_U8 if dt == np.uint8 else _ak.MODE_F32
        got = None
        if isinstance(params, _DeviceParams):  # the table of items went up with the params
            got = params.stashed(_items_tag(x5, oh, ow, interpolation, antialias, mode, flip))
        if got is not None:
            (table,), geometry = got
            y = _ik.launch_boxes(table, geometry, oh, ow, interpolation, bool(antialias),
                                 mode=mode, nchw=False, round_mid=False)  # fmt: skip
        else:
            y = _crop_direct(x5, (top, left, hh, ww), flip, oh, ow, interpolation, antialias,
                             mode)  # fmt: skip
        flipped = y is not None and flip is not None
        if y is None:
            tag = _crop_tag(oh, ow, interpolation, antialias)
            got = params.stashed(tag) if isinstance(params, _DeviceParams) else None
            if got is not None:  # the tables went up with the params
                y = _ak.crop_launch(x5, *got, oh, ow, mode=mode)
            else:
                y = _ak.resized_crop(x5, top, left, hh, ww, oh, ow, interpolation,
                                     bool(antialias), mode=mode)  # fmt: skip
        return _back(xp, y if y.dtype == dt else y.astype(dt), layout), flipped
    ry = xp.asarray(_crop_matrices(top, hh, H, oh, interpolation, bool(antialias)))
    rxt = xp.asarray(np.ascontiguousarray(
        _crop_matrices(left, ww, W, ow, interpolation, bool(antialias)).transpose(0, 2, 1)))
    # two plain batched GEMMs (batch = the items), the contracted axis moved next to the GEMM
    # dimension; the cheaper order first (counting multiply-adds per frame and channel)
    if oh * H * W + oh * W * ow <= H * W * ow + oh * H * ow:  # rows, then columns
        t = xp.ascontiguousarray(xp.transpose(x5, (0, 2, 1, 4, 3)), dtype=xp.float32)  # B H T C W
        t = xp.matmul(ry, t.reshape(B, H, T * C * W)).reshape(B, oh * T * C, W)
        y = xp.matmul(t, rxt).reshape(B, oh, T, C, ow)
        y = xp.transpose(y, (0, 2, 1, 4, 3))  # B T oh ow C
    else:  # columns, then rows
        t = xp.ascontiguousarray(xp.transpose(x5, (0, 1, 2, 4, 3)), dtype=xp.float32)  # B T H C W
        t = xp.matmul(t.reshape(B, T * H * C, W), rxt).reshape(B, T, H, C * ow)
        t = xp.ascontiguousarray(xp.transpose(t, (0, 2, 1, 3))).reshape(B, H, T * C * ow)
        y = xp.matmul(ry, t).reshape(B, oh, T, C, ow)
        y = xp.transpose(y, (0, 2, 1, 4, 3))
    return _back(xp, xp.ascontiguousarray(_finish(xp, y, x5.dtype, dtype)), layout), False


def _direct_ok(heights, widths, oh, ow, interpolation, antialias, c) -> bool:
    """Whether every box of these sizes goes to the one-pass kernel (no host tap tables)."""
    fits = _ik.direct_fits
    return c <= 4 and all(fits(int(h), oh, int(w), ow, interpolation, antialias, c)
                          for h, w in zip(heights, widths))  # fmt: skip


def _crop_direct(x5, box, flip, oh, ow, interpolation, antialias, mode):
    """cupy ``x5`` ``[B, T, H, W, C]``: each item's box (host ``top, left, height, width``
    [B]) resized to ``oh x ow`` and mirrored where ``flip`` (host bool [B] or None) by one
    launch of the one-pass kernel, float32 (``MODE_F32``) or uint8 rounded once
    (``MODE_U8``), ``[B, T, oh, ow, C]``; None where a box needs the two passes."""
    if x5.shape[-1] > 4 or not _ik.enabled():
        return None
    B = int(x5.shape[0])
    boxes = list(zip(*(np.asarray(v, np.int64).reshape(-1).tolist() for v in box)))
    flips = [False] * B if flip is None else np.asarray(flip, bool).reshape(-1).tolist()
    return _ik.resample_boxes(x5, boxes, flips, oh, ow, interpolation, bool(antialias),
                              mode=mode, nchw=False, round_mid=False)  # fmt: skip


def random_resized_crop(x, size, *, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0), seed=0,
                        epoch=0, ids=None, interpolation="bilinear", antialias=True, layout=None,
                        dtype=None, return_params=False):  # fmt: skip
    """:func:`sample_resized_crop_params` then :func:`apply_resized_crop`."""
    xp, x5, lay = _canon(x, layout)
    params = sample_resized_crop_params(seed, epoch, as_ids(ids, x5.shape[0], xp), x5.shape[2],
                                        x5.shape[3], scale=scale, ratio=ratio, xp=xp)  # fmt: skip
    y = apply_resized_crop(x, params, size, interpolation=interpolation, antialias=antialias,
                           layout=layout, dtype=dtype)  # fmt: skip
    return (y, params) if return_params else y


@functools.cache
def _rcn_defaults() -> dict:
    """``resize_crop_normalize``'s defaults of the options the batched path takes (read-only:
    cached)."""
    import inspect

    from .image import resize_crop_normalize

    keep = ("mean", "std", "scale", "interpolation", "antialias", "dtype", "layout")
    params = inspect.signature(resize_crop_normalize).parameters
    return {k: params[k].default for k in keep}


def fused_resized_crop_normalize(x, params, size, *, in_layout=None, color_jitter=None,
                                 bound=255.0, **kwargs):  # fmt: skip
    """The recipe's folded path: each clip's box (``params``: top, left, height, width [B];
    ``flip`` [B] too, optional: mirrored where true) resized by
    :func:`avpipe.ops.image.resize_crop_normalize` (``box=..., size=size, short_side=None,
    crop_size=None``). ``x``: a batch (``in_layout``: its layout; channels-last layouts read
    without a copy), or a list of ``[T, H, W, C]`` clips of any sizes (the same ``T``).
    ``kwargs`` go to ``resize_crop_normalize`` (mean, std, scale, dtype, layout of its output,
    interpolation, antialias). Returns ``[B, T, ...]`` (``[B, ...]`` for images).

    ``color_jitter``: :func:`sample_color_jitter_params`' params, applied between the resize
    and the normalize (torchvision's order; ``bound`` is used only with it): the crops resized
    to ``0..bound`` float32 values,
    :func:`apply_color_jitter` (``bound``), then :class:`Normalize` (``kwargs``' mean, std,
    scale, dtype and layout) — the same values as those calls one after another.

    numpy: one call per clip (the reference). cupy: every clip in one launch of the one-pass
    kernel (:func:`avpipe.ops._resize_kernels.resample_boxes`) where its boxes fit it; else one
    call per clip. With ``color_jitter`` on cupy: then the gray means' and the pixels' launches
    (jitter and normalize in one pass). The crops' table of items and the jitter's parameters
    travel in the launches' own parameters (:func:`avpipe.device.launch_table`) where they
    fit, else in a host -> device copy each."""
    from .image import _affine, _check_box, _check_interp, _dtype, resize_crop_normalize

    if isinstance(x, (list, tuple)):
        clips, images = list(x), False
        xp = array_module(clips[0]) if clips else np
    else:
        xp, x5, _ = _canon(x, in_layout)
        clips, images = [x5[b] for b in range(x5.shape[0])], x.ndim == 4
    top, left, hh, ww = (_param_on_host(params, k) for k in ("top", "left", "height", "width"))
    flips = _param_on_host(params, "flip") if "flip" in params else np.zeros(len(clips), bool)
    for k, v in zip(("top", "left", "height", "width", "flip"), (top, left, hh, ww, flips)):
        if len(v) != len(clips):  # one value a clip, on every device
            raise ValueError(f"params[{k!r}] must have one value per clip ({len(clips)}), got "
                             f"{len(v)}")
    boxes = [(int(top[b]), int(left[b]), int(hh[b]), int(ww[b])) for b in range(len(clips))]
    flips = [bool(f) for f in flips]
    oh, ow = _size(size)
    opts = {**_rcn_defaults(), **kwargs}  # (the numpy path takes resize_crop_normalize's own)
    crop_kw = kwargs
    if color_jitter is not None:  # the crops as 0..bound floats, channels last
        crop_kw = {**kwargs, "mean": 0.0, "std": 1.0, "scale": 1.0, "dtype": "float32",
                   "layout": "NHWC"}  # fmt: skip
    y = None
    if xp is not np and clips and _ik.enabled():
        bad = set(kwargs) - set(_rcn_defaults())
        if bad:
            raise TypeError(f"unexpected keyword arguments {sorted(bad)}")
        copts = {**_rcn_defaults(), **crop_kw}
        _check_interp(copts["interpolation"])
        dt = _dtype(copts["dtype"])
        for c, box in zip(clips, boxes):  # the numpy path's checks
            _check_box(box, int(c.shape[-3]), int(c.shape[-2]))
        if dt != np.uint8 and copts["layout"] in ("NCHW", "NHWC", "CHW", "HWC"):
            a, b = _affine(copts["mean"], copts["std"], copts["scale"], int(clips[0].shape[-1]))
            mode = _ik.MODE_F16 if dt == np.float16 else _ik.MODE_F32
            got = _ik.box_items(clips, boxes, flips, oh, ow, copts["interpolation"],
                                copts["antialias"], mode=mode)  # fmt: skip
            if got is not None:  # (the rows travel in the launch's table, or one copy)
                rows, geometry = got
                y = _ik.launch_boxes(rows, geometry, oh, ow, copts["interpolation"],
                                     copts["antialias"], mode=mode,
                                     nchw=copts["layout"] in ("NCHW", "CHW"), a=a, b=b)  # fmt: skip
    if y is None:
        y = xp.stack([resize_crop_normalize(c, box=box, flip=f, size=(oh, ow), short_side=None,
                                            crop_size=None, **crop_kw)
                      for c, box, f in zip(clips, boxes, flips)])  # fmt: skip
    if color_jitter is not None:
        y = _jitter_normalize(xp, y, color_jitter, bound, opts)
    return y[:, 0] if images else y


def _jitter_normalize(xp, y, jitter, bound, opts):
    """:func:`fused_resized_crop_normalize`'s colour jitter and normalize of ``y`` ``[B, T,
    H, W, 3]`` 0..bound float32: on cupy one pass (and the gray means), the jitter's host
    parameters in the launches' table (or one copy, :func:`avpipe.ops._image_augment_kernels.pixels`),
    else :func:`apply_color_jitter` then :class:`Normalize`."""
    if _kernel_ok(y):  # (_pixels with a Normalize's options, without making one per batch)
        return _pixels(xp, y, "BTHWC", jitter=jitter, bound=bound, norm=_NormOpts(
            opts["mean"], opts["std"], opts["scale"], opts["dtype"], opts["layout"]))
    norm = Normalize(opts["mean"], opts["std"], scale=opts["scale"], dtype=opts["dtype"],
                     out_layout=opts["layout"], layout="BTHWC")  # fmt: skip
    return norm.apply(apply_color_jitter(y, jitter, bound=bound, layout="BTHWC"), {})


class _NormOpts(NamedTuple):
    """What :func:`_pixels` reads of a :class:`Normalize`."""

    mean: object
    std: object
    scale: float
    dtype: object
    out_layout: str


# --- centre crop and N-crop ----------------------------------------------------------------------


def center_crop_clips(x, size, *, layout=None):
    """The central ``size`` window of every frame (torchvision's rounding of the offsets); a
    view."""
    xp, x5, layout = _canon(x, layout)
    ch, cw = _size(size)
    H, W = x5.shape[2:4]
    if ch > H or cw > W:
        raise ValueError(f"crop {size!r} is larger than the {H}x{W} frames")
    t, le = _center_offsets(H, W, ch, cw)
    return _back(xp, x5[:, :, t : t + ch, le : le + cw], layout)


def n_crop(x, size, n=3, *, layout=None):
    """N crops of every clip, stacked as a new axis after the batch: ``[B, N, ...]``.

    * ``n=3``: square-ish crops along the long side at its start, centre and end (the short side
      centred; SlowFast's ``uniform_crop`` offsets: centre ``ceil((L - s) / 2)``);
    * ``n=5``: torchvision ``five_crop``: top-left, top-right, bottom-left, bottom-right, centre;
    * ``n=10``: ``ten_crop``: the five crops, then the five of the horizontally flipped frames.
    """
    xp, x5, layout = _canon(x, layout)
    ch, cw = _size(size)
    H, W = x5.shape[2:4]
    if ch > H or cw > W:
        raise ValueError(f"crop {size!r} is larger than the {H}x{W} frames")
    if n == 3:
        yo, xo = math.ceil((H - ch) / 2), math.ceil((W - cw) / 2)
        if H > W:
            boxes = [(0, xo), (yo, xo), (H - ch, xo)]
        else:
            boxes = [(yo, 0), (yo, xo), (yo, W - cw)]
        crops = [x5[:, :, t : t + ch, le : le + cw] for t, le in boxes]
    elif n in (5, 10):
        ct, cl = _center_offsets(H, W, ch, cw)
        boxes = [(0, 0), (0, W - cw), (H - ch, 0), (H - ch, W - cw), (ct, cl)]
        crops = [x5[:, :, t : t + ch, le : le + cw] for t, le in boxes]
        if n == 10:
            xf = x5[:, :, :, ::-1]
            crops += [xf[:, :, t : t + ch, le : le + cw] for t, le in boxes]
    else:
        raise ValueError(f"n must be 3, 5 or 10, got {n!r}")
    out = xp.stack([_back(xp, c, layout) for c in crops], axis=1)
    return out


# --- flip, grayscale -----------------------------------------------------------------------------


def _host_ids(ids):
    """int64 sample ids on the host (the small per-item draws are made there and copied up
    once: the same words as on the device, without its many small launches)."""
    return as_ids(host(ids) if hasattr(ids, "__cuda_array_interface__") else ids, len(ids), np)


def sample_flip_params(seed, epoch, ids, *, p=0.5, stream="flip", xp=np):
    """``{"flip": bool [B]}``, True with probability ``p`` (drawn on the host, on ``xp``)."""
    ids = _host_ids(ids)
    return _to_xp(xp, {"flip": R.bernoulli(seed, stream, epoch, ids, 1, p=p)[:, 0]})


def apply_flip(x, params, *, layout=None):
    """Mirror left-right the clips whose ``params["flip"]`` is True (all their frames)."""
    xp, x5, layout = _canon(x, layout)
    if _kernel_ok(x5):  # cupy: one launch
        mode = _ak.MODE_U8 if x5.dtype == np.uint8 else _ak.MODE_F32
        return _back(xp, _ak.pixels(x5, flip=params["flip"], mode=mode), layout)
    f = on(xp, params["flip"], bool).reshape(-1, 1, 1, 1, 1)
    return _back(xp, xp.where(f, x5[:, :, :, ::-1], x5), layout)


def sample_grayscale_params(seed, epoch, ids, *, p=0.1, stream="grayscale", xp=np):
    """``{"gray": bool [B]}``, True with probability ``p`` (torchvision RandomGrayscale; drawn on
    the host, on ``xp``)."""
    ids = _host_ids(ids)
    return _to_xp(xp, {"gray": R.bernoulli(seed, stream, epoch, ids, 1, p=p)[:, 0]})


def _gray(xp, x):
    """``0.2989 R + 0.587 G + 0.114 B`` keeping a channel axis of 1 (float32)."""
    return (x[..., 0:1] * GRAY[0] + x[..., 1:2] * GRAY[1] + x[..., 2:3] * GRAY[2]).astype(xp.float32)


def apply_grayscale(x, params, *, layout=None):
    """Replace the RGB channels of the chosen clips by their luma (torchvision's weights; 3
    channels kept); uint8 in -> uint8 out (rounded)."""
    xp, x5, layout = _canon(x, layout)
    g = xp.broadcast_to(_gray(xp, x5.astype(xp.float32)), x5.shape)
    g = _finish(xp, g, x5.dtype, None) if x5.dtype == np.uint8 else g.astype(x5.dtype)
    m = on(xp, params["gray"], bool).reshape(-1, 1, 1, 1, 1)
    return _back(xp, xp.where(m, g, x5), layout)


# --- colour jitter -------------------------------------------------------------------------------


def sample_color_jitter_params(seed, epoch, ids, *, brightness=0.0, contrast=0.0, saturation=0.0,
                               hue=0.0, random_order=True, p=1.0, stream="color_jitter",
                               xp=np):  # fmt: skip
    """torchvision ``ColorJitter.get_params`` per clip: brightness, contrast and saturation
    factors uniform on ``[max(0, 1 - v), 1 + v]`` (or a given ``(low, high)``), hue on
    ``[-h, h]`` (``h <= 0.5``); ``order [B, 4]``: a random permutation of (0 brightness,
    1 contrast, 2 saturation, 3 hue) per clip, or ``0, 1, 2, 3`` with ``random_order=False``.
    A clip not applied (probability ``1 - p``) gets the identity factors. Drawn on the host and
    copied to ``xp`` at once (the four factors float64 ``[B]``)."""
    ids = _host_ids(ids)
    bounds = _jitter_bounds(brightness, contrast, saturation, hue)
    u = R.uniform(seed, stream, epoch, ids, 8)
    a = applied(seed, stream, epoch, ids, p, np) if p < 1.0 else None
    return _to_xp(xp, _jitter_params(u, bounds, random_order, a))


def _jitter_bounds(brightness, contrast, saturation, hue):
    """The four factors' ``(low, high)`` ranges (checked), as torchvision's ColorJitter."""

    def rng(v, name, centre):
        if isinstance(v, (int, float)):
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v!r}")
            return (max(0.0, centre - v), centre + v) if name != "hue" else (-v, v)
        return uniform_range(v, name)

    bounds = [rng(brightness, "brightness", 1.0), rng(contrast, "contrast", 1.0),
              rng(saturation, "saturation", 1.0), rng(hue, "hue", 0.0)]  # fmt: skip
    if not (-0.5 <= bounds[3][0] <= bounds[3][1] <= 0.5):
        raise ValueError(f"hue must be in [0, 0.5] or a range inside [-0.5, 0.5], got {hue!r}")
    return bounds


def _jitter_params(u, bounds, random_order, a):
    """:func:`sample_color_jitter_params`' host arrays from each clip's 8 uniforms ``u`` (4
    factors, 4 sort keys of the order) and whether it is applied (``a``; None: all)."""
    lo, hi = np.array(bounds, np.float64).T[:, :, None]  # [4, 1] each
    # [4, B]: the same float64 steps as factor by factor (each factor's row contiguous)
    fac = np.ascontiguousarray(lo + (hi - lo) * u[:, :4].T)
    if random_order:
        order = np.argsort(u[:, 4:8], axis=1, kind="stable").astype(np.int64)
    else:
        order = np.broadcast_to(np.arange(4, dtype=np.int64), (u.shape[0], 4)).copy()
    if a is not None:
        fac = np.where(a[None], fac, np.array([1.0, 1.0, 1.0, 0.0])[:, None])
    out = {name: fac[k] for k, name in enumerate(_ORDER)}
    out["order"] = order
    return out


def _rgb_to_hsv(xp, r, g, b):
    """torchvision's ``_rgb2hsv`` (values in [0, 1])."""
    maxc = xp.maximum(xp.maximum(r, g), b)
    minc = xp.minimum(xp.minimum(r, g), b)
    eqc = maxc == minc
    cr = maxc - minc
    one = xp.ones_like(maxc)
    s = cr / xp.where(eqc, one, maxc)
    crd = xp.where(eqc, one, cr)
    rc, gc, bc = (maxc - r) / crd, (maxc - g) / crd, (maxc - b) / crd
    hr = (maxc == r) * (bc - gc)
    hg = ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
    hb = ((maxc != g) & (maxc != r)) * (4.0 + gc - rc)
    h = xp.fmod((hr + hg + hb) / 6.0 + 1.0, 1.0)
    return h, s, maxc


def _hsv_to_rgb(xp, h, s, v):
    """torchvision's ``_hsv2rgb``."""
    i = xp.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.astype(xp.int32) % 6
    p = xp.clip(v * (1.0 - s), 0.0, 1.0)
    q = xp.clip(v * (1.0 - s * f), 0.0, 1.0)
    t = xp.clip(v * (1.0 - s * (1.0 - f)), 0.0, 1.0)
    table = ((v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q))
    out = []
    for c in range(3):
        y = table[5][c]
        for k in range(4, -1, -1):
            y = xp.where(i == k, table[k][c], y)
        out.append(y)
    return xp.stack(out, axis=-1)


def _adjust_hue(xp, x, factor, bound):
    """``x`` [N, ..., 3] float32 in 0..bound; ``factor`` [N] hue shifts (turns)."""
    y = x / bound
    h, s, v = _rgb_to_hsv(xp, y[..., 0], y[..., 1], y[..., 2])
    f = factor.reshape((-1,) + (1,) * (h.ndim - 1)).astype(h.dtype)
    h = xp.mod(h + f, 1.0)
    return _hsv_to_rgb(xp, h, s, v) * bound


def apply_color_jitter(x, params, *, bound=None, layout=None):
    """Brightness, contrast, saturation and hue (torchvision's formulas, each clipped to
    ``0..bound``) in each clip's ``order``:

    * brightness ``f``: ``x * f``; contrast: ``f x + (1 - f) mean(gray(frame))`` (the mean
      luma of each frame, as torchvision on a ``[T, C, H, W]`` tensor); saturation:
      ``f x + (1 - f) gray(x)``; hue: shift H of HSV by ``f`` turns.

    numpy (the reference): vectorized per step of the order, one blend for the items doing
    brightness, contrast or saturation there (identity factors for the others) and the hue
    items as one sub-batch. cupy (uint8 / float32): two launches (each frame's gray mean at its
    contrast step, then all four steps per pixel; :mod:`avpipe.ops._image_augment_kernels`), within
    1e-3 of the value range of numpy (1 level on uint8 at a rounding boundary).
    ``bound``: 255 for uint8 input, else 1.0. uint8 in -> uint8 out (rounded once)."""
    xp, x5, layout = _canon(x, layout)
    if x5.shape[-1] != 3:
        raise ValueError(f"colour jitter needs 3 channels, got {x5.shape[-1]}")
    bound = float(bound if bound is not None else (255.0 if x5.dtype == np.uint8 else 1.0))
    if _kernel_ok(x5):
        mode = _ak.MODE_U8 if x5.dtype == np.uint8 else _ak.MODE_F32
        return _back(xp, _ak.pixels(x5, jitter=params, bound=bound, mode=mode), layout)
    y = x5.astype(xp.float32)
    order = _param_on_host(params, "order").astype(np.int64)
    B = y.shape[0]
    fac = [on(xp, params[n], xp.float64).astype(xp.float32) for n in _ORDER]
    hue_h = _param_on_host(params, "hue").astype(np.float64)
    shp = (B, 1, 1, 1, 1)
    for step in range(4):
        o = order[:, step]
        if np.any(o < 3):
            od = xp.asarray(o).reshape(shp)
            f = xp.where(od == 0, fac[0].reshape(shp),
                         xp.where(od == 1, fac[1].reshape(shp),
                                  xp.where(od == 2, fac[2].reshape(shp), 1.0)))  # fmt: skip
            tgt = xp.zeros(shp, xp.float32)
            if np.any((o == 1) | (o == 2)):
                g = _gray(xp, y)
                m = g.mean(axis=(2, 3, 4), keepdims=True)
                tgt = xp.where(od == 2, g, xp.where(od == 1, m, 0.0))
            y = xp.clip(f * y + (1.0 - f) * tgt, 0.0, bound).astype(xp.float32)
        idx = np.nonzero((o == 3) & (hue_h != 0.0))[0]
        if idx.size:
            di = xp.asarray(idx)
            y[di] = _adjust_hue(xp, y[di], fac[3][di], bound).astype(xp.float32)
    return _back(xp, _finish(xp, y, x5.dtype, None if x5.dtype == np.uint8 else x5.dtype), layout)


# --- temporal jitter -----------------------------------------------------------------------------


def sample_temporal_jitter_params(seed, epoch, ids, n_indices, *, max_shift=0, max_jitter=1,
                                  stream="temporal_jitter", xp=np):  # fmt: skip
    """``{"shift": int64 [B], "jitter": int64 [B, n_indices]}``: a clip-wide shift uniform on
    ``[-max_shift, max_shift]`` and a per-index jitter uniform on ``[-max_jitter,
    max_jitter]``."""
    ids = as_ids(ids, len(ids), xp)
    w = R.words(seed, stream, epoch, ids, 1 + int(n_indices), xp=xp)
    ms, mj = int(max_shift), int(max_jitter)
    return {"shift": below(w[:, 0], 2 * ms + 1, xp) - ms,
            "jitter": below(w[:, 1:], 2 * mj + 1, xp) - mj}  # fmt: skip


def apply_temporal_jitter(indices, n_frames, params):
    """``sort(clip(indices + shift + jitter, 0, n_frames - 1))`` per clip: jittered frame
    indices ``[B, n]`` (``n_frames``: an int or per clip), still in order."""
    xp = array_module(indices)
    idx = xp.asarray(indices, dtype=xp.int64)
    nf = xp.asarray(on(xp, n_frames, xp.int64)).reshape(-1, 1)
    j = idx + on(xp, params["shift"], xp.int64)[:, None] + on(xp, params["jitter"], xp.int64)
    return xp.sort(xp.clip(j, 0, nf - 1), axis=1)


# --- mixup / cutmix ------------------------------------------------------------------------------


def sample_mixup_params(seed, epoch, ids, *, alpha=0.2, p=1.0, stream="mixup", xp=np):
    """``{"lam": float64 [B]}``: Beta(alpha, alpha) per item (two Gamma draws, host-side);
    1 (no mixing) with probability ``1 - p``."""
    ids_h = _host_ids(ids)
    g1 = gamma(seed, stream + ".a", epoch, ids_h, alpha)
    g2 = gamma(seed, stream + ".b", epoch, ids_h, alpha)
    lam = g1 / (g1 + g2)
    if p < 1.0:
        lam = np.where(applied(seed, stream, epoch, ids_h, p, np), lam, 1.0)
    return _to_xp(xp, {"lam": np.asarray(lam, np.float64)})


def _labels(xp, labels, num_classes, B):
    y = xp.asarray(labels)
    if y.ndim == 1:
        if num_classes is None:
            raise ValueError("integer labels need num_classes")
        y = (y[:, None] == xp.arange(int(num_classes))[None, :]).astype(xp.float32)
    if y.shape[0] != B:
        raise ValueError(f"labels must have {B} rows, got {y.shape[0]}")
    return y.astype(xp.float32)


def apply_mixup(x, labels, params, *, num_classes=None, layout=None):
    """MixUp: item ``b`` becomes ``lam x[b] + (1 - lam) x[b - 1]`` (paired with the previous
    item, as torchvision v2's batch roll by 1), labels likewise (one-hot ``[B, K]`` or integer
    with ``num_classes``). Returns ``(x float32, labels float32 [B, K])``."""
    xp, x5, layout = _canon(x, layout)
    B = x5.shape[0]
    lam = on(xp, params["lam"], xp.float64).astype(xp.float32)
    xf = x5.astype(xp.float32)
    y = lam.reshape(-1, 1, 1, 1, 1) * xf + (1 - lam).reshape(-1, 1, 1, 1, 1) * xp.roll(xf, 1, axis=0)
    t = _labels(xp, labels, num_classes, B)
    t = lam[:, None] * t + (1 - lam)[:, None] * xp.roll(t, 1, axis=0)
    return _back(xp, y, layout), t


def sample_cutmix_params(seed, epoch, ids, height, width, *, alpha=1.0, p=1.0, stream="cutmix",
                         xp=np):  # fmt: skip
    """torchvision v2 ``CutMix`` per item: ``lam ~ Beta(alpha, alpha)``, centre ``(r_y, r_x)``
    uniform over the frame, half sides ``int(0.5 sqrt(1 - lam) * H)`` / ``* W``, the box clipped
    to the frame; ``lam`` adjusted to ``1 - box area / (H W)``. Returns ``{"y1", "x1", "y2",
    "x2": int64 [B], "lam": float64 [B]}`` (an empty box with probability ``1 - p``)."""
    ids_h = _host_ids(ids)
    H, W = int(height), int(width)
    g1 = gamma(seed, stream + ".a", epoch, ids_h, alpha)
    g2 = gamma(seed, stream + ".b", epoch, ids_h, alpha)
    lam = g1 / (g1 + g2)
    w = R.words(seed, stream, epoch, ids_h, 2)
    ry, rx = below(w[:, 0], H, np), below(w[:, 1], W, np)
    r = 0.5 * np.sqrt(1.0 - lam)
    hh, hw = (r * H).astype(np.int64), (r * W).astype(np.int64)
    y1, y2 = np.maximum(ry - hh, 0), np.minimum(ry + hh, H)
    x1, x2 = np.maximum(rx - hw, 0), np.minimum(rx + hw, W)
    if p < 1.0:
        a = applied(seed, stream, epoch, ids_h, p, np)
        y2, x2 = np.where(a, y2, y1), np.where(a, x2, x1)
    lam = 1.0 - (y2 - y1) * (x2 - x1) / float(H * W)
    return _to_xp(xp, dict(y1=y1, x1=x1, y2=y2, x2=x2, lam=lam))


def apply_cutmix(x, labels, params, *, num_classes=None, layout=None):
    """CutMix: the box of item ``b`` (every frame) is taken from item ``b - 1``; labels mixed
    with the adjusted ``lam``. Returns ``(x, labels float32 [B, K])``; x keeps its dtype."""
    xp, x5, layout = _canon(x, layout)
    B, T, H, W, C = x5.shape
    y1, x1, y2, x2 = (on(xp, params[k], xp.int64).reshape(-1, 1, 1) for k in ("y1", "x1", "y2", "x2"))
    r = xp.arange(H).reshape(1, -1, 1)
    c = xp.arange(W).reshape(1, 1, -1)
    m = ((r >= y1) & (r < y2) & (c >= x1) & (c < x2))[:, None, :, :, None]
    y = xp.where(m, xp.roll(x5, 1, axis=0), x5)
    lam = on(xp, params["lam"], xp.float64).astype(xp.float32)
    t = _labels(xp, labels, num_classes, B)
    t = lam[:, None] * t + (1 - lam)[:, None] * xp.roll(t, 1, axis=0)
    return _back(xp, y, layout), t


# --- NV12 crop -----------------------------------------------------------------------------------


def nv12_crop_box(top, left, height, width, frame_height, frame_width):
    """The even-aligned NV12 box that holds the RGB crop ``(top, left, height, width)``.

    NV12 shares one chroma sample among each 2x2 block of luma, aligned to even rows and
    columns, so a crop can be taken on the NV12 planes before colour conversion (fewer pixels
    converted) when it starts on even coordinates; this widens the box to even ``top``/``left``
    (and an even end, cut at the frame edge). Returns ``((top2, left2, height2, width2), (dy,
    dx))``: convert ``crop_nv12(y, uv, box2)`` with :func:`avpipe.ops.image.nv12_to_rgb`, then
    take rows ``dy:dy + height`` and columns ``dx:dx + width``: the result equals the crop of
    the whole frame's conversion exactly."""
    top, left, height, width = int(top), int(left), int(height), int(width)
    if top < 0 or left < 0 or height <= 0 or width <= 0 or top + height > frame_height \
            or left + width > frame_width:  # fmt: skip
        raise ValueError(f"crop {(top, left, height, width)} is outside the "
                         f"{frame_height}x{frame_width} frame")  # fmt: skip
    t2, l2 = top & ~1, left & ~1
    b2 = min(frame_height, (top + height + 1) & ~1)
    r2 = min(frame_width, (left + width + 1) & ~1)
    return (t2, l2, b2 - t2, r2 - l2), (top - t2, left - l2)


def crop_nv12(y, uv, box):
    """Views of the luma ``[..., H, W]`` and chroma ``[..., ceil(H/2), ceil(W/2), 2]`` planes for
    an even-aligned ``box = (top, left, height, width)`` (:func:`nv12_crop_box`)."""
    t, le, h, w = box
    if t % 2 or le % 2:
        raise ValueError(f"an NV12 box must start on even coordinates, got {box!r}")
    yc = y[..., t : t + h, le : le + w]
    uvc = uv[..., t // 2 : (t + h + 1) // 2, le // 2 : (le + w + 1) // 2, :]
    return yc, uvc


# --- ops for chains ------------------------------------------------------------------------------


def _ids_for(x5, ids, xp):
    if ids is None or isinstance(ids, (list, tuple, range, np.ndarray)):
        return as_ids(ids, x5.shape[0], np)  # host ids: the samplers draw there
    return as_ids(ids, x5.shape[0], xp)


def _pixels(xp, x5, layout, *, flip=None, jitter=None, bound=None, norm=None):
    """cupy: flip, colour jitter and a :class:`Normalize` op (each optional, in that order) as
    one kernel (two with a jitter), with the dtype and layout the ops give one after another
    (the jitter's uint8 rounding kept before the normalize)."""
    from .image import _affine, _dtype

    u8 = x5.dtype == np.uint8
    bound = float(bound if bound is not None else (255.0 if u8 else 1.0))
    if norm is None:
        y = _ak.pixels(x5, flip=flip, jitter=jitter, bound=bound,
                       mode=_ak.MODE_U8 if u8 else _ak.MODE_F32)  # fmt: skip
        return _back(xp, y, layout)
    a, b = _affine(norm.mean, norm.std, norm.scale, 3)  # image.normalize's constants
    nchw = norm.out_layout in ("NCHW", "CHW")
    dt = _dtype(norm.dtype)
    if dt == np.uint8:
        raise ValueError(f"dtype must be float16 or float32, got {norm.dtype!r}")
    y = _ak.pixels(x5, flip=flip, jitter=jitter, bound=bound, round_u8=u8 and jitter is not None,
                   affine=(a, b), nchw=nchw,
                   mode=_ak.MODE_F16 if dt == np.float16 else _ak.MODE_F32)  # fmt: skip
    if dt != y.dtype:
        y = y.astype(dt)
    if nchw:
        return y[:, 0] if layout in ("BHWC", "BCHW") else y
    return _back(xp, y, "BTHWC" if layout in ("BTHWC", "BTCHW") else "BHWC")


def _pixel_ops(x, ops, params):
    """:class:`RandomFlip`, :class:`ColorJitter` and :class:`Normalize` (at most one each,
    Normalize last, one layout): on cupy one pass over the pixels (:func:`_pixels`; flip
    commutes with the jitter); otherwise, or for any other run, the ops one after another."""
    kinds = [type(op) for op in ops]
    layouts = {op.layout for op in ops}
    xp, x5, layout = _canon(x, ops[0].layout)
    if (not _kernel_ok(x5) or len(layouts) != 1 or len(set(kinds)) != len(kinds)
            or not set(kinds) <= {RandomFlip, ColorJitter, Normalize}
            or (Normalize in kinds and kinds[-1] is not Normalize)):  # fmt: skip
        for op, p in zip(ops, params):
            x = op.apply(x, p)
        return x
    got = dict(zip(kinds, zip(ops, params)))
    flip = got[RandomFlip][1]["flip"] if RandomFlip in got else None
    jitter, bound = None, None
    if ColorJitter in got:
        jitter, bound = got[ColorJitter][1], got[ColorJitter][0].bound
    norm = got[Normalize][0] if Normalize in got else None
    return _pixels(xp, x5, layout, flip=flip, jitter=jitter, bound=bound, norm=norm)


def _clip_ops(x, ops, params):
    """:class:`Chain`'s ``fuse`` of a run of :class:`RandomResizedCrop` (first, if there),
    :class:`RandomFlip`, :class:`ColorJitter` and :class:`Normalize`: on cupy the resized crop
    (one launch, with a flip that follows it) then the pixel ops in one pass
    (:func:`_pixel_ops`), their device inputs already uploaded by :func:`_sample_run` (no copy,
    no sync); otherwise the ops in turn."""
    if isinstance(ops[0], RandomResizedCrop):
        crop, p = ops[0], params[0]
        ops, params = ops[1:], params[1:]
        flip = None  # a flip right after the crop (the same layout) folded into its kernel,
        if ops and type(ops[0]) is RandomFlip and ops[0].layout == crop.layout:  # when its
            flip = _known_on_host(params[0], "flip")  # values are known without a read back
        x, flipped = _resized_crop(x, p, crop.size, crop.interpolation, crop.antialias,
                                   crop.layout, crop.dtype, flip)  # fmt: skip
        if flipped:
            ops, params = ops[1:], params[1:]
    return _pixel_ops(x, ops, params) if ops else x


def _own_sampler(op) -> bool:
    """Whether ``op`` draws as its class here does (so :func:`_draw` can draw for it)."""
    for cls in (RandomResizedCrop, RandomFlip, ColorJitter, Normalize):
        if isinstance(op, cls):
            return type(op).sample is cls.sample
    return False


def _sample_run(x, ops, *, seed, epoch=0, ids=None):
    """``fuse.sample`` of :func:`_clip_ops`: the run's parameter dicts, equal to what the ops'
    samplers give (all see the run's input: the crop leads its run), drawn by :func:`_draw` at
    once."""
    if all(_own_sampler(op) for op in ops):
        return _draw(x, ops, seed, epoch, ids)
    return [op.sample(x, seed=seed, epoch=epoch, ids=ids) for op in ops]


def _draw(x, ops, seed, epoch, ids):
    """The parameter dicts of :class:`RandomResizedCrop`, :class:`RandomFlip`,
    :class:`ColorJitter` and :class:`Normalize` ops for the batch ``x``: every op's words in
    one Philox pass on the host (:func:`avpipe.ops.random.words_many`; the same numbers as the module's
    samplers, which draw each stream alone), the values computed there; on cupy one host ->
    device copy for all of them plus each resized crop's tap tables (stashed in its params, so
    applying them copies nothing and never waits for the device)."""
    xp, x5, _ = _canon(x, ops[0].layout)
    ids_h = _host_ids(_ids_for(x5, ids, xp))
    reqs, spans = [], []
    for op in ops:
        r = []
        if isinstance(op, RandomResizedCrop):
            r = [(op.stream, 40)]
        elif isinstance(op, RandomFlip):
            _check_p(op.p)
            r = [(op.stream, 1)]
        elif isinstance(op, ColorJitter):
            _jitter_bounds(op.brightness, op.contrast, op.saturation, op.hue)
            r = [(op.stream, 8)] + ([(op.stream + ".p", 1)] if op.p < 1.0 else [])
            if op.p < 1.0:
                _check_p(op.p)
        spans.append((len(reqs), len(r)))
        reqs += r
    words = R.words_many(seed, epoch, ids_h, reqs)
    hosts, crops = [], {}
    for i, (op, (k, n)) in enumerate(zip(ops, spans)):
        w = words[k : k + n]
        if isinstance(op, RandomResizedCrop):
            _, xr, _ = _canon(x, op.layout)
            hosts.append(_rrc_boxes(w[0], xr.shape[2], xr.shape[3], op.scale, op.ratio))
            oh, ow = _size(op.size)
            hp = hosts[-1]
            if (xp is not np and op.interpolation in ("bilinear", "bicubic") and _kernel_ok(xr, 0)
                    and not _direct_ok(hp["height"], hp["width"], oh, ow, op.interpolation,
                                       op.antialias, int(xr.shape[-1]))):  # fmt: skip
                crops[i] = (_crop_tag(oh, ow, op.interpolation, op.antialias),
                            *_ak.crop_tables(hp["top"], hp["left"], hp["height"], hp["width"],
                                             oh, ow, op.interpolation, op.antialias))  # fmt: skip
        elif isinstance(op, RandomFlip):
            hosts.append({"flip": unit(w[0][:, 0], np) < float(op.p)})
        elif isinstance(op, ColorJitter):
            bounds = _jitter_bounds(op.brightness, op.contrast, op.saturation, op.hue)
            a = unit(w[1][:, 0], np) < float(op.p) if n == 2 else None
            hosts.append(_jitter_params(unit(w[0], np), bounds, op.random_order, a))
        else:
            hosts.append({})
    if xp is np:
        return hosts
    for i, op in enumerate(ops):  # the one-pass crops' tables of items (a flip after the
        if isinstance(op, RandomResizedCrop) and i not in crops:  # crop folded in)
            got = _items_ahead(x, ops, hosts, i)
            if got is not None:
                crops[i] = got
    arrays = [v for hp in hosts for v in hp.values()]
    for _, tables, _ in crops.values():
        arrays += tables
    with xp.cuda.Device(int(x5.device.id)):
        views = iter(upload_many(xp, arrays))
    out = [_DeviceParams({k: next(views) for k in hp}, hp) for hp in hosts]
    for i, (tag, tables, meta) in crops.items():
        out[i]._stash[tag] = (tuple(next(views) for _ in tables), meta)
    return out


def _items_tag(x5, oh, ow, interpolation, antialias, mode, flip):
    """The key of a one-pass crop's device table of items in its params' stash: the table
    holds the input's address and geometry, the output and the flips."""
    return ("crop_items", x5.data.ptr, tuple(x5.shape), tuple(x5.strides), x5.dtype.str,
            int(oh), int(ow), interpolation, bool(antialias), mode,
            None if flip is None else tuple(np.asarray(flip, bool).tolist()))  # fmt: skip


def _crop_mode(op, x5):
    dt = np.dtype(op.dtype) if op.dtype is not None else (
        np.dtype(np.uint8) if x5.dtype == np.uint8 else np.dtype(np.float32))
    return _ak.MODE_U8 if dt == np.uint8 else _ak.MODE_F32


def _items_ahead(x, ops, hosts, i):
    """``(tag, (table,), geometry)``: the table of items :func:`_resized_crop` will launch the
    crop ``ops[i]`` with (its boxes ``hosts[i]``, the flips of a :class:`RandomFlip` right after
    it, as :func:`_clip_ops` folds them), to go up with the params; None where the one-pass
    kernel does not take it."""
    op = ops[i]
    _, x5, _ = _canon(x, op.layout)
    oh, ow = _size(op.size)
    if op.interpolation not in ("bilinear", "bicubic") or not _kernel_ok(x5, 0) or x5.shape[-1] > 4:
        return None
    nxt = ops[i + 1] if i + 1 < len(ops) else None
    flip = hosts[i + 1]["flip"] if type(nxt) is RandomFlip and nxt.layout == op.layout else None
    hp, B = hosts[i], int(x5.shape[0])
    boxes = list(zip(*(hp[k].tolist() for k in ("top", "left", "height", "width"))))
    flips = [False] * B if flip is None else flip.tolist()
    mode = _crop_mode(op, x5)
    got = _ik.box_items(x5, boxes, flips, oh, ow, op.interpolation, bool(op.antialias), mode=mode)
    if got is None:
        return None
    return (_items_tag(x5, oh, ow, op.interpolation, op.antialias, mode, flip), (got[0],),
            got[1])  # fmt: skip


_clip_ops.sample = _sample_run


def _check_size(name, v):
    """An int or [height, width] of positive ints (ValueError naming ``name`` and ``v``)."""
    if isinstance(v, (list, tuple)) and len(v) == 2:
        for x in v:
            pos_int(name, x)
        return
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"{name} must be a positive int or [height, width], got {v!r}")


def _check_resize(args):
    if ("size" in args) == ("short_side" in args) or args.get("size", 0) is None:
        raise ValueError("give exactly one of size or short_side")
    if "size" in args:
        _check_size("size", args["size"])
    else:
        pos_int("short_side", args["short_side"])
    check_choice("interpolation", args.get("interpolation", "bilinear"), INTERPOLATIONS)
    if not isinstance(args.get("antialias", True), bool):
        raise ValueError(f"antialias must be true or false, got {args['antialias']!r}")


def _check_center_crop(args):
    _check_size("size", args.get("size", 224))


@register("resize", kind="image", stage="pixels", validate=_check_resize)
def _op_resize(x, *, size=None, short_side=None, interpolation="bilinear", antialias=True):
    """:func:`avpipe.ops.image.resize` to ``size`` ([height, width] or an int) or with the
    shorter side ``short_side``; clips ``[B, T, H, W, C]`` frame by frame."""
    size = tuple(size) if isinstance(size, list) else size
    kw = {"short_side": short_side} if short_side is not None else {}
    if x.ndim == 5:
        b, t = x.shape[:2]
        y = resize(x.reshape(b * t, *x.shape[2:]), size, interpolation=interpolation,
                   antialias=antialias, **kw)  # fmt: skip
        return y.reshape(b, t, *y.shape[1:])
    return resize(x, size, interpolation=interpolation, antialias=antialias, **kw)


@register(kind="image", stage="pixels")
class RandomResizedCrop(Augment):
    """A random resized crop to ``size`` per image or clip, torchvision's ``RandomResizedCrop``
    (``scale``, ``ratio``)."""

    name = "random_resized_crop"
    fuse = staticmethod(_clip_ops)
    fuse_leads = True  # its sampler reads the frame size of the data it gets

    def __init__(self, size=224, *, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0),
                 interpolation="bilinear", antialias=True, layout=None, dtype=None, stream=None):  # fmt: skip
        super().__init__(stream)
        self.size, self.scale, self.ratio = size, scale, ratio
        self.interpolation, self.antialias, self.layout, self.dtype = interpolation, antialias, layout, dtype

    def sample(self, x, *, seed, epoch=0, ids=None):
        return _draw(x, [self], seed, epoch, ids)[0]  # sample_resized_crop_params' boxes

    def apply(self, x, params):
        return apply_resized_crop(x, params, self.size, interpolation=self.interpolation,
                                  antialias=self.antialias, layout=self.layout, dtype=self.dtype)  # fmt: skip


@register(kind="image", stage="pixels", context=("layout",), validate=_check_center_crop)
class CenterCrop(Augment):
    """The central ``size`` window of every frame (:func:`center_crop_clips`)."""

    name = "center_crop"

    def __init__(self, size=224, *, layout=None, stream=None):
        super().__init__(stream)
        self.size, self.layout = size, layout

    def apply(self, x, params):
        return center_crop_clips(x, self.size, layout=self.layout)


@register(kind="image", stage="pixels")
class RandomFlip(Augment):
    """A horizontal flip with probability ``p`` per image or clip (:func:`sample_flip_params`)."""

    name = "flip"
    fuse = staticmethod(_clip_ops)

    def __init__(self, p=0.5, *, layout=None, stream=None):
        super().__init__(stream)
        self.p, self.layout = p, layout

    def sample(self, x, *, seed, epoch=0, ids=None):
        return _draw(x, [self], seed, epoch, ids)[0]  # sample_flip_params' draws

    def apply(self, x, params):
        return apply_flip(x, params, layout=self.layout)


@register(kind="image", stage="pixels")
class RandomGrayscale(Augment):
    """Grayscale with probability ``p`` per image or clip (:func:`sample_grayscale_params`)."""

    name = "grayscale"

    def __init__(self, p=0.1, *, layout=None, stream=None):
        super().__init__(stream)
        self.p, self.layout = p, layout

    def sample(self, x, *, seed, epoch=0, ids=None):
        xp, x5, _ = _canon(x, self.layout)
        return sample_grayscale_params(seed, epoch, _ids_for(x5, ids, xp), p=self.p,
                                       stream=self.stream, xp=xp)  # fmt: skip

    def apply(self, x, params):
        return apply_grayscale(x, params, layout=self.layout)


@register(kind="image", stage="pixels")
class ColorJitter(Augment):
    """torchvision's ``ColorJitter`` per image or clip: brightness, contrast, saturation and hue
    (:func:`sample_color_jitter_params`)."""

    name = "color_jitter"
    fuse = staticmethod(_clip_ops)

    def __init__(self, brightness=0.0, contrast=0.0, saturation=0.0, hue=0.0, *,
                 random_order=True, p=1.0, bound=None, layout=None, stream=None):  # fmt: skip
        super().__init__(stream)
        self.brightness, self.contrast, self.saturation, self.hue = brightness, contrast, saturation, hue
        self.random_order, self.p, self.bound, self.layout = random_order, p, bound, layout

    def sample(self, x, *, seed, epoch=0, ids=None):
        return _draw(x, [self], seed, epoch, ids)[0]  # sample_color_jitter_params' draws

    def apply(self, x, params):
        return apply_color_jitter(x, params, bound=self.bound, layout=self.layout)


@register(kind="image", stage="pixels", gives="tensor")
class Normalize(Augment):
    """:func:`avpipe.ops.image.normalize` per channel, then the output layout (``"NCHW"``:
    channels before H, W: ``[B, T, C, H, W]`` for clips). cupy, 3 channels: one kernel (equal
    to the numpy path: the same float32 ``v * a + b``), fused with a flip and a colour jitter
    just before it in a :class:`Chain`."""

    name = "normalize"
    fuse = staticmethod(_clip_ops)

    def __init__(self, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), *,
                 scale=1.0 / 255.0, dtype="float32", out_layout="NCHW", layout=None, stream=None):  # fmt: skip
        super().__init__(stream)
        self.mean, self.std, self.scale, self.dtype = mean, std, scale, dtype
        self.out_layout, self.layout = out_layout, layout

    def apply(self, x, params):
        from .image import normalize

        xp, x5, layout = _canon(x, self.layout)
        if _kernel_ok(x5):
            return _pixels(xp, x5, layout, norm=self)
        y = normalize(x5, self.mean, self.std, scale=self.scale, dtype=self.dtype, layout="NHWC")
        if self.out_layout in ("NCHW", "CHW"):
            y = xp.ascontiguousarray(xp.moveaxis(y, -1, 2))
            return y[:, 0] if layout in ("BHWC", "BCHW") else y
        return _back(xp, y, "BTHWC" if layout in ("BTHWC", "BTCHW") else "BHWC")


def video_train_chain(size=224, *, scale=(0.08, 1.0), brightness=0.4, contrast=0.4,
                      saturation=0.4, hue=0.1, flip_p=0.5, dtype="float32", layout=None):  # fmt: skip
    """The usual training stack: random resized crop -> flip -> colour jitter -> normalize
    (ImageNet statistics, ``[B, T, C, H, W]`` / ``[B, C, H, W]`` out)."""
    return Chain([
        RandomResizedCrop(size, scale=scale, layout=layout),
        RandomFlip(flip_p, layout=layout),
        ColorJitter(brightness, contrast, saturation, hue, layout=layout),
        Normalize(dtype=dtype, layout=layout),
    ])  # fmt: skip
