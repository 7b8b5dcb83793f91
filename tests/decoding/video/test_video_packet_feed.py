"""The NVDEC packet path's feed (packets read from the file by position, converted to Annex B,
disposable packets that are not wanted left out) decodes to exactly the frames asked for.
Checked here with FFmpeg's own decoders on the CPU; the GPU test runs the same feed on NVDEC."""

from __future__ import annotations

import av
import numpy as np
import pytest
from video_media import encoder_available, make_video, reference_frames

from avpipe._source import open_source
from avpipe.decoding.video._nal import parameter_sets_annexb, to_annexb
from avpipe.decoding.video._nvdec_packets import PacketPathError, packet_feed
from avpipe.decoding.video._scan import scan_stream

CODECS = [c for c in ("h264", "hevc") if encoder_available({"h264": "libx264", "hevc": "libx265"}[c])]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("feed")
    out = {c: make_video(d / f"f_{c}.mp4", codec=c, num_frames=60, width=160, height=96,
                         container="mp4") for c in CODECS}
    out["vfr"] = make_video(d / "f_vfr.mp4", codec="h264", num_frames=40, width=160, height=96,
                            pts=[100 + 33 * i + (i % 3) * 7 for i in range(40)],
                            time_base=__import__("fractions").Fraction(1, 1000))
    return out


def _decode_feed(codec, feed, scan):
    """FFmpeg decodes the feed (Annex B); display index -> rgb24 frame."""
    cc = av.CodecContext.create(codec, "r")
    got = {}
    for k, data, _ in feed:
        pkt = av.Packet(data)
        pkt.pts = int(scan.decode_pts[k])
        for fr in cc.decode(pkt):
            got[scan.pts_to_index[int(fr.pts)]] = fr.to_ndarray(format="rgb24")
    for fr in cc.decode(None):
        got[scan.pts_to_index[int(fr.pts)]] = fr.to_ndarray(format="rgb24")
    return got


@pytest.mark.parametrize("name", CODECS + ["vfr"])
@pytest.mark.parametrize("targets", [[1, 5, 9, 13], [0], [20, 24, 28, 32, 36], [37, 38, 39]])
def test_feed_decodes_to_the_frames_asked_for(files, name, targets):
    path = files[name]
    codec = "h264" if name == "vfr" else name
    scan = scan_stream(open_source(path), path)
    assert scan.packet_pos is not None and scan.nal_size == 4
    ref, _ = reference_frames(path)
    feed = packet_feed(path, scan, targets)
    assert feed[0][1].startswith(scan.parameter_sets)
    fed = [k for k, _, _ in feed]
    assert fed == sorted(fed)
    assert sorted(i for _, _, i in feed if i is not None) == targets
    skipped = [k for k in range(fed[0], fed[-1] + 1) if k not in fed]
    assert all(scan.disposable[k] for k in skipped)  # only unreferenced pictures are left out
    got = _decode_feed(codec, feed, scan)
    for t in targets:
        np.testing.assert_array_equal(got[t], ref[t], err_msg=f"{name} frame {t}")


def test_feed_skips_disposable_packets(files):
    """x264's default B-frames are not referenced: a strided clip leaves many packets out."""
    path = files[CODECS[0]] if CODECS else pytest.skip("no H.264/HEVC encoder")
    scan = scan_stream(open_source(path), path)
    feed = packet_feed(path, scan, [20, 24, 28, 32])
    span = feed[-1][0] - feed[0][0] + 1
    assert scan.disposable.any() and len(feed) < span


def _annexb_reference(data, length_size):
    """to_annexb as the NAL-by-NAL loop it was (one part per NAL unit)."""
    parts, pos, n = [], 0, len(data)
    while pos + length_size <= n:
        size = int.from_bytes(data[pos : pos + length_size], "big")
        if size <= 0 or pos + length_size + size > n:
            return None
        parts.append(b"\x00\x00\x00\x01" + data[pos + length_size : pos + length_size + size])
        pos += length_size + size
    if pos != n:
        return None
    return b"".join(parts) if parts or length_size == 4 else None


def test_annexb_equals_the_nal_by_nal_loop():
    """One NAL unit, several, none, zero or overrunning prefixes, trailing bytes; bytes,
    bytearray and memoryview input (the packet path passes views of one file read)."""
    rng = np.random.default_rng(0)
    for _ in range(3000):
        ls = int(rng.choice([1, 2, 3, 4, 4, 4]))
        data = b"".join(int(sz).to_bytes(ls, "big") + rng.bytes(int(sz))
                        for sz in rng.integers(0, 40, int(rng.integers(0, 4))))  # fmt: skip
        r = rng.random()
        if r < 0.2 and data:
            data = data[: int(rng.integers(0, len(data)))]
        elif r < 0.3:
            data += rng.bytes(int(rng.integers(1, 6)))
        want = _annexb_reference(data, ls)
        for got in (to_annexb(data, ls), to_annexb(bytearray(data), ls),
                    to_annexb(memoryview(b"xy" + data)[2:], ls)):  # fmt: skip
            assert got == want and type(got) is type(want), (ls, data)


def test_annexb_conversion_and_parameter_sets():
    nal1, nal2 = b"\x65\x88\x84\x00", b"\x06\x05\x01"
    four = len(nal1).to_bytes(4, "big") + nal1 + len(nal2).to_bytes(4, "big") + nal2
    assert to_annexb(four, 4) == b"\x00\x00\x00\x01" + nal1 + b"\x00\x00\x00\x01" + nal2
    two = len(nal1).to_bytes(2, "big") + nal1
    assert to_annexb(two, 2) == b"\x00\x00\x00\x01" + nal1
    assert to_annexb(four[:-1], 4) is None  # a prefix that overruns the packet
    sps, pps = b"\x67\x42\x00\x1e", b"\x68\xce\x3c\x80"
    avcc = bytes([1, 0x42, 0, 0x1E, 0xFF, 0xE1]) + len(sps).to_bytes(2, "big") + sps
    avcc += bytes([1]) + len(pps).to_bytes(2, "big") + pps
    assert parameter_sets_annexb("h264", avcc) == b"\x00\x00\x00\x01" + sps + b"\x00\x00\x00\x01" + pps
    assert parameter_sets_annexb("h264", b"\x00\x00\x00\x01" + sps) is None  # Annex B already


def test_matroska_packets_are_not_located(tmp_path):
    """Matroska reports block positions, not the packets' own bytes: the scan's check against
    the file refuses them, and the packet path is not used there."""
    path = make_video(tmp_path / "m.mkv", codec="h264", num_frames=12, container="matroska")
    scan = scan_stream(open_source(path), path)
    assert scan.packet_pos is None
    with pytest.raises(PacketPathError):
        packet_feed(path, scan, [3])


def test_feed_refuses_a_file_that_changed(files, tmp_path):
    path = files["vfr"]
    scan = scan_stream(open_source(path), path)
    short = tmp_path / "short.mp4"
    short.write_bytes(open(path, "rb").read()[: int(scan.packet_pos.max()) // 2])
    with pytest.raises(PacketPathError):
        packet_feed(str(short), scan, [30, 34])
