"""The CPU backend: PyAV (FFmpeg) decode with keyframe seeks, frames matched by pts.

To reach a frame the backend seeks to the keyframe at or before it (``backward=True,
any_frame=False``) and decodes forward, picking frames whose pts equal the scan's pts for the
wanted indices. When the first frame after a seek is already later than the wanted one (open
GOP leading pictures, an imprecise container index) it seeks one keyframe further back. Between
two wanted frames it keeps decoding forward unless a keyframe lies in between, where a seek is
cheaper. Every frame of a request is decoded at most once, and *disposable* packets (pictures
no other picture references, see :mod:`._nal`) that are not wanted are not decoded at all.
"""

from __future__ import annotations

import threading

import numpy as np

from ...errors import CorruptDataError, DecodeError, UnsupportedFormatError
from ._plan import skippable_pts
from ._scan import StreamScan, av_error, open_container

__all__ = ["PyAVBackend"]

_MAX_BAD_PACKETS = 32


class PyAVBackend:
    """The CPU backend (a :class:`._backend.VideoBackend`)."""

    name = "pyav"

    def __init__(self, source, scan: StreamScan, *, threads: int = 0):
        self._source = source
        self.scan = scan
        self._threads = int(threads)
        self._container = None
        self._stream = None
        self._lock = threading.Lock()
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
    def _seek_target(self, seek_index: int) -> int:
        """Where to seek for the keyframe at display index ``seek_index``: the earlier of its
        pts and its dts. FFmpeg compares a seek's timestamp with the packets' decode times in
        some demuxers (MPEG-TS, the generic seek): seeking to the pts of a keyframe that B-frames
        follow lands just after it there, so the first GOP could not be reached at all."""
        scan = self.scan
        kpts = int(scan.pts[seek_index])
        if scan.decode_pts is not None and scan.dts_sorted is not None:
            hit = np.flatnonzero(scan.decode_pts == kpts)
            if hit.size and hit[0] < len(scan.dts_sorted):
                return min(kpts, int(scan.dts_sorted[hit[0]]))
        return kpts

    def _frames_from(self, seek_index: int, skip_pts=frozenset(), *, from_start=False):
        """Frames (PyAV VideoFrames, display order) after seeking to the keyframe at
        ``seek_index`` (``from_start``: the file reopened and read from its start, no seek);
        packets whose pts is in ``skip_pts`` are not decoded."""
        name = self.scan.source_name
        if from_start:
            self.close()
        container, st = self._open()
        try:
            if not from_start:
                container.seek(self._seek_target(seek_index), stream=st, backward=True,
                               any_frame=False)
        except Exception as e:  # noqa: BLE001
            if seek_index != 0:
                raise av_error(name, e, f"seek to frame {seek_index} failed") from None
            # unseekable at the start: reopen
            self.close()
            container, st = self._open()
        bad = 0
        demux = container.demux(st)
        while True:
            try:
                pkt = next(demux)
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001 — a damaged file
                raise av_error(name, e, "reading packets failed") from None
            if skip_pts and pkt.pts in skip_pts:
                continue
            try:
                frames = st.codec_context.decode(pkt)
            except Exception as e:  # noqa: BLE001
                bad += 1
                if bad > _MAX_BAD_PACKETS:
                    raise av_error(name, e, "too many undecodable packets") from None
                self.damaged = f"a packet failed to decode and was skipped ({e})"
                continue
            yield from frames

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
        skip = skippable_pts(scan, targets)
        gen = None
        last = -1  # display index of the last decoded frame on the current generator
        ti = 0
        while ti < len(targets):
            t = targets[ti]
            kf = scan.keyframe_at_or_before(t)
            if gen is None or last >= t or kf > last:
                seek_kf, from_start = kf, False
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
                if ti < len(targets):
                    nxt = targets[ti]
                    if scan.keyframe_at_or_before(nxt) > last:
                        break  # a keyframe lies between: seek instead of decoding through


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
