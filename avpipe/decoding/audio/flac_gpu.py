"""The GPU FLAC decoder of a window of files, as the layers above use it: the pipeline's
window loader (plan, launch, collect) and extraction (its kernels compiled ahead). The decoder
itself is ``_flac_cuda`` (kernels, plan, libFLAC for what the GPU leaves)."""

from __future__ import annotations

from ._flac_cuda import (
    PAD,
    Launched,
    Plan,
    collect,
    compile_kernels,
    decode_on_gpu,
    launch,
    plan_batch,
)

__all__ = ["PAD", "Plan", "Launched", "plan_batch", "launch", "collect", "compile_kernels",
           "decode_on_gpu"]
