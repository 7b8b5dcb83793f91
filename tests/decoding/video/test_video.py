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


# -- clips: the keyframe seek, one decode pass, decoder threads ----------------------------------
_GOP10 = "keyint=10:min-keyint=10:scenecut=0"
CLIP_FILES = {  # (muxer, encoder, options): B-frames everywhere, open GOPs in the HEVC ones
    "mp4_h264": ("mp4", "libx264", f"bframes=3:b-adapt=0:{_GOP10}"),
    "mp4_hevc_open_gop": ("mp4", "libx265", f"bframes=3:{_GOP10}:open-gop=1"),
    "mov_h264": ("mov", "libx264", f"bframes=2:b-adapt=0:{_GOP10}"),
    "mkv_h264": ("matroska", "libx264", f"bframes=3:b-adapt=0:{_GOP10}"),
    "mkv_hevc_open_gop": ("matroska", "libx265", f"bframes=3:{_GOP10}:open-gop=1"),
    "ts_h264": ("mpegts", "libx264", f"bframes=3:b-adapt=0:{_GOP10}"),
    "ts_hevc_open_gop": ("mpegts", "libx265", f"bframes=3:{_GOP10}:open-gop=1"),
}
_EXT = {"mp4": "mp4", "mov": "mov", "matroska": "mkv", "mpegts": "ts"}
CLIP_LEN, CLIP_STRIDE = 8, 3  # 22 frames: every clip crosses two keyframes


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory):
    """Per key: (path, the full decode's frames); 60 frames, a keyframe every 10."""
    import av
    from test_mp4_scan import _x264, _x265, encode

    from avpipe._source import open_source
    from avpipe.decoding.video._scan import scan_stream

    d = tmp_path_factory.mktemp("clips")
    out = {}
    for key, (fmt, enc, opts) in CLIP_FILES.items():
        if not encoder_available(enc):
            continue
        p = encode(d / f"{key}.{_EXT[fmt]}", codec=enc, n=60,
                   opts=_x264(opts) if enc == "libx264" else _x265(opts), fmt=fmt)
        with av.open(p) as c:
            frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        s = scan_stream(open_source(p), p)
        assert s.num_frames == len(frames) == 60 and s.keyframe_indices.tolist()[:3] == [0, 10, 20]
        if "open_gop" in key:  # leading pictures: after a keyframe in decode order, before it shown
            order = s.decode_pts.tolist()
            k = order.index(int(s.pts[20]))
            assert min(order[k + 1:k + 4]) < s.pts[20], "no open GOP"
        out[key] = (p, frames)
    return out


class _Recorded:
    """A PyAV container whose seeks and demuxed packets are recorded in ``log``."""

    def __init__(self, container, log):
        self._c, self._log = container, log

    def __getattr__(self, name):
        return getattr(self._c, name)

    def seek(self, *a, **k):
        self._log.append(("seek", a[0] if a else k.get("offset")))
        return self._c.seek(*a, **k)

    def demux(self, *a, **k):
        for p in self._c.demux(*a, **k):
            self._log.append(("packet", p.pts))
            yield p


def _record(monkeypatch):
    from avpipe.decoding.video import _pyav

    log = []
    real = _pyav.open_container
    monkeypatch.setattr(_pyav, "open_container", lambda src, name: _Recorded(real(src, name), log))
    return log


def _clips(n=60):
    return [list(range(s, s + CLIP_LEN * CLIP_STRIDE, CLIP_STRIDE))
            for s in range(n - (CLIP_LEN - 1) * CLIP_STRIDE)]


@pytest.mark.parametrize("key", list(CLIP_FILES))
def test_clip_is_one_seek_landing_on_its_keyframe(clip_files, key, monkeypatch):
    """A strided clip across keyframes costs one seek, which lands on the keyframe at or before
    its first frame (MP4/MOV and Matroska seek by the keyframe's pts, MPEG-TS by its dts), and
    one decode pass: every packet is read once, nothing before that keyframe."""
    if key not in clip_files:
        pytest.skip("encoder missing")
    path, frames = clip_files[key]
    log = _record(monkeypatch)
    with avpipe.VideoDecoder(path, device="cpu", threads=1) as dec:
        scan = dec._scan
        for idx in _clips():
            log.clear()
            got = dec.get_frames(idx).data
            for k, i in enumerate(idx):
                np.testing.assert_array_equal(got[k], frames[i], err_msg=f"{key} {idx} frame {i}")
            seeks = [e for e in log if e[0] == "seek"]
            read = [pts for kind, pts in log if kind == "packet"]
            kf = scan.keyframe_at_or_before(idx[0])
            assert len(seeks) == 1, (key, idx, log)
            assert read[0] == scan.pts[kf], (key, idx, "seek landed elsewhere", read[:3])
            assert len(read) == len(set(read)), (key, idx, "packets read twice")


@pytest.mark.parametrize("threads", [1, 2, 0])
@pytest.mark.parametrize("key", list(CLIP_FILES))
def test_clips_equal_full_decode_with_threads(clip_files, key, threads):
    """Every strided clip, the clips in one request, every frame asked for alone, and a
    shuffled request equal a full decode: one FFmpeg thread, two, and FFmpeg's choice."""
    if key not in clip_files:
        pytest.skip("encoder missing")
    path, frames = clip_files[key]
    ref = np.stack(frames)
    with avpipe.VideoDecoder(path, device="cpu", threads=threads) as dec:
        for idx in _clips():
            np.testing.assert_array_equal(dec.get_frames(idx).data, ref[idx], err_msg=f"{idx}")
        many = [i for idx in _clips()[::7] for i in idx]
        np.testing.assert_array_equal(dec.get_frames(many).data, ref[many])
        for i in range(0, 60, 3 if threads else 1):
            np.testing.assert_array_equal(dec.get_frames([i]).data[0], ref[i], err_msg=str(i))
        order = np.random.default_rng(threads).permutation(60)
        np.testing.assert_array_equal(dec.get_frames(order).data, ref[order])


def test_seek_that_lands_early_drops_packets_undecoded(clip_files, monkeypatch):
    """A demuxer that lands on an earlier keyframe (here: an MP4 sought by the keyframe's dts):
    the packets before the wanted keyframe are read and dropped, not decoded, so the decoder
    gets the same packets and gives the same frames as after an exact seek."""
    from avpipe.decoding.video import _pyav

    path, frames = clip_files["mp4_h264"]
    idx = _clips()[21]  # frames 21..42: keyframe 20
    with avpipe.VideoDecoder(path, device="cpu", threads=1) as dec:
        exact = dec.get_frames(idx).data
        want = dict(dec._cpu.counters)
    assert want["dropped"] == 0 and want["seeks"] == 1
    monkeypatch.setattr(_pyav, "seeks_by_pts", lambda container: False)
    with avpipe.VideoDecoder(path, device="cpu", threads=1) as dec:
        early = dec.get_frames(idx).data
        got = dict(dec._cpu.counters)
    assert got["dropped"] > 0  # the dts seek landed on keyframe 10
    assert got["packets"] == want["packets"] and got["seeks"] == 1
    np.testing.assert_array_equal(early, exact)
    np.testing.assert_array_equal(exact, np.stack([frames[i] for i in idx]))


def test_seek_rule_by_container():
    from avpipe.decoding.video._pyav import seeks_by_pts

    for name in ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "mp4", "mov"):
        assert seeks_by_pts(name), name
    for name in ("mpegts", "avi", "flv", "h264", "", None):
        assert not seeks_by_pts(name), name


def test_threads_left_unset_use_ffmpeg_threads(media):
    """``threads`` unset: FFmpeg's frame and slice threads with its own count (more than one
    on a machine with several CPUs); ``threads=1``: none."""
    import os

    with avpipe.VideoDecoder(media["h264"], device="cpu") as dec:
        dec.get_frames([3])
        cc = dec._cpu._stream.codec_context
        assert "FRAME" in str(cc.thread_type) or cc.thread_type.name == "AUTO"
        assert cc.thread_count > 1 or (os.cpu_count() or 1) == 1
    with avpipe.VideoDecoder(media["h264"], device="cpu", threads=1) as dec:
        dec.get_frames([3])
        assert dec._cpu._stream.codec_context.thread_count == 1
