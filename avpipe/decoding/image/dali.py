"""DALI's helpers as the layers above use them (the pipeline's prefetching stream,
:mod:`avpipe.pipeline._dali_stream`): building a pipeline with its fallback options, tracking it
for the exit hook, the native-call gate, and the thread count. The one-request decoders and the
helpers themselves are ``_dali``; its docstring says why the exit hook and the gate exist."""

from __future__ import annotations

from ._dali import (
    ShuttingDown,
    build_tracked,
    build_with_fallback,
    host_rows,
    hw_decoder_load,
    mixed_options,
    native_call,
    num_threads,
    release,
    views,
)

__all__ = ["ShuttingDown", "hw_decoder_load", "host_rows", "views", "build_tracked", "build_with_fallback", "mixed_options", "native_call", "num_threads",
           "release"]
