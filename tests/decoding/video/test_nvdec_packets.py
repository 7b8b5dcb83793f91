"""The NVDEC packet path's bookkeeping, against a stand-in for PyNvVideoCodec (no GPU needed):
which packets reach the decoder, and which frame is which."""

from __future__ import annotations

import ctypes
import dataclasses
import types

import av
import numpy as np
import pytest

from avpipe._source import open_source
from avpipe.decoding.video import _nvdec_packets as NP
from avpipe.decoding.video._nal import to_annexb
from avpipe.decoding.video._scan import _scan_stream


class FakeNvc:
    """Demuxer over PyAV packets (decode order); a decoder with one frame per picture fed,
    labelled with its packet's pts: at zero latency in decode order (demuxer-fed: returned by
    the call that fed it; from memory: when the next picture starts), at native latency in
    display order, ``delay`` pictures late; the rest at the end-of-stream flush."""

    class VideoPacketFlag:
        ENDOFPICTURE, ENDOFSTREAM = 4, 1

    class DisplayDecodeLatencyType:
        NATIVE, ZERO = 0, 2

    class cudaVideoCodec:  # noqa: N801
        H264, HEVC = "H264", "HEVC"

    class PacketData:
        pass

    def __init__(self, path, shift=0, drop=None, lose_picture=None, extra_picture=False, delay=4,
                 lose_native=None):  # fmt: skip
        self.path, self.shift, self.drop, self.lose_picture = path, shift, drop, lose_picture
        self.delay = delay
        self.lose_native = lose_native  # a picture only a native-latency session drops
        self.extra_picture = extra_picture  # the flush gives one picture more than was fed
        self.fed, self.calls, self.flushes = [], [], 0
        self.by_slice = {}  # a picture's first slice (NAL bytes) -> its packet's pts
        with av.open(path) as c:  # packets fed from memory are known by their slices
            for p in c.demux(c.streams.video[0]):
                if p.size:
                    for nal in _first_slices(to_annexb(bytes(p), 4)):
                        self.by_slice[nal] = int(p.pts)

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
        native = kw["latency"] == self.DisplayDecodeLatencyType.NATIVE
        assert native or kw["latency"] == self.DisplayDecodeLatencyType.ZERO
        fake = self
        fake.latencies = getattr(fake, "latencies", []) + [kw["latency"]]

        class Dec:
            pending = []  # from memory (no ENDOFPICTURE): a picture waits for the next one

            def Decode(self_inner, pkt):  # noqa: N802
                if isinstance(pkt, fake.PacketData) and pkt.bsl == 0:  # end of stream: flush
                    assert pkt.decode_flag == fake.VideoPacketFlag.ENDOFSTREAM
                    fake.flushes += 1
                    ps, self_inner.pending = self_inner.pending, []
                    if native:
                        ps = sorted(ps)
                    if fake.extra_picture:
                        ps = ps + ps[-1:]
                elif isinstance(pkt, fake.PacketData):  # from memory: Annex B, pictures in a row
                    assert pkt.bsl_data and getattr(pkt, "decode_flag", 0) == 0
                    slices = _first_slices(ctypes.string_at(pkt.bsl_data, pkt.bsl))
                    fake.calls.append(len(slices))
                    held = self_inner.pending + [fake.by_slice[nal] for nal in slices]
                    if native:  # the earliest in display order goes out, `delay` late
                        ps = []
                        while len(held) > fake.delay:
                            held.sort()
                            ps.append(held.pop(0))
                        self_inner.pending = held
                    else:  # decode order, each picture out when the next one starts
                        ps, self_inner.pending = held[:-1], held[-1:]
                else:  # from the demuxer: one picture, out at once
                    assert pkt.decode_flag == fake.VideoPacketFlag.ENDOFPICTURE
                    ps = [pkt.pts - fake.shift]
                if fake.lose_picture is not None and fake.lose_picture in ps:
                    ps.remove(fake.lose_picture)  # a picture NVDEC did not output
                if native and fake.lose_native in ps:
                    ps.remove(fake.lose_native)
                fake.fed.extend(ps)
                return [("frame", p) for p in ps]

        return Dec()


def _first_slices(annexb: bytes) -> list:
    """The first slice NAL of each H.264 picture in an Annex B buffer (first_mb_in_slice 0)."""
    return [nal for nal in annexb.split(b"\x00\x00\x00\x01")[1:]
            if len(nal) > 1 and nal[0] & 0x1F in (1, 5) and nal[1] & 0x80]


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


@pytest.mark.parametrize("chunk", ["1", "3", "16", "1000"])
def test_file_packets_go_in_chunks(clip, monkeypatch, chunk):
    """Packets read from the file reach NVDEC a chunk per Decode call, then one end-of-stream
    flush; frames still map to their packets."""
    path, scan = clip
    monkeypatch.setenv("AVPIPE_NVDEC_CHUNK", chunk)
    fake = FakeNvc(path)
    monkeypatch.setattr(NP, "pynvc", lambda: fake)
    targets = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41]
    got = list(NP.PacketDecoder(0, 0).frames(path, scan, targets))
    assert sorted(i for i, _ in got) == targets
    assert all(frame[1] == int(scan.pts[idx]) for idx, frame in got)
    feed = NP.packet_feed(path, scan, targets)
    size = int(chunk)
    assert fake.calls == [len(feed[c : c + size]) for c in range(0, len(feed), size)]
    assert max(fake.calls) <= size
    assert fake.flushes == 1  # the request ends with an end-of-stream packet


def test_a_chunk_short_of_a_picture_is_refused(clip, monkeypatch):
    """Fewer pictures than packets cannot be mapped: the caller is told, and the session that
    may hold a picture is dropped."""
    path, scan = clip
    targets = [23, 27, 31]
    feed = NP.packet_feed(path, scan, targets)
    lost = int(scan.decode_pts[feed[1][0]])
    monkeypatch.setattr(NP, "pynvc", lambda: FakeNvc(path, lose_picture=lost))
    dec = NP.PacketDecoder(0, 0)
    with pytest.raises(NP.PacketPathError, match="packets gave"):
        list(dec.frames(path, scan, targets))
    assert dec._dec is None  # the next request gets a fresh session


def test_more_pictures_than_packets_is_refused(clip, monkeypatch):
    path, scan = clip
    monkeypatch.setattr(NP, "pynvc", lambda: FakeNvc(path, extra_picture=True))
    dec = NP.PacketDecoder(0, 0)
    with pytest.raises(NP.PacketPathError, match="more pictures"):
        list(dec.frames(path, scan, [23, 27, 31]))
    assert dec._dec is None


def test_a_request_left_early_drops_the_session(clip, monkeypatch):
    """The caller stops after the first frame (its own write failed): the session may hold
    pictures, so the next request gets a fresh one; a request run to its end keeps it."""
    path, scan = clip
    monkeypatch.setattr(NP, "pynvc", lambda: FakeNvc(path))
    dec = NP.PacketDecoder(0, 0)
    list(dec.frames(path, scan, [23, 27, 31]))
    kept = dec._dec
    assert kept is not None
    g = dec.frames(path, scan, [23, 27, 31])
    next(g)
    g.close()
    assert dec._dec is None


class _Frame:
    def __init__(self, shape, strides, luma, chroma):
        self.shape, self.strides, self._p = shape, strides, (luma, chroma)

    def GetPtrToPlane(self, i):  # noqa: N802 — PyNvVideoCodec's name
        return self._p[i]


def test_frame_planes_reads_and_checks_the_layout():
    """NVDEC frames are read by plane pointers only when they describe NV12 of the stream's size."""
    from avpipe.decoding.video._nvdec import frame_planes

    base = 1 << 20
    # 360 rows of luma, chroma right after, pitch 640 (what PyNvVideoCodec 2.2 gives 640x360)
    assert frame_planes(_Frame((540, 640), (640, 1), base, base + 360 * 640), 360, 640) == (
        base, base + 360 * 640, 640,
    )  # fmt: skip
    # a padded pitch and chroma after aligned rows (1080p in 1088-row surfaces)
    f = _Frame((1632, 1920), (2048, 1), base, base + 1088 * 2048)
    assert frame_planes(f, 1080, 1920) == (base, base + 1088 * 2048, 2048)
    bad = [
        _Frame((540, 640), (640, 1), base, base + 359 * 640),  # chroma inside the luma rows
        _Frame((540, 640), (640, 1), base, base + 360 * 640 + 3),  # not on a row start
        _Frame((500, 640), (640, 1), base, base + 360 * 640),  # chroma rows past the frame
        _Frame((540, 320), (640, 1), base, base + 360 * 640),  # narrower than the stream
        _Frame((540, 640), (640, 2), base, base + 360 * 640),  # not byte-packed rows
        _Frame((540, 640), (640, 1), base, base),  # one plane
    ]
    for fr in bad:
        assert frame_planes(fr, 360, 640) is None
    assert frame_planes(object(), 360, 640) is None  # an older PyNvVideoCodec: DLPack instead


def test_which_streams_take_the_packet_path(clip, monkeypatch):
    """By default H.264/HEVC whose packets the scan located (MP4) take the packet path; "1" adds
    demuxer-fed containers, "0" turns it off; small or non-H.264/HEVC streams never take it."""
    from avpipe.decoding.video._nvdec import use_packet_path

    path, scan = clip  # 160x144 H.264 MP4
    mkv = dataclasses.replace(scan, packet_pos=None)
    for mode, mp4_takes, mkv_takes in [(None, True, False), ("auto", True, False),
                                       ("1", True, True), ("on", True, True), ("true", True, True),
                                       ("0", False, False), ("off", False, False),
                                       ("no", False, False)]:  # fmt: skip
        if mode is None:
            monkeypatch.delenv("AVPIPE_NVDEC_PACKETS", raising=False)
        else:
            monkeypatch.setenv("AVPIPE_NVDEC_PACKETS", mode)
        assert use_packet_path(scan, path) is mp4_takes, mode
        assert use_packet_path(mkv, path) is mkv_takes, mode
    monkeypatch.setenv("AVPIPE_NVDEC_PACKETS", "1")
    assert not use_packet_path(scan, None)  # bytes in memory
    assert not use_packet_path(dataclasses.replace(scan, codec="vp9"), path)
    assert not use_packet_path(dataclasses.replace(scan, width=128), path)
    assert not use_packet_path(dataclasses.replace(scan, disposable=None), path)


def test_file_fed_sessions_hand_out_display_order_and_demuxed_ones_decode_order(clip, monkeypatch):
    """File-fed requests go to a native-latency session (pictures out late, in display order);
    the i-th frame out is the fed packet with the i-th smallest pts. Demuxer-fed ones go to a
    zero-latency session. A decoder that hands out pictures later still maps every frame."""
    path, scan = clip
    lat = FakeNvc.DisplayDecodeLatencyType
    targets = [3, 7, 11, 15, 19, 22, 26, 30]
    for delay in (1, 4, 40):
        fake = FakeNvc(path, delay=delay)
        monkeypatch.setattr(NP, "pynvc", lambda fake=fake: fake)
        got = list(NP.PacketDecoder(0, 0).frames(path, scan, targets))
        assert [i for i, _ in got] == targets  # display order: the targets in order
        assert all(frame[1] == int(scan.pts[i]) for i, frame in got), delay
        assert fake.latencies == [lat.NATIVE]
    # decode order on request (the backend's fallback): a zero-latency session, same frames
    fake = FakeNvc(path)
    monkeypatch.setattr(NP, "pynvc", lambda: fake)
    got = list(NP.PacketDecoder(0, 0).frames(path, scan, targets, in_display_order=False))
    assert sorted(i for i, _ in got) == targets
    assert all(frame[1] == int(scan.pts[i]) for i, frame in got)
    assert fake.latencies == [lat.ZERO]
    fake = FakeNvc(path)
    monkeypatch.setattr(NP, "pynvc", lambda: fake)
    demuxed = dataclasses.replace(scan, packet_pos=None)
    list(NP.PacketDecoder(0, 0).frames(path, demuxed, [40, 44]))
    assert fake.latencies == [lat.ZERO]


def test_display_order_sorts_fed_packets_by_pts(clip):
    path, scan = clip
    targets = [5, 9, 26, 30]  # the clip's B-frames come late: 27 is decoded before 26
    feed = NP.packet_feed(path, scan, targets)
    order = NP.display_order(feed, scan)
    assert len(order) == len(feed)
    assert [i for i in order if i is not None] == targets
    fed_pts = sorted(int(scan.decode_pts[k]) for k, _, _ in feed)
    want = {int(scan.pts[t]): t for t in targets}
    assert order == [want.get(p) for p in fed_pts]
    assert [int(scan.decode_pts[k]) for k, _, _ in feed] != fed_pts  # B-frames: orders differ
    dup = dataclasses.replace(scan, decode_pts=np.where(
        np.arange(len(scan.decode_pts)) == feed[1][0], scan.decode_pts[feed[0][0]], scan.decode_pts))
    with pytest.raises(NP.PacketPathError, match="share pts"):
        NP.display_order(feed, dup)


def test_chunks_follow_the_frame_size_unless_set(clip, monkeypatch):
    _, scan = clip
    monkeypatch.delenv("AVPIPE_NVDEC_CHUNK", raising=False)
    size = {(640, 360): 64, (1280, 720): 24, (1920, 1080): 16, (3840, 2160): 16, (160, 144): 64}
    for (w, h), n in size.items():
        s = dataclasses.replace(scan, width=w, height=h)
        assert NP._chunk_size(s) == n, (w, h)
        assert n * w * h * 3 // 2 <= NP._CHUNK_BYTES or n == NP._CHUNK_MIN
    for v in ("auto", "AUTO", ""):
        monkeypatch.setenv("AVPIPE_NVDEC_CHUNK", v)
        assert NP._chunk_size(scan) == 64
    monkeypatch.setenv("AVPIPE_NVDEC_CHUNK", "5")
    assert NP._chunk_size(dataclasses.replace(scan, width=3840, height=2160)) == 5


def test_which_requests_go_in_display_order(clip):
    """Display order where the fed pts show B-frame reordering and none is below the start
    picture's; decode order where they show none (pts equal to decode times would name the
    wrong pictures) or where the start picture has leading pictures."""
    path, scan = clip
    feed = NP.packet_feed(path, scan, [22, 26, 30])  # 27 is fed before 26
    assert NP.shows_display_order(feed, scan)
    assert not NP.shows_display_order(NP.packet_feed(path, scan, [1, 2, 3]), scan)  # in order
    dpts = scan.decode_pts.copy()  # pts equal to decode times: no reordering shown
    flat = dataclasses.replace(scan, decode_pts=np.sort(dpts))
    assert not NP.shows_display_order(feed, flat)
    lead = dpts.copy()  # a picture after the start in decode order, shown before it
    lead[feed[2][0]] = dpts[feed[0][0]] - 1
    assert not NP.shows_display_order(feed, dataclasses.replace(scan, decode_pts=lead))
    assert not NP.shows_display_order([], scan)


def test_one_session_per_latency_and_frames_right_in_both(clip, monkeypatch):
    path, scan = clip
    lat = FakeNvc.DisplayDecodeLatencyType
    fake = FakeNvc(path, delay=2)
    monkeypatch.setattr(NP, "pynvc", lambda: fake)
    pd = NP.PacketDecoder(0, 0)
    for kw in ({}, {"in_display_order": False}, {}, {}):
        got = list(pd.frames(path, scan, [22, 26, 30], **kw))
        assert sorted(i for i, _ in got) == [22, 26, 30]
        assert all(frame[1] == int(scan.pts[i]) for i, frame in got)
    list(pd.frames(path, scan, [1, 2, 3]))  # no reordering in the feed: decode order
    assert fake.latencies == [lat.NATIVE, lat.ZERO, lat.NATIVE, lat.ZERO]


def test_a_dropped_session_lives_until_the_next_request(clip, monkeypatch):
    """A session dropped after an error may have handed out frames that queued work still
    reads: its last reference goes when the next request starts (after the caller's sync)."""
    path, scan = clip
    monkeypatch.setattr(NP, "pynvc", lambda: FakeNvc(path, extra_picture=True))
    pd = NP.PacketDecoder(0, 0)
    with pytest.raises(NP.DisplayOrderError, match="more pictures"):
        list(pd.frames(path, scan, [22, 26, 30]))
    assert pd._dec is None and pd._retired is not None
    monkeypatch.setattr(NP, "pynvc", lambda: FakeNvc(path))
    list(pd.frames(path, scan, [22, 26, 30]))
    assert pd._retired is None and pd._dec is not None


def test_a_file_the_display_order_session_miscounts_is_served_in_decode_order(clip, monkeypatch):
    """End to end through the backend and the real packet decoder: a display-order session
    that drops a picture (as one drops an HEVC CRA's leading pictures) makes the request go
    again in decode order, with every frame right, and the file's later requests go in decode
    order from the start."""
    import sys
    import types

    from test_nvdec_fallback import _FakeCupy, _Stream

    from avpipe.decoding.video import _nvdec as nv

    path, scan = clip
    targets = [22, 26, 30]
    feed = NP.packet_feed(path, scan, targets)
    lost = int(scan.decode_pts[feed[3][0]])
    fake = FakeNvc(path, lose_native=lost)
    monkeypatch.setattr(NP, "pynvc", lambda: fake)
    monkeypatch.setattr(NP, "_local", __import__("threading").local())  # a fresh session
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy)
    b = object.__new__(nv.NvdecBackend)
    b.scan, b.device = scan, types.SimpleNamespace(index=0)
    b._source = types.SimpleNamespace(path=path)
    b._stream, b._stream_ptr, b.packet_path, b._packet_failure = _Stream(), 0, True, None
    out = {}

    def write(frame, rows, output, chw, o):
        for r in rows:
            out[r] = frame[1]

    b._write = write
    lat = FakeNvc.DisplayDecodeLatencyType
    assert b._decode_packets(targets, "rgb", False, None, [[0], [1], [2]]) == []
    assert out == {k: int(scan.pts[t]) for k, t in enumerate(targets)}
    assert fake.latencies == [lat.NATIVE, lat.ZERO] and not b._display_order
    assert b._decode_packets([40, 44], "rgb", False, None, [[0], [1]]) == []
    assert fake.latencies[-1] == lat.ZERO and out[1] == int(scan.pts[44])
