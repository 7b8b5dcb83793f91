"""Packet-level NVDEC decoding: feed only the packets a request needs.

PyNvVideoCodec's ``SimpleDecoder`` decodes every frame from the keyframe before a request to its
last frame. For a sparse request (a 16-frame clip with stride 4, a few uniform frames) most of
those frames are only needed as references, and about half of them (x264's default B-frames) are
not even that: no picture references them (:mod:`._nal`). This decoder feeds only the packets
from the keyframe on that are referenced or wanted to one NVDEC session per thread, reused
across files.

Where the packet scan located every packet in the file (MP4/MOV and the like: ``packet_pos``),
the packets are read straight from the file (one ``pread`` per request, no demuxer) and
converted to Annex B (start codes; parameter sets from the container's avcC / hvcC record
first); elsewhere PyNvVideoCodec's demuxer reads the file from its start for every request.
The file-fed path is the default for H.264/HEVC in MP4/MOV; the demuxer-fed one is opt-in
(``AVPIPE_NVDEC_PACKETS=1``); :mod:`._nvdec` says when each is used.

Packets read from the file go to NVDEC in chunks per ``Decode`` call (``AVPIPE_NVDEC_CHUNK``;
by default as many as 32 MiB of decoded frames hold, 16 to 64), and an end-of-stream packet ends
each request. Such a request goes to a session at the codec's native display latency where it
can: PyNvVideoCodec hands out each picture a few pictures after it was decoded, in display
order, so NVDEC already works on the next pictures while a decoded one is copied out (with zero
latency every picture is copied as soon as it is decoded, and the session's NVDEC queue empties
at each one). Display order is the order of the pictures' presentation timestamps, so the i-th
picture out is the fed packet with the i-th smallest pts (:func:`display_order`; it rests on
the container's pts following the bitstream's picture order). A request whose fed pts show no
B-frame reordering, or show leading pictures of the start picture (an HEVC CRA's, which such a
session drops), goes to a zero-latency session instead (:func:`shows_display_order`), whose
pictures come out in decode order, one per packet fed. Either way each frame is known without
trusting the timestamps PyNvVideoCodec puts on frames (it re-labels them), and the count is
checked; a display-order count that does not add up raises :class:`DisplayOrderError`, and the
caller serves the request, and the file's later ones, in decode order. Chunks and latency both
matter (docs/how-it-works.md, "Measured trade-offs"): one packet per call (``AVPIPE_NVDEC_CHUNK=1``)
leaves NVDEC idle between calls; 64 packets per call and the native latency each give a few percent
more clips/s than 16 and zero latency. A session holds up to one chunk of decoded frames at a time
(PyNvVideoCodec's output buffers), so memory per thread is about ``chunk`` frames plus the display
delay's few.
Demuxer-fed packets go one per call, marked ``ENDOFPICTURE``, to a zero-latency session (each
picture out at once, in decode order), and the demuxer's packet order is
checked against the scan's (PyAV) packet by packet. Anything unexpected raises
:class:`PacketPathError`; the caller then serves the request with the ``SimpleDecoder`` path.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from ... import settings
from ._nal import to_annexb
from ._nvdec_caps import pynvc
from ._plan import PacketPathError, plan_request
from ._scan import StreamScan

__all__ = [
    "PacketPathError",
    "PacketDecoder",
    "thread_packet_decoder",
    "packet_feed",
    "display_order",
    "shows_display_order",
    "DisplayOrderError",
]


class DisplayOrderError(PacketPathError):
    """A display-order (native-latency) session's pictures did not add up to the packets fed,
    or two fed packets share a pts: the request can still go in decode order."""


_local = threading.local()


class PacketDecoder:
    """One NVDEC session (per thread and GPU), re-used while codec and size stay the same."""

    def __init__(self, gpu: int, stream_ptr: int):
        self.gpu = gpu
        self.stream_ptr = stream_ptr
        self._dec = None
        self._key = None
        self._retired = None  # a dropped session, kept until the next request (see drop)

    def drop(self):
        """Forget the session (after an error, or with pictures left in its parser): it is never
        fed again; the next request opens a fresh one. Its last reference is kept until the next
        request starts: frames it handed out may still be read by work queued on the stream,
        which the caller synchronizes after each request."""
        if self._dec is not None:
            self._retired = self._dec
        self._dec, self._key = None, None

    def _decoder(self, nvc, codec_id, width: int, height: int, latency):
        key = (str(codec_id), width, height, str(latency))
        if self._dec is None or self._key != key:
            if self._dec is not None:  # healthy, its frames all read: released now
                self._dec, self._key = None, None
            self._dec = nvc.CreateDecoder(
                gpuid=self.gpu,
                codec=codec_id,
                cudacontext=0,
                cudastream=self.stream_ptr,
                usedevicememory=True,
                latency=latency,
            )
            self._key = key
        return self._dec

    def frames(self, path: str, scan: StreamScan, targets, *, in_display_order: bool = True):
        """Yield ``(display index, frame)`` for the sorted unique ``targets``: in display order
        where the packets are read from the file and both ``in_display_order`` and
        :func:`shows_display_order` allow it (a native-latency session), else in decode order
        (zero latency); each frame (a PyNvVideoCodec DecodedFrame, NV12 in device memory) is
        valid until the next item is requested. Targets the decoder never produced are not
        yielded. Packets are read from the file where the scan located them, else from
        PyNvVideoCodec's demuxer."""
        nvc = pynvc()
        self._retired = None  # the caller synchronized its stream after the last request
        remaining = {int(t) for t in targets}
        if scan.packet_pos is not None:
            codec = nvc.cudaVideoCodec.H264 if scan.codec == "h264" else nvc.cudaVideoCodec.HEVC
            feed = packet_feed(path, scan, targets)
            ordered = in_display_order and shows_display_order(feed, scan)
            lat = nvc.DisplayDecodeLatencyType
            dec = self._decoder(nvc, codec, scan.width, scan.height,
                                lat.NATIVE if ordered else lat.ZERO)  # fmt: skip
            yield from self._chunked(nvc, dec, feed, remaining, scan, ordered)
            return
        dmx, packets = self._demuxed(nvc, path, scan, targets)
        zero = nvc.DisplayDecodeLatencyType.ZERO
        dec = self._decoder(nvc, dmx.GetNvCodecId(), scan.width, scan.height, zero)
        end_of_picture = nvc.VideoPacketFlag.ENDOFPICTURE
        for k, pkt, idx in packets:
            pkt.decode_flag = end_of_picture
            frames = dec.Decode(pkt)
            if len(frames) > 1:  # zero latency is not honoured: the path cannot map frames
                self.drop()
                raise RuntimeError(f"packet {k} gave {len(frames)} frames (not zero-latency)")
            if frames and idx in remaining:
                remaining.discard(idx)
                yield idx, frames[0]
                if not remaining:
                    return

    def _chunked(self, nvc, dec, feed, remaining, scan: StreamScan, in_display_order: bool):
        """:meth:`frames` for packets read from the file: a chunk of packets per ``Decode`` call,
        then an end-of-stream flush. A native-latency session returns the pictures in display
        order, the last ones at the flush, so the i-th picture out is the fed packet with the
        i-th smallest pts (:func:`display_order`); a zero-latency one in decode order, each as
        soon as the next one starts, so the i-th picture out is the i-th packet fed. The count
        is checked at the end."""
        if in_display_order:
            expected = display_order(feed, scan)
        else:
            expected = [idx for _, _, idx in feed]
        miscount = DisplayOrderError if in_display_order else PacketPathError
        pos = 0
        complete = False
        chunk = _chunk_size(scan)
        calls = [feed[c : c + chunk] for c in range(0, len(feed), chunk)] + [None]
        try:
            for part in calls:
                pd = nvc.PacketData()
                if part is not None:
                    buf = np.frombuffer(b"".join(data for _, data, _ in part), dtype=np.uint8)
                    pd.bsl_data = int(buf.ctypes.data)
                    pd.bsl = int(buf.size)
                    pd.pts = int(part[0][0])
                else:  # flush: the last picture, and the parser starts afresh on the next request
                    pd.bsl_data, pd.bsl = 0, 0
                    pd.decode_flag = nvc.VideoPacketFlag.ENDOFSTREAM
                for frame in dec.Decode(pd):
                    if pos >= len(expected):
                        raise miscount(f"more pictures than the {len(feed)} packets fed")
                    idx = expected[pos]
                    pos += 1
                    if idx in remaining:
                        remaining.discard(idx)
                        yield idx, frame
            if pos != len(expected):
                raise miscount(f"{len(feed)} packets gave {pos} pictures")
            complete = True
        finally:
            if not complete:
                self.drop()  # it raised, or its parser holds pictures: never fed again

    @staticmethod
    def _demuxed(nvc, path: str, scan: StreamScan, targets):
        """PyNvVideoCodec's demuxer and its packets to feed, as ``(packet index, PacketData,
        display index or None)``; its packet order is checked against the scan's, packet by
        packet."""
        plan = plan_request(scan, targets)
        dpts = scan.decode_pts
        try:
            dmx = nvc.CreateDemuxer(filename=path)
        except Exception as e:  # noqa: BLE001
            raise PacketPathError(f"CreateDemuxer failed: {e}") from None

        def packets():
            offset = None
            n = int(dpts.shape[0])
            for k, pkt in enumerate(dmx):
                if pkt.bsl == 0:
                    return
                if k >= n:
                    raise PacketPathError("more packets than the scan found")
                if offset is None:
                    offset = int(pkt.pts) - int(dpts[0])
                p = int(dpts[k])
                if int(pkt.pts) - offset != p:
                    raise PacketPathError(f"packet {k}: pts {pkt.pts} != scan {p} (+{offset})")
                if k < plan.start or not plan.needed(k):
                    continue
                yield k, pkt, plan.want.get(p)

        return dmx, packets()


def packet_feed(path: str, scan: StreamScan, targets):
    """What the packet path hands NVDEC for the sorted unique display indices ``targets``:
    ``[(packet index, Annex B bytes, display index or None)]`` in decode order, from the
    keyframe at or before the first target to the last target's packet, skipping disposable
    packets that are not targets. The first item starts with the parameter sets."""
    if scan.packet_pos is None:
        raise PacketPathError("the scan did not locate the packets")
    plan = plan_request(scan, targets)  # the same plan as the demuxer feed and PyAV
    dpts, want = scan.decode_pts, plan.want
    ks = plan.packets
    at = scan.packet_pos[ks]
    size = scan.packet_size[ks]
    lo, hi = int(at.min()), int((at + size).max())
    with open(path, "rb", buffering=0) as f:
        span = os.pread(f.fileno(), hi - lo, lo)
    if len(span) != hi - lo:
        raise PacketPathError("the file is shorter than its packet index")
    feed = []
    view = memoryview(span)  # packets as views of the one read: to_annexb copies each once
    for k, a, n in zip(ks, at.tolist(), size.tolist()):
        data = to_annexb(view[a - lo : a - lo + n], scan.nal_size)
        if data is None:
            raise PacketPathError(f"packet {k}: NAL length prefixes do not add up")
        if not feed:
            data = scan.parameter_sets + data
        feed.append((k, data, want.get(int(dpts[k]))))
    return feed


def display_order(feed, scan: StreamScan) -> list:
    """The display indices (None for pictures fed only as references) of ``feed``'s pictures in
    the order a display-order session returns them: by presentation timestamp. Two fed packets
    with one pts have no defined order: :class:`DisplayOrderError` (decode order serves them).

    This rests on the container's pts following the bitstream's display order (its picture
    order counts), as encoders' muxers write them; :func:`shows_display_order` keeps the
    requests where the pts give no sign of it in decode order."""
    dpts = scan.decode_pts
    keyed = sorted((int(dpts[k]), k, idx) for k, _, idx in feed)
    for a, b in zip(keyed, keyed[1:]):
        if a[0] == b[0]:
            raise DisplayOrderError(f"packets {a[1]} and {b[1]} share pts {a[0]}")
    return [idx for _, _, idx in keyed]


def shows_display_order(feed, scan: StreamScan) -> bool:
    """Whether ``feed`` goes to a display-order session: its pts show the reordering of
    B-frames (some fed packet's pts below an earlier one's; without it, a display-order session
    would gain nothing to be sure of, and pts equal to decode times, as some remuxes write for
    B-frame streams, would name the wrong pictures), and none is below the first packet's (the
    start picture's leading pictures, such as an HEVC CRA's, which that session drops)."""
    dpts = scan.decode_pts
    pts = [int(dpts[k]) for k, _, _ in feed]
    if not pts or min(pts) < pts[0]:
        return False
    return any(b < a for a, b in zip(pts, pts[1:]))


# Decoded frames a chunk may hold by default (PyNvVideoCodec keeps a chunk's frames until the
# next call): 64 packets of 640x360, 16 of 1080p and above.
_CHUNK_BYTES = 32 << 20
_CHUNK_MIN, _CHUNK_MAX = 16, 64


def _chunk_size(scan: StreamScan) -> int:
    """Packets per ``Decode`` call: ``AVPIPE_NVDEC_CHUNK``, or as many frames as
    :data:`_CHUNK_BYTES` hold (NV12), from 16 to 64."""
    n = settings.nvdec_chunk()
    if n is not None:
        return n
    frame = max(1, int(scan.width) * int(scan.height) * 3 // 2)
    return max(_CHUNK_MIN, min(_CHUNK_MAX, _CHUNK_BYTES // frame))


def thread_packet_decoder(gpu: int, stream_ptr: int) -> PacketDecoder:
    decs = getattr(_local, "decs", None)
    if decs is None:
        decs = _local.decs = {}
    key = (gpu, stream_ptr)
    d = decs.get(key)
    if d is None:
        d = decs[key] = PacketDecoder(gpu, stream_ptr)
    return d
