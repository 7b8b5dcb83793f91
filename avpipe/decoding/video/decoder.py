""":class:`VideoDecoder`: frames of one video stream by index or time.

Frame ``i`` is the i-th frame a full decode displays, on every backend: the metadata come from a
packet scan (every packet's pts, sorted), requests are sorted and deduplicated, every needed GOP
is decoded once from the keyframe at or before it, and frames are matched by pts.

Which backend decodes is the walk over the ``"video"`` list of :mod:`avpipe.decoding.backends`
(NVDEC on a GPU device, then PyAV); a refusal, when the backend is opened or at a later request,
moves the decoder to the next backend for good and is kept in ``VideoDecoder.fallbacks``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._results import BatchResult
from ..._source import open_source
from ..._validate import check_choice, pos_int
from ...device import resolve_device
from ...errors import CorruptDataError, MemoryCapError, UnsupportedFormatError
from ..backends import (
    BackendRefused,
    Fallback,
    VideoRequest,
    backends,
    first_accepting,
    register,
    warn_fallback,
)
from ._backend import VideoBackend
from ._nvdec import NvdecBackend
from ._pyav import PyAVBackend
from ._scan import StreamScan, scan_stream

__all__ = ["VideoDecoder", "VideoMetadata", "FrameBatch"]

log = logging.getLogger("avpipe")


class NvdecEntry:
    """NVDEC on a GPU device; its refusals (codec, profile, depth, size) come when the stream
    is opened or at the first request (:class:`~._nvdec.NvdecRefused`)."""

    name = "nvdec"
    label = "NVDEC"

    def accepts(self, req: VideoRequest):
        return True if req.device.is_cuda else None

    def open(self, req: VideoRequest) -> VideoBackend:
        return NvdecBackend(req.source, req.scan, req.device)


class PyAVEntry:
    """PyAV (FFmpeg) on the CPU: every stream the scan read; on a GPU device only with
    ``allow_cpu_fallback`` (the frames are then uploaded)."""

    name = "pyav"
    label = "PyAV"

    def accepts(self, req: VideoRequest):
        if req.device.is_cuda and not req.options.get("allow_cpu_fallback", True):
            return "allow_cpu_fallback=False"
        return True

    def open(self, req: VideoRequest) -> VideoBackend:
        return req.cpu  # the decoder's own CPU backend, which also fills in missing frames


register("video", NvdecEntry())
register("video", PyAVEntry())

DEFAULT_MEMORY_CAP = 4 << 30  # bytes one request may return (4 GiB)


def _from_scan(name: str, field: str | None = None, doc: str = ""):
    """A read-only attribute of VideoMetadata that is the scan's own field."""
    return property(lambda self: getattr(self.scan, field or name), doc=doc)


class VideoMetadata:
    """What the container and a packet scan say about one video stream: a read-only view of
    the scan (``scan``, the :class:`~._scan.StreamScan` the backends decode from), in seconds.

    ``pts_seconds`` holds one float per frame in display order (the stream's own times, not
    shifted to 0); ``duration_seconds`` runs from the first frame's pts to the end of the last
    frame; ``average_fps = num_frames / duration_seconds``. ``rotation`` is the display
    rotation in degrees counterclockwise; ``sample_aspect_ratio`` is None when not set.
    ``damaged``: None, or why the stream is damaged though frames were found (demuxing stopped
    at bad data, fewer frames than the container declares): the frames are those read.
    """

    __slots__ = ("scan", "pts_seconds", "keyframe_indices", "begin_seconds", "end_seconds",
                 "duration_seconds", "average_fps")  # fmt: skip

    num_frames = _from_scan("num_frames")
    width = _from_scan("width")
    height = _from_scan("height")
    codec = _from_scan("codec", doc="FFmpeg's codec name")
    pixel_format = _from_scan("pixel_format", "pix_fmt", doc="FFmpeg's name, or None")
    bit_depth = _from_scan("bit_depth")
    rotation = _from_scan("rotation")
    sample_aspect_ratio = _from_scan("sample_aspect_ratio")
    color_space = _from_scan("color_space")
    color_range = _from_scan("color_range")
    stream_index = _from_scan("stream_index")
    container = _from_scan("container")
    time_base = _from_scan("time_base")
    damaged = _from_scan("damaged")

    def __init__(self, scan: StreamScan):
        tb = float(scan.time_base)
        pts = scan.pts.astype(np.float64) * tb
        pts.setflags(write=False)
        kf = scan.keyframe_indices.copy()
        kf.setflags(write=False)
        begin = float(scan.pts[0] * scan.time_base)
        end = float(scan.end_pts * scan.time_base)
        dur = end - begin
        for k, v in (("scan", scan), ("pts_seconds", pts), ("keyframe_indices", kf),
                     ("begin_seconds", begin), ("end_seconds", end), ("duration_seconds", dur),
                     ("average_fps", (scan.num_frames / dur) if dur > 0 else 0.0)):  # fmt: skip
            object.__setattr__(self, k, v)

    @classmethod
    def from_scan(cls, scan: StreamScan) -> VideoMetadata:
        return cls(scan)

    def __setattr__(self, name, value):
        raise AttributeError(f"VideoMetadata is read-only (setting {name!r})")

    def __reduce__(self):
        return (VideoMetadata, (self.scan,))

    def __repr__(self) -> str:
        return (
            f"VideoMetadata(num_frames={self.num_frames}, codec={self.codec!r}, "
            f"width={self.width}, height={self.height}, pixel_format={self.pixel_format!r}, "
            f"average_fps={self.average_fps:.6g}, duration_seconds={self.duration_seconds:.6g}, "
            f"stream_index={self.stream_index}, container={self.container!r}, "
            f"damaged={self.damaged!r})"
        )


@dataclass(frozen=True)
class FrameBatch(BatchResult):
    """Decoded frames: ``data`` is [N, H, W, 3] uint8 RGB (or [N, 3, H, W] with
    ``layout="CHW"``, or [N, H*3/2, W] NV12 with ``output="nv12"``) on the decoder's device,
    numpy on the CPU and cupy on a GPU; ``indices`` and ``pts_seconds`` are numpy, one per frame.
    ``damaged``: None, or why the video is damaged (the metadata's reason, or packets that
    failed to decode while these frames were made). ``errors`` is always empty: a frame that
    cannot be decoded raises."""

    data: Any
    indices: np.ndarray
    pts_seconds: np.ndarray
    errors: tuple = ()
    device: str = "cpu"
    damaged: str | None = None

    def __len__(self) -> int:
        return int(self.indices.shape[0])


class VideoDecoder:
    """Decode frames of one video stream by index or time.

    Args:
        source: a path, bytes, or a binary file-like object.
        device: ``None`` (the GPU when usable, else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        stream_index: the stream's index in the container (as FFmpeg/PyAV number them);
            None picks the best video stream.
        output: ``"rgb"`` (uint8 RGB, FFmpeg's own conversion on the CPU, the same matrix and
            range on the GPU) or ``"nv12"`` (native 4:2:0, [H*3/2, W] per frame).
        layout: ``"HWC"`` or ``"CHW"`` for RGB output.
        rotate: apply the container's display rotation to returned frames (False: only report
            it in ``metadata.rotation``).
        allow_cpu_fallback: on a GPU device, decode with PyAV (and upload) when NVDEC refuses the
            stream (codec, profile, depth, size); ``backend`` and ``fallbacks`` report it.
            False raises :class:`~avpipe.errors.UnsupportedFormatError` instead.
        memory_cap_bytes: a request whose output would exceed this raises
            :class:`~avpipe.errors.MemoryCapError` (None: no cap).
        threads: CPU decoder threads. 0 (the default): FFmpeg's frame and slice threading
            with the count it picks from the CPU count;
            1: decode on the calling thread. Frames are the same for any count.
        index: a video index (:func:`avpipe.decoding.build_index`'s file, or a loaded
            :class:`~avpipe.decoding.VideoIndex`): the file's scan is taken from it when the file's
            size and mtime still match the entry (else the file is scanned as without one).
        strict: raise :class:`~avpipe.errors.CorruptDataError` for a damaged video (see
            ``VideoMetadata.damaged`` and ``FrameBatch.damaged``) instead of decoding what
            is there.
    """

    def __init__(
        self,
        source,
        *,
        device=None,
        stream_index=None,
        output: str = "rgb",
        layout: str = "HWC",
        rotate: bool = False,
        allow_cpu_fallback: bool = True,
        memory_cap_bytes: int | None = DEFAULT_MEMORY_CAP,
        threads: int = 0,
        index=None,
        strict: bool = False,
    ):
        check_choice("output", output, ("rgb", "nv12"))
        check_choice("layout", layout, ("HWC", "CHW"))
        if output == "nv12" and (rotate or layout != "HWC"):
            raise ValueError("output='nv12' takes neither rotate=True nor layout='CHW'")
        if memory_cap_bytes is not None:
            pos_int("memory_cap_bytes", memory_cap_bytes)
        self._closed = True
        self.device = resolve_device(device)
        self._src = open_source(source)
        self.source_name = self._src.name
        self._scan = None
        if index is not None:
            from ._index import load_index

            index = load_index(index)
            if self._src.path is not None:
                self._scan = index.lookup(self._src.path, self.source_name, stream_index)
        if self._scan is None:
            self._scan = scan_stream(self._src, self.source_name, stream_index)
        self.metadata = VideoMetadata(self._scan)
        self.strict = bool(strict)
        if self.strict and self.metadata.damaged:
            raise CorruptDataError(self.source_name, self.metadata.damaged)
        self.output, self.layout, self.rotate = output, layout, bool(rotate)
        self.memory_cap_bytes = memory_cap_bytes
        self._cpu: VideoBackend = PyAVBackend(self._src, self._scan, threads=threads)
        self._active: VideoBackend | None = None
        self._at = -1  # the active backend's place in self._entries
        self.fallbacks: list[Fallback] = []
        self._lock = threading.Lock()
        self._closed = False
        self._entries = backends("video")
        self._request = VideoRequest(
            source=self._src, source_name=self.source_name, scan=self._scan, device=self.device,
            cpu=self._cpu, options={"allow_cpu_fallback": bool(allow_cpu_fallback),
                                    "threads": threads},
        )  # fmt: skip
        self._next_backend()

    def _next_backend(self, refused: Exception | None = None) -> None:
        """Walk the video backends past the active one (a refusal, ``refused``, moves the
        decoder on for good): the first that accepts the stream and opens decodes from now on.
        Each refusal is kept in ``fallbacks`` and logged; none left raises
        :class:`~avpipe.errors.UnsupportedFormatError` naming the first refusal."""
        seen = len(self.fallbacks)
        if refused is not None:
            self.fallbacks.append(Fallback(self._entries[self._at].name, str(refused)))
            if self._active is not self._cpu:
                self._active.close()
        self._active = None
        at, backend = first_accepting(self._entries, self._request, lambda e: e.open(self._request),
                                      self.fallbacks, start=self._at + 1)  # fmt: skip
        if backend is None:
            self.close()
            first = self.fallbacks[0] if self.fallbacks else None
            if first is None:
                raise UnsupportedFormatError(self.source_name, "no video backend accepts it")
            label = next((getattr(e, "label", e.name) for e in self._entries
                          if e.name == first.backend), first.backend)  # fmt: skip
            raise UnsupportedFormatError(
                self.source_name, f"{label} refused the stream: {first.reason}"
            ) from None
        self._at, self._active = at, backend
        for f in self.fallbacks[seen:]:
            warn_fallback(self.source_name, f, backend.name)

    # -- properties --------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The name of the backend that decodes: ``"nvdec"`` or ``"pyav"`` (the CPU, also
        after a GPU fallback), or a registered backend's."""
        return self._active.name if self._active is not None else "pyav"

    @property
    def fallback_reason(self) -> str | None:
        """Why the first backend tried refused the stream (``fallbacks[0].reason``), or None."""
        return self.fallbacks[0].reason if self.fallbacks else None

    @property
    def _gpu(self):
        """The active backend when it is not the CPU one (None otherwise)."""
        return self._active if self._active is not self._cpu else None

    @_gpu.setter
    def _gpu(self, backend) -> None:
        self._active = self._cpu if backend is None else backend

    def __len__(self) -> int:
        return self.metadata.num_frames

    def __repr__(self) -> str:
        m = self.metadata
        return (
            f"VideoDecoder({self.source_name!r}, device={self.device}, backend={self.backend}, "
            f"{m.codec} {m.width}x{m.height}, {m.num_frames} frames)"
        )

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        self._closed = True
        active, cpu = getattr(self, "_active", None), getattr(self, "_cpu", None)
        for b in (active, cpu) if active is not cpu else (cpu,):
            if b is not None:
                b.close()
        self._active = cpu

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # -- requests ----------------------------------------------------------------------------
    def _frame_shape(self):
        m = self.metadata
        h, w = m.height, m.width
        if self.output == "nv12":
            return (h + (h + 1) // 2, w)
        if self.rotate and m.rotation % 180 == 90:
            h, w = w, h
        return (3, h, w) if self.layout == "CHW" else (h, w, 3)

    def _check_indices(self, indices, param="indices") -> np.ndarray:
        arr = np.asarray(indices)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if arr.ndim != 1:
            raise ValueError(f"{param} must be a 1-D sequence of ints, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            if np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr)):
                arr = arr.astype(np.int64)
            else:
                raise TypeError(f"{param} must hold ints, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
        n = self.metadata.num_frames
        arr = np.where(arr < 0, arr + n, arr)
        bad = (arr < 0) | (arr >= n)
        if bad.any():
            raise IndexError(
                f"{param} must be in [-{n}, {n}) for {self.source_name}, got {np.asarray(indices).ravel()[bad][:5].tolist()}"
            )
        return arr

    def _check_cap(self, n: int):
        if self.memory_cap_bytes is None:
            return
        need = n * math.prod(self._frame_shape())
        if need > self.memory_cap_bytes:
            raise MemoryCapError(
                f"request of {n} frames needs {need} bytes, more than memory_cap_bytes="
                f"{self.memory_cap_bytes} ({self.source_name}); ask for fewer frames or use iter_frames()"
            )

    def get_frames(self, indices) -> FrameBatch:
        """Frames at display ``indices`` (any order, duplicates allowed, negative from the end),
        returned in the order asked."""
        self._assert_open()
        idx = self._check_indices(indices)
        self._check_cap(idx.size)
        return self._decode(idx)

    def get_frame(self, index: int):
        """One frame's data ([H, W, 3] by default)."""
        return self.get_frames([index]).data[0]

    def get_frames_in_range(
        self, start: int = 0, stop: int | None = None, step: int = 1
    ) -> FrameBatch:
        """Frames ``start, start+step, ...`` below ``stop`` (Python ``range`` semantics)."""
        n = self.metadata.num_frames
        step = pos_int("step", step)
        stop = n if stop is None else stop
        for p, v in (("start", start), ("stop", stop)):
            if not isinstance(v, (int, np.integer)):
                raise TypeError(f"{p} must be an int, got {v!r}")
        s, e, st = slice(int(start), int(stop), int(step)).indices(n)
        return self.get_frames(np.arange(s, e, st, dtype=np.int64))

    def index_at(self, seconds) -> np.ndarray:
        """For each t, the index of the last frame with pts <= t; ValueError when t is before the
        first pts or at/after the end of the last frame."""
        m = self.metadata
        t = np.asarray(seconds, dtype=np.float64)
        scalar = t.ndim == 0
        t = t.reshape(-1)
        if not np.all(np.isfinite(t)):
            raise ValueError(f"seconds must be finite, got {np.asarray(seconds).tolist()}")
        # compare in stream ticks so that a t equal to a frame's pts maps to that frame exactly
        eps = 1e-9
        bad = (t < m.begin_seconds - eps) | (t >= m.end_seconds - eps)
        if bad.any():
            raise ValueError(
                f"seconds must be in [{m.begin_seconds}, {m.end_seconds}) for {self.source_name}, "
                f"got {t[bad][:5].tolist()}"
            )
        idx = np.searchsorted(m.pts_seconds, t + eps, side="right") - 1
        idx = np.clip(idx, 0, m.num_frames - 1).astype(np.int64)
        return idx[0] if scalar else idx

    def get_frames_at(self, seconds) -> FrameBatch:
        """For each t (seconds, the stream's own clock), the last frame with pts <= t."""
        self._assert_open()
        idx = self.index_at(np.asarray(seconds, dtype=np.float64).reshape(-1))
        self._check_cap(idx.size)
        return self._decode(idx)

    def iter_frames(self, indices=None, *, chunk_size: int = 32) -> Iterator[FrameBatch]:
        """Yield the frames at ``indices`` (default: all, in order) as batches of at most
        ``chunk_size`` frames, in ascending index order, decoding each GOP once overall."""
        self._assert_open()
        chunk_size = pos_int("chunk_size", chunk_size)
        self._check_cap(int(chunk_size))
        if indices is None:
            idx = np.arange(self.metadata.num_frames, dtype=np.int64)
        else:
            idx = np.unique(self._check_indices(indices))
        for s in range(0, idx.size, int(chunk_size)):
            yield self._decode(idx[s : s + int(chunk_size)])

    # -- internals ---------------------------------------------------------------------------
    def _assert_open(self):
        if self._closed:
            raise RuntimeError(f"VideoDecoder for {self.source_name} is closed")

    def _decode(self, idx: np.ndarray) -> FrameBatch:
        """The active backend decodes; a refusal moves this decoder to the next backend for good
        (:meth:`_next_backend`), and frames a backend did not deliver come from PyAV."""
        uniq, inverse = np.unique(idx, return_inverse=True)
        slots: list[list[int]] = [[] for _ in range(uniq.size)]
        for row, u in enumerate(inverse.tolist()):
            slots[u].append(row)
        targets = uniq.tolist()
        with self._lock:
            while True:
                b = self._active
                try:
                    if getattr(b, "on_gpu", False):
                        data = self._decode_gpu(b, targets, slots, idx.size)
                    else:
                        data = self._decode_cpu(b, targets, slots, idx.size)
                    break
                except BackendRefused as e:
                    if b is self._cpu:
                        raise
                    self._next_backend(refused=e)
        pts = self.metadata.pts_seconds[idx].copy()
        damaged = self.metadata.damaged or self._cpu.damaged
        if damaged and self.strict:
            raise CorruptDataError(self.source_name, damaged)
        return FrameBatch(data=data, indices=idx.copy(), pts_seconds=pts, device=str(self.device),
                          damaged=damaged)

    def _plain_rows(self):
        """(row shape the backends write, whether it is CHW, whether rotation follows)."""
        m = self.metadata
        if self.output == "nv12":
            return (m.height + (m.height + 1) // 2, m.width), False, False
        rotate = bool(self.rotate and m.rotation % 360)
        chw = self.layout == "CHW" and not rotate
        return ((3, m.height, m.width) if chw else (m.height, m.width, 3)), chw, rotate

    def _rotated(self, xp, out):
        """Apply the display rotation (and then the CHW layout) to a whole batch."""
        m = self.metadata
        out = xp.rot90(out, k=(m.rotation // 90) % 4, axes=(1, 2))
        if self.layout == "CHW":
            out = xp.moveaxis(out, -1, 1)
        return xp.ascontiguousarray(out)

    def _fill_in(self, missing, targets, slots, row, chw, out, xp) -> None:
        """Decode the frames another backend did not deliver with PyAV, into their rows of
        ``out`` (numpy, or cupy on the decoder's GPU: each frame uploaded once)."""
        pos = {t: i for i, t in enumerate(targets)}
        host = np.empty((len(missing), *row), dtype=np.uint8)
        self._cpu.decode(
            missing, output=self.output, chw=chw, out=host,
            slots=[[i] for i in range(len(missing))],
        )  # fmt: skip
        for i, t in enumerate(missing):
            frame = xp.asarray(host[i])
            for r in slots[pos[t]]:
                out[r] = frame

    def _decode_cpu(self, backend, targets, slots, n):
        row, chw, rotate = self._plain_rows()
        out = np.empty((n, *row), dtype=np.uint8)
        missing = backend.decode(targets, output=self.output, chw=chw, out=out, slots=slots)
        if missing and backend is not self._cpu:
            self._fill_in(missing, targets, slots, row, chw, out, np)
        if rotate:
            out = self._rotated(np, out)
        if self.device.is_cuda:  # GPU fallback: frames go to the decoder's device
            import cupy

            with cupy.cuda.Device(self.device.index):
                return cupy.asarray(out)
        return out

    def _decode_gpu(self, backend, targets, slots, n):
        import cupy

        row, chw, rotate = self._plain_rows()
        with cupy.cuda.Device(self.device.index):
            out = cupy.empty((n, *row), dtype=cupy.uint8)
        missing = backend.decode(targets, output=self.output, chw=chw, out=out, slots=slots)
        if missing:  # frames the GPU did not deliver: the PyAV backend decodes them
            with cupy.cuda.Device(self.device.index):
                self._fill_in(missing, targets, slots, row, chw, out, cupy)
        if rotate:
            with cupy.cuda.Device(self.device.index):
                out = self._rotated(cupy, out)
        return out
