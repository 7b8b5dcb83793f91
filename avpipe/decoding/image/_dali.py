"""DALI image-decoding pipelines (private): built once per (device, capacity, roi) and fed with
``fn.external_source``; synchronous (no prefetch), so one ``run()`` decodes exactly the batch fed.
``decode_image_batch`` runs them on the CPU; the image stream builds its own (``_dali_stream``)
from the option helpers here.

A DALI operator error invalidates its pipeline, so a failed pipeline is dropped from the cache
and the next call builds a fresh one (a CPU build costs milliseconds, a "mixed" one ~2 s).

Interpreter exit: DALI pipelines (and nvImageCodec decoders) own C++ threads, and building,
running or destroying one releases the GIL while it waits on them. The feeds call them from
daemon threads (a feed's producer, which even runs ahead into the next epoch); had such a call
still been under way when the interpreter began finalizing, re-taking the GIL would end that
thread with ``pthread_exit`` inside DALI's C++ (``PyPipeline::~PyPipeline`` is ``noexcept``):
``std::terminate``, "terminate called without an active exception", the process aborted. So
every such call goes through :func:`native_call`, every pipeline avpipe builds is registered
(:func:`build_tracked`) and shut down by :func:`release` (its threads joined there, inside
the gate), and an ``atexit`` hook (:func:`_at_exit`, run before finalization and before DALI's
own hook) closes the gate, waits for the calls under way and shuts the remaining pipelines down
on the exiting thread. After it, a native call raises :class:`ShuttingDown` instead of starting.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import operator
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from ... import settings

log = logging.getLogger("avpipe")

_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()


# --- native calls and interpreter exit (the module docstring) -----------------------------------


class ShuttingDown(RuntimeError):
    """The interpreter is exiting: avpipe's DALI pipelines and decoders are shut down."""


EXIT_WAIT_S = 30.0  # how long the exit hook waits for native calls under way in other threads

_GATE = threading.Condition()
_STATE = {"active": 0, "closed": False, "hooked": False}
_LIVE: dict = {}  # id(pipeline) -> pipeline: built by avpipe and not yet released (strong refs)
# pipelines never to be touched again: a forked child's copies of its parent's (DALI's own exit
# hook treats them as before), and at exit those left while a call was still under way
_LEFT: list = []


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: no call is under way in it (the gate's
    lock may have been held by one of them), and the parent's pipelines are not its to shut
    down (DALI's own exit hook treats them as before)."""
    global _GATE
    _GATE = threading.Condition()
    _STATE["active"] = 0
    _LEFT.extend(_LIVE.values())
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _hook() -> None:
    """(Re-)register the exit hook last, so that it runs first (atexit is LIFO): before DALI's
    own hook, which nvidia.dali.pipeline registers when it is imported. Under ``_GATE``."""
    if _STATE["hooked"]:
        atexit.unregister(_at_exit)
    atexit.register(_at_exit)
    _STATE["hooked"] = True


@contextlib.contextmanager
def native_call():
    """Around each call into DALI / nvImageCodec that may release the GIL (build, run, shut
    down): the exit hook waits for the calls under way; after it, raises ShuttingDown."""
    with _GATE:
        if _STATE["closed"]:
            raise ShuttingDown("avpipe: the interpreter is exiting; image decoding has stopped")
        if not _STATE["hooked"]:
            _hook()
        _STATE["active"] += 1
    try:
        yield
    finally:
        with _GATE:
            _STATE["active"] -= 1
            if not _STATE["active"]:
                _GATE.notify_all()


def _shutdown_pipe(pipe) -> None:
    """Stop a DALI pipeline's threads and free its backend now, on this thread (DALI's
    ``Pipeline._shutdown``; the Python object left behind owns nothing native)."""
    shut = getattr(pipe, "_shutdown", None)
    if shut is not None:
        shut()


def build_tracked(pipe):
    """``pipe.build()`` (inside :func:`native_call`), then registered for :func:`release` and
    the exit hook. A pipeline that fails to build is shut down here, before the error leaves."""
    with native_call():
        try:
            pipe.build()
        except BaseException:
            with contextlib.suppress(Exception):
                _shutdown_pipe(pipe)
            raise
        with _GATE:
            _LIVE[id(pipe)] = pipe
            _hook()  # DALI is imported by now: keep this hook ahead of DALI's
    return pipe


def release(pipe) -> None:
    """Shut a registered pipeline down now (its threads joined on this thread, inside the gate:
    the exit hook waits for it). Once the exit hook has run: nothing (it did it)."""
    if pipe is None:
        return
    with _GATE:
        if _STATE["closed"] or _LIVE.pop(id(pipe), None) is None:
            return
        _STATE["active"] += 1
    try:
        _shutdown_pipe(pipe)
    finally:
        with _GATE:
            _STATE["active"] -= 1
            if not _STATE["active"]:
                _GATE.notify_all()


def _at_exit(wait_s: float | None = None) -> None:
    """atexit, before the interpreter finalizes: no new native call starts, the ones under way
    (a feed's producer thread decoding ahead) finish, and every pipeline still registered is
    shut down here, on the exiting thread, where joining DALI's threads is safe."""
    wait_s = EXIT_WAIT_S if wait_s is None else wait_s
    with _GATE:
        _STATE["closed"] = True
        end = time.monotonic() + wait_s
        while _STATE["active"]:
            left = end - time.monotonic()
            if left <= 0:
                break
            _GATE.wait(left)
        busy = _STATE["active"]
        pipes = list(_LIVE.values())
        _LIVE.clear()
        if busy:  # a call still under way may use any of them: leave them all alone (and alive)
            _LEFT.extend(pipes)
    if busy:
        log.warning("avpipe: %d DALI call(s) still running at exit; pipelines left as they are",
                    busy)
        return
    for pipe in pipes:
        try:
            _shutdown_pipe(pipe)
        except Exception:  # noqa: BLE001 - exiting: nothing to report to
            pass


def num_threads() -> int:
    n = settings.dali_threads()
    if n is not None:
        return n
    return max(1, min(16, os.cpu_count() or 1))


def hw_decoder_load() -> float:
    """The share of each batch's JPEGs given to the GPU's hardware JPEG decoder (where the GPU has
    one; DALI's other JPEGs go to its CUDA decoder, whose Huffman stage runs on the CPU threads for
    images under about a megapixel). avpipe's default is 1.0, not DALI's 0.65: small JPEGs decode
    faster when the hardware decoder takes them all (docs/how-it-works.md, "Measured trade-offs").
    ``AVPIPE_JPEG_HW_LOAD`` sets it."""
    return settings.jpeg_hw_load()


def mixed_options(fancy: bool) -> dict:
    """Decoder options for DALI's "mixed" (GPU) image decoder."""
    opts = {"hw_decoder_load": hw_decoder_load()}
    if fancy:  # the GPU's JPEG chroma upsampling made to match libjpeg-turbo's (the CPU path)
        opts["jpeg_fancy_upsampling"] = True
    return opts


def build_with_fallback(build, opts: dict):
    """``build(opts)``; where DALI rejects an option (an older DALI), build without
    ``jpeg_fancy_upsampling`` first, then without any option (each drop logged once)."""
    tries = [opts]
    if "jpeg_fancy_upsampling" in opts:
        tries.append({k: v for k, v in opts.items() if k != "jpeg_fancy_upsampling"})
    if opts:
        tries.append({})
    for o, fewer in zip(tries, tries[1:]):
        try:
            return build(o)
        except ShuttingDown:
            raise
        except Exception as e:  # noqa: BLE001 - DALI raises RuntimeError/TypeError
            dropped = tuple(sorted(set(o) - set(fewer)))
            if dropped not in _DROPPED:
                _DROPPED.add(dropped)
                log.warning("avpipe: DALI refused image decoder option(s) %s (%s: %s); "
                            "building without", list(dropped), type(e).__name__, e)  # fmt: skip
    return build(tries[-1])


_DROPPED: set = set()


def capacity_for(n: int, max_batch: int) -> int:
    """Batch capacity buckets (powers of two up to max_batch) so few pipelines get built."""
    cap = 1
    while cap < n and cap < max_batch:
        cap *= 2
    return min(cap, max_batch)


class DaliDecoder:
    """One DALI pipeline: encoded bytes (+ optional ROI) -> RGB uint8."""

    def __init__(self, device_index: int | None, capacity: int, roi: bool, fancy: bool = True):
        from nvidia.dali import fn, pipeline_def, types

        self.device_index = device_index
        self.capacity = capacity
        self.roi = roi
        self.fancy = fancy
        self.key = _key(device_index, capacity, roi, fancy)
        self.lock = threading.Lock()
        mixed = device_index is not None

        def build(extra):
            return self._build(fn, pipeline_def, types, mixed, roi, capacity, device_index, extra)

        self.pipe = build_with_fallback(build, mixed_options(fancy) if mixed else {})
        self.broken = False

    @staticmethod
    def _build(fn, pipeline_def, types, mixed, roi, capacity, device_index, extra):
        @pipeline_def(
            batch_size=capacity,
            num_threads=num_threads(),
            device_id=device_index,
            exec_async=False,
            exec_pipelined=False,
            prefetch_queue_depth=1,
        )
        def _pipe():
            enc = fn.external_source(name="enc", device="cpu", dtype=types.UINT8, ndim=1)
            dev = "mixed" if mixed else "cpu"
            if roi:
                from nvidia.dali import math as dmath

                anchor = fn.external_source(name="anchor", device="cpu", dtype=types.FLOAT, ndim=1)
                shape = fn.external_source(name="shape", device="cpu", dtype=types.FLOAT, ndim=1)
                # clip the box to the (upright) image: [W, H] of the picture
                hwc = fn.peek_image_shape(enc, dtype=types.FLOAT)
                wh = fn.stack(hwc[1], hwc[0])
                anchor = dmath.min(anchor, wh - 1.0)
                shape = dmath.max(dmath.min(shape, wh - anchor), 1.0)
                return fn.decoders.image_slice(
                    enc,
                    anchor,
                    shape,
                    device=dev,
                    output_type=types.RGB,
                    axis_names="WH",
                    normalized_anchor=False,
                    normalized_shape=False,
                    **extra,
                )
            return fn.decoders.image(enc, device=dev, output_type=types.RGB, **extra)

        return build_tracked(_pipe())

    def run(self, encoded: list, rois: list | None = None):
        """Decode ``encoded`` (list of uint8 arrays, len <= capacity); returns DALI's TensorList."""
        with native_call(), self.lock:
            if self.broken:
                raise RuntimeError("pipeline is no longer valid")
            try:
                self.pipe.feed_input("enc", encoded)
                if self.roi:
                    # roi = (top, left, height, width) -> anchor (x, y), shape (w, h)
                    self.pipe.feed_input(
                        "anchor", [np.array([r[1], r[0]], np.float32) for r in rois]
                    )
                    self.pipe.feed_input(
                        "shape", [np.array([r[3], r[2]], np.float32) for r in rois]
                    )
                (out,) = self.pipe.run()
                return out
            except BaseException:
                self.broken = True
                raise


def _key(device_index, capacity, roi, fancy):
    # the hardware-decoder share is read when a pipeline is built: a new value builds a new one
    return (device_index, capacity, roi, fancy, None if device_index is None else hw_decoder_load())


def get(device_index: int | None, capacity: int, roi: bool, fancy: bool = True) -> DaliDecoder:
    key = _key(device_index, capacity, roi, fancy)
    with _CACHE_LOCK:
        dec = _CACHE.get(key)
        if dec is not None and not dec.broken:
            return dec
    with native_call():  # the build: DALI's imports and set-up (ShuttingDown once exiting)
        dec = DaliDecoder(device_index, capacity, roi, fancy)
    with _CACHE_LOCK:
        had = _CACHE.get(dec.key)
        if had is not None and not had.broken:  # another thread built one meanwhile: keep
            loser, dec = dec, had  # that one, and shut this one's pipeline down (its threads)
        else:
            loser = None
            _CACHE[dec.key] = dec
    if loser is not None:
        with loser.lock:
            pipe = getattr(loser, "pipe", None)
            loser.pipe = None
        release(pipe)
    return dec


def discard(dec: DaliDecoder) -> None:
    """Drop a failed decoder from the cache and shut its pipeline down now (its threads)."""
    with _CACHE_LOCK:
        if _CACHE.get(dec.key) is dec:
            del _CACHE[dec.key]
    with dec.lock:
        pipe = getattr(dec, "pipe", None)
        dec.pipe = None
    release(pipe)


def to_host_list(out) -> list:
    """TensorListCPU -> list of numpy arrays (copies: DALI reuses its buffers)."""
    return [np.array(out[i], copy=True) for i in range(len(out))]


class Rows(Sequence):
    """The images of a stacked ``[N, H, W, C]`` batch as a sequence of ``[H, W, C]`` views, each
    made when it is asked for: a batch consumed through ``stacked`` costs no per-image calls."""

    __slots__ = ("_dense",)

    def __init__(self, dense):
        self._dense = dense

    def __len__(self):
        return int(self._dense.shape[0])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Rows(self._dense[i])
        n = len(self)
        j = operator.index(i)
        if not -n <= j < n:
            raise IndexError(f"image index {i} out of range for {n} images")
        return self._dense[j]

    def __repr__(self):
        return f"Rows({len(self)} x {tuple(self._dense.shape[1:])})"


def host_rows(t) -> np.ndarray:
    """A CPU TensorList of equal-length vectors (anchors, shapes) -> one [N, K] numpy array."""
    if t.is_dense_tensor():
        return np.array(t.as_tensor())
    return np.stack([np.asarray(t[i]) for i in range(len(t))])


def views(out, device_index):
    """TensorList -> (sequence of per-image arrays, stacked array or None), without copying: the
    arrays alias DALI's buffers and are valid until the pipeline runs again."""
    n = len(out)
    if device_index is None:
        if out.is_dense_tensor():
            dense = np.asarray(out.as_tensor())
            return Rows(dense), dense
        return [np.asarray(out[i]) for i in range(n)], None
    import cupy

    with cupy.cuda.Device(device_index):
        if out.is_dense_tensor():
            dense = cupy.asarray(out.as_tensor())
            return Rows(dense), dense
        return [cupy.asarray(out[i]) for i in range(n)], None
