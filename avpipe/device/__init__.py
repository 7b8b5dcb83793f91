"""The device layer: where arrays live, which array module computes on them, how they move
between the host and a GPU, how they leave avpipe, and how its CUDA kernels load.

* :mod:`avpipe.device.devices`: device names (``"cpu"``, ``"cuda"``, ``"cuda:N"``), the
  default device, the array module (numpy or cupy) of an array, CUDA streams;
* :mod:`avpipe.device.transfers`: uploads (``upload_many``: a kernel's tables in one copy),
  downloads into page-locked memory, pinned sources held until their copies are done;
* :mod:`avpipe.device.interop`: DLPack export to numpy, CuPy, PyTorch and JAX;
* :mod:`avpipe.device.cuda_modules`: the one loader of the CUDA kernels (compiled per device,
  cached, one fallback rule) and the launch tables they take.

This package only re-exports them: ``from avpipe.device import resolve_device``.
"""

from .cuda_modules import NO_TABLE, TABLE_BYTES, TABLE_CUDA, launch_table, table_args
from .devices import (
    Device,
    array_module,
    default_device,
    device_of,
    gpu_available,
    gpu_count,
    is_cupy,
    resolve_device,
    stream,
)
from .interop import export, to_cupy, to_jax, to_numpy, to_torch
from .transfers import (
    download,
    keep_until_done,
    pinned_size,
    round_up_eighth,
    to_device,
    upload_many,
)

__all__ = [
    "Device",
    "resolve_device",
    "default_device",
    "gpu_available",
    "gpu_count",
    "array_module",
    "device_of",
    "is_cupy",
    "to_device",
    "stream",
    "to_torch",
    "to_jax",
    "to_cupy",
    "to_numpy",
    "export",
    "upload_many",
    "download",
    "keep_until_done",
    "pinned_size",
    "round_up_eighth",
    "launch_table",
    "table_args",
    "NO_TABLE",
    "TABLE_BYTES",
    "TABLE_CUDA",
]
