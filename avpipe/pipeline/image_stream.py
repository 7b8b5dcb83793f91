"""A prefetching stream of decoded image batches (the training / benchmark hot path).

:func:`decode_image_stream` keeps DALI reading and decoding the next batches while the caller
works on the current one, and hands out views of DALI's buffers (no copies). A batch that fails
is decoded by :func:`avpipe.decoding.image.decode_image_batch` (which reports the bad images),
and the prefetching path starts again after it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np

from .._source import open_source
from .._validate import pos_int
from ..decoding.image import (
    ImageBatch,
    admit,
    dali,
    decode_image_batch,
    file_reader,
    isolate,
    j2k_check,
    native_stderr,
    resolve_max_pixels,
    size_problem,
    sniff_format,
    square_window,
)
from ..device import Device, resolve_device
from ._dali_stream import StreamDecoder

__all__ = ["decode_image_stream", "LoadedChunks", "stream_loaded", "needs_batch_path"]


def decode_image_stream(
    sources: Sequence,
    *,
    batch_size: int = 128,
    device=None,
    exact_jpeg: bool = True,
    prefetch: int = 2,
    center_square: bool = False,
    center_square_margin: float = 0.02,
    max_pixels: int | None = None,
):
    """Decode ``sources`` in batches of ``batch_size``, yielding one :class:`ImageBatch` each, with
    DALI reading and decoding the next batches while the caller works on the current one (the
    training / benchmark hot path).

    ``center_square=True`` decodes only the middle of each image (a crop while decoding, so the
    discarded sides are never decoded): its centred ``min(H, W)`` square, widened on each side
    by ``ceil(center_square_margin * min(H, W)) + 3`` pixels where the image has room
    (``center_square_margin=0``: the bare square). Each batch's ``windows`` say where the crops
    lie; give them to :func:`avpipe.ops.image.resize_crop_normalize` (``window=``) and a
    short-side resize + centre crop of the crops equals the one of the whole images exactly, as
    long as the fixed margin holds the filter's reach, about ``r * min(H, W) / short_side``
    pixels (``r``: 1 bilinear, 2 bicubic; less when the centre crop is narrower than the resized
    short side): with the default 0.02, a target short side of at least about ``50 * r`` (the op
    raises ValueError where the crop is too small). Raise the margin for smaller targets.

    No copies: each batch's arrays alias DALI's output buffers and stay valid only until the next
    batch is asked for (copy what you keep). On a GPU each batch is ordered on the CuPy stream
    that is current when it is asked for: work queued on that stream sees the decoded pixels and
    finishes before DALI reuses the buffers (work on another stream must first wait for that
    one); with an older DALI (or ``AVPIPE_DALI_STREAM_OUTPUTS=0``) the pixels are ready on the
    host instead and asking for the next batch first waits for the work queued on the current
    stream. ``stacked`` is set when a batch's images all have one shape. A batch that fails (a
    bad image) is decoded again with :func:`decode_image_batch`, so bad images show up in
    ``errors`` and the rest still come back; the prefetching path then starts again after it
    (after the ``r``-th failure, ``2**(r-1) - 1`` batches later, at most 63).
    On a GPU a stream of one batch has nothing to read ahead: it is decoded by
    :func:`decode_image_batch` (its own arrays; no pipeline to build, about 2 s).
    A missing path raises ``FileNotFoundError`` before anything is decoded.

    ``max_pixels``: the pixel cap (see :func:`decode_image_batch`). Each source's header is
    read before its batch is decoded (the pixel cap, the JPEG 2000 header check): a batch
    holding an image over the cap, an invalid JPEG 2000 or one for the helper process goes to
    :func:`decode_image_batch`, which reports (or isolates) it.
    """
    batch_size = pos_int("batch_size", batch_size)
    if isinstance(sources, (str, bytes, bytearray, memoryview, os.PathLike)) or hasattr(
        sources, "read"
    ):
        sources = [sources]
    srcs = [open_source(s, param=f"sources[{i}]") for i, s in enumerate(sources)]
    dev = resolve_device(device)
    if dev.is_cuda:
        dali.hw_decoder_load()  # as in decode_image_batch
    if not isinstance(center_square, bool):
        raise TypeError(f"center_square must be a bool, got {center_square!r}")
    margin = center_square_margin
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"center_square_margin must be a number in [0, 1), got {margin!r}")
    cap = resolve_max_pixels(max_pixels)
    chunks = [srcs[i : i + batch_size] for i in range(0, len(srcs), batch_size)]
    return _stream(chunks, dev, batch_size, exact_jpeg, prefetch, center_square, float(margin),
                   cap)


class LoadedChunks:
    """A stream's chunks asked for one at a time, in order, as DALI needs them: ``n`` chunks,
    ``get(i)`` returns chunk ``i``'s sources (bytes sources, each already checked as
    :func:`needs_batch_path` does; a chunk may be empty). Taken by :func:`stream_loaded`: the
    caller reads the files itself (where a read that never returns can be given up) and keeps
    what is read ahead bounded."""

    def __init__(self, n: int, get, start: int = 0):
        self.n, self.get, self.start = int(n), get, int(start)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            lo, hi, step = i.indices(self.n)
            if step != 1:
                raise ValueError("LoadedChunks slices take a step of 1")
            return LoadedChunks(max(0, hi - lo), self.get, self.start + lo)
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.get(self.start + i)

    def __iter__(self):
        return (self[i] for i in range(self.n))


def stream_loaded(chunks: LoadedChunks, *, batch_size: int, device=None, exact_jpeg: bool = True,
                  prefetch: int = 2, max_pixels: int | None = None):
    """:func:`decode_image_stream` over :class:`LoadedChunks`: one :class:`ImageBatch` per
    chunk, in order. DALI asks for each chunk when it starts decoding it (``prefetch`` chunks
    ahead of the one handed out, on the thread iterating the stream), never for the whole
    stream at once; the sources' headers are not read again (the caller checked them).
    ``batch_size``: the largest chunk."""
    dev = resolve_device(device)
    if dev.is_cuda:
        dali.hw_decoder_load()
    return _stream(chunks, dev, pos_int("batch_size", batch_size), exact_jpeg, prefetch, cap=resolve_max_pixels(max_pixels))


def _one_pixel_png() -> bytes:
    """A valid 1x1 grey PNG: what an empty chunk hands DALI (which takes no empty batch); its
    image is dropped with the reader's padding."""
    import struct
    import zlib

    def part(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + part(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
            + part(b"IDAT", zlib.compress(b"\x00\x80")) + part(b"IEND", b""))


_EMPTY_CHUNK = np.frombuffer(_one_pixel_png(), np.uint8)


def _load_chunk(chunk):
    if not chunk:
        return [_EMPTY_CHUNK]
    out = []
    for s in chunk:
        try:
            data = s.read_bytes()
        except OSError:
            data = b""
        out.append(np.frombuffer(data, np.uint8))
    return out


def needs_batch_path(s, cap) -> bool:
    """Whether a source must not reach the fast path's decoder: a JPEG 2000 cut short or with
    an invalid main header (decoders have died with a signal on those), an image whose header
    declares more pixels than the cap, or one for the helper process (``AVPIPE_IMAGE_ISOLATION``).
    The per-batch path reports, or isolates, it. Reads only header bytes (the first 4 KiB, a
    JPEG 2000's first 64 KiB and last bytes, and where a header lies further in, that part)."""
    if s.data is not None:
        fmt = sniff_format(s.data)
        if fmt is None:
            return False  # the decoder refuses it: the per-batch path reports it then
        err, isolated = admit(s.name, s.data, fmt, cap)
        return err is not None or isolated
    if s.path is None:
        return False
    try:
        with open(s.path, "rb") as f:
            head = f.read(4096)
            fmt = sniff_format(head)
            if fmt is None:
                return False
            if fmt == "jpeg2000":
                head += f.read((1 << 16) - len(head))
                f.seek(max(0, os.fstat(f.fileno()).st_size - 64))
                tail = f.read()
                if not tail.rstrip(b"\x00").endswith(b"\xff\xd9") or head.find(b"\xff\x90") < 0:
                    return True
                problem, vouched = j2k_check(head)
                if problem is not None:
                    return True
            else:
                vouched = False
            if isolate(fmt, vouched):
                return True
            return size_problem(s.name, file_reader(f, head), fmt, cap) is not None
    except OSError:
        return False


def _stream(chunks, dev: Device, batch_size, exact_jpeg, prefetch, square=False, margin=0.0,
            cap=None):
    """The fast path (DALI reading and decoding ahead) over runs of chunks; a chunk that fails
    there (a bad image) is decoded by :func:`decode_image_batch`, which reports its bad
    images, and the fast path starts again after it. Each restart builds a pipeline, so the
    ``r``-th failure sends that chunk and the ``2**(r-1) - 1`` after it (64 in all at most) to
    the per-batch path: data with many bad images spends its time decoding, not rebuilding."""
    if not chunks:
        return
    if dev.is_cuda and len(chunks) == 1:
        # one batch: nothing to read ahead, so no stream pipeline to build (~2 s on a GPU)
        b = decode_image_batch(chunks[0], device=dev, exact_jpeg=exact_jpeg, max_pixels=cap or 0)
        yield _center_squares(b, margin) if square else b
        return
    # the fast path never takes a chunk holding a source it must not decode (the per-batch
    # path reports, or isolates, it); the headers are read ahead on a thread (_Headers)
    heads = _Checked(len(chunks)) if isinstance(chunks, LoadedChunks) else _Headers(chunks, cap)
    k, failures = 0, 0
    try:
        while k < len(chunks):
            known = heads.wait(k + RUN_AHEAD)
            end = k
            while end < known and not heads.cut[end]:
                end += 1
            done = 0
            if end > k:
                fast = _fast_run(chunks[k:end], dev, batch_size, exact_jpeg, prefetch, square,
                                 margin)  # fmt: skip
                try:
                    for batch in fast:
                        if batch is None:  # the fast path failed at this chunk
                            break
                        yield batch
                        done += 1
                finally:
                    fast.close()
            failed = done < end - k
            k += done
            if k >= len(chunks):
                return
            if not failed and k == known:  # the run reached the headers read so far
                continue
            # a failed chunk (then a pause of the fast path) or one holding a source the fast
            # path must not decode: the per-batch path
            slow = 1
            if failed:
                failures += 1
                slow = min(2 ** (failures - 1), 64)
            for chunk in chunks[k : k + slow]:
                b = decode_image_batch(chunk, device=dev, exact_jpeg=exact_jpeg,
                                       max_pixels=cap or 0)  # fmt: skip
                yield _center_squares(b, margin) if square else b
            k += slow
    finally:
        heads.close()


RUN_AHEAD = 64  # chunks whose headers a fast run waits for (the first run's latency bound)


class _Headers:
    """Each chunk's verdict of :func:`needs_batch_path`, read in order on a daemon thread
    ahead of the decoding: a stream of a million files starts decoding after the headers of
    its first :data:`RUN_AHEAD` chunks, not of all of them, and the rest are read while DALI
    decodes (so a long stream costs one more pipeline build, not a pause). Short streams are
    read on the calling thread. ``cut[i]``: chunk ``i`` holds such a source."""

    def __init__(self, chunks, cap):
        self.chunks, self.cap = chunks, cap
        self.cut = [None] * len(chunks)
        self.known = 0
        self.stop = False
        self.cv = threading.Condition()
        if len(chunks) <= RUN_AHEAD:
            self._read()
        else:
            threading.Thread(target=self._read, daemon=True, name="avpipe-image-headers").start()

    def _read(self):
        for i, c in enumerate(self.chunks):
            if self.stop:
                return
            try:
                v = any(needs_batch_path(s, self.cap) for s in c)
            except Exception:  # noqa: BLE001 - the per-batch path reports what went wrong
                v = True
            with self.cv:
                self.cut[i] = v
                self.known = i + 1
                self.cv.notify_all()

    def wait(self, upto: int) -> int:
        """How many chunks' verdicts are known, once ``upto`` of them are (or all)."""
        upto = min(upto, len(self.chunks))
        with self.cv:
            while self.known < upto:
                self.cv.wait()
            return self.known

    def close(self):
        self.stop = True


class _Checked:
    """:class:`_Headers` of :class:`LoadedChunks`, whose sources were checked by the caller."""

    def __init__(self, n):
        self.cut, self.known = [False] * n, n

    def wait(self, upto: int) -> int:
        return self.known

    def close(self):
        pass


def _fast_run(chunks, dev, batch_size, exact_jpeg, prefetch, square, margin):
    """The chunks' batches from a DALI stream; yields None (and stops) where it fails."""
    idx = dev.index if dev.is_cuda else None
    done = 0
    with dev.activate():
        # (LoadedChunks: bytes, asked for chunk by chunk)
        paths = [None] if isinstance(chunks, LoadedChunks) else [s.path for c in chunks for s in c]
        try:
            with native_stderr():
                dec = StreamDecoder(
                    lambda i: _load_chunk(chunks[i]), len(chunks), idx, batch_size, exact_jpeg,
                    prefetch, files=paths if all(p is not None for p in paths) else None,
                    square=square, margin=margin,
                )  # fmt: skip
        except dali.ShuttingDown:  # the interpreter is exiting: no slow path either
            raise
        except Exception:  # noqa: BLE001 - no fast path (items DALI cannot start on)
            yield None
            return
        cupy = None
        if dev.is_cuda:
            import cupy
        try:
            while done < len(chunks):
                stream = None
                if cupy is not None:
                    if dec.stream_outputs:
                        # the batch is bound to the caller's stream: that stream (not the host)
                        # waits for the decode, and DALI frees the buffers in its order, after
                        # the work the caller queues there (no host synchronisation)
                        stream = cupy.cuda.get_current_stream()
                    elif done:
                        # host-synchronous outputs: work the caller queued on the previous
                        # batch's buffers must finish before DALI may reuse them
                        cupy.cuda.get_current_stream().synchronize()
                try:
                    with native_stderr():
                        outs = dec.run(stream)
                except StopIteration:
                    break
                except dali.ShuttingDown:
                    raise
                except Exception:  # noqa: BLE001 - a bad image: the caller redoes this chunk
                    yield None
                    return
                items, dense = dali.views(outs[0], idx)
                k = len(chunks[done])  # the reader pads the last batch
                if len(items) > k:
                    items, dense = items[:k], (dense[:k] if dense is not None else None)
                windows = None
                if square:  # anchors [x, y] and upright shapes [H, W, C] -> (top, left, H, W)
                    xy, hwc = dali.host_rows(outs[1])[:k], dali.host_rows(outs[2])[:k]
                    windows = tuple(
                        (int(a[1]), int(a[0]), int(s[0]), int(s[1])) for a, s in zip(xy, hwc)
                    )
                yield ImageBatch(images=items, errors=(), device=str(dev), stacked=dense,
                                 windows=windows)  # fmt: skip
                done += 1
        finally:  # the pipeline's threads and buffers go when the run ends or is dropped (shut
            # down here, on this thread; at interpreter exit by _dali's exit hook instead)
            dec.close()


def _center_squares(b: ImageBatch, margin: float) -> ImageBatch:
    """The slow path's equivalent of ``center_square``: crop after decoding."""
    out, windows = [], []
    for im in b.images:
        if im is None:
            out.append(None)
            windows.append(None)
            continue
        h, w = im.shape[:2]
        top, left, ch, cw = square_window(h, w, margin)
        out.append(im[top : top + ch, left : left + cw])
        windows.append((top, left, h, w))
    stacked = None
    if b.stacked is not None and len(set(windows)) == 1:  # one box for all: a view of the stack
        top, left, h, w = windows[0]
        _, _, ch, cw = square_window(h, w, margin)
        stacked = b.stacked[:, top : top + ch, left : left + cw]
        out = [stacked[i] for i in range(len(out))]
    return ImageBatch(images=out, errors=b.errors, device=b.device, stacked=stacked,
                      windows=tuple(windows))  # fmt: skip
