"""VideoDecoder on the CPU (PyAV backend), on files the tests encode themselves."""

from __future__ import annotations

import fractions
import io
import threading
import time

import numpy as np
import pytest
from video_media import (
    CODECS,
    corrupt_middle,
    encoder_available,
    garbage,
    make_video,
    reference_frames,
    truncate,
)

import avpipe
from avpipe.errors import CorruptDataError, DecodeError, MemoryCapError, UnsupportedFormatError
from avpipe.ops.color import nv12_to_rgb_reference, yuv_coefficients
from avpipe.pipeline import samplers

ALL = [c for c in CODECS if encoder_available(CODECS[c][0])]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("video")
    files = {}
    for c in ALL:
        files[c] = make_video(d / f"clip_{c}.{CODECS[c][2]}", codec=c)
    tb = fractions.Fraction(1, 1000)
    steps = [40, 20, 60, 33, 47]
    pts = [100 + sum(steps[k % 5] for k in range(i)) for i in range(30)]
    files["vfr"] = make_video(d / "vfr.mp4", codec="h264", num_frames=30, pts=pts, time_base=tb)
    files["vfr_pts"] = [p / 1000 for p in pts]
    return files


@pytest.fixture(scope="module")
def refs(media):
    return {k: reference_frames(v) for k, v in media.items() if k != "vfr_pts"}


@pytest.mark.parametrize("codec", ALL)
def test_frames_equal_pyav_decode(media, refs, codec):
    frames, pts = refs[codec]
    with avpipe.VideoDecoder(media[codec], device="cpu") as dec:
        m = dec.metadata
        assert dec.backend == "pyav"
        assert m.codec == codec
        assert m.num_frames == len(frames) == 36
        assert (m.width, m.height) == (128, 96)
        np.testing.assert_allclose(m.pts_seconds, pts)
        assert m.keyframe_indices[0] == 0
        if codec != "mjpeg":
            assert list(m.keyframe_indices) == [0, 10, 20, 30]
        assert m.duration_seconds == pytest.approx(36 / 25)
        assert m.average_fps == pytest.approx(25.0)
        # random order, duplicates, backwards and forwards seeks
        idx = [35, 3, 3, 17, 0, 34, 11, 10, 9, 22, 3, -1]
        b = dec.get_frames(idx)
        assert b.data.shape == (len(idx), 96, 128, 3) and b.data.dtype == np.uint8
        assert b.indices.tolist() == [i % 36 for i in idx]
        for k, i in enumerate(idx):
            np.testing.assert_array_equal(b.data[k], frames[i])
            assert b.pts_seconds[k] == pytest.approx(pts[i])


def test_all_frames_and_reverse_order(media, refs):
    frames, _ = refs["hevc"]
    with avpipe.VideoDecoder(media["hevc"], device="cpu") as dec:
        b = dec.get_frames(np.arange(35, -1, -1))
        for k in range(36):
            np.testing.assert_array_equal(b.data[k], frames[35 - k])
        r = dec.get_frames_in_range(2, 30, step=4)
        assert r.indices.tolist() == list(range(2, 30, 4))
        for k, i in enumerate(r.indices):
            np.testing.assert_array_equal(r.data[k], frames[i])


def test_vfr_index_and_time(media, refs):
    frames, pts = refs["vfr"]
    want = media["vfr_pts"]
    with avpipe.VideoDecoder(media["vfr"], device="cpu") as dec:
        m = dec.metadata
        assert m.num_frames == 30
        np.testing.assert_allclose(m.pts_seconds, want, atol=1e-9)
        assert m.pts_seconds[0] == pytest.approx(0.1)  # not shifted to 0
        end = want[-1] + (want[-1] - want[-2])  # the last packet's duration
        assert m.duration_seconds == pytest.approx(end - 0.1, abs=0.05)
        assert m.average_fps == pytest.approx(30 / m.duration_seconds)
        # exact pts, just before the next pts, and in between
        ts, expect = [], []
        for i in range(29):
            ts += [want[i], (want[i] + want[i + 1]) / 2, want[i + 1] - 1e-4]
            expect += [i, i, i]
        b = dec.get_frames_at(ts)
        assert b.indices.tolist() == expect
        for k, i in enumerate(expect[:12]):
            np.testing.assert_array_equal(b.data[k], frames[i])
        with pytest.raises(ValueError):
            dec.get_frames_at([0.05])
        with pytest.raises(ValueError):
            dec.get_frames_at([m.end_seconds + 0.01])
        assert dec.get_frames_at([m.end_seconds - 1e-3]).indices.tolist() == [29]


def test_layouts_nv12_and_sources(media, refs):
    frames, _ = refs["h264"]
    data = open(media["h264"], "rb").read()
    for src in (data, io.BytesIO(data)):
        with avpipe.VideoDecoder(src, device="cpu", layout="CHW") as dec:
            b = dec.get_frames([5, 1])
            assert b.data.shape == (2, 3, 96, 128)
            np.testing.assert_array_equal(b.data[0], frames[5].transpose(2, 0, 1))
    with avpipe.VideoDecoder(media["h264"], device="cpu", output="nv12") as dec:
        b = dec.get_frames([7])
        assert b.data.shape == (1, 144, 128)
        m = dec.metadata
        rgb = nv12_to_rgb_reference(b.data[0], 96, 128, yuv_coefficients(m.color_space, m.color_range, m.pixel_format))
        diff = rgb.astype(np.float64) - frames[7]
        assert 10 * np.log10(255**2 / np.mean(diff**2)) > 40  # our matrix matches FFmpeg's


@pytest.mark.parametrize("codec", [c for c in ("h264", "mjpeg", "vp9") if c in ALL])
def test_nv12_reference_matches_ffmpeg_rgb(media, refs, codec):
    """The numpy reference of the GPU conversion follows FFmpeg's rgb24 (PSNR > 44 dB)."""
    frames, _ = refs[codec]
    with avpipe.VideoDecoder(media[codec], device="cpu", output="nv12") as dec:
        m = dec.metadata
        co = yuv_coefficients(m.color_space, m.color_range, m.pixel_format)
        b = dec.get_frames([0, 13, 29])
        for k, i in enumerate([0, 13, 29]):
            d = nv12_to_rgb_reference(b.data[k], 96, 128, co).astype(np.float64) - frames[i]
            assert np.abs(d).max() <= 4
            assert 10 * np.log10(255**2 / np.mean(d**2)) > 44


def test_stream_index_and_rotation(tmp_path):
    import av

    p = tmp_path / "two.mkv"
    with av.open(str(p), "w", format="matroska") as out:
        a = out.add_stream("libx264", rate=25)
        a.width, a.height, a.pix_fmt = 64, 48, "yuv420p"
        b = out.add_stream("libx264", rate=25)
        b.width, b.height, b.pix_fmt = 96, 64, "yuv420p"
        for i in range(6):
            from video_media import synth_frame

            for st, (w, h) in ((a, (64, 48)), (b, (96, 64))):
                fr = av.VideoFrame.from_ndarray(synth_frame(i, w, h), format="rgb24")
                for pkt in st.encode(fr):
                    out.mux(pkt)
        for st in (a, b):
            for pkt in st.encode(None):
                out.mux(pkt)
    with avpipe.VideoDecoder(p, device="cpu", stream_index=1) as dec:
        assert (dec.metadata.width, dec.metadata.height) == (96, 64)
        assert dec.metadata.stream_index == 1
        assert dec.get_frames([0]).data.shape == (1, 64, 96, 3)
    with avpipe.VideoDecoder(p, device="cpu") as dec:
        assert dec.metadata.stream_index in (0, 1)
    with pytest.raises(ValueError, match="stream_index"):
        avpipe.VideoDecoder(p, device="cpu", stream_index=7)


def test_streaming_chunks_and_memory_cap(media, refs):
    frames, _ = refs["vp9"]
    with avpipe.VideoDecoder(media["vp9"], device="cpu", memory_cap_bytes=10 * 96 * 128 * 3) as dec:
        got = []
        for chunk in dec.iter_frames(chunk_size=8):
            assert len(chunk) <= 8
            got.extend(zip(chunk.indices.tolist(), chunk.data))
        assert [i for i, _ in got] == list(range(36))
        for i, a in got[::5]:
            np.testing.assert_array_equal(a, frames[i])
        with pytest.raises(MemoryCapError, match="memory_cap_bytes"):
            dec.get_frames(range(11))
        with pytest.raises(IndexError):
            dec.get_frames([36])
    dec.close()
    with pytest.raises(RuntimeError, match="closed"):
        dec.get_frames([0])


def test_samplers_seeded(media, refs):
    frames, pts = refs["h264"]
    with avpipe.VideoDecoder(media["h264"], device="cpu") as dec:
        u = samplers.sample_uniform(dec, 5)
        assert u.indices.tolist() == [3, 10, 18, 25, 32]  # centres of 5 segments of 36 frames
        c1 = samplers.sample_random_clips(dec, num_clips=3, clip_length=4, stride=3, seed=7)
        c2 = samplers.sample_random_clips(dec, num_clips=3, clip_length=4, stride=3, seed=7)
        assert c1.data.shape == (3, 4, 96, 128, 3)
        np.testing.assert_array_equal(c1.indices, c2.indices)
        assert np.all(np.diff(c1.indices, axis=1) == 3)
        for c in range(3):
            for t in range(4):
                np.testing.assert_array_equal(c1.data[c, t], frames[c1.indices[c, t]])
                assert c1.pts_seconds[c, t] == pytest.approx(pts[c1.indices[c, t]])
        r = samplers.sample_regular_clips(dec, clip_length=4, stride=2, interval=10)
        assert r.indices[:, 0].tolist() == [0, 10, 20]
        r = samplers.sample_regular_clips(dec, clip_length=4, stride=1, num_clips=2)
        assert r.indices[:, 0].tolist() == [0, 32]
        t = samplers.sample_clips_at(dec, [0.0, 0.5], clip_length=3, stride=2)
        assert t.indices.tolist() == [[0, 2, 4], [12, 14, 16]]
        with pytest.raises(ValueError, match="clip_length"):
            samplers.sample_random_clips(dec, clip_length=20, stride=2)


def test_missing_and_bad_arguments(tmp_path, media):
    with pytest.raises(FileNotFoundError):
        avpipe.VideoDecoder(tmp_path / "nope.mp4", device="cpu")
    with pytest.raises(ValueError, match="layout"):
        avpipe.VideoDecoder(media["h264"], device="cpu", layout="WHC")


def _bounded(fn, seconds=20.0):
    """Run fn in a thread; fail if it does not finish in time; return its exception or None."""
    box = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            box["e"] = e

    th = threading.Thread(target=run, daemon=True)
    t0 = time.time()
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"did not finish within {seconds} s"
    assert time.time() - t0 < seconds
    return box.get("e")


def _decode_all(path):
    with avpipe.VideoDecoder(path, device="cpu") as dec:
        for _ in dec.iter_frames(chunk_size=16):
            pass


@pytest.mark.parametrize("kind", ["garbage", "truncated_mp4", "truncated_mkv", "corrupt_webm", "corrupt_mp4", "empty"])
def test_bad_files_raise_typed_errors(tmp_path, media, kind):
    if kind == "garbage":
        p = garbage(tmp_path / "g.mp4")
    elif kind == "truncated_mp4":
        p = truncate(media["h264"], tmp_path / "t.mp4", 0.6)
    elif kind == "truncated_mkv":
        p = truncate(media["hevc"], tmp_path / "t.mkv", 0.5)
    elif kind == "corrupt_webm":
        p = corrupt_middle(media["vp8"], tmp_path / "c.webm")
    elif kind == "corrupt_mp4":
        p = corrupt_middle(media["h264"], tmp_path / "c.mp4")
    else:
        p = tmp_path / "e.mkv"
        p.write_bytes(b"")
    err = _bounded(lambda: _decode_all(p))
    if kind in ("garbage", "truncated_mp4", "empty"):
        assert isinstance(err, DecodeError), repr(err)
    if err is not None:
        assert isinstance(err, DecodeError), repr(err)  # never an untyped error
        assert str(p) in str(err)


def test_unsupported_codec(tmp_path):
    import av

    p = tmp_path / "m.avi"
    with av.open(str(p), "w", format="avi") as out:
        st = out.add_stream("mpeg4", rate=25)
        st.width, st.height, st.pix_fmt = 64, 48, "yuv420p"
        for i in range(3):
            from video_media import synth_frame

            for pkt in st.encode(av.VideoFrame.from_ndarray(synth_frame(i, 64, 48), format="rgb24")):
                out.mux(pkt)
        for pkt in st.encode(None):
            out.mux(pkt)
    with pytest.raises(UnsupportedFormatError, match="mpeg4"):
        avpipe.VideoDecoder(p, device="cpu")


def test_truncated_tail_is_a_shorter_video_or_a_typed_error(tmp_path, media):
    """A WebM cut at 70%: the scan sees only the packets that are there, so either the frames
    that survive decode (fewer than the original's) or a CorruptDataError names the file."""
    p = truncate(media["vp9"], tmp_path / "tail.webm", 0.7)
    seen = {}

    def run():
        with avpipe.VideoDecoder(p, device="cpu") as dec:
            seen["n"] = dec.metadata.num_frames
            seen["decoded"] = sum(len(b.indices) for b in dec.iter_frames(chunk_size=16))

    err = _bounded(run)
    if err is None:
        with avpipe.VideoDecoder(media["vp9"], device="cpu") as full:
            assert 0 < seen["n"] < full.metadata.num_frames
        assert seen["decoded"] == seen["n"]
    else:
        assert isinstance(err, CorruptDataError) and str(p) in str(err), repr(err)


@pytest.mark.parametrize("fmt,codec,opts", [
    ("mpegts", "libx264", "bframes=2:b-adapt=0:keyint=10:min-keyint=10:scenecut=0"),
    ("mpegts", "libx265", "bframes=2:keyint=10:min-keyint=10:scenecut=0:open-gop=1"),
])
def test_every_frame_of_mpegts_with_b_frames(tmp_path, fmt, codec, opts):
    """MPEG-TS with B-frames: FFmpeg's seek there compares decode times, so seeking to a
    keyframe's pts landed just after it: the first GOP could not be decoded at all, and the
    last GOP's frames were not found. Every frame, asked for alone, equals a full decode."""
    import av
    from test_mp4_scan import _x264, _x265, encode

    opt = _x264(opts) if codec == "libx264" else _x265(opts)
    p = encode(tmp_path / "v.ts", codec=codec, n=30, opts=opt, fmt=fmt)
    with av.open(p) as c:
        want = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    with avpipe.VideoDecoder(p, device="cpu") as d:
        assert d.metadata.num_frames == len(want) == 30
        for i in reversed(range(30)):
            np.testing.assert_array_equal(d.get_frames([i]).data[0], want[i], err_msg=str(i))
        np.testing.assert_array_equal(d.get_frames(list(range(30))).data, np.stack(want))


def test_h264_in_avi_with_b_frames_is_refused_not_misnumbered(tmp_path):
    """AVI keeps decode times only: with B-frames, sorting them does not give display order
    (frame 3 came back as the decoder's frame 2, silently). Such a file is refused by name;
    without B-frames every frame equals a full decode."""
    import av
    from test_mp4_scan import _x264, encode

    b = encode(tmp_path / "b.avi", n=30, opts=_x264("bframes=2:b-adapt=0:keyint=10"), fmt="avi")
    with pytest.raises(UnsupportedFormatError, match="B-frames") as ei:
        avpipe.VideoDecoder(b, device="cpu")
    assert b in str(ei.value)
    p = encode(tmp_path / "p.avi", n=30, opts=_x264("bframes=0:keyint=10"), fmt="avi")
    with av.open(p) as c:
        want = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    with avpipe.VideoDecoder(p, device="cpu") as d:
        np.testing.assert_array_equal(d.get_frames(list(range(30))[::-1]).data, want[::-1])
