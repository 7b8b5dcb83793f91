"""The GPU backend: NVDEC through PyNvVideoCodec, frames stay on the GPU.

H.264 and HEVC in MP4/MOV go through the packet path (:mod:`._nvdec_packets`: only the packets a
request needs, read from the file by position); everything else, and any request the packet
path cannot map, through PyNvVideoCodec's SimpleDecoder, except streams with open GOPs, which
that decoder serves wrongly (:func:`simple_decoder_refusal`): the CPU decodes those.

Frames come out in their native NV12 layout (device memory) and are converted to RGB by our own
kernel (:mod:`avpipe.ops.color`), which follows the stream's colour-matrix and range tags the way FFmpeg
does for the CPU backend. PyNvVideoCodec numbers frames with its own demuxer; every returned
frame's pts is checked against the packet scan, and frames whose pts do not match are decoded
by the CPU backend instead (counted in ``pts_mismatches``), so frame i is the same on both.

SimpleDecoders are expensive to create: each thread keeps one (``reconfigure_decoder`` moves it
to the next file; PyNvVideoCodec keeps an LRU cache of hardware sessions behind it). Separate
threads use separate decoders, which NVDEC runs on its several engines concurrently.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict

import numpy as np

from ... import settings
from ...errors import UnsupportedFormatError
from ...ops.color import nv12_planes_to_rgb, nv12_to_rgb_device, yuv_coefficients
from ._backend import BackendRefused
from ._nvdec_caps import nvdec_supports, pynvc
from ._nvdec_packets import DisplayOrderError, PacketPathError, thread_packet_decoder
from ._scan import StreamScan

__all__ = ["NvdecBackend", "NvdecRefused"]

log = logging.getLogger("avpipe")

_local = threading.local()

# The packet path (feed NVDEC only what a request needs, :mod:`._nvdec_packets`) serves H.264 and
# HEVC files whose packets the scan located (MP4/MOV): AVPIPE_NVDEC_PACKETS unset or "auto".
# "1" (or true/yes/on) also sends other containers' H.264/HEVC through it (packets from
# PyNvVideoCodec's demuxer, which reads from the file's start for every request); "0" (or
# false/no/off) turns it off (SimpleDecoder only). Streams under 144 pixels never take it.
# It is faster than the SimpleDecoder path, which decodes every picture from the keyframe on
# (about twice as many for sparse clips) and is bound by NVDEC there, as long as it feeds NVDEC
# chunks of packets (docs/how-it-works.md, "Measured trade-offs"). A request it cannot
# serve goes to the SimpleDecoder path; after three files in a row on which PyNvVideoCodec
# misbehaved (and the SimpleDecoder did not), it is off for the process.
_packet_path = {"enabled": True, "why_off": None, "failures": 0}
_PACKET_FAILURES_OFF = 3


def use_packet_path(scan: StreamScan, path) -> bool:
    """Whether requests on this stream go through the packet path (see the note above)."""
    mode = settings.nvdec_packets()
    if mode == "off":
        return False
    every = mode == "on"  # also containers read by PyNvVideoCodec's demuxer
    return (
        path is not None
        and scan.codec in ("h264", "hevc")
        and scan.disposable is not None
        and (every or scan.packet_pos is not None)
        and min(scan.width, scan.height) >= 144  # NVDEC's HEVC minimum; refusals go below
    )


def simple_decoder_refusal(scan: StreamScan) -> str | None:
    """Why PyNvVideoCodec's SimpleDecoder cannot serve this stream frame-exactly, or None.

    Its frame index counts decoded pictures from a keyframe in decode order, and it labels the
    i-th picture it hands out with the i-th decode timestamp whatever that picture is. That is
    right only where each keyframe's decode position is its display index and every picture
    decoded before it displays before it (closed GOPs). Open GOPs break it: HEVC CRA keyframes
    with leading pictures, H.264 recovery points. With PyNvVideoCodec 2.2.4 on circles_hevc.mp4
    (a CRA every 15 frames), frame 13 alone comes back as frame 15, frame 28 as 30; in a clip
    10..16, frames 13 and 14 come back as misdecoded leading pictures; every one labelled as
    the frame asked for, so no label check can catch it."""
    dpts, pts = scan.decode_pts, np.asarray(scan.pts, dtype=np.int64)
    n = len(pts)
    if dpts is None or len(dpts) != n or n == 0:
        return None  # no decode order known: nothing to hold against it
    shown = np.searchsorted(pts, dpts)  # display index of each packet, in decode order
    if int(shown.max()) >= n or not np.array_equal(pts[shown], dpts):
        return None
    if len(np.unique(shown)) != n:  # repeated timestamps: the order cannot be told
        return None
    at = np.empty(n, dtype=np.int64)
    at[shown] = np.arange(n)  # decode position of each display index
    seen = np.maximum.accumulate(shown)  # the latest frame decoded so far, in display order
    for k in map(int, scan.keyframe_indices):
        if at[k] != k or (k > 0 and int(seen[k - 1]) != k - 1):
            return (
                f"{scan.codec} with open GOPs (pictures decoded after the keyframe at frame "
                f"{k} display before it): PyNvVideoCodec's SimpleDecoder hands out wrong "
                "pictures there; only the NVDEC packet path (H.264/HEVC in MP4/MOV) serves it"
            )
    return None


# What frame 0's label said per file: (abspath, size, mtime_ns, stream) -> (conventions,)
_LABELS: OrderedDict[tuple, tuple] = OrderedDict()
_LABELS_SIZE = 4096
_LABELS_LOCK = threading.Lock()


class FrameLabels:
    """Which frame a SimpleDecoder label names, for one file.

    PyNvVideoCodec labels frame i with its pts, its pts from a zero start, or (MP4) the i-th
    decode timestamp, depending on the demuxer and the file. Where these conventions differ
    (B-frames), accepting a label under any of them lets a wrong picture through: with a
    reorder delay of two, the i-th decode timestamp is frame i-2's pts, so frame i-2 handed
    out for frame i under the pts convention passes as frame i under the decode-timestamp one.
    (On MP4, PyNvVideoCodec 2.2.4 uses the decode-timestamp convention; labels are given by
    position, not read from the picture, so they catch a miscount, never a wrong picture: see
    :func:`simple_decoder_refusal` for the streams where that happens.) So the convention is
    fixed once per file from frame 0's label (the file's first picture, where a seek to the
    start lands) and only that one is accepted after. Where frame 0's label matches none, every
    convention stays accepted (a label passes under any of them). What frame 0 said is kept per
    file (path, size, mtime; :data:`_LABELS`), so later opens of the file skip frame 0.
    Where frame 0's label itself is wrong, the file's frames go to the CPU: slower, not wrong."""

    def __init__(self, scan: StreamScan, path=None):
        pts = np.asarray(scan.pts, dtype=np.int64)
        self.conventions = {"pts": pts, "zero": pts - pts[0]} if len(pts) else {"pts": pts}
        dts = scan.dts_sorted
        if dts is not None and len(dts) == len(pts):
            self.conventions["dts"] = np.asarray(dts, dtype=np.int64)
        distinct = []
        for a in self.conventions.values():
            if not any(np.array_equal(a, b) for b in distinct):
                distinct.append(a)
        # whether the conventions name different frames anywhere (else nothing to fix)
        self.ambiguous = len(distinct) > 1
        self.fixed: tuple[str, ...] | None = None  # the conventions frame 0's label matched
        self.tried = False  # frame 0's label was read (matched or not)
        self._key = None
        if self.ambiguous and path is not None:
            try:
                st = os.stat(path)
                self._key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, scan.stream_index)
            except (OSError, TypeError, ValueError):
                pass
            with _LABELS_LOCK:
                hit = _LABELS.get(self._key) if self._key is not None else None
                if hit is not None:
                    _LABELS.move_to_end(self._key)
            if hit is not None:
                self.tried, self.fixed = True, hit[0]

    @property
    def wants_frame0(self) -> bool:
        """Whether the next request should include frame 0 to fix the convention."""
        return self.ambiguous and not self.tried

    def calibrate(self, got) -> None:
        """Fix the convention from frame 0's label ``got`` (None: the frame has no label)."""
        self.tried = True
        if got is None:
            return
        names = tuple(n for n, a in self.conventions.items() if int(a[0]) == got)
        self.fixed = names or None
        if not names:
            log.debug("avpipe: frame 0 labelled %d, under no convention; all kept", got)
        if self._key is not None:
            with _LABELS_LOCK:
                _LABELS[self._key] = (self.fixed,)
                _LABELS.move_to_end(self._key)
                while len(_LABELS) > _LABELS_SIZE:
                    _LABELS.popitem(last=False)

    def ok(self, got: int, index: int) -> bool:
        """Whether label ``got`` names frame ``index``."""
        names = self.fixed or tuple(self.conventions)
        return any(int(self.conventions[n][index]) == got for n in names)


class NvdecRefused(BackendRefused):
    """NVDEC cannot decode this stream (codec, profile, size, depth); the reason is the text."""


def thread_stream(gpu: int):
    """This thread's CUDA stream on ``gpu`` (decoders of one thread share it)."""
    import cupy

    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    s = streams.get(gpu)
    if s is None:
        with cupy.cuda.Device(gpu):
            s = streams[gpu] = cupy.cuda.Stream(non_blocking=True)
    return s


def _acquire(nvc, path_or_bytes, gpu: int, stream_ptr: int):
    """A SimpleDecoder on ``path_or_bytes``: this thread's cached one, reconfigured, if any.

    Only sessions that never raised are cached (:func:`_release`); a cached one whose
    ``reconfigure_decoder`` raises is dropped here, never used again (see the note below)."""
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    key = (gpu, stream_ptr)
    dec = pool.pop(key, None)
    if dec is not None and isinstance(path_or_bytes, str):
        try:
            dec.reconfigure_decoder(path_or_bytes)
            return dec
        except Exception as e:  # noqa: BLE001 — fall back to a fresh decoder
            log.debug("avpipe: reconfigure_decoder failed (%s); creating a new decoder", e)
    return nvc.SimpleDecoder(
        path_or_bytes,
        gpu_id=gpu,
        cuda_stream=stream_ptr,
        use_device_memory=True,
        output_color_type=nvc.OutputColorType.NATIVE,
    )


def _release(dec, gpu: int, stream_ptr: int):
    """Return a healthy session to this thread's cache (callers pass only sessions that never
    raised)."""
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    pool.setdefault((gpu, stream_ptr), dec)  # a second one is dropped


# Sessions that raised. PyNvVideoCodec's NvDecoder keeps going after a failed
# cuvidCreateDecoder (its size fields are set, the decoder handle is not): the next bitstream
# it parses calls HandlePictureDecode, which throws "Decoder not initialized" from inside
# libnvcuvid's parser callback, and that exception ends in std::terminate. A session that has
# raised once is therefore never reconfigured, decoded with or flushed again: its last
# reference is dropped and its destructor releases its handles (it destroys the parser and the
# decoder; it parses nothing).


def _frame_pts(frame):
    for attr in ("getPTS", "get_pts"):
        fn = getattr(frame, attr, None)
        if fn is not None:
            try:
                return int(fn())
            except Exception:  # noqa: BLE001
                return None
    p = getattr(frame, "pts", None)
    return int(p) if p is not None else None


# Frames are read by their planes' device pointers (PyNvVideoCodec's GetPtrToPlane) where the
# frame exposes them; the first failure turns that off for the process (DLPack then, as before).
_raw_planes = {
    "enabled": True,  # AVPIPE_NVDEC_DLPACK=1 (read per request) turns it off too
    "why_off": None,
}


def frame_planes(frame, height: int, width: int):
    """(luma pointer, chroma pointer, row pitch) of a PyNvVideoCodec NV12 frame, or None where
    the frame does not expose them or they do not describe an NV12 frame of that size."""
    get = getattr(frame, "GetPtrToPlane", None)
    if get is None:
        return None
    try:
        shape, strides = tuple(frame.shape), tuple(frame.strides)
        luma, chroma = int(get(0)), int(get(1))
    except Exception:  # noqa: BLE001
        return None
    if len(shape) < 2 or len(strides) < 2 or strides[-1] != 1 or shape[1] < width:
        return None
    pitch = int(strides[0])
    if pitch < width or chroma <= luma:
        return None
    chroma_row, rest = divmod(chroma - luma, pitch)
    if rest or chroma_row < height or chroma_row + (height + 1) // 2 > shape[0]:
        return None
    return luma, chroma, pitch


class NvdecBackend:
    """The GPU backend (a :class:`._backend.VideoBackend`)."""

    name = "nvdec"
    on_gpu = True
    damaged = None  # NVDEC reports no per-packet damage; the CPU backend does
    # The packet path may ask for display order (a native-latency session, _nvdec_packets)
    # until that fails once on this file; then this backend asks for decode order only.
    _display_order = True
    # why the SimpleDecoder path cannot serve this stream (simple_decoder_refusal), or None;
    # worked out when that path is first wanted (the packet path never needs it)
    _simple_refusal = None
    _simple_checked = False

    def __init__(self, source, scan: StreamScan, device):

        self.scan = scan
        self.device = device
        self.pts_mismatches = 0
        if scan.bit_depth != 8:
            raise NvdecRefused(
                f"{scan.bit_depth}-bit video ({scan.pix_fmt}) is decoded on the CPU only"
            )
        if scan.pix_fmt and not scan.pix_fmt.startswith(("yuv420p", "yuvj420p", "nv12")):
            raise NvdecRefused(f"pixel format {scan.pix_fmt} (only 4:2:0 is decoded by NVDEC here)")
        try:
            nvc = pynvc()
        except ImportError as e:
            raise NvdecRefused(str(e)) from None
        try:
            ok = nvdec_supports(scan.codec, gpu=device.index)
        except Exception:  # noqa: BLE001 — a caps query failure is not a verdict
            ok = True
        if not ok:
            raise NvdecRefused(f"NVDEC on this GPU does not decode {scan.codec}")
        self._coeffs = yuv_coefficients(scan.color_space, scan.color_range, scan.pix_fmt)
        self._stream = thread_stream(device.index)
        import cupy

        # what every frame's write uses, looked up once
        self._hw = (int(scan.height), int(scan.width))
        self._rt = cupy.cuda.runtime
        self._stream_ptr = int(self._stream.ptr)
        self._source = source
        self._nvc = nvc
        self._dec = None
        self.nvc_num_frames = -1
        self._pts_offset = None  # "none" once a frame came without a pts: trust the index
        self._labels = None  # FrameLabels, made at the SimpleDecoder path's first request
        self._packet_failure = None  # why the packet path failed on this file, until counted
        self._dlpack = False  # AVPIPE_NVDEC_DLPACK, read per request
        self.packet_path = use_packet_path(scan, source.path)
        if not self.packet_path:
            if self._simple_refused() is not None:
                raise NvdecRefused(self._simple_refusal)
            self._simple()

    def _simple_refused(self) -> str | None:
        """Why the SimpleDecoder path cannot serve this stream (open GOPs), or None."""
        if not self._simple_checked:
            self._simple_refusal = simple_decoder_refusal(self.scan)
            self._simple_checked = True
        return self._simple_refusal

    def _simple(self):
        """The SimpleDecoder for this file (created on first use)."""
        if self._dec is None:
            import cupy

            src = self._source.path if self._source.path is not None else self._source.read_bytes()
            try:
                with cupy.cuda.Device(self.device.index):
                    self._dec = _acquire(self._nvc, src, self.device.index, self._stream_ptr)
            except Exception as e:  # noqa: BLE001 — NVDEC refused the stream
                self._dec = None
                raise NvdecRefused(
                    f"PyNvVideoCodec could not open {self.scan.source_name}: "
                    f"{type(e).__name__}: {e}"
                ) from None
            try:
                self.nvc_num_frames = len(self._dec)
            except Exception:  # noqa: BLE001
                self.nvc_num_frames = -1
        return self._dec

    def close(self):
        dec, self._dec = getattr(self, "_dec", None), None
        if dec is not None:
            try:
                self._stream.synchronize()
            except Exception:  # noqa: BLE001
                pass
            _release(dec, self.device.index, self._stream_ptr)  # healthy: failures are dropped

    def _drop_failed(self):
        """The SimpleDecoder raised: drop it (never cached); a later call opens a fresh one."""
        try:
            self._stream.synchronize()
        except Exception:  # noqa: BLE001
            pass
        self._dec = None

    def _pts_ok(self, got, index: int) -> bool:
        """Whether the SimpleDecoder's frame labelled ``got`` is frame ``index``
        (:class:`FrameLabels`); anything else means its frame is not ours."""
        if got is None:
            return self._pts_offset == "none"
        return self._labels.ok(got, index)

    def _batch(self, targets):
        """(frames for targets[:k], targets[k:]): PyNvVideoCodec's seek refuses some streams'
        last frames (AVI MJPEG), so on an error it is asked again without the tail, each time
        by a fresh session (a session that raised is never called again: :meth:`_drop_failed`)."""
        tail = []
        while targets:
            dec = self._simple()  # a refusal (NvdecRefused) goes to the caller: CPU takes over
            try:
                frames = dec.get_batch_frames_by_index([int(t) for t in targets])
                if len(frames) == len(targets):
                    return frames, tail
                log.warning(
                    "avpipe: PyNvVideoCodec returned %d of %d frames for %s",
                    len(frames),
                    len(targets),
                    self.scan.source_name,
                )
                return [], list(targets) + tail
            except Exception as e:  # noqa: BLE001
                self._drop_failed()
                log.warning(
                    "avpipe: PyNvVideoCodec failed on %s (%s: %s)",
                    self.scan.source_name,
                    type(e).__name__,
                    " ".join(str(e).split())[:200],
                )
                if len(tail) >= 4:
                    return [], list(targets) + tail
                tail.insert(0, targets.pop())
        return [], tail

    def decode(self, targets, *, output: str, chw: bool, out, slots) -> list[int]:
        """Decode sorted unique ``targets`` into ``out`` (cupy, [N, ...]); ``slots[i]`` lists the
        output rows that frame ``targets[i]`` fills. Returns the targets NVDEC did not deliver
        correctly (sorted; the caller decodes them elsewhere)."""
        import cupy

        scan = self.scan
        self._dlpack = settings.nvdec_dlpack()
        missing = None
        if self.packet_path and _packet_path["enabled"]:
            missing = self._decode_packets(targets, output, chw, out, slots)
        if missing is None and self._simple_refused() is not None:
            # (not counted against the packet path: that count is for PyNvVideoCodec failing
            # where its SimpleDecoder then served, and turning the path off would send every
            # later open-GOP file to the CPU)
            why, self._packet_failure = self._packet_failure, None
            log.warning("avpipe: %s: NVDEC packet path failed (%s); decoding on the CPU (%s)",
                        scan.source_name, why or "it cannot serve this request",
                        self._simple_refusal)
            return sorted({int(t) for t in targets})
        if missing is None:
            if self._labels is None:
                self._labels = FrameLabels(scan, self._source.path)
            # frame 0 rides along with the first request whose labels could be misread
            first = int(targets[0]) if len(targets) else None
            extra = self._labels.wants_frame0 and first not in (0, None)
            with cupy.cuda.Device(self.device.index), self._stream:
                frames, missing = self._batch(([0] if extra else []) + [int(t) for t in targets])
                if extra:
                    if frames:
                        self._labels.calibrate(_frame_pts(frames[0]))
                        frames = frames[1:]
                    missing = [t for t in missing if t != 0]  # 0 is not a target here
                elif frames and self._labels.wants_frame0 and first == 0:
                    self._labels.calibrate(_frame_pts(frames[0]))
                mislabelled = False
                if self._packet_failure is not None:  # the SimpleDecoder serves what it did not
                    _packet_path_failed(self.scan.source_name, self._packet_failure)
                    self._packet_failure = None
                for t, fr, rows in zip(targets[: len(frames)], frames, slots):
                    got = _frame_pts(fr)
                    if got is None and self._pts_offset is None:
                        self._pts_offset = "none"  # no pts exposed: trust its index
                    if not self._pts_ok(got, int(t)):
                        missing.append(t)
                        mislabelled = True
                        continue
                    self._write(fr, rows, output, chw, out)
                self._stream.synchronize()  # frames' surfaces are reused by the next call
                if mislabelled and self.scan.codec != "mjpeg":
                    # the session handed out a wrong picture: it met bad data (PyNvVideoCodec
                    # then prints "Decode Error occurred for picture N" and goes on). Such a
                    # session, cached and reconfigured for the next file, can crash the
                    # process (SIGSEGV, a damaged H.264 MP4 then any file): never reused. (A
                    # tail PyNvVideoCodec refused to seek to was refused by a session already
                    # dropped, see _batch; the fresh one that served the rest is healthy.)
                    # MJPEG is left out: its pictures are independent, and its sessions
                    # mislabel frames of clean AVI files; dropping them would make which frames
                    # NVDEC serves (and which the CPU) differ from one open of a file to the
                    # next.
                    self._drop_failed()
        if missing:
            self.pts_mismatches += len(missing)
            log.warning(
                "avpipe: NVDEC frame numbering differs from the packet scan for %s (%d frames); "
                "decoding those on the CPU",
                scan.source_name,
                len(missing),
            )
        return sorted(set(missing or ()))


    def _write(self, frame, rows, output, chw, out):
        """Convert one decoded NV12 frame into ``out[rows]`` on this backend's stream."""
        dst = out[rows[0]]
        if not (_raw_planes["enabled"] and not self._dlpack
                and self._write_raw(frame, dst, output, chw)):  # fmt: skip
            self._write_dlpack(frame, dst, output, chw)
        for r in rows[1:]:
            out[r] = dst

    def _write_raw(self, frame, dst, output, chw) -> bool:
        """The frame's planes by their device pointers, without a DLPack round trip (a DLPack
        export per frame costs a large share of the clip rate with many threads;
        docs/how-it-works.md, "Measured trade-offs").
        The kernel or copies are ordered after the decoder's event on this backend's stream.
        False where the frame does not expose its planes; the caller then uses DLPack."""
        H, W = self._hw
        planes = frame_planes(frame, H, W)
        if planes is None or not dst.flags.c_contiguous:
            return False
        luma, chroma, pitch = planes
        try:
            ev = int(getattr(frame, "decoder_stream_event", 0) or 0)
            if ev:
                self._rt.streamWaitEvent(self._stream_ptr, ev, 0)
            if output == "nv12":
                rt, d = self._rt, int(dst.data.ptr)
                d2d = rt.memcpyDeviceToDevice
                rt.memcpy2DAsync(d, W, luma, pitch, W, H, d2d, self._stream_ptr)
                ch = (H + 1) // 2
                rt.memcpy2DAsync(d + H * W, W, chroma, pitch, W, ch, d2d, self._stream_ptr)
            else:
                nv12_planes_to_rgb(luma, chroma, pitch, H, W, self._coeffs, dst, chw=chw)
        except Exception as e:  # noqa: BLE001 — this PyNvVideoCodec's pointers are not usable
            _raw_planes.update(enabled=False, why_off=f"{type(e).__name__}: {e}")
            log.warning(
                "avpipe: NVDEC frames by pointer disabled (%s: %s); using DLPack",
                type(e).__name__,
                e,
            )
            return False
        return True

    def _write_dlpack(self, frame, dst, output, chw):
        import cupy

        scan = self.scan
        H, W = scan.height, scan.width
        x = cupy.from_dlpack(frame)
        if x.ndim == 3 and x.shape[-1] == 1:
            x = x[..., 0]
        if x.ndim != 2 or x.shape[1] < W or x.shape[0] < H + (H + 1) // 2:
            raise UnsupportedFormatError(
                scan.source_name,
                f"NVDEC returned a frame of shape {tuple(x.shape)}, expected NV12 for {W}x{H}",
            )
        chroma_row = (x.shape[0] * 2) // 3 if x.shape[0] % 3 == 0 else H
        if output == "nv12":
            ch = (H + 1) // 2
            dst[:H] = x[:H, :W]
            dst[H : H + ch] = x[chroma_row : chroma_row + ch, :W]
        else:
            nv12_to_rgb_device(x, H, W, self._coeffs, dst, chw=chw, chroma_row=chroma_row)

    def _decode_packets(self, targets, output, chw, out, slots):
        """The packet path; returns the targets it did not deliver, or None when it cannot
        serve this request (the caller then uses the SimpleDecoder path for this file)."""
        import cupy

        pos = {int(t): i for i, t in enumerate(targets)}
        done = set()
        pd = thread_packet_decoder(self.device.index, self._stream_ptr)

        def serve(in_display_order: bool) -> None:
            done.clear()  # a failed pass's frames do not count: every target is written again
            for t, frame in pd.frames(self._source.path, self.scan, targets,
                                      in_display_order=in_display_order):  # fmt: skip
                self._write(frame, slots[pos[t]], output, chw, out)
                done.add(t)

        try:
            with cupy.cuda.Device(self.device.index), self._stream:
                try:
                    serve(self._display_order)
                except DisplayOrderError as e:
                    # the display-order session's pictures did not add up: this request and
                    # the file's later ones go in decode order (the dropped session's frames
                    # are read before it is released)
                    log.info("avpipe: %s: NVDEC in decode order (%s)", self.scan.source_name, e)
                    self._display_order = False
                    self._stream.synchronize()
                    serve(False)
                self._stream.synchronize()
        except (PacketPathError, OSError) as e:  # this file, not the path: no count against it
            log.info("avpipe: %s: packet path not used (%s)", self.scan.source_name, e)
            self.packet_path = False
            return None
        except Exception as e:  # noqa: BLE001 — counted once the SimpleDecoder has served it
            pd.drop()
            self._packet_failure = f"{type(e).__name__}: {e}"
            self.packet_path = False
            return None
        missing = [t for t in targets if t not in done]
        if missing:  # cannot happen while every picture maps to its packet; be safe
            self._packet_failure = f"delivered {len(done)} of {len(targets)} frames"
            self.packet_path = False
            return None
        _packet_path["failures"] = 0
        return []


def _packet_path_failed(name: str, why: str) -> None:
    """The packet path failed on a file the SimpleDecoder then decoded: PyNvVideoCodec did
    something unexpected. Three such failures in a row turn the path off for the process (one
    odd file must not cost every later file its speed; a PyNvVideoCodec that misbehaves on
    every file must not cost every file a retry)."""
    _packet_path["failures"] = n = _packet_path["failures"] + 1
    if n >= _PACKET_FAILURES_OFF and _packet_path["enabled"]:
        _packet_path.update(enabled=False, why_off=why)
        log.warning("avpipe: NVDEC packet path disabled after %d failures in a row (%s)", n, why)
    else:
        log.warning("avpipe: %s: NVDEC packet path failed (%s); SimpleDecoder used", name, why)


def nvdec_diagnostics(backend: NvdecBackend, indices) -> dict:
    """Pts PyNvVideoCodec reports for ``indices`` next to the scan's (for GPU tests)."""
    frames = backend._simple().get_batch_frames_by_index([int(i) for i in indices])
    backend._stream.synchronize()
    return {
        "nvc_num_frames": backend.nvc_num_frames,
        "scan_num_frames": backend.scan.num_frames,
        "nvc_pts": [_frame_pts(f) for f in frames],
        "scan_pts": [int(backend.scan.pts[i]) for i in indices],
        "labels": None if backend._labels is None else backend._labels.fixed,
    }


__all__ += ["nvdec_diagnostics"]
