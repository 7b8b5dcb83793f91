"""Still-image decoding: nvImageCodec on a GPU, DALI's CPU decoders on the CPU, and a helper
process for images the header checks cannot vouch for: the ``"image"`` backends of
:mod:`avpipe.decoding.backends`, walked per image after its header checks.

On a GPU (``device="cuda"``) nvImageCodec (the library inside DALI's ``"mixed"`` decoder, called
directly: ``_nvimgcodec.py`` says why) uses nvJPEG (with the hardware JPEG engine where the GPU
has one), nvJPEG2000 and nvTIFF; on the CPU DALI's CPU decoders (libjpeg-turbo, libpng,
libtiff, OpenJPEG, libwebp, ...). Formats: JPEG, PNG, TIFF, JPEG 2000, BMP, WebP, PNM.

Output is always ``[H, W, 3]`` uint8 RGB:

* grayscale is replicated to three channels, palette images expanded, alpha dropped;
* 16-bit samples (PNG, TIFF) become ``round(x / 257)`` (DALI's own uint8 conversion, which is
  exactly this rule; tests check it against the 16-bit source values);
* EXIF orientation is honoured (the pixels come back upright, as
  ``PIL.ImageOps.exif_transpose`` gives them).

Decoding is batched. On the CPU one DALI pipeline per (batch capacity, ROI or not) is built once
and fed through ``fn.external_source``; with ``roi=`` each image is decoded only inside its box
(``fn.decoders.image_slice``: libjpeg-turbo skips the rest of the picture). On a GPU one
nvImageCodec decoder per GPU decodes each batch; a box is cut from the decoded picture.

Errors: a missing path raises ``FileNotFoundError``; unrecognised bytes raise
:class:`~avpipe.errors.UnsupportedFormatError`, empty, truncated or corrupt images
:class:`~avpipe.errors.CorruptDataError` — both name the file. nvImageCodec marks each image it
cannot decode and goes on; DALI (the CPU path) fails a whole batch when one image is bad, so a
failed batch is decoded again item by item to find the culprits. With ``on_error="skip"`` the
good images still come back (``None`` in place of each bad one) and :func:`decode_image_batch`
reports the errors.

Before any decoder sees an image, its header is read (``_header.py``): an image declaring more
pixels than the pixel cap (``max_pixels=``, ``AVPIPE_MAX_IMAGE_PIXELS``) raises
:class:`~avpipe.errors.ImageTooLargeError`, and a JPEG 2000 main header with a field no valid
codestream has (a tile size of 0 killed the process with SIGFPE inside the decoder) a
:class:`~avpipe.errors.CorruptDataError`. An image the checks cannot vouch for (a JPEG 2000
whose main header is not within its first 64 KiB; ``AVPIPE_IMAGE_ISOLATION``) is decoded in a
helper process (``_isolated.py``): a decoder crash there costs only that image.
"""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import settings
from ..._results import BatchResult
from ..._source import open_source
from ..._validate import check_on_error
from ...device import Device, gpu_available, resolve_device
from ...errors import CorruptDataError, ImageTooLargeError, UnsupportedFormatError
from ..backends import ImageRequest, backends, first_accepting, register
from . import _dali, _isolated, _nvimgcodec
from ._cpu import MAX_BATCH, _classify, _run, native_stderr
from ._header import FORMAT_NAMES, bytes_reader, image_size, j2k_check, sniff_format

__all__ = [
    "decode_images",
    "decode_image_batch",
    "ImageBatch",
    "sniff_format",
    "square_window",
    "decoder_status",
]

def truncation(data: bytes, fmt: str | None) -> str | None:
    """Why ``data`` is visibly cut short, or None. nvJPEG decodes a truncated JPEG without
    complaint (the missing rows come out grey) while libjpeg refuses it; checking the
    end-of-image marker makes both devices treat truncation as the error it is."""
    if fmt == "jpeg" and not bytes(data[-64:]).rstrip(b"\x00").endswith(b"\xff\xd9"):
        return "truncated JPEG (no end-of-image marker)"
    if fmt == "png" and bytes(data).rfind(b"IEND") < 0:
        return "the PNG data ends early (no IEND chunk: truncated)"
    if fmt == "jpeg2000":  # OpenJPEG has crashed on a codestream cut before its first tile
        if bytes(data).find(b"\xff\x90") < 0:
            return "the JPEG 2000 data ends early (no tile after the header: truncated)"
        if not bytes(data[-64:]).rstrip(b"\x00").endswith(b"\xff\xd9"):
            return "the JPEG 2000 data ends early (no end-of-codestream marker: truncated)"
        return j2k_header_problem(data)
    return None


def j2k_header_problem(data) -> str | None:
    """What in a JPEG 2000 codestream's main header (SOC to the first tile) cannot be valid, or
    None (:func:`._header.j2k_check`: segment lengths, unknown markers, SIZ's image, tile and
    component fields, COD and QCD). Decoders have died with a signal on such headers (a tile
    size of 0: SIGFPE); checked up front, cheaply (a walk over a few hundred bytes)."""
    return j2k_check(data)[0]


def resolve_max_pixels(max_pixels) -> int | None:
    """The pixel cap: ``max_pixels`` (an int >= 0; 0: no cap), or with None the
    ``AVPIPE_MAX_IMAGE_PIXELS`` setting (default 178,956,970: Pillow's decompression-bomb
    limit). Returns None for no cap."""
    if max_pixels is None:
        return settings.max_image_pixels()
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, (int, np.integer)):
        raise TypeError(f"max_pixels must be an int >= 0 or None, got {max_pixels!r}")
    if max_pixels < 0:
        raise ValueError(f"max_pixels must be an int >= 0 (0: no cap) or None, got {max_pixels!r}")
    return int(max_pixels) or None


def size_problem(name: str, get, fmt: str | None, cap: int | None):
    """An :class:`~avpipe.errors.ImageTooLargeError` when the header (read through ``get``)
    declares more than ``cap`` pixels, else None (no cap, or a header that does not say)."""
    if cap is None:
        return None
    hw = image_size(get, fmt)
    if hw is None or hw[0] * hw[1] <= cap:
        return None
    h, w = hw
    return ImageTooLargeError(
        name, f"the {FORMAT_NAMES.get(fmt, fmt)} header declares {w}x{h} = {w * h:,} pixels, "
        f"over the pixel cap of {cap:,} (max_pixels=, AVPIPE_MAX_IMAGE_PIXELS; 0: no cap)")  # fmt: skip


def isolate(fmt: str | None, vouched: bool) -> bool:
    """Whether an image goes to the helper process (``AVPIPE_IMAGE_ISOLATION``): ``auto``, a
    JPEG 2000 whose main header the check could not walk to its end; ``all``, every image."""
    mode = settings.image_isolation()
    if mode == "all":
        return True
    return mode == "auto" and fmt == "jpeg2000" and not vouched


def admit(name: str, data, fmt: str | None, cap: int | None):
    """What happens to an image's bytes before any decoder sees them: ``(error, isolated)``.
    ``error``: a typed error (cut short, an invalid JPEG 2000 header, over the pixel cap) or
    None; ``isolated``: decode it in the helper process (:func:`isolate`)."""
    why = truncation(data, fmt)
    if why is not None:
        return CorruptDataError(name, why), False
    err = size_problem(name, bytes_reader(data), fmt, cap)
    if err is not None:
        return err, False
    vouched = fmt == "jpeg2000" and j2k_check(data)[1]
    return None, isolate(fmt, vouched)


@dataclass(frozen=True)
class ImageBatch(BatchResult):
    """The result of :func:`decode_image_batch`.

    ``images``: one ``[H, W, 3]`` uint8 array per source (numpy on the CPU, cupy on a GPU),
    ``None`` where decoding failed; a list, or (streams) a read-only sequence of views of
    ``stacked`` made as they are indexed (``list(images)`` for a list). ``errors``:
    ``(index, exception)`` for each failure.
    ``device``: where the arrays live. ``stacked`` (GPU batches, streams): all images as one ``[N, H, W, 3]``
    array when every image decoded and all have the same shape (the images are views of it);
    else None. ``windows`` (streams with ``center_square``): per image, ``(top, left, full_h,
    full_w)``: where the decoded crop lies in the whole (upright) image, as
    :func:`avpipe.ops.image.resize_crop_normalize`'s ``window`` takes it; else None.
    ``backends`` (:func:`decode_image_batch`): per source, the name of the backend that decoded
    it, or tried to (None where reading or the header checks failed); ``fallbacks``: ``(index,``
    :class:`~avpipe.decoding.backends.Fallback```)`` for each backend that refused an image.
    """

    images: Sequence
    errors: tuple = ()
    device: str = "cpu"
    stacked: Any = field(default=None, repr=False)
    windows: tuple | None = field(default=None, repr=False)
    backends: tuple = field(default=(), repr=False)
    fallbacks: tuple = field(default=(), repr=False)


def _check_rois(rois, n):
    if rois is None:
        return None
    rois = list(rois)
    if len(rois) != n:
        raise ValueError(f"roi must have one box per source ({n}), got {len(rois)}")
    out = []
    for r in rois:
        if r is None:
            out.append(None)
            continue
        try:
            top, left, h, w = (int(v) for v in r)
        except (TypeError, ValueError):
            raise ValueError(f"roi boxes must be (top, left, height, width), got {r!r}") from None
        if top < 0 or left < 0 or h <= 0 or w <= 0:
            raise ValueError(f"roi boxes must be (top, left, height, width) >= 0, got {r!r}")
        out.append((top, left, h, w))
    return out


class _NotDecoded(RuntimeError):
    """nvImageCodec returned no image (it says why only on stderr: ``native_log``)."""


def _clip_box(box, h: int, w: int):
    """``(top, left, height, width)`` clipped to an ``h x w`` picture, as DALI's slice does it:
    the corner inside the picture, at least one pixel."""
    top, left = min(box[0], h - 1), min(box[1], w - 1)
    return top, left, max(min(box[2], h - top), 1), max(min(box[3], w - left), 1)


def _gpu_chunk(dev: Device, chunk, datas, srcs, rois, fancy, images, errors):
    """Decode one chunk with nvImageCodec on the GPU: a bad image is ``None`` in its result, and
    the decoder stays usable (no rebuild); each failed one is decoded once more alone, to put
    the decoder's own words for it into its error. Fills ``images``/``errors``; returns the
    chunk stacked ``[N, H, W, 3]`` when every image decoded with one shape (the images are views
    of it), else None (each image its own array)."""
    import cupy

    load = _dali.hw_decoder_load()
    cuda_stream = cupy.cuda.get_current_stream().ptr
    arrays = [np.frombuffer(datas[i], np.uint8) for i in chunk]
    parsed, where, failed = [], [], {}
    with native_stderr() as log:
        dec = _nvimgcodec.get(dev.index, fancy, load)  # its set-up warnings stay off stderr
        for j, a in enumerate(arrays):
            try:
                parsed.append(dec.code_stream(a))
                where.append(j)
            except Exception as e:  # noqa: BLE001 - nvImageCodec raises RuntimeError
                failed[j] = e
        try:
            outs = dec.decode(parsed, cuda_stream) if parsed else []
        except _dali.ShuttingDown:  # the interpreter is exiting: not the images' fault
            raise
        except Exception:  # noqa: BLE001 - the whole call refused: each alone below
            outs = [None] * len(parsed)
    got = {}
    for j, img in zip(where, outs):
        if img is None:
            failed.setdefault(j, None)
        else:
            got[j] = img
    for j in sorted(failed):
        if failed[j] is None:  # decode it alone: its own native lines and exception, if any
            with native_stderr() as log:
                try:
                    img = dec.decode([parsed[where.index(j)]], cuda_stream)[0]
                    err = None if img is not None else _NotDecoded("nvImageCodec: not decoded")
                except _dali.ShuttingDown:
                    raise
                except Exception as e:  # noqa: BLE001
                    img, err = None, e
            if img is not None:  # decoded alone after all
                got[j] = img
                continue
            failed[j] = err
        e = failed[j]
        try:
            e.native_log = log[0] if log else ""
        except AttributeError:
            pass
        i = chunk[j]
        errors.append((i, _classify(srcs[i].name, datas[i], e)))
    views = {}
    for j, img in got.items():
        a = _nvimgcodec.to_cupy(img)
        if rois is not None:
            top, left, h, w = _clip_box(rois[j], a.shape[0], a.shape[1])
            a = a[top : top + h, left : left + w]
        views[j] = a
    shapes = {tuple(a.shape) for a in views.values()}
    if len(views) == len(chunk) and len(shapes) == 1:
        dense = cupy.empty((len(chunk), *shapes.pop()), cupy.uint8)
        for j, a in views.items():
            dense[j] = a
        for j, i in enumerate(chunk):
            images[i] = dense[j]
        return dense
    for j, a in views.items():
        images[chunk[j]] = a.copy()  # its own C-ordered array, free of the decoder's Image
    return None


@dataclass
class _Work:
    """What an image backend's ``decode(work, indices)`` reads and fills: the sources' bytes and
    names, the boxes, and the batch's ``images`` / ``errors``."""

    dev: Device
    datas: list
    srcs: list
    rois: list | None
    exact_jpeg: bool
    images: list
    errors: list

    def boxes(self, chunk):
        if self.rois is None:
            return None
        return [self.rois[i] if self.rois[i] is not None else (0, 0, 1 << 30, 1 << 30)
                for i in chunk]  # fmt: skip


class IsolatedEntry:
    """The helper process (``_isolated.py``), on the CPU: an image the header checks cannot
    vouch for (``AVPIPE_IMAGE_ISOLATION``); a decoder crash there costs only that image."""

    name = "isolated"

    def accepts(self, req: ImageRequest):
        return True if req.isolated else None

    def decode(self, work: _Work, indices) -> None:
        dev = work.dev
        for i in indices:
            box = None if work.rois is None else work.rois[i]
            what = f"{FORMAT_NAMES.get(sniff_format(work.datas[i]), 'image')} decoder"
            img, err = _isolated.decode(work.srcs[i].name, work.datas[i], box, work.exact_jpeg,
                                        what)  # fmt: skip
            if err is not None:
                work.errors.append((i, err))
            else:
                work.images[i] = dev.xp.asarray(img) if dev.is_cuda else img


class NvImageCodecEntry:
    """nvImageCodec on a GPU device (nvJPEG, nvJPEG2000, nvTIFF), in chunks of ``MAX_BATCH``;
    returns the batch stacked when one chunk holds every source and all decoded alike."""

    name = "nvimgcodec"

    def accepts(self, req: ImageRequest):
        return True if req.device.is_cuda else None

    def decode(self, work: _Work, indices):
        stacked = None
        for c0 in range(0, len(indices), MAX_BATCH):
            chunk = indices[c0 : c0 + MAX_BATCH]
            dense = _gpu_chunk(work.dev, chunk, work.datas, work.srcs, work.boxes(chunk),
                               work.exact_jpeg, work.images, work.errors)  # fmt: skip
            if len(chunk) == len(work.srcs):
                stacked = dense
        return stacked


class DaliCpuEntry:
    """DALI's CPU decoders in chunks of ``MAX_BATCH``; a failed chunk is decoded again image
    by image to find the culprits."""

    name = "dali_cpu"

    def accepts(self, req: ImageRequest):
        return None if req.device.is_cuda else True

    def decode(self, work: _Work, indices) -> None:
        dev, srcs, datas = work.dev, work.srcs, work.datas
        for c0 in range(0, len(indices), MAX_BATCH):
            chunk = indices[c0 : c0 + MAX_BATCH]
            crs = work.boxes(chunk)
            enc = [np.frombuffer(datas[i], np.uint8) for i in chunk]
            try:
                items, _ = _run(dev, enc, crs, work.exact_jpeg)
                for i, a in zip(chunk, items):
                    work.images[i] = a
            except _dali.ShuttingDown:  # the interpreter is exiting: not the images' fault
                raise
            except Exception as e:  # noqa: BLE001 - DALI raises RuntimeError
                if len(chunk) == 1:  # the culprit is known: no second decode of bad data
                    work.errors.append((chunk[0], _classify(srcs[chunk[0]].name, datas[chunk[0]], e)))
                    continue
                # find the culprits one by one (each failure rebuilds a 1-image pipeline)
                for j, i in enumerate(chunk):
                    try:
                        items, _ = _run(
                            dev, [enc[j]], None if crs is None else [crs[j]], work.exact_jpeg
                        )
                        work.images[i] = items[0]
                    except _dali.ShuttingDown:
                        raise
                    except Exception as e:  # noqa: BLE001 - DALI raises RuntimeError
                        work.errors.append((i, _classify(srcs[i].name, datas[i], e)))


register("image", IsolatedEntry())
register("image", NvImageCodecEntry())
register("image", DaliCpuEntry())


def decode_image_batch(
    sources: Sequence,
    *,
    device=None,
    roi: Sequence | None = None,
    exact_jpeg: bool = True,
    max_pixels: int | None = None,
) -> ImageBatch:
    """Decode every source, never raising for a bad image (see :class:`ImageBatch`).

    ``roi``: one ``(top, left, height, width)`` box (or None: whole image) per source, in the
    upright image's pixels; boxes are clipped to the image. A missing path still raises
    ``FileNotFoundError`` (it is an argument error, not a content error).
    ``exact_jpeg``: on the GPU, upsample JPEG chroma as libjpeg-turbo does (DALI's
    ``jpeg_fancy_upsampling``), so GPU and CPU pixels agree within 4 levels (IDCT rounding); False lets nvJPEG use its
    faster default upsampling (larger differences at sharp colour edges; what a plain DALI
    pipeline does).
    ``max_pixels``: the pixel cap: an image whose header declares more pixels is not decoded
    (an :class:`~avpipe.errors.ImageTooLargeError` naming the file and its size); None: the
    ``AVPIPE_MAX_IMAGE_PIXELS`` setting (default 178,956,970, Pillow's decompression-bomb
    limit); 0: no cap.

    Images no header check can vouch for (``AVPIPE_IMAGE_ISOLATION``; by default a JPEG 2000
    whose main header could not be walked to its first tile) are decoded on the CPU in a helper
    process, so that a decoder dying on one (a signal) costs only that image: its error names
    the file and the signal.
    """
    if isinstance(sources, (str, bytes, bytearray, memoryview, os.PathLike)) or hasattr(
        sources, "read"
    ):
        sources = [sources]
    sources = list(sources)
    dev = resolve_device(device)
    if dev.is_cuda:
        _dali.hw_decoder_load()  # a bad AVPIPE_JPEG_HW_LOAD is the caller's error, not the images'
    rois = _check_rois(roi, len(sources))
    cap = resolve_max_pixels(max_pixels)
    srcs = [open_source(s, param=f"sources[{i}]") for i, s in enumerate(sources)]
    images: list = [None] * len(srcs)
    errors: list = []
    datas: list = [None] * len(srcs)
    admitted = []  # (index, format, whether the checks send it to the helper process)
    for i, s in enumerate(srcs):
        try:
            data = s.read_bytes()
        except OSError as e:
            errors.append((i, CorruptDataError(s.name, f"could not read: {e}")))
            continue
        datas[i] = data
        if len(data) == 0:
            errors.append((i, CorruptDataError(s.name, "empty file")))
        elif (fmt := sniff_format(data)) is None:
            errors.append((i, UnsupportedFormatError(s.name, "not a supported image format")))
        else:
            err, isolated = admit(s.name, data, fmt, cap)
            if err is not None:
                errors.append((i, err))
            else:
                admitted.append((i, fmt, isolated))
    entries = backends("image")
    groups: dict = {}
    chosen: list = [None] * len(srcs)
    fallbacks: list = []
    for i, fmt, isolated in admitted:
        req = ImageRequest(source_name=srcs[i].name, data=datas[i], fmt=fmt, device=dev,
                           isolated=isolated)  # fmt: skip
        refused: list = []
        at, entry = first_accepting(entries, req, lambda e: e, refused)
        fallbacks += [(i, f) for f in refused]
        if entry is None:
            why = "; ".join(str(f) for f in refused) or "no image backend accepts it"
            errors.append((i, UnsupportedFormatError(srcs[i].name, why)))
            continue
        groups.setdefault(at, []).append(i)
        chosen[i] = entry.name
    stacked = None
    work = _Work(dev, datas, srcs, rois, exact_jpeg, images, errors)
    with dev.activate():
        for at in sorted(groups):
            dense = entries[at].decode(work, groups[at])
            if dense is not None:
                stacked = dense
    errors.sort(key=lambda t: t[0])
    return ImageBatch(images=images, errors=tuple(errors), device=str(dev), stacked=stacked,
                      backends=tuple(chosen), fallbacks=tuple(fallbacks))  # fmt: skip


def decode_images(
    sources, *, device=None, on_error: str = "raise", roi=None, exact_jpeg: bool = True,
    max_pixels: int | None = None,
) -> list:
    """Decode images to a list of ``[H, W, 3]`` uint8 RGB arrays (numpy on the CPU, cupy on a GPU).

    ``sources``: paths, bytes or binary file-likes (a single source gives a list of one).
    ``device``: None (the GPU when usable, else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
    ``on_error``: ``"raise"`` raises the first bad image's :class:`~avpipe.DecodeError` (naming
    the file); ``"skip"`` puts ``None`` in its place. ``roi``, ``exact_jpeg``, ``max_pixels``:
    see :func:`decode_image_batch`.
    """
    check_on_error(on_error)
    batch = decode_image_batch(sources, device=device, roi=roi, exact_jpeg=exact_jpeg,
                               max_pixels=max_pixels)  # fmt: skip
    if batch.errors and on_error == "raise":
        raise batch.errors[0][1]
    return batch.images


def square_window(h: int, w: int, margin: float) -> tuple[int, int, int, int]:
    """``(top, left, height, width)`` of ``center_square``'s crop of an ``h x w`` image. The
    margin's product is taken in float32, as DALI's graph arithmetic does on the fast path."""
    side = min(h, w)
    m = math.ceil(float(np.float32(side) * np.float32(margin))) + 3 if margin > 0 else 0
    x0, y0 = (w - side) // 2, (h - side) // 2
    ax, ay = max(x0 - m, 0), max(y0 - m, 0)
    return ay, ax, min(y0 + side + m, h) - ay, min(x0 + side + m, w) - ax


# --- avpipe.info() probe ------------------------------------------------------------------------

# an 8x8 baseline JPEG of one colour (200, 30, 60)
_TINY_JPEG = base64.b64decode(
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAMCAgMCAgMDAwMEAwMEBQgFBQQEBQoHBwYIDAoMDAsKCwsNDhIQDQ4RDgsL"
    "EBYQERMUFRUVDA8XGBYUGBIUFRT/2wBDAQMEBAUEBQkFBQkUDQsNFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQU"
    "FBQUFBQUFBQUFBQUFBQUFBQUFBT/wAARCAAIAAgDASIAAhEBAxEB/8QAHwAAAQUBAQEBAQEAAAAAAAAAAAECAwQFBgcI"
    "CQoL/8QAtRAAAgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAkM2JyggkKFhcYGRol"
    "JicoKSo0NTY3ODk6Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKTlJWWl5iZmqKjpKWmp6ip"
    "qrKztLW2t7i5usLDxMXGx8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/8QAHwEAAwEBAQEBAQEBAQAAAAAA"
    "AAECAwQFBgcICQoL/8QAtREAAgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdhcRMiMoEIFEKRobHBCSMzUvAVYnLR"
    "ChYkNOEl8RcYGRomJygpKjU2Nzg5OkNERUZHSElKU1RVVldYWVpjZGVmZ2hpanN0dXZ3eHl6goOEhYaHiImKkpOUlZaX"
    "mJmaoqOkpaanqKmqsrO0tba3uLm6wsPExcbHyMnK0tPU1dbX2Nna4uPk5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEA"
    "PwDwqiiivmj+3T//2Q=="
)


def _probe(device: str) -> str:
    try:
        batch = decode_image_batch([_TINY_JPEG], device=device)
        if batch.errors:
            return f"unavailable: {batch.errors[0][1]}"
        img = batch.images[0]
        if device != "cpu":
            img = img.get()
        if img.shape != (8, 8, 3) or np.abs(img[4, 4].astype(int) - (200, 30, 60)).max() > 8:
            return f"unavailable: wrong pixels {img[4, 4].tolist()} (shape {img.shape})"
        return "ok"
    except Exception as e:  # noqa: BLE001 - a status report never raises
        return f"unavailable: {type(e).__name__}: {e}".splitlines()[0][:300]


def decoder_status() -> dict:
    """Whether DALI's CPU and GPU ("mixed") image decoders build and run on a tiny in-memory JPEG:
    ``{"cpu": "ok" | "unavailable: <why>", "mixed": ...}``. Never raises."""
    out = {}
    try:
        import nvidia.dali  # noqa: F401
    except Exception as e:  # noqa: BLE001
        why = f"unavailable: DALI does not import ({type(e).__name__}: {e})"
        return {"cpu": why, "mixed": why}
    out["cpu"] = _probe("cpu")
    try:
        usable = gpu_available()
    except Exception:  # noqa: BLE001
        usable = False
    out["mixed"] = _probe("cuda") if usable else "unavailable: no usable CUDA GPU"
    return out
