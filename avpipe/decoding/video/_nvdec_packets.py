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

The session runs with zero display latency (``DisplayDecodeLatencyType.ZERO``): NVDEC returns
every picture in decode order, nothing reordered. Packets read from the file go to NVDEC in
chunks of ``AVPIPE_NVDEC_CHUNK`` (default 16) packets per ``Decode`` call, and an end-of-stream
packet ends each request; pictures come out one per packet, in the order fed, so the frame of
each packet is known without trusting timestamps (PyNvVideoCodec re-labels them), and the count
is checked. Chunks matter: one packet per call (``AVPIPE_NVDEC_CHUNK=1``, each picture out at the
next call, or each call marked ``ENDOFPICTURE`` and waiting for its own picture) leaves NVDEC
idle between calls, and chunks of 16 give a clearly higher clip rate (``benchmarks/README.md``
has the figures of ``benchmarks/bench_video.py``). A session holds up to one chunk of decoded frames at a time
(PyNvVideoCodec's output buffers), so memory per thread is about ``chunk + 1`` frames.
Demuxer-fed packets go one per call, marked ``ENDOFPICTURE``, and the demuxer's packet order is
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

__all__ = ["PacketPathError", "PacketDecoder", "thread_packet_decoder", "packet_feed"]

_local = threading.local()


class PacketDecoder:
    """One NVDEC session (per thread and GPU), re-used while codec and size stay the same."""

    def __init__(self, gpu: int, stream_ptr: int):
        self.gpu = gpu
        self.stream_ptr = stream_ptr
        self._dec = None
        self._key = None

    def drop(self):
        """Forget the session (after an error, or with pictures left in its parser): it is never
        fed again; the next request opens a fresh one."""
        self._dec, self._key = None, None

    def _decoder(self, nvc, codec_id, width: int, height: int):
        key = (str(codec_id), width, height)
        if self._dec is None or self._key != key:
            self.drop()
            self._dec = nvc.CreateDecoder(
                gpuid=self.gpu,
                codec=codec_id,
                cudacontext=0,
                cudastream=self.stream_ptr,
                usedevicememory=True,
                latency=nvc.DisplayDecodeLatencyType.ZERO,
            )
            self._key = key
        return self._dec

    def frames(self, path: str, scan: StreamScan, targets):
        """Yield ``(display index, frame)`` for the sorted unique ``targets``, in decode order;
        each frame (a PyNvVideoCodec DecodedFrame, NV12 in device memory) is valid until the
        next item is requested. Targets the decoder never produced are not yielded. Packets are
        read from the file where the scan located them, else from PyNvVideoCodec's demuxer."""
        nvc = pynvc()
        remaining = {int(t) for t in targets}
        if scan.packet_pos is not None:
            codec = nvc.cudaVideoCodec.H264 if scan.codec == "h264" else nvc.cudaVideoCodec.HEVC
            dec = self._decoder(nvc, codec, scan.width, scan.height)
            yield from self._chunked(nvc, dec, packet_feed(path, scan, targets), remaining)
            return
        dmx, packets = self._demuxed(nvc, path, scan, targets)
        dec = self._decoder(nvc, dmx.GetNvCodecId(), scan.width, scan.height)
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

    def _chunked(self, nvc, dec, feed, remaining):
        """:meth:`frames` for packets read from the file: a chunk of packets per ``Decode`` call,
        then an end-of-stream flush. A zero-latency session returns every picture in decode
        order, each as soon as the next one starts (the last at the flush), so the i-th picture
        out is the i-th packet fed; the count is checked at the end."""
        expected = [idx for _, _, idx in feed]
        pos = 0
        complete = False
        chunk = _chunk_size()
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
                        raise PacketPathError(f"more pictures than the {len(feed)} packets fed")
                    idx = expected[pos]
                    pos += 1
                    if idx in remaining:
                        remaining.discard(idx)
                        yield idx, frame
            if pos != len(expected):
                raise PacketPathError(f"{len(feed)} packets gave {pos} pictures")
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


def _chunk_size() -> int:
    return settings.nvdec_chunk()


def thread_packet_decoder(gpu: int, stream_ptr: int) -> PacketDecoder:
    decs = getattr(_local, "decs", None)
    if decs is None:
        decs = _local.decs = {}
    key = (gpu, stream_ptr)
    d = decs.get(key)
    if d is None:
        d = decs[key] = PacketDecoder(gpu, stream_ptr)
    return d
