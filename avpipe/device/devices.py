"""Devices: their names, the array module that computes on each, and CUDA streams.

Devices are named ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ``None`` means the default device:
the GPU when CuPy imports and a CUDA driver reports a device, else the CPU (the choice is logged
once at INFO level and reported by ``avpipe.info()``).

Every operator is written once against an *array module* (:mod:`numpy` on the CPU, :mod:`cupy`
on a GPU): ``xp = array_module(x)``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import settings

__all__ = [
    "Device",
    "resolve_device",
    "default_device",
    "gpu_available",
    "gpu_count",
    "array_module",
    "device_of",
    "is_cupy",
    "stream",
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


def gpu_count() -> int:
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
    return gpu_count() > 0


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
    n = gpu_count()
    index = int(idx) if idx is not None else 0
    if n == 0:
        raise RuntimeError(f"{param}={device!r}: no usable CUDA GPU (is cupy installed?)")
    if index >= n:
        raise ValueError(f"{param}={device!r}: only {n} CUDA device(s) are visible")
    return Device("cuda", index)


def is_cupy(x) -> bool:
    """Whether ``x`` is a cupy array (told by its type's module: cupy is not imported)."""
    return type(x).__module__.startswith("cupy")


def array_module(*arrays):
    """numpy, or cupy when any of ``arrays`` is a cupy array."""
    for a in arrays:
        if is_cupy(a):
            import cupy

            return cupy
    return np


def device_of(x) -> Device:
    """The device an array lives on."""
    if is_cupy(x):
        return Device("cuda", int(x.device.id))
    return Device("cpu")


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


