"""Disposable-packet skipping: fewer packets decoded, the same frames out."""

from __future__ import annotations

import av
import numpy as np
import pytest

import avpipe
from avpipe._source import open_source
from avpipe.decoding.video import _plan
from avpipe.decoding.video import _pyav as _video_cpu
from avpipe.decoding.video._nal import disposable_flags, nal_length_size, slice_nal_headers
from avpipe.decoding.video._scan import _scan_stream


def _encode(path, codec, n=48, bframes=3, w=160, h=144):
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=25)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        if codec == "libx264":
            s.options = {"bf": str(bframes), "g": "24", "threads": "1"}
        else:
            s.options = {"x265-params": f"bframes={bframes}:keyint=24:log-level=none:pools=1:frame-threads=1"}
        yy, xx = np.mgrid[0:h, 0:w]
        for i in range(n):
            img = np.stack([(xx * 3 + i * 5) % 256, (yy * 2 + i * 3) % 256, (xx + yy + i * 7) % 256], -1)
            for p in s.encode(av.VideoFrame.from_ndarray(img.astype(np.uint8), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def test_nal_parsing_annexb_and_length_prefixed():
    # H.264: a non-reference slice (nal_ref_idc 0, type 1) and a reference IDR (0x65)
    annexb = b"\x00\x00\x00\x01\x09\xf0" + b"\x00\x00\x01\x01\x9a\x00"
    assert slice_nal_headers(annexb, "h264", 0) == [(False, 0)]
    avcc = (2).to_bytes(4, "big") + b"\x65\x88" + (2).to_bytes(4, "big") + b"\x41\x9a"
    assert slice_nal_headers(avcc, "h264", 4) == [(True, 0), (True, 0)]
    # HEVC TRAIL_N (type 0) temporal id 0 vs TRAIL_R (type 1)
    assert slice_nal_headers(b"\x00\x00\x01\x00\x01\xaa", "hevc", 0) == [(False, 0)]
    assert slice_nal_headers(b"\x00\x00\x01\x02\x01\xaa", "hevc", 0) == [(True, 0)]
    # a sub-layer non-reference picture below the top temporal layer stays
    flags = disposable_flags([b"\x00\x00\x01\x00\x01", b"\x00\x00\x01\x02\x02"], "hevc", 0)
    assert flags == [False, False]
    assert disposable_flags([b"\x00\x00\x01\x01\x9a"], "vp9", 0) == [False]
    assert nal_length_size("h264", b"\x01\x64\x00\x1e\xff") == 4
    assert nal_length_size("h264", b"\x00\x00\x00\x01") == 0


@pytest.mark.parametrize("codec", ["libx264", "libx265"])
def test_skipping_decodes_fewer_packets_and_same_frames(tmp_path, codec, monkeypatch):
    path = _encode(tmp_path / "b.mp4", codec)
    scan = _scan_stream(open_source(path), "b.mp4")
    assert scan.disposable is not None and scan.disposable.sum() >= 8  # B-frames nobody references
    with av.open(str(path)) as c:
        ref = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    idx = list(range(5, 45, 4))  # a strided clip: most disposable frames are not wanted
    decoded = []
    real = _video_cpu.PyAVBackend._frames_from

    def counting(self, seek_index, skip_pts=frozenset(), **kw):
        decoded.append(len(skip_pts))
        return real(self, seek_index, skip_pts, **kw)

    monkeypatch.setattr(_video_cpu.PyAVBackend, "_frames_from", counting)
    with avpipe.VideoDecoder(path, device="cpu") as dec:
        got = dec.get_frames(idx)
    for k, i in enumerate(idx):
        np.testing.assert_array_equal(got.data[k], ref[i])
    assert decoded and max(decoded) > 0  # some packets were skipped
    wanted = {int(scan.pts[i]) for i in idx}
    assert not (_plan.skippable_pts(scan, idx) & wanted)  # a wanted frame is never skipped


def test_p_only_stream_has_nothing_to_skip(tmp_path):
    path = _encode(tmp_path / "p.mp4", "libx264", bframes=0)
    scan = _scan_stream(open_source(path), "p.mp4")
    assert not scan.disposable.any()
