"""The device layer: where arrays live, which array module computes on them, and how they leave.

Devices are named ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ``None`` means the default device:
the GPU when CuPy imports and a CUDA driver reports a device, else the CPU (the choice is logged
once at INFO level and reported by ``avpipe.info()``).

Every operator is written once against an *array module* (:mod:`numpy` on the CPU, :mod:`cupy`
on a GPU): ``xp = array_module(x)``. Arrays leave through DLPack without a copy
(:func:`to_torch`, :func:`to_jax`, :func:`to_cupy`, :func:`to_numpy` — the last one copies only
when the data is on a GPU, since host memory is the only place numpy can see).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import settings

__all__ = [
    "Device",
    "resolve_device",
    "default_device",
    "gpu_available",
    "array_module",
    "device_of",
    "to_device",
    "stream",
    "to_torch",
    "to_jax",
    "to_cupy",
    "to_numpy",
    "export",
]

log = logging.getLogger("avpipe")

_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


@dataclass(frozen=True)
class Device:
    """A resolved device: ``kind`` is ``"cpu"`` or ``"cuda"``; ``index`` is the GPU ordinal."""

    kind: str
    index: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def xp(self):
        """The array module for this device (numpy or cupy)."""
        if self.is_cuda:
            import cupy

            return cupy
        return np

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @contextlib.contextmanager
    def activate(self):
        """Make this the current CUDA device for the ``with`` block (no-op on the CPU)."""
        if not self.is_cuda:
            yield
            return
        import cupy

        with cupy.cuda.Device(self.index):
            yield


def _gpu_count() -> int:
    """CUDA devices usable here: 0 with ``AVPIPE_DISABLE_GPU`` set (read at each call)."""
    if settings.disable_gpu():
        return 0
    return _cuda_device_count()


@functools.cache
def _cuda_device_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device: all mean "no usable GPU"
        return 0


def gpu_available() -> bool:
    """True when CuPy imports and the CUDA driver reports at least one device."""
    return _gpu_count() > 0


def default_device() -> Device:
    """``cuda:0`` when a GPU is usable (and ``AVPIPE_DISABLE_GPU`` is off), else the CPU."""
    dev = Device("cuda", 0) if gpu_available() else Device("cpu")
    if _logged.get("default") != dev:
        _logged["default"] = dev
        log.info("avpipe: default device is %s", dev)
    return dev


_logged: dict = {}


def resolve_device(device: Any = None, *, param: str = "device") -> Device:
    """Resolve ``None``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a :class:`Device`.

    Raises ``ValueError`` naming ``param`` for an unknown name, and ``RuntimeError`` when a GPU
    is asked for and none is usable.
    """
    if device is None:
        return default_device()
    if isinstance(device, Device):
        return device
    if not isinstance(device, str):
        # torch.device and similar objects print as "cuda:0" / "cpu"
        device = str(device)
    m = _DEVICE_RE.match(device.strip().lower())
    if not m:
        raise ValueError(f"{param} must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    kind, idx = m.group(1), m.group(2)
    if kind == "cpu":
        if idx is not None:
            raise ValueError(f"{param} must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        return Device("cpu")
    n = _gpu_count()
    index = int(idx) if idx is not None else 0
    if n == 0:
        raise RuntimeError(f"{param}={device!r}: no usable CUDA GPU (is cupy installed?)")
    if index >= n:
        raise ValueError(f"{param}={device!r}: only {n} CUDA device(s) are visible")
    return Device("cuda", index)


def _is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy")


def array_module(*arrays):
    """numpy, or cupy when any of ``arrays`` is a cupy array."""
    for a in arrays:
        if _is_cupy(a):
            import cupy

            return cupy
    return np


def device_of(x) -> Device:
    """The device an array lives on."""
    if _is_cupy(x):
        return Device("cuda", int(x.device.id))
    return Device("cpu")


def to_device(x, device: Any = None):
    """Move an array (numpy/cupy/anything with DLPack) to ``device``; no copy when already there."""
    dev = resolve_device(device)
    if dev.is_cuda:
        import cupy

        if _is_cupy(x) and x.device.id == dev.index:
            return x
        with cupy.cuda.Device(dev.index):
            if _is_cupy(x):
                return x.copy()
            return cupy.asarray(x)
    return to_numpy(x)


def upload_many(xp, arrays, *, wait: bool = False) -> list:
    """Host numpy ``arrays`` on ``xp``'s device in one copy: packed into one byte buffer, each at
    an offset aligned to 8 bytes; returns views of it with the arrays' dtypes and shapes (for
    kernels' small per-call tables: one transfer instead of one each).

    On a GPU the buffer is pinned host memory and the copy is queued on the current stream
    without waiting: a copy from pageable memory first waits for all the work queued on the
    stream, which would hold the caller (a feed's producer) to the GPU's pace every batch. The
    pinned buffer is kept until the copy is done (:func:`keep_until_done`). Work on other
    streams must not read such views; ``wait=True`` (tables cached for every stream) copies on
    a stream of its own and returns when the copy is done, waiting for nothing else."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offs, pos = [], 0
    for a in arrays:
        offs.append(pos)
        pos += -(-a.nbytes // 8) * 8
    size = max(pos, 8)
    if xp is np:
        buf = np.zeros(size, np.uint8)
    else:
        mem = xp.cuda.alloc_pinned_memory(1 << max(12, (size - 1).bit_length()))
        buf = np.frombuffer(mem, np.uint8, size)
    for a, o in zip(arrays, offs):
        buf[o : o + a.nbytes] = a.view(np.uint8).reshape(-1)
    if xp is np:
        dev = buf
    else:
        if wait:  # the destination from the copy stream's pool, where the copy runs: no
            st = _copy_stream(xp, xp.cuda.Device().id)  # block another stream's work holds
            with st:
                dev = xp.empty(size, xp.uint8)
        else:
            st = xp.cuda.get_current_stream()
            dev = xp.empty(size, xp.uint8)
        dev.set(buf, stream=st)  # from pinned memory: queued on st, not waited for
        if wait:
            st.synchronize()
        else:
            keep_until_done(st.record(), mem)
    if xp is np:
        views = [dev[o : o + a.nbytes].view(a.dtype) for a, o in zip(arrays, offs)]
        return [v if a.ndim == 1 else v.reshape(a.shape) for a, v in zip(arrays, views)]
    # each array an ndarray over its part of the buffer: one object apiece, where a slice, a
    # view and a reshape made three (a batch's tables are several small arrays, every batch)
    base = dev.data
    return [xp.ndarray(a.shape, a.dtype, memptr=base + o) for a, o in zip(arrays, offs)]


# --- small per-call tables in a launch's own parameters -----------------------------------------
#
# A kernel's per-call table (a batch's rows, boxes, jitter factors: a few hundred bytes) can
# travel in the launch's parameters instead of a host -> device copy: no pinned buffer, no
# device buffer, no event to keep them alive (the driver takes the parameters' bytes at the
# launch). On an H200 a launch with its table this way cost 12 us of host time, against 51 us
# for upload_many and a launch. A kernel takes the table as ``AvpTable`` by value (CUDA's
# ``__grid_constant__``: read in place, not copied per thread) beside its pointer arguments,
# and an ``inl`` flag: set, its table pointers are byte offsets into that table
# (``avp_tab``); offset 0 is never one (the first word is left empty), so a null pointer still
# means "none". The table is TABLE_BYTES: with a kernel's other arguments within the 4 KiB of
# parameters every CUDA device takes; 3,584 bytes of arrays (a batch of 64 rows of 7 int64).
# Larger tables, and GPUs before compute capability 7.0 (no ``__grid_constant__``), keep the
# copy.

TABLE_BYTES = 3592
TABLE_CUDA = r"""
#ifndef AVP_TABLE_DEFINED
#define AVP_TABLE_DEFINED
#define AVP_TABLE_WORDS @WORDS@
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
#define AVP_GRID_CONST __grid_constant__
#else
#define AVP_GRID_CONST
#endif
// a launch's small tables, by value (device.py's TABLE_BYTES)
struct AvpTable { long long w[AVP_TABLE_WORDS]; };
// p: a device address, or with inl set a byte offset into the launch's table (never 0). A
// GPU before 7.0 never gets a table (launch_table says no there), and reading one would copy
// it to every thread's memory: there p is always an address.
template <typename T>
__device__ __forceinline__ const T* avp_tab(const AvpTable& tab, int inl, const T* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
    return p;
#else
    return inl ? (const T*)((const char*)tab.w + (unsigned long long)p) : p;
#endif
}
#endif
""".replace("@WORDS@", str(TABLE_BYTES // 8))
_TABLE = np.dtype({"names": ["w"], "formats": [(np.int64, (TABLE_BYTES // 8,))]}, align=True)
NO_TABLE = np.zeros(TABLE_BYTES // 8, np.int64).view(_TABLE)[0]  # the table of a launch without


def launch_table(xp, arrays):
    """Host ``arrays`` packed into one by-value kernel argument (``AvpTable``), each at an
    offset aligned to 8 bytes (from 8 on): ``(table, offsets)`` with the offsets as
    ``numpy.uint64`` (what the kernel's pointer arguments take in their place), or None where
    they do not fit ``TABLE_BYTES`` or the current device cannot read a table so (then copy
    them up: :func:`upload_many`)."""
    if xp is np or not _tables_ok(xp, xp.cuda.Device().id):
        return None
    offs, pos = [], 8
    for a in arrays:
        offs.append(np.uint64(pos))
        pos += -(-a.nbytes // 8) * 8
    if pos > TABLE_BYTES:
        return None
    w = np.zeros(TABLE_BYTES // 8, np.int64)
    raw = w.view(np.uint8)
    for a, o in zip(arrays, offs):
        o = int(o)
        raw[o : o + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    return w.view(_TABLE)[0], offs


def table_args(xp, arrays):
    """Host ``arrays`` for a kernel that takes a launch table: ``(tab, inl, args)``, the
    arrays in the launch's own table where they fit (``args`` their byte offsets, ``inl`` 1),
    else copied up in one copy (``args`` device arrays, ``inl`` 0, ``tab`` :data:`NO_TABLE`)."""
    got = launch_table(xp, arrays)
    if got is None:
        return NO_TABLE, 0, upload_many(xp, arrays)
    return got[0], 1, got[1]


@functools.cache
def _tables_ok(xp, device_id: int) -> bool:
    """Whether kernels on ``device_id`` read a launch's table in place (compute capability 7.0
    or later: ``__grid_constant__``)."""
    try:
        return int(xp.cuda.Device(device_id).compute_capability) >= 70
    except Exception:  # noqa: BLE001 - no capability known: keep the copies
        return False


def round_up_eighth(n: int) -> int:
    """``n`` rounded up to ``m * 2**k`` with ``m`` in 8..15 (``n`` itself up to 16): at most 1/8
    more, and eight sizes an octave, so sizes that vary from call to call (a batch's length)
    meet the same few values again (a cached plan, a pooled buffer)."""
    n = max(int(n), 1)
    if n <= 16:
        return n
    k = n.bit_length() - 4  # n >> k is in 8..15
    return -(-n >> k) << k


def pinned_size(nbytes: int) -> int:
    """The size of a page-locked buffer for ``nbytes``: :func:`round_up_eighth`, at least 4 KiB.
    CuPy's pinned-memory pool reuses a freed block only for a request of the same size, so
    buffers for arrays of varying shapes (a batch's features, its length changing every batch)
    would otherwise each be a new page-locked allocation (slow, and every size ever seen kept
    in the pool)."""
    return round_up_eighth(max(int(nbytes), 4096))


def download(arrays) -> tuple[list, Any]:
    """Device-to-host copies of ``arrays``, queued on the current stream and not waited for:
    ``(host arrays, event)``. Each host array views page-locked memory from CuPy's pool (sized
    by :func:`pinned_size`; back in the pool when the last view of it is gone); read them only
    after ``event.synchronize()``. Host (numpy) arrays come back as they are, with event None
    when all of them are."""
    out, event = [], None
    for x in arrays:
        if isinstance(x, np.ndarray) or not _is_cupy(x):
            out.append(np.asarray(x))
            continue
        import cupy

        try:
            x = cupy.ascontiguousarray(x)
            try:
                mem = cupy.cuda.alloc_pinned_memory(pinned_size(x.nbytes))
            except Exception:  # noqa: BLE001 - no page-locked memory left: a plain copy, waited
                out.append(x.get())
                continue
            host = np.frombuffer(mem, x.dtype, x.size).reshape(x.shape)
            if x.nbytes:
                st = cupy.cuda.get_current_stream()
                cupy.cuda.runtime.memcpyAsync(host.ctypes.data, x.data.ptr, x.nbytes,
                                              cupy.cuda.runtime.memcpyDeviceToHost, st.ptr)
        except BaseException:
            if event:  # a copy queued for an earlier array writes into memory about to be freed
                cupy.cuda.get_current_stream().synchronize()
            raise
        out.append(host)
        event = True
    if event:
        import cupy

        event = cupy.cuda.get_current_stream().record()
    return out, event


@functools.cache
def _copy_stream(cupy, device_id: int):
    """A stream of ``upload_many(wait=True)``'s own on ``device_id`` (its copies wait for no
    other work)."""
    with cupy.cuda.Device(device_id):
        return cupy.cuda.Stream(non_blocking=True)


_IN_FLIGHT: collections.deque = collections.deque()  # (event, what it holds) of queued work
_IN_FLIGHT_LOCK = threading.Lock()


def keep_until_done(event, mem) -> None:
    """Hold ``mem`` until ``event`` (recorded after the work that reads it) is done: a copy's
    pinned source, or device arrays made on other streams that a kernel reads (their memory
    goes back to their own stream's pool when dropped, where work not ordered after that
    kernel could reuse it). Work already done lets go of its memory (in order, under a lock:
    the feeds' producers and the video decode threads call this from several threads)."""
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.append((event, mem))
        while _IN_FLIGHT and _IN_FLIGHT[0][0].done:
            _IN_FLIGHT.popleft()


@contextlib.contextmanager
def stream(device: Any = None, *, non_blocking: bool = True):
    """A CUDA stream for the ``with`` block on ``device`` (a no-op on the CPU).

    Yields the ``cupy.cuda.Stream`` (or ``None`` on the CPU). Work queued inside runs on it; the
    caller synchronizes when it needs the results on the host.
    """
    dev = resolve_device(device)
    if not dev.is_cuda:
        yield None
        return
    import cupy

    with cupy.cuda.Device(dev.index):
        s = cupy.cuda.Stream(non_blocking=non_blocking)
        with s:
            yield s


# --- leaving avpipe through DLPack ------------------------------------------------------------


def to_numpy(x) -> np.ndarray:
    """A numpy array: zero-copy for host data, a device-to-host copy for GPU data."""
    if isinstance(x, np.ndarray):
        return x
    if _is_cupy(x):
        return x.get()
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (RuntimeError, BufferError, TypeError):
            pass
    if type(x).__module__.startswith("torch"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def to_cupy(x):
    """A cupy array sharing ``x``'s GPU memory (DLPack); host arrays are copied to the GPU."""
    import cupy

    if _is_cupy(x):
        return x
    if isinstance(x, np.ndarray):
        return cupy.asarray(x)
    return cupy.from_dlpack(x)


def to_torch(x):
    """A torch tensor sharing ``x``'s memory through DLPack (no copy, CPU or GPU)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        # torch.from_numpy shares memory and accepts read-only-free arrays
        if not x.flags.writeable:
            x = x.copy()
        return torch.from_numpy(x)
    return torch.from_dlpack(x)


def to_jax(x):
    """A JAX array from ``x`` through DLPack (zero-copy where JAX's device matches)."""
    import jax.dlpack
    import jax.numpy as jnp

    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    return jax.dlpack.from_dlpack(x)


_EXPORTERS = {"numpy": to_numpy, "cupy": to_cupy, "torch": to_torch, "jax": to_jax}


def export(x, framework: str | None = None):
    """Convert to ``framework`` (``"numpy"``, ``"cupy"``, ``"torch"``, ``"jax"``; None: as is)."""
    if framework is None:
        return x
    try:
        fn = _EXPORTERS[framework]
    except KeyError:
        raise ValueError(
            f"framework must be one of {sorted(_EXPORTERS)} or None, got {framework!r}"
        ) from None
    return fn(x)
