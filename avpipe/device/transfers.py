"""Transfers between the host and a GPU: arrays moved to a device, a kernel's small tables copied
up in one copy, results copied down into page-locked memory, and the pinned sources of queued
copies held until the copies are done."""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any

import numpy as np

from .devices import is_cupy, resolve_device
from .interop import to_numpy

__all__ = [
    "to_device",
    "upload_many",
    "download",
    "keep_until_done",
    "pinned_size",
    "round_up_eighth",
]


def to_device(x, device: Any = None):
    """Move an array (numpy/cupy/anything with DLPack) to ``device``; no copy when already there."""
    dev = resolve_device(device)
    if dev.is_cuda:
        import cupy

        if is_cupy(x) and x.device.id == dev.index:
            return x
        with cupy.cuda.Device(dev.index):
            if is_cupy(x):
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
        if isinstance(x, np.ndarray) or not is_cupy(x):
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
