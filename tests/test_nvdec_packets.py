"""The NVDEC packet path's bookkeeping, against a stand-in for PyNvVideoCodec (no GPU needed):
which packets reach the decoder, and which frame is which."""

from __future__ import annotations

import dataclasses
import types

import av
import numpy as np
import pytest

from avpipe._source import open_source
from avpipe.decoding import _nvdec_packets as NP
from avpipe.decoding._video_scan import _scan_stream


class FakeNvc:
    """Demuxer over PyAV packets (decode order); a zero-latency decoder: one frame per picture
    packet, returned by the call that fed it, labelled with that packet's pts."""

    class VideoPacketFlag:
        ENDOFPICTURE = 4

    class DisplayDecodeLatencyType:
        ZERO = 2

    class cudaVideoCodec:  # noqa: N801
        H264, HEVC = "H264", "HEVC"

    class PacketData:
        pass

    def __init__(self, path, shift=0, drop=None):
        self.path, self.shift, self.drop = path, shift, drop
        self.fed = []
        with av.open(path) as c:  # decode-order pts, for packets fed from memory
            self.dpts = [int(p.pts) for p in c.demux(c.streams.video[0]) if p.size]

    def CreateDemuxer(self, filename):  # noqa: N802
        with av.open(filename) as c:
            pkts = [p for p in c.demux(c.streams.video[0]) if p.size]
            metas = [types.SimpleNamespace(pts=int(p.pts) + self.shift, bsl=p.size, decode_flag=0)
                     for p in pkts]
        if self.drop is not None:
            del metas[self.drop]
        metas.append(types.SimpleNamespace(pts=0, bsl=0, decode_flag=0))  # end of stream

        class Dmx:
            def __iter__(self_inner):
                return iter(metas)

            def GetNvCodecId(self_inner):  # noqa: N802
                return "H264"

        return Dmx()

    def CreateDecoder(self, **kw):  # noqa: N802
        assert kw["latency"] == self.DisplayDecodeLatencyType.ZERO
        fake = self

        class Dec:
            def Decode(self_inner, pkt):  # noqa: N802
                assert pkt.decode_flag == fake.VideoPacketFlag.ENDOFPICTURE
                if isinstance(pkt, fake.PacketData):  # from memory: pts is the packet's index
                    assert pkt.bsl > 0 and pkt.bsl_data
                    p = fake.dpts[pkt.pts]
                else:
                    p = pkt.pts - fake.shift
                fake.fed.append(p)
                return [("frame", p)]

        return Dec()


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("np") / "b.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=25)
        s.width, s.height, s.pix_fmt = 160, 144, "yuv420p"
        s.options = {"bf": "3", "g": "20", "threads": "1"}
        for i in range(60):
            img = np.full((144, 160, 3), (i * 4) % 256, np.uint8)
            img[:, : (i * 2) % 160] = 255 - img[:, : (i * 2) % 160]
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return str(path), _scan_stream(open_source(path), "b.mp4")


@pytest.mark.parametrize("feed,shift", [("file", 0), ("demuxer", 0), ("demuxer", -1024)])
def test_frames_map_by_packet_and_skip_what_is_not_needed(clip, monkeypatch, feed, shift):
    """Packets read from the file by position (MP4: the default) or from PyNvVideoCodec's
    demuxer (AVPIPE_NVDEC_PACKETS=1 elsewhere) reach the decoder the same way."""
    path, scan = clip
    assert scan.packet_pos is not None
    if feed == "demuxer":
        scan = dataclasses.replace(scan, packet_pos=None)
    fake = FakeNvc(path, shift=shift)
    monkeypatch.setattr(NP, "pynvc", lambda: fake)
    targets = [23, 27, 31, 35, 39]
    got = list(NP.PacketDecoder(0, 0).frames(path, scan, targets))
    assert [i for i, _ in got] != [] and sorted(i for i, _ in got) == targets
    for idx, frame in got:  # each yielded frame is the picture of that display index
        assert frame[1] == int(scan.pts[idx])
    kf = scan.keyframe_at_or_before(targets[0])
    fed = set(fake.fed)
    assert min(fake.fed) >= int(scan.pts[kf]) or int(scan.pts[kf]) in fed
    wanted = {int(scan.pts[t]) for t in targets}
    skipped = {int(p) for p, d in zip(scan.decode_pts, scan.disposable) if d} - wanted
    assert skipped and not (skipped & fed)  # disposable, unwanted packets never reach NVDEC
    # nothing before the keyframe in decode order is fed, and decoding stops at the last target
    order = [int(p) for p in scan.decode_pts]
    assert order.index(fake.fed[0]) == order.index(int(scan.pts[kf]))
    assert fake.fed[-1] in wanted


def test_packet_order_disagreement_is_refused(clip, monkeypatch):
    path, scan = clip
    scan = dataclasses.replace(scan, packet_pos=None)  # the demuxer's order is checked
    monkeypatch.setattr(NP, "pynvc", lambda: FakeNvc(path, drop=5))
    with pytest.raises(NP.PacketPathError, match="packet 5"):
        list(NP.PacketDecoder(0, 0).frames(path, scan, [40, 44]))
