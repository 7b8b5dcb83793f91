"""Container metadata and a packet scan (demux only, plus one decoded frame for colour tags).

The scan reads every packet's pts of the chosen stream. Sorted, they are the pts of the frames
a full decode yields, in display order (B-frames are stored out of order). Packets without data
(the demuxer's final flush packet), packets the container marks as discarded (frames before an
MP4 edit list's start) are skipped; a packet without pts falls back to its dts.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from ...errors import CorruptDataError, DecodeError, EmptyMediaError, UnsupportedFormatError
from ._nal import nal_length_size, parameter_sets_annexb, slice_nal_headers

__all__ = ["StreamScan", "scan_stream", "open_container", "av_error", "scan_mp4_file",
           "remember_scan", "is_scan_cached"]

_SUPPORTED = ("h264", "hevc", "vp8", "vp9", "mjpeg", "av1")


def av_error(name: str, e: BaseException, what: str = "decoding failed") -> DecodeError:
    """Map a PyAV/FFmpeg exception to avpipe's typed errors (naming the source)."""
    import av

    if isinstance(e, DecodeError):
        return e
    msg = f"{what}: {type(e).__name__}: {e}"
    text = str(e).lower()
    invalid = getattr(getattr(av, "error", None), "InvalidDataError", None)
    if (invalid is not None and isinstance(e, invalid)) or isinstance(e, EOFError):
        return CorruptDataError(name, msg)
    if "not implemented" in text or "unsupported" in text or "decoder not found" in text:
        return UnsupportedFormatError(name, msg)
    return CorruptDataError(name, msg)


def open_container(source, name: str):
    """``av.open`` on a path or stream with typed errors."""
    import av

    try:
        return av.open(source.path_or_stream(), mode="r")
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 — every FFmpeg failure to open means bad content
        raise av_error(name, e, "cannot open container") from None


@dataclass
class StreamScan:
    source_name: str
    stream_index: int
    codec: str
    pix_fmt: str | None
    width: int
    height: int
    time_base: Fraction
    pts: np.ndarray  # int64 stream ticks, display order
    keyframe_indices: np.ndarray  # int64 display indices of keyframes, ascending
    end_pts: int  # the end of the last frame, in ticks
    bit_depth: int = 8
    color_space: str | None = None
    color_range: str | None = None
    rotation: int = 0
    sample_aspect_ratio: Fraction | None = None
    container: str | None = None
    pts_to_index: dict = field(default_factory=dict, repr=False)
    dts_sorted: np.ndarray | None = field(default=None, repr=False)  # decode-order times, sorted
    # per packet in decode (file) order: its pts, and whether no other picture references it
    decode_pts: np.ndarray | None = field(default=None, repr=False)
    disposable: np.ndarray | None = field(default=None, repr=False)
    # H.264 / HEVC in a file whose packets PyAV locates: each packet's byte offset and size in
    # decode order, the NAL length size and the parameter sets in Annex B (the NVDEC packet path
    # reads packets itself instead of demuxing); None where that does not hold
    packet_pos: np.ndarray | None = field(default=None, repr=False)
    packet_size: np.ndarray | None = field(default=None, repr=False)
    nal_size: int = 0
    parameter_sets: bytes | None = field(default=None, repr=False)
    damaged: str | None = None  # why the stream is damaged though frames were read, else None

    @property
    def num_frames(self) -> int:
        return int(self.pts.shape[0])

    def keyframe_at_or_before(self, index: int) -> int:
        """Display index of the last keyframe whose index is <= ``index`` (0 if none)."""
        k = int(np.searchsorted(self.keyframe_indices, index, side="right")) - 1
        return int(self.keyframe_indices[k]) if k >= 0 else 0


def _bit_depth(pix_fmt: str | None) -> int:
    if not pix_fmt:
        return 8
    for d in (16, 14, 12, 10, 9):
        if f"p{d}" in pix_fmt:
            return d
    return 8


_SPACES = {
    0: "rgb",
    1: "bt709",
    2: "unspecified",
    4: "fcc",
    5: "bt470bg",
    6: "smpte170m",
    7: "smpte240m",
    8: "ycgco",
    9: "bt2020nc",
    10: "bt2020c",
}
_RANGES = {0: "unspecified", 1: "tv", 2: "pc"}


def _color_name(x, table) -> str | None:
    if x is None:
        return None
    try:
        return table.get(int(x), str(int(x)))
    except (TypeError, ValueError):
        return str(x).lower()


def _pick_stream(container, stream_index, name):
    streams = container.streams
    if stream_index is None:
        videos = list(streams.video)
        if not videos:
            raise EmptyMediaError(name, "the container holds no video stream")
        try:
            import av  # noqa: F401

            best = container.streams.best("video") if hasattr(container.streams, "best") else None
        except Exception:  # noqa: BLE001
            best = None
        return best if best is not None else videos[0]
    if isinstance(stream_index, bool) or not isinstance(stream_index, (int, np.integer)):
        raise TypeError(f"stream_index must be an int or None, got {stream_index!r}")
    if not 0 <= int(stream_index) < len(streams):
        raise ValueError(
            f"stream_index must be in [0, {len(streams)}) for {name}, got {stream_index}"
        )
    st = streams[int(stream_index)]
    if st.type != "video":
        raise ValueError(f"stream_index={stream_index} of {name} is a {st.type} stream, not video")
    return st


_CACHE: OrderedDict[tuple, StreamScan] = OrderedDict()
_CACHE_SIZE = 256
_CACHE_LOCK = threading.Lock()


def _cache_key(path: str, stream_index=None) -> tuple | None:
    """The scan cache's key of a file: (absolute path, size, mtime ns, stream), None when it
    cannot be stat'ed."""
    try:
        stt = os.stat(path)
    except OSError:
        return None
    return (os.path.abspath(path), stt.st_size, stt.st_mtime_ns, stream_index)


def _cached(key) -> StreamScan | None:
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
        return hit


def remember_scan(key: tuple, scan: StreamScan) -> None:
    """Put a scan made elsewhere (:func:`scan_mp4_file` in another process) into the cache
    under ``key``; a later open finds it only while the file's size and mtime still match."""
    with _CACHE_LOCK:
        _CACHE[key] = scan
        _CACHE.move_to_end(key)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)


def is_scan_cached(path: str) -> bool:
    """Whether an open of ``path`` (its default stream) would find its scan in the cache."""
    key = _cache_key(path)
    return key is not None and _cached(key) is not None


def scan_mp4_file(path: str) -> tuple | None:
    """``(cache key, scan)`` of an MP4 / MOV file read from its sample tables, for
    :func:`remember_scan` in the process that will open it (scanning ahead, in another
    process); None where that reader does not apply (another container, damage): the open then
    scans as always, and reports what is wrong. The key is taken before the read and checked
    after it, so a file changed meanwhile is never remembered."""
    key = _cache_key(path)
    if key is None:
        return None
    from ..._source import Source

    scan = _scan_mp4(Source(name=path, path=path), path)
    if scan is None or _cache_key(path) != key:
        return None
    return key, scan


def scan_stream(source, name: str, stream_index=None) -> StreamScan:
    """The scan of a stream; scans of files are cached by (path, size, mtime, stream)."""
    key = None if source.path is None else _cache_key(source.path, stream_index)
    if key is not None:
        hit = _cached(key)
        if hit is not None:
            return hit
    result = _scan_mp4(source, name, stream_index) if key is not None else None
    if result is None:
        result = _scan_stream(source, name, stream_index)
    if key is not None:
        remember_scan(key, result)
    return result


_AVI_REORDER = (
    "its pictures are reordered (B-frames) but AVI stores decode times only, so which picture "
    "is frame i is not known without decoding the whole file; remux it with timestamps "
    "(MP4 or MKV, e.g. ffmpeg -i in.avi -c copy out.mkv) or re-encode it"
)


def _reorders(source, name: str, stream_index: int, packets: int = 48) -> bool:
    """Whether decoding the stream's first ``packets`` packets gives pictures out of the
    packets' order (their timestamps going back): B-frames in a container whose timestamps
    follow decode order (AVI)."""
    last = None
    try:
        with contextlib.closing(open_container(source, name)) as c:
            st = c.streams[stream_index]
            for k, pkt in enumerate(c.demux(st)):
                if k >= packets:
                    break
                try:
                    frames = st.codec_context.decode(pkt)
                except Exception:  # noqa: BLE001 — judged on what decodes
                    continue
                for f in frames:
                    if f.pts is not None:
                        if last is not None and f.pts < last:
                            return True
                        last = f.pts
    except DecodeError:
        return False
    return False


def _scan_stream(source, name: str, stream_index=None) -> StreamScan:
    """Demux the whole stream once and collect everything the decoders need."""
    with contextlib.closing(open_container(source, name)) as container:
        st = _pick_stream(container, stream_index, name)
        cc = st.codec_context
        codec = cc.name if cc is not None else None
        # FFmpeg may pick a wrapper decoder (libdav1d for av1): report the codec's own name
        codec = {"libdav1d": "av1", "libaom-av1": "av1", "libvpx": "vp8", "libvpx-vp9": "vp9"}.get(
            codec, codec
        )
        if codec not in _SUPPORTED:
            raise UnsupportedFormatError(
                name, f"video codec {codec!r} is not supported (supported: {', '.join(_SUPPORTED)})"
            )
        tb = st.time_base or Fraction(1, 90000)
        pts_list: list[int] = []
        dts_list: list[int] = []
        key_pts: list[int] = []
        last_dur = 0
        durations: dict[int, int] = {}  # pts -> the packet's own duration, where it has one
        nal_size = nal_length_size(codec, bytes(cc.extradata or b"")) if cc is not None else 0
        slice_headers: list = []
        positions: list = []  # (pos, size) per packet, for H.264 / HEVC files
        samples: list = []  # a few packets' bytes, to check their positions against the file
        locate = source.path is not None and codec in ("h264", "hevc") and nal_size > 0
        first_frame = None
        decode_first = True
        damaged = None
        n_packets = 0  # every packet with data, also those the container marks discarded
        try:
            for pkt in container.demux(st):
                n_packets += pkt.size > 0 or pkt.dts is not None  # not the final flush
                if pkt.size == 0 or (getattr(pkt, "is_discard", False)):
                    continue
                p = pkt.pts if pkt.pts is not None else pkt.dts
                if p is None:
                    p = (pts_list[-1] + max(last_dur, 1)) if pts_list else 0
                pts_list.append(int(p))
                dts_list.append(int(pkt.dts) if pkt.dts is not None else int(p))
                if pkt.is_keyframe:
                    key_pts.append(int(p))
                if codec in ("h264", "hevc"):
                    data = bytes(pkt)
                    slice_headers.append(slice_nal_headers(data, codec, nal_size))
                    if locate:
                        at = pkt.pos if pkt.pos is not None else -1
                        positions.append((int(at), len(data)))
                        if len(samples) < 2 or len(positions) % 97 == 0:
                            samples.append((int(at), data))
                if pkt.duration:
                    last_dur = int(pkt.duration)
                    durations[int(p)] = int(pkt.duration)
                if decode_first:
                    try:
                        frames = cc.decode(pkt)
                    except Exception:  # noqa: BLE001 — the first packets of open-GOP streams
                        frames = []
                    if frames:
                        first_frame = frames[0]
                        decode_first = False
                    elif len(pts_list) > 64:
                        decode_first = False
        except Exception as e:  # noqa: BLE001
            if not pts_list:
                raise av_error(name, e, "cannot read packets") from None
            # a damaged tail: keep what was read (frames past it fail when asked for)
            damaged = f"demuxing stopped at damaged data after {len(pts_list)} frames ({e})"
        if not pts_list:
            raise EmptyMediaError(name, f"video stream {st.index} holds no frames")
        if (codec in ("h264", "hevc") and "avi" in str(container.format.name)
                and all(a < b for a, b in zip(pts_list, pts_list[1:]))
                and _reorders(source, name, st.index)):
            raise UnsupportedFormatError(name, _AVI_REORDER)
        pts = np.array(sorted(pts_list), dtype=np.int64)
        if slice_headers:
            max_tid = max((t for h in slice_headers for _, t in h), default=0)
            disposable = np.array(
                [bool(h) and all((not r) and t == max_tid for r, t in h) for h in slice_headers]
            )
        else:
            disposable = np.zeros(len(pts_list), dtype=bool)
        # duplicate pts (broken muxing) would make two frames indistinguishable: keep them unique
        if np.unique(pts).size != pts.size:
            raise CorruptDataError(name, f"video stream {st.index} has duplicate timestamps")
        pts_to_index = {int(p): i for i, p in enumerate(pts.tolist())}
        kidx = sorted({pts_to_index[p] for p in key_pts})
        if not kidx or kidx[0] != 0:
            kidx = [0] + kidx
        if pts.size > 1:
            steps = np.diff(pts)
            typical = int(np.median(steps))
        else:
            typical = 0
        # the last *displayed* frame's duration (with B-frames the last packet in decode
        # order is another frame)
        step_last = durations.get(int(pts[-1]), 0) or (last_dur if last_dur > 0 else typical)
        if step_last <= 0:
            rate = st.average_rate or st.guessed_rate or Fraction(25)
            step_last = max(1, int(round(1 / (float(rate) * float(tb)))))
        packet_pos = packet_size = param_sets = None
        if locate and len(positions) == len(pts_list) and _positions_hold(source.path, samples):
            param_sets = parameter_sets_annexb(codec, bytes(cc.extradata or b""))
            if param_sets is not None:
                packet_pos = np.array([p for p, _ in positions], dtype=np.int64)
                packet_size = np.array([n for _, n in positions], dtype=np.int64)
        pix_fmt = cc.pix_fmt if cc is not None else None
        color_space = color_range = None
        rotation = 0
        if first_frame is not None:
            pix_fmt = first_frame.format.name
            color_space = _color_name(first_frame.colorspace, _SPACES)
            color_range = _color_name(first_frame.color_range, _RANGES)
            try:
                rotation = int(round(first_frame.rotation or 0)) % 360
            except Exception:  # noqa: BLE001
                rotation = 0
        # MP4 counts samples (AVI's count is of time slots, with gaps for dropped frames)
        declared = int(st.frames or 0) if "mp4" in str(container.format.name) else 0
        if damaged is None and declared > n_packets:
            damaged = f"the container declares {declared} frames but holds {n_packets} (truncated)"
        if damaged is None and len(container.streams) == 1 and container.duration:
            said = container.duration / 1e6  # microseconds; from 0 or from the first pts
            got = float((int(pts[-1]) + int(step_last)) * tb)
            got = max(got, got - float(pts[0] * tb))
            if said > got + 2 * float(step_last * tb) + 0.1:
                damaged = f"the container declares {said:.3f} s but holds {got:.3f} s (truncated)"
        sar = st.sample_aspect_ratio or (cc.sample_aspect_ratio if cc is not None else None)
        width = int(cc.width or (first_frame.width if first_frame else 0))
        height = int(cc.height or (first_frame.height if first_frame else 0))
        return StreamScan(
            source_name=name,
            stream_index=int(st.index),
            codec=codec,
            pix_fmt=pix_fmt,
            width=width,
            height=height,
            time_base=Fraction(tb),
            pts=pts,
            keyframe_indices=np.array(kidx, dtype=np.int64),
            end_pts=int(pts[-1]) + int(step_last),
            bit_depth=_bit_depth(pix_fmt),
            color_space=color_space,
            color_range=color_range,
            rotation=rotation,
            sample_aspect_ratio=Fraction(sar) if sar else None,
            container=getattr(container.format, "name", None),
            pts_to_index=pts_to_index,
            dts_sorted=np.array(sorted(dts_list), dtype=np.int64),
            decode_pts=np.array(pts_list, dtype=np.int64),
            disposable=disposable,
            packet_pos=packet_pos,
            packet_size=packet_size,
            nal_size=int(nal_size) if packet_pos is not None else 0,
            parameter_sets=param_sets,
            damaged=damaged,
        )


def _positions_hold(path: str, samples) -> bool:
    """Whether the file holds these packets' bytes at the positions the demuxer reported."""
    try:
        with open(path, "rb", buffering=0) as f:
            for at, data in samples:
                if at < 0 or os.pread(f.fileno(), len(data), at) != data:
                    return False
    except OSError:
        return False
    return bool(samples)


_MP4_MIN_PACKETS = 48


def _scan_mp4(source, name: str, stream_index=None) -> StreamScan | None:
    """The scan read from an MP4 / MOV file's sample tables (no demux, no decode), or None where
    the file is not one that reader reproduces exactly (the demux scan then runs)."""
    from . import _mp4

    if stream_index is not None and (
        isinstance(stream_index, bool) or not isinstance(stream_index, (int, np.integer))
    ):
        return None  # the demux scan says what is wrong with it
    try:
        if not _mp4.looks_like_mp4(source.path):
            return None
        v = _mp4.read_video_track(source.path, stream_index)
        # a short file: the demux scan may end before the decoder's delay lets its first frame
        # out (then it reports no colour tags), and that delay depends on the thread count
        pts = np.sort(v.pts)
        if pts.size < _MP4_MIN_PACKETS or not (pts[1:] > pts[:-1]).all():
            return None  # (duplicate timestamps: the demux scan reports them)
    except Exception:  # noqa: BLE001 — DemuxScanNeeded, or damage the reader
        return None  # trips on: the demux scan is the authority and reports it with typed errors
    pts_to_index = dict(zip(pts.tolist(), range(pts.size)))
    kidx = np.unique(np.searchsorted(pts, v.pts[v.key])).tolist()
    if not kidx or kidx[0] != 0:
        kidx = [0] + kidx
    last = int(np.argmax(v.pts))
    nal_size = nal_length_size(v.codec, v.extradata)
    param_sets = parameter_sets_annexb(v.codec, v.extradata) if nal_size > 0 else None
    located = param_sets is not None
    return StreamScan(
        source_name=name,
        stream_index=v.stream_index,
        codec=v.codec,
        pix_fmt=v.pix_fmt,
        width=v.width,
        height=v.height,
        time_base=Fraction(1, v.timescale),
        pts=pts,
        keyframe_indices=np.array(kidx, dtype=np.int64),
        end_pts=int(pts[-1]) + int(v.duration[last]),
        bit_depth=_bit_depth(v.pix_fmt),
        color_space=v.color_space,
        color_range=v.color_range,
        rotation=v.rotation,
        sample_aspect_ratio=v.sample_aspect_ratio,
        container=v.container,
        pts_to_index=pts_to_index,
        dts_sorted=np.sort(v.dts),
        decode_pts=v.pts.astype(np.int64),
        disposable=v.disposable,
        packet_pos=v.pos.astype(np.int64) if located else None,
        packet_size=v.size.astype(np.int64) if located else None,
        nal_size=int(nal_size) if located else 0,
        parameter_sets=param_sets,
    )
