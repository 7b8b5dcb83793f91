"""SpecAugment on a GPU: the CUDA glue of :func:`avpipe.ops.audio_augment.spec_augment`.

The kernels are ``_spec_augment.cu`` (after :data:`avpipe.ops.random.PHILOX_FUNCTION`, their
draws' generator): one draws the masks' table from ``(seed, epoch, ids)``, one masks a float32
``[B, n_mels, T]`` batch from a table, one draws and masks in a single launch. The numpy code
of :mod:`avpipe.ops.audio_augment` (``sample_spec_augment_params``, ``apply_spec_augment``) is
their reference; they equal it exactly. Settings arrive checked (``audio_augment``'s
``_spec_settings``).
"""

from __future__ import annotations

import functools

import numpy as np

from ..device import NO_TABLE, array_module, table_args, upload_many
from ..device.cuda_modules import CudaModule
from . import random as R
from ._augment_base import as_ids, host

_SPEC_PARAMS = ("freq_start", "freq_width", "time_start", "time_width")


def spec_augment_table(params):
    """The kernels' mask table: int64 ``[B, 2 kf + 2 kt]`` (per item its frequency-mask starts,
    widths, time-mask starts, widths), on the params' device."""
    parts = [params[k] for k in _SPEC_PARAMS]
    xp = array_module(parts[0])
    B = int(np.shape(parts[0])[0])
    return xp.ascontiguousarray(xp.concatenate(
        [xp.asarray(a, dtype=xp.int64).reshape(B, -1) for a in parts], axis=1))


def spec_params_of(table, kf, kt):
    """The sampler's dict: views of the columns of a mask table."""
    cuts = np.cumsum([0, kf, kf, kt, kt])
    return {k: table[:, cuts[j] : cuts[j + 1]] for j, k in enumerate(_SPEC_PARAMS)}


def _table_of(cupy, parts, B, kf, kt):
    """The mask table whose first ``B`` rows' column views the four param arrays are (as the
    device sampler hands them out), or None."""
    ld = 2 * kf + 2 * kt
    base = getattr(parts[0], "base", None)
    if (not isinstance(base, cupy.ndarray) or base.ndim != 2 or base.dtype != np.int64
            or not base.flags.c_contiguous or base.shape[1] != ld or base.shape[0] < B):  # fmt: skip
        return None
    for a, k, off in zip(parts, (kf, kf, kt, kt), (0, kf, 2 * kf, 2 * kf + kt)):
        if (not isinstance(a, cupy.ndarray) or a.base is not base or a.shape != (B, k)
                or a.strides != (8 * ld, 8) or a.data.ptr != base.data.ptr + 8 * off):  # fmt: skip
            return None
    return base[:B]


_KERNELS = CudaModule(__file__, "_spec_augment.cu", table=True, prelude=R.PHILOX_FUNCTION,
                      names=("avpipe_spec_augment_draw", "avpipe_spec_augment",
                             "avpipe_spec_augment_fused"))  # fmt: skip
KERNEL_FILE = _KERNELS.paths[0]  # the source (the CPU tests build it as C++)


def _spec_kernels(device_id: int):
    """(draw, apply, fused) kernels of ``_spec_augment.cu`` on ``device_id``."""
    k = _KERNELS.get(device_id)
    return (k["avpipe_spec_augment_draw"], k["avpipe_spec_augment"],
            k["avpipe_spec_augment_fused"])


# the most masks (freq_masks + time_masks) the one-launch path takes (_spec_augment.cu's
# AVPIPE_SPEC_MAX_MASKS: its shared memory); more go through the table of draws
SPEC_FUSED_MAX_MASKS = 256


def draw_scalars(seed, epoch, n_mels, kf, F, kt, time_width, adaptive_time_masks,
                 stream):  # fmt: skip
    """The draw kernel's arguments between ``(ids, lens, B)`` and ``(table, ld)``, for checked
    settings (``audio_augment._spec_settings``): adaptive None is passed as -1."""
    fixed = _draw_fixed(seed, int(n_mels), kf, F, kt, float(time_width),
                        None if adaptive_time_masks is None else float(adaptive_time_masks),
                        stream)  # fmt: skip
    return fixed + (np.uint32(int(epoch) & 0xFFFFFFFF),)


@functools.lru_cache(maxsize=64, typed=True)  # typed: a bool or float seed is not 1's entry
def _draw_fixed(seed, n_mels, kf, F, kt, time_width, adaptive_time_masks, stream):
    """:func:`draw_scalars` but the epoch's (the same from batch to batch of a run)."""
    frac = time_width < 1
    fk = R.stream_key(seed, stream + ".freq")
    tk = R.stream_key(seed, stream + ".time")
    return (np.int32(kf), np.int32(kt), np.int64(n_mels), np.int64(F),
            np.float64(time_width if frac else int(time_width)), np.int32(frac),
            np.float64(-1.0 if adaptive_time_masks is None else adaptive_time_masks),
            np.uint32(fk[0]), np.uint32(fk[1]), np.uint32(tk[0]), np.uint32(tk[1]))  # fmt: skip


def spec_augment_draws(cupy, seed, epoch, ids, lengths, n_mels, kf, F, kt, time_width,
                       adaptive_time_masks, stream):  # fmt: skip
    """sample_spec_augment_params on a GPU for checked settings (``audio_augment._spec_settings``):
    ``(table [B, 2 kf + 2 kt], lengths)`` on the device, one kernel (host ids and lengths in
    the launch's own table where they fit, else copied up in one copy, not waited for; the
    kernel writes the lengths to the device for the masks)."""
    host_in = not (isinstance(ids, cupy.ndarray) or isinstance(lengths, cupy.ndarray))
    if host_in:
        ids = as_ids(ids, len(ids), np)
        lens = np.asarray(host(lengths), np.int64).reshape(-1)
    else:
        ids = cupy.ascontiguousarray(as_ids(ids, len(ids), cupy))
        lens = cupy.ascontiguousarray(cupy.asarray(lengths, dtype=cupy.int64).reshape(-1))
    B = int(ids.shape[0])
    if lens.shape[0] != B:
        raise ValueError(f"lengths must have one entry per id ({B}), got {lens.shape[0]}")
    ld = 2 * kf + 2 * kt
    table = cupy.empty((B, ld), cupy.int64)
    tab, inl, lens_out, lens_arg = NO_TABLE, 0, 0, lens
    if host_in and B and ld:
        tab, inl, (ids, lens_arg) = table_args(cupy, [ids, lens])
        if inl:  # the kernel reads them from its table and writes the lengths to the device
            lens = lens_out = cupy.empty(B, cupy.int64)
        else:
            lens = lens_arg
    elif host_in:
        ids, lens = upload_many(cupy, [ids, lens])
        lens_arg = lens
    if B and ld:
        draw = _spec_kernels(table.device.id)[0]
        draw(((B + 127) // 128,), (128,),
             (ids, lens_arg, np.int64(B),
              *draw_scalars(seed, epoch, n_mels, kf, F, kt, time_width,
                            adaptive_time_masks, stream),
              table, np.int64(ld), lens_out, tab, np.int32(inl)))  # fmt: skip
    return table, lens


def spec_augment_apply(cupy, x, lens, table, kf, kt, mask_value):
    """The mask kernel over float32 ``x [B, F, T]``: ``lens`` (device int64 [B]), ``table``
    (device int64 [B, 2 kf + 2 kt], contiguous rows)."""
    x = cupy.ascontiguousarray(x)
    B, F, T = x.shape
    out = cupy.empty_like(x)
    total = B * F * T
    ld = table.strides[0] // 8
    threads = 256
    at = table.data.ptr
    ptrs = [np.uint64(at + 8 * off) for off in (0, kf, 2 * kf, 2 * kf + kt)]
    apply = _spec_kernels(x.device.id)[1]
    apply(((total + threads - 1) // threads,), (threads,),
          (x, out, lens, *ptrs, np.int64(ld), np.int32(kf), np.int32(kt), np.int64(F),
           np.int64(T), np.int64(total), np.float32(mask_value)))  # fmt: skip
    return out


def spec_augment_fused(cupy, x, seed, epoch, ids, lengths, kf, F, kt, time_width,
                       adaptive_time_masks, stream, mask_value, inplace):  # fmt: skip
    """Draws and masks in one launch (``avpipe_spec_augment_fused``) on the float32 cupy
    ``x [B, n_mels, T]`` for checked settings and checked host int64 ``ids`` and ``lengths``
    (frames) ``[B]`` (``audio_augment.spec_augment``'s), in the launch's own table where they
    fit. ``inplace``: ``x`` itself is masked and returned (only its masked cells written; a
    strided ``x`` is masked as a contiguous copy, copied back), else a new array."""
    if not x.flags.c_contiguous:  # a contiguous copy of our own, masked in place
        own = spec_augment_fused(cupy, cupy.ascontiguousarray(x), seed, epoch, ids, lengths, kf,
                                 F, kt, time_width, adaptive_time_masks, stream, mask_value,
                                 True)
        if not inplace:
            return own
        x[...] = own
        return x
    B, n_mels, T = x.shape
    out = x if inplace else cupy.empty_like(x)
    tab, inl, (ids_a, lens_a) = table_args(cupy, [ids, lengths])
    fused = _spec_kernels(x.device.id)[2]
    fused((1, min(n_mels, 65535), min(B, 65535)), (128,),
          (x, out, np.int32(not inplace), ids_a, lens_a, np.int64(B),
           *draw_scalars(seed, epoch, n_mels, kf, F, kt, time_width, adaptive_time_masks,
                         stream),
           np.int64(T), np.float32(mask_value), tab, np.int32(inl)))  # fmt: skip
    return out


def spec_parts(params, B, xp):
    """The four param arrays checked against a batch of ``B``: each ``[B, k]`` or ``[1, k]``
    (broadcast to the batch, as the numpy reference does), the widths as many as the starts.
    Returns ``(parts, kf, kt)``."""
    parts = [params[k] for k in _SPEC_PARAMS]
    for k, a in zip(_SPEC_PARAMS, parts):
        shape = tuple(np.shape(a))
        if len(shape) != 2 or shape[0] not in (1, B):
            raise ValueError(f"params[{k!r}] must be [{B}, masks] (or [1, masks]), got shape "
                             f"{shape}")
    kf, kt = int(np.shape(parts[0])[1]), int(np.shape(parts[2])[1])
    if np.shape(parts[1])[1] != kf or np.shape(parts[3])[1] != kt:
        raise ValueError("params' widths must be as many as their starts, got "
                         f"{[tuple(np.shape(a)) for a in parts]}")
    if B != 1 and any(np.shape(a)[0] == 1 for a in parts):
        mod = np if all(isinstance(a, np.ndarray) for a in parts) else xp
        parts = [mod.broadcast_to(mod.asarray(a), (B, np.shape(a)[1])) for a in parts]
    return parts, kf, kt


def spec_augment_kernel(cupy, x, lens_host, params, mask_value):
    """apply_spec_augment on a GPU: the params' table (one copy up with the lengths, where they
    are on the host) and the mask kernel."""
    B = x.shape[0]
    parts, kf, kt = spec_parts(params, B, cupy)
    lens = np.asarray(lens_host, np.int64).reshape(-1)
    by_name = dict(zip(_SPEC_PARAMS, parts))
    if all(isinstance(a, np.ndarray) for a in parts):  # host params: one copy for all
        lens, table = upload_many(cupy, [lens, spec_augment_table(by_name)])
    else:
        (lens,) = upload_many(cupy, [lens])
        table = _table_of(cupy, parts, B, kf, kt)
        if table is None:
            table = spec_augment_table({k: cupy.asarray(a) for k, a in by_name.items()})
    return spec_augment_apply(cupy, x, lens, table, kf, kt, mask_value)
