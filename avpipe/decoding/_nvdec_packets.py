"""Packet-level NVDEC decoding: feed only the packets a request needs.

PyNvVideoCodec's ``SimpleDecoder`` decodes every frame from the keyframe before a request to its
last frame. For a sparse request (a 16-frame clip with stride 4, a few uniform frames) most of
those frames are only needed as references, and about half of them (x264's default B-frames) are
not even that: no picture references them (:mod:`._nal`). This decoder demuxes with
PyNvVideoCodec, skips every packet before the keyframe and every disposable packet that is not
wanted, and hands the rest to one NVDEC session per thread, reused across files.

The session runs with zero display latency (``DisplayDecodeLatencyType.ZERO``) and every packet
is marked ``ENDOFPICTURE``: NVDEC then returns each picture from the very ``Decode`` call that
fed its packet, in decode order. So the frame of packet *k* is known without trusting
timestamps (PyNvVideoCodec re-labels them), nothing stays queued between requests, and a request
ends as soon as its last target is decoded. The packet order of PyNvVideoCodec's demuxer is
checked against the scan's (PyAV) packet by packet; any disagreement raises
:class:`PacketPathError`, and the caller falls back to the ``SimpleDecoder`` path.
"""

from __future__ import annotations

import threading

import numpy as np

from ._nvdec_caps import pynvc
from ._video_scan import StreamScan

__all__ = ["PacketPathError", "PacketDecoder", "thread_packet_decoder"]

_local = threading.local()


class PacketPathError(RuntimeError):
    """The packet path cannot serve this request; use the SimpleDecoder path instead."""


class PacketDecoder:
    """One NVDEC session (per thread and GPU), re-used while codec and size stay the same."""

    def __init__(self, gpu: int, stream_ptr: int):
        self.gpu = gpu
        self.stream_ptr = stream_ptr
        self._dec = None
        self._key = None

    def _decoder(self, nvc, codec_id, width: int, height: int):
        key = (str(codec_id), width, height)
        if self._dec is None or self._key != key:
            self._dec = None
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
        next item is requested. Targets the decoder never produced are not yielded."""
        nvc = pynvc()
        dpts = scan.decode_pts
        disp = scan.disposable
        if dpts is None or disp is None:
            raise PacketPathError("the scan has no packet order")
        want = {int(scan.pts[t]): int(t) for t in targets}
        kf = scan.keyframe_at_or_before(int(targets[0]))
        pos = np.nonzero(dpts == scan.pts[kf])[0]
        if pos.size == 0:
            raise PacketPathError("keyframe not found in the packet order")
        start = int(pos[0])
        remaining = set(want.values())
        try:
            dmx = nvc.CreateDemuxer(filename=path)
        except Exception as e:  # noqa: BLE001
            raise PacketPathError(f"CreateDemuxer failed: {e}") from None
        dec = self._decoder(nvc, dmx.GetNvCodecId(), scan.width, scan.height)
        end_of_picture = nvc.VideoPacketFlag.ENDOFPICTURE
        offset = None
        k = -1
        n = int(dpts.shape[0])
        for pkt in dmx:
            if pkt.bsl == 0:
                break
            k += 1
            if k >= n:
                raise PacketPathError("more packets than the scan found")
            if offset is None:
                offset = int(pkt.pts) - int(dpts[0])
            p = int(dpts[k])
            if int(pkt.pts) - offset != p:
                raise PacketPathError(f"packet {k}: pts {pkt.pts} != scan {p} (+{offset})")
            if k < start or (disp[k] and p not in want):
                continue
            pkt.decode_flag = end_of_picture
            frames = dec.Decode(pkt)
            if len(frames) > 1:  # zero latency is not honoured: the path cannot map frames
                self._dec = None
                raise RuntimeError(f"packet {k} gave {len(frames)} frames (not zero-latency)")
            idx = want.get(p)
            if frames and idx in remaining:
                remaining.discard(idx)
                yield idx, frames[0]
                if not remaining:
                    return


def thread_packet_decoder(gpu: int, stream_ptr: int) -> PacketDecoder:
    decs = getattr(_local, "decs", None)
    if decs is None:
        decs = _local.decs = {}
    key = (gpu, stream_ptr)
    d = decs.get(key)
    if d is None:
        d = decs[key] = PacketDecoder(gpu, stream_ptr)
    return d
