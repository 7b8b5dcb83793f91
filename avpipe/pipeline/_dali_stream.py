"""The prefetching DALI pipeline behind :func:`avpipe.pipeline.image_stream.decode_image_stream`:
DALI's own threads read and decode the next batches while the caller works on the current one.
DALI's helpers come from :mod:`avpipe.decoding.image.dali`.
"""

from __future__ import annotations

import inspect

from .. import settings
from ..decoding.image.dali import (
    build_tracked,
    build_with_fallback,
    mixed_options,
    native_call,
    num_threads,
    release,
)

__all__ = ["StreamDecoder"]


class StreamDecoder:
    """A pipelined, prefetching DALI pipeline over a known list of batches: DALI's own threads
    read and decode batch i+1.. while the caller works on batch i.

    ``load(i)`` returns batch ``i``'s encoded images (a list of uint8 arrays); ``n_batches`` is
    how many there are. With ``files`` (all sources are paths) DALI's own file reader reads them
    in its C++ threads instead (the last batch is padded; the caller trims it). ``run()`` returns
    DALI's outputs (valid until the next ``run()``): ``(images,)``, or with ``square`` (a
    decode-time crop of the centred square widened by ``ceil(margin * side) + 3`` pixels a side
    where there is room; ``margin=0``: the bare square) ``(images, anchors [x, y], shapes
    [H, W, C])``; it raises StopIteration after the last batch.

    With DALI's default (dynamic) executor, whose outputs DALI never reuses while they are
    referenced, ``run()`` asks for the next iteration right after taking a batch's outputs
    (``schedule_run`` / ``outputs``, as DALI's own framework iterators do), so DALI keeps
    ``prefetch`` batches in flight while the caller works on the one it got; ``pipe.run()``
    would only ask on the caller's next call. ``stream_outputs``: on a GPU, ``run(stream)``
    binds the outputs to that CUDA stream (DALI's ``outputs(cuda_stream=...)``): the stream,
    not the host, waits for the decode, and DALI frees the buffers in that stream's order.

    Its DALI threads: building, running and :meth:`close` (which shuts the pipeline down and
    joins them, on the calling thread) go through ``_dali.native_call``, so the interpreter's
    exit waits for them, and a decoder still open at exit is shut down by ``_dali``'s exit hook
    (the module docstring of ``avpipe.decoding.image._dali``). Close it when done: until then
    it holds its threads and buffers.
    """

    pipe = None

    def __init__(self, load, n_batches: int, device_index, capacity: int, fancy: bool,
                 prefetch: int = 2, files: list | None = None, square: bool = False,
                 margin: float = 0.0):  # fmt: skip
        from nvidia.dali import fn, pipeline_def, types

        mixed = device_index is not None

        def source(info):
            if info.iteration >= n_batches:
                raise StopIteration
            return load(info.iteration)

        def build(extra):
            @pipeline_def(
                batch_size=capacity,
                num_threads=num_threads(),
                device_id=device_index,
                prefetch_queue_depth=prefetch,
            )
            def _pipe():
                if files is not None:
                    enc, _ = fn.readers.file(
                        files=files, random_shuffle=False, pad_last_batch=True, name="reader"
                    )
                else:
                    enc = fn.external_source(
                        source=source, batch=True, batch_info=True, device="cpu",
                        dtype=types.UINT8, ndim=1,
                    )  # fmt: skip
                dev = "mixed" if mixed else "cpu"
                if square:  # a decode-time crop: the centred min(H, W) square + margins
                    from nvidia.dali import math as dmath

                    hwc = fn.peek_image_shape(enc, dtype=types.FLOAT)
                    h, w = hwc[0], hwc[1]
                    side = dmath.min(h, w)
                    x0, y0 = dmath.floor((w - side) * 0.5), dmath.floor((h - side) * 0.5)
                    m = dmath.ceil(side * float(margin)) + 3.0 if margin > 0 else 0.0
                    ax, ay = dmath.max(x0 - m, 0.0), dmath.max(y0 - m, 0.0)
                    ex, ey = dmath.min(x0 + side + m, w), dmath.min(y0 + side + m, h)
                    anchor = fn.stack(ax, ay)
                    img = fn.decoders.image_slice(
                        enc, anchor, fn.stack(ex - ax, ey - ay), device=dev,
                        output_type=types.RGB, axis_names="WH", normalized_anchor=False,
                        normalized_shape=False, **extra,
                    )  # fmt: skip
                    return img, anchor, hwc
                return fn.decoders.image(enc, device=dev, output_type=types.RGB, **extra)

            return build_tracked(_pipe())

        with native_call():
            self.pipe = build_with_fallback(build, mixed_options(fancy) if mixed else {})

        self.n_batches = n_batches
        self.done = 0
        self.prefetch = max(1, int(prefetch))
        self.started = False
        # outputs stay valid while referenced (DALI >= 2.0 default); else the legacy pipe.run()
        self.dynamic = bool(getattr(self.pipe, "exec_dynamic", False))
        self.stream_outputs = mixed and self.dynamic and _outputs_take_stream(self.pipe)

    def run(self, stream=None):
        """The next batch's outputs (see above). ``stream`` (a ``cupy.cuda.Stream``; only where
        ``stream_outputs``): bind the outputs to it instead of waiting on the host."""
        if self.done >= self.n_batches:
            raise StopIteration
        with native_call():
            pipe = self.pipe
            if pipe is None:
                raise RuntimeError("the stream decoder is closed")
            if not self.dynamic:
                outs = pipe.run()
                self.done += 1
                return outs
            if not self.started:
                self.started = True
                pipe.schedule_run()  # the first call queues `prefetch` iterations
            outs = pipe.outputs(stream) if stream is not None else pipe.outputs()
            self.done += 1
            # queue the next iteration now, so DALI works on it while the caller uses this batch
            # (an error raised here makes the caller decode this batch again on its slow path)
            if self.done + self.prefetch <= self.n_batches:
                pipe.schedule_run()
            return outs

    def close(self):
        """Shut the pipeline down now: its threads are joined here, on this thread (not later,
        wherever and whenever the last reference goes)."""
        pipe, self.pipe = self.pipe, None
        release(pipe)

    def __del__(self):  # one never closed (a dropped generator): its threads go with it
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _outputs_take_stream(pipe) -> bool:
    """Whether ``pipe.outputs`` accepts ``cuda_stream`` (DALI >= 2.0 with the dynamic executor);
    ``AVPIPE_DALI_STREAM_OUTPUTS=0`` turns it off (host-synchronous outputs, as before)."""
    if not settings.dali_stream_outputs():
        return False
    try:
        return "cuda_stream" in inspect.signature(pipe.outputs).parameters
    except (TypeError, ValueError):
        return False
