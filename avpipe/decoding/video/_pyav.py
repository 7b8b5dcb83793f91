"""The CPU backend: PyAV (FFmpeg) decode with keyframe seeks, frames matched by pts.

To reach a frame the backend seeks to the keyframe at or before it (``backward=True,
any_frame=False``) and decodes forward, picking frames whose pts equal the scan's pts for the
wanted indices. The seek's timestamp is the one the container's demuxer compares (see
:meth:`PyAVBackend._seek_target`); where a demuxer still lands on an earlier keyframe, the
packets before the wanted keyframe are read and dropped, not decoded. When the first frame after
a seek is already later than the wanted one (open GOP leading pictures, an imprecise container
index) it seeks one keyframe further back. Between two wanted frames it keeps decoding forward,
also across a keyframe, unless the packets still to decode before that keyframe cost more than
a seek (:data:`SEEK_COST`): a strided clip is one seek and one decode pass. Every frame of a
request is decoded at most once, and *disposable* packets (pictures no other picture
references, see :mod:`._nal`) that are not wanted are not decoded at all.

Decoder threads: ``threads=0`` (the default) is FFmpeg's frame and slice threading with the
count FFmpeg picks from the CPU count; ``threads=1`` decodes on the calling thread only. Frames
are the same for any count.
"""

from __future__ import annotations

import threading

import numpy as np

from ...errors import CorruptDataError, DecodeError, UnsupportedFormatError
from ._plan import skipped_mask
from ._scan import StreamScan, av_error, open_container

__all__ = ["PyAVBackend", "SEEK_COST"]

_MAX_BAD_PACKETS = 32

#: Packets that a seek with its decoder flush costs about as much as decoding: between two
#: wanted frames with a keyframe between them, the backend decodes on when at most this many
#: needed packets lie before that keyframe, and seeks to the keyframe otherwise.
SEEK_COST = 4

# Demuxers that compare a seek's timestamp with keyframes' presentation times (their index is
# by pts): MP4/MOV and Matroska/WebM. Seeking there to a keyframe's dts, earlier than its pts
# when B-frames follow it, lands on the keyframe before.
_PTS_SEEK_FORMATS = frozenset({"mov", "mp4", "matroska", "webm"})


def seeks_by_pts(container: str | None) -> bool:
    """Whether the demuxer named ``container`` (FFmpeg's format name, e.g.
    ``"mov,mp4,m4a,3gp,3g2,mj2"``) seeks by keyframes' pts."""
    return bool(container) and not _PTS_SEEK_FORMATS.isdisjoint(container.split(","))


class PyAVBackend:
    """The CPU backend (a :class:`._backend.VideoBackend`).

    ``counters`` adds up, over the backend's life, the seeks made (``seeks``), the packets sent
    to the decoder (``packets``) and those read after a seek and dropped because they precede
    the wanted keyframe (``dropped``): what a request cost, for tests and probes."""

    name = "pyav"
    on_gpu = False

    def __init__(self, source, scan: StreamScan, *, threads: int = 0):
        self._source = source
        self.scan = scan
        self._threads = int(threads)
        self._container = None
        self._stream = None
        self._lock = threading.Lock()
        self._last_pts = None  # pts of the last packet the current decode pass read
        self.counters = {"seeks": 0, "packets": 0, "dropped": 0}
        self.damaged: str | None = None  # set when a packet fails to decode and is skipped

    # -- lifecycle ---------------------------------------------------------------------------
    def _open(self):
        if self._container is None:
            self._container = open_container(self._source, self.scan.source_name)
            self._stream = self._container.streams[self.scan.stream_index]
            cc = self._stream.codec_context
            try:
                cc.thread_type = "AUTO"
                cc.thread_count = self._threads
            except Exception:  # noqa: BLE001 — threading is an optimisation only
                pass
        return self._container, self._stream

    def close(self):
        c, self._container, self._stream = self._container, None, None
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass

    # -- decoding ----------------------------------------------------------------------------
    def _decode_position(self, pts) -> int | None:
        """Position in decode order of the packet with ``pts`` (None: the scan has no packet
        order, or no such packet)."""
        dpts = self.scan.decode_pts
        if dpts is None or pts is None:
            return None
        hit = np.flatnonzero(dpts == pts)
        return int(hit[0]) if hit.size else None

    def _seek_target(self, seek_index: int) -> int:
        """Where to seek for the keyframe at display index ``seek_index``. MP4/MOV and
        Matroska: its pts (see :func:`seeks_by_pts`). Elsewhere the earlier of its pts and its
        dts: FFmpeg compares a seek's timestamp with the packets' decode times in some demuxers
        (MPEG-TS, the generic seek), where seeking to the pts of a keyframe that B-frames follow
        lands just after it, so the first GOP could not be reached at all."""
        scan = self.scan
        kpts = int(scan.pts[seek_index])
        if seeks_by_pts(scan.container):
            return kpts
        if scan.decode_pts is not None and scan.dts_sorted is not None:
            k = self._decode_position(kpts)
            if k is not None and k < len(scan.dts_sorted):
                return min(kpts, int(scan.dts_sorted[k]))
        return kpts

    def _frames_from(self, seek_index: int, skip_pts=frozenset(), *, from_start=False):
        """Frames (PyAV VideoFrames, display order) after seeking to the keyframe at
        ``seek_index`` (``from_start``: the file reopened and read from its start, no seek);
        packets whose pts is in ``skip_pts`` are not decoded, and packets before the keyframe's
        in decode order (a seek that landed early) are read and dropped."""
        name = self.scan.source_name
        if from_start:
            self.close()
        container, st = self._open()
        self._last_pts = None
        landing = None  # after a seek: the keyframe's pts, until the first packet is read
        try:
            if not from_start:
                container.seek(self._seek_target(seek_index), stream=st, backward=True,
                               any_frame=False)
                self.counters["seeks"] += 1
                landing = int(self.scan.pts[seek_index])
        except Exception as e:  # noqa: BLE001
            if seek_index != 0:
                raise av_error(name, e, f"seek to frame {seek_index} failed") from None
            # unseekable at the start: reopen
            self.close()
            container, st = self._open()
        counters = self.counters
        drop = ()  # pts of the packets before the keyframe's where the seek landed early
        bad = 0
        demux = container.demux(st)
        while True:
            try:
                pkt = next(demux)
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001 — a damaged file
                raise av_error(name, e, "reading packets failed") from None
            if pkt.pts is not None:
                self._last_pts = pkt.pts
            if landing is not None:
                drop = self._before_keyframe(pkt.pts, landing)
                landing = None
            if drop:
                if pkt.pts in drop:
                    counters["dropped"] += 1
                    continue
                drop = ()  # the keyframe (or a packet the scan does not hold): decode from here
            if skip_pts and pkt.pts in skip_pts:
                continue
            counters["packets"] += 1
            try:
                frames = st.codec_context.decode(pkt)
            except Exception as e:  # noqa: BLE001
                bad += 1
                if bad > _MAX_BAD_PACKETS:
                    raise av_error(name, e, "too many undecodable packets") from None
                self.damaged = f"a packet failed to decode and was skipped ({e})"
                continue
            yield from frames

    def _before_keyframe(self, first_pts, kpts: int) -> frozenset:
        """Pts of the packets from ``first_pts`` (the first packet after a seek) up to the
        keyframe ``kpts``'s packet in decode order: empty unless the seek landed early."""
        if first_pts is None or first_pts == kpts:
            return frozenset()
        p0, kpos = self._decode_position(first_pts), self._decode_position(kpts)
        if p0 is None or kpos is None or p0 >= kpos:
            return frozenset()
        return frozenset(self.scan.decode_pts[p0:kpos].tolist())

    def _seek_cheaper(self, t: int, last: int, needed) -> bool:
        """Whether reaching display index ``t`` from the current pass (``last``: the display
        index of its last frame) is cheaper by a seek to ``t``'s keyframe than by decoding on.
        No keyframe between: never (decoding on is the way there). Otherwise: when more than
        :data:`SEEK_COST` packets that would be decoded (``needed``: the running count of such
        packets in decode order, None when every packet is) lie between the pass's position and
        that keyframe's packet."""
        kf = self.scan.keyframe_at_or_before(t)
        if kf <= last:
            return False
        kpos = self._decode_position(int(self.scan.pts[kf]))
        at = self._decode_position(self._last_pts)
        if kpos is None or at is None:  # no packet order: count the frames between
            return kf - last - 1 > SEEK_COST
        if at >= kpos - 1:
            return False
        extra = (kpos - 1 - at) if needed is None else int(needed[kpos - 1] - needed[at])
        return extra > SEEK_COST

    def decode(self, targets, *, output: str, chw: bool, out, slots) -> list[int]:
        """:meth:`VideoBackend.decode <._backend.VideoBackend.decode>` into a numpy ``out``;
        every target is delivered (a frame that cannot be decoded raises)."""
        name = self.scan.source_name
        shape = tuple(out.shape[1:])
        pos = {t: i for i, t in enumerate(targets)}
        for t, frame in self.iter_frames(targets):
            a = frame_to_array(frame, output, name)
            if chw and output == "rgb":
                a = np.moveaxis(a, -1, 0)
            if a.shape != shape:
                raise UnsupportedFormatError(
                    name,
                    f"frame {t} has shape {a.shape}, the stream says {shape} (size change mid-stream)",
                )
            for r in slots[pos[t]]:
                out[r] = a
        return []

    def iter_frames(self, targets):
        """Yield ``(index, av.VideoFrame)`` for the sorted, unique display ``targets``."""
        with self._lock:
            yield from self._iter_frames(list(targets))

    def _iter_frames(self, targets):
        scan = self.scan
        p2i = scan.pts_to_index
        kfs = scan.keyframe_indices.tolist()
        name = scan.source_name
        mask = skipped_mask(scan, targets)
        skip = frozenset()
        needed = None
        if mask is not None and mask.any():
            skip = frozenset(scan.decode_pts[mask].tolist())
            needed = np.cumsum(~mask)
        gen = None
        last = -1  # display index of the last decoded frame on the current generator
        ti = 0
        reseek = True
        while ti < len(targets):
            t = targets[ti]
            if reseek or last >= t:
                seek_kf, from_start = scan.keyframe_at_or_before(t), False
                while True:
                    gen = self._frames_from(seek_kf, skip, from_start=from_start)
                    first = None
                    for f in gen:
                        idx = p2i.get(f.pts)
                        if idx is not None:
                            first = (idx, f)
                            break
                    if first is not None and first[0] <= t:
                        break
                    if from_start:
                        raise CorruptDataError(name, (
                            "no decodable frame in the file" if first is None else
                            f"frame {t} cannot be decoded (first frame reachable is {first[0]})"
                        ))
                    # landed after the wanted frame, or on nothing decodable: one keyframe
                    # further back, and before the first one the file from its start
                    k = kfs.index(seek_kf) if seek_kf in kfs else 0
                    if k == 0:
                        from_start = True
                    else:
                        seek_kf = kfs[k - 1]
                pending = [first]
            else:
                pending = []
            reseek = False
            while ti < len(targets):
                t = targets[ti]
                if pending:
                    idx, f = pending.pop()
                else:
                    f = next(gen, None)
                    if f is None:
                        raise CorruptDataError(
                            name,
                            f"frame {t} of {scan.num_frames} could not be decoded "
                            "(truncated or corrupt data)",
                        )
                    idx = p2i.get(f.pts)
                    if idx is None:
                        continue
                last = idx
                if idx < t:
                    continue
                if idx > t:
                    raise CorruptDataError(
                        name,
                        f"frame {t} was not produced by the decoder (got frame {idx} after it)",
                    )
                yield t, f
                ti += 1
                if ti < len(targets) and self._seek_cheaper(targets[ti], last, needed):
                    reseek = True
                    break


def frame_to_array(frame, output: str, name: str) -> np.ndarray:
    """A PyAV frame as ``rgb24`` [H, W, 3] or NV12 [H*3/2, W] numpy uint8."""
    try:
        if output == "nv12":
            return frame.to_ndarray(format="nv12")
        return frame.to_ndarray(format="rgb24")
    except DecodeError:
        raise
    except Exception as e:  # noqa: BLE001
        raise av_error(name, e, "pixel conversion failed") from None
