"""Leaving avpipe: arrays handed to numpy, CuPy, PyTorch or JAX through DLPack, without a copy
where the memory can be shared (:func:`to_numpy` copies only data on a GPU, since host memory
is the only place numpy can see)."""

from __future__ import annotations

import numpy as np

from .devices import is_cupy

__all__ = ["to_numpy", "to_cupy", "to_torch", "to_jax", "export"]


def to_numpy(x) -> np.ndarray:
    """A numpy array: zero-copy for host data, a device-to-host copy for GPU data."""
    if isinstance(x, np.ndarray):
        return x
    if is_cupy(x):
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

    if is_cupy(x):
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
