"""The MP4 / MOV sample-table scan (avpipe.decoding.video._mp4) against the demux scan.

Every field of the fast scan must equal what the PyAV demux scan (``_scan_stream``) reports for
the same file; files the reader does not reproduce exactly must fall back (``_scan_mp4`` returns
None) and never raise.
"""

from __future__ import annotations

import fractions
import glob
import os
import shutil
import struct

import av
import numpy as np
import paths
import pytest
from video_media import reference_frames, synth_frame

from avpipe._source import open_source
from avpipe.decoding.video import _mp4
from avpipe.decoding.video import _scan as vs
from avpipe.errors import UnsupportedFormatError

SAMPLES = sorted(
    p
    for p in glob.glob(os.path.join(paths.SAMPLES, "video", "*"))
    if p.lower().endswith((".mp4", ".mov", ".m4v"))
)


def _x264(s):
    return {"preset": "ultrafast", "x264-params": "threads=1:" + s}


def _x265(s):
    return {"preset": "ultrafast", "x265-params": "log-level=error:pools=1:frame-threads=1:" + s}


def encode(path, *, codec="libx264", n=50, w=64, h=48, fps=25, pix="yuv420p", opts=None,
           fmt="mp4", pts=None, tb=None, audio=False, muxer_opts=None):
    path = os.fspath(path)
    with av.open(path, "w", format=fmt, options=muxer_opts or {}) as out:
        ast = out.add_stream("aac", rate=16000, layout="mono") if audio else None
        st = out.add_stream(codec, rate=fps)
        st.width, st.height, st.pix_fmt = w, h, pix
        if tb is not None:
            st.time_base = tb
            st.codec_context.time_base = tb
        st.options = dict(opts or {})
        if ast is not None:  # a track before the video one, with packets so the muxer keeps it
            for k in range(8):
                af = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
                af.sample_rate, af.pts, af.time_base = 16000, k * 1024, fractions.Fraction(1, 16000)
                for p in ast.encode(af):
                    out.mux(p)
            for p in ast.encode(None):
                out.mux(p)
        for i in range(n):
            fr = av.VideoFrame.from_ndarray(synth_frame(i, w, h), format="rgb24").reformat(format=pix)
            if pts is not None:
                fr.pts, fr.time_base = int(pts[i]), tb
            for p in st.encode(fr):
                out.mux(_sane_dts(p))
        for p in st.encode(None):
            out.mux(_sane_dts(p))
    return path


def _sane_dts(p):
    """libx265 through FFmpeg leaves a lone picture's dts unset (whatever the memory held:
    usually a huge negative number, which the MP4 muxer refuses, some runs a value it takes).
    A dts after its pts or more than 2**20 ticks before it is such garbage: use the pts."""
    if p.pts is not None and p.dts is not None and not (p.pts - 2**20 < p.dts <= p.pts):
        p.dts = p.pts
    return p


VFR = np.cumsum([0] + [40, 40, 80, 40, 20, 60] * 10)[:50]
# name -> (encode kwargs, whether the fast path must take it)
CASES = {
    "h264_b": (dict(opts=_x264("bframes=2:b-adapt=0:keyint=10:min-keyint=10:scenecut=0")), True),
    "h264_nob": (dict(opts=_x264("bframes=0:keyint=10")), True),
    "h264_pyramid": (dict(n=60, opts=_x264("bframes=3:b-pyramid=normal:keyint=30")), True),
    "h264_open_gop": (dict(n=60, opts=_x264("bframes=3:open-gop=1:keyint=20:min-keyint=20:scenecut=0")), True),
    "h264_odd_size": (dict(w=130, h=94, opts=_x264("bframes=2")), True),
    "h264_slices": (dict(w=256, h=192, opts=_x264("bframes=2:slices=4")), True),
    "h264_yuvj": (dict(pix="yuvj420p", opts=_x264("bframes=2")), True),
    "h264_fullrange": (dict(opts=_x264("bframes=2:fullrange=on")), True),
    "h264_bt709": (dict(opts=_x264("bframes=2:colormatrix=bt709:colorprim=bt709:transfer=bt709")), True),
    "h264_sar": (dict(opts=_x264("bframes=2:sar=4/3")), True),
    "h264_444": (dict(pix="yuv444p", opts=_x264("bframes=2")), True),
    "h264_422": (dict(pix="yuv422p", opts=_x264("bframes=2")), True),
    "h264_10bit": (dict(pix="yuv420p10le", opts=_x264("bframes=2")), True),
    "h264_ntsc": (dict(fps=fractions.Fraction(30000, 1001), opts=_x264("bframes=2")), True),
    "h264_long": (dict(n=400, w=32, h=32, opts=_x264("bframes=3:keyint=50")), True),
    "h264_vfr_nob": (dict(pts=VFR, tb=fractions.Fraction(1, 1000), opts=_x264("bframes=0")), True),
    "h264_empty_edit": (dict(n=60, pts=list(range(5, 65)), tb=fractions.Fraction(1, 25), opts=_x264("bframes=2")), True),
    "h264_empty_edit_nob": (dict(n=60, pts=list(range(7, 67)), tb=fractions.Fraction(1, 25), opts=_x264("bframes=0")), True),
    "h264_mov": (dict(fmt="mov", opts=_x264("bframes=2")), True),
    "h264_ref1_scenecut": (dict(n=80, opts=_x264("bframes=2:ref=1:keyint=60:min-keyint=2:scenecut=90")), True),
    "h264_intra_refresh": (dict(n=60, opts=_x264("bframes=0:intra-refresh=1:keyint=20")), True),
    "h264_vfr_b_pyramid": (dict(pts=VFR, tb=fractions.Fraction(1, 90000) * 90, opts=_x264("bframes=3:b-pyramid=normal")), True),
    "h264_audio_first": (dict(audio=True, opts=_x264("bframes=2")), True),
    "h264_faststart": (dict(opts=_x264("bframes=2"), muxer_opts={"movflags": "+faststart"}), True),
    "hevc_b": (dict(codec="libx265", opts=_x265("keyint=10:min-keyint=10:bframes=2")), True),
    "hevc_nob": (dict(codec="libx265", opts=_x265("keyint=10:bframes=0")), True),
    "hevc_open_gop": (dict(codec="libx265", n=60, opts=_x265("keyint=20:min-keyint=20:bframes=4:open-gop=1:scenecut=0")), True),
    "hevc_temporal_layers": (dict(codec="libx265", opts=_x265("keyint=20:bframes=3:b-pyramid=1:temporal-layers=1")), True),
    "hevc_10bit": (dict(codec="libx265", pix="yuv420p10le", opts=_x265("bframes=2")), True),
    "hevc_444": (dict(codec="libx265", pix="yuv444p", opts=_x265("bframes=2")), True),
    "hevc_full": (dict(codec="libx265", opts=_x265("bframes=2:range=full:colormatrix=bt709")), True),
    "hevc_444_full": (dict(codec="libx265", pix="yuv444p", opts=_x265("bframes=2:range=full")), True),
    "hevc_odd_size": (dict(codec="libx265", w=130, h=94, opts=_x265("bframes=2")), True),
    "hevc_repeat_headers": (dict(codec="libx265", opts=_x265("bframes=2:repeat-headers=1")), True),
    "h264_interlaced": (dict(w=64, h=64, opts=_x264("bframes=2:interlaced=1")), True),
    "h264_hrd_aud": (dict(opts=_x264("bframes=2:nal-hrd=vbr:vbv-maxrate=500:vbv-bufsize=1000:aud=1")), True),
    "hevc_slices_aud": (dict(codec="libx265", w=128, h=128, opts=_x265("bframes=2:slices=2:aud=1")), True),
    # left to the demux scan
    "h264_vfr_b": (dict(pts=VFR, tb=fractions.Fraction(1, 1000), opts=_x264("bframes=2")), True),
    "h264_negative_cts": (dict(opts=_x264("bframes=2"), muxer_opts={"movflags": "+negative_cts_offsets"}), False),
    "h264_fragmented": (dict(opts=_x264("bframes=2"), muxer_opts={"movflags": "+frag_keyframe+empty_moov"}), False),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("mp4")
    files = {}
    for name, (kw, _) in CASES.items():
        ext = ".mov" if kw.get("fmt") == "mov" else ".mp4"
        try:
            files[name] = encode(d / (name + ext), **kw)
        except Exception as e:  # noqa: BLE001 — an encoder option this PyAV build lacks
            files[name] = e
    return files


def _scans(path, stream_index=None):
    src = open_source(path)
    return vs._scan_stream(src, src.name, stream_index), vs._scan_mp4(src, src.name, stream_index)


def assert_same(slow, fast, skip=()):
    for k, a in slow.__dict__.items():
        if k in skip:
            continue
        b = getattr(fast, k)
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            assert (a is None) == (b is None), k
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), k
        else:
            assert a == b and type(a) is type(b), (k, a, b)


@pytest.mark.parametrize("path", SAMPLES, ids=os.path.basename)
def test_sample_files_equal_the_demux_scan(path):
    slow, fast = _scans(path)
    assert fast is not None
    assert_same(slow, fast)


@pytest.mark.parametrize("name", list(CASES))
def test_encoded_files_equal_the_demux_scan(made, name):
    path = made[name]
    if isinstance(path, Exception):
        pytest.skip(f"encoder lacks an option: {path}")
    slow, fast = _scans(path)
    if CASES[name][1]:
        assert fast is not None, _why(path)
        assert_same(slow, fast)
    else:
        assert fast is None
    assert_same(slow, vs.scan_stream(open_source(path), path))


def _why(path):
    try:
        _mp4.read_video_track(path)
    except _mp4.DemuxScanNeeded as e:
        return str(e)
    return "short"


def test_edit_list_b_frames_have_discarded_leading_samples(made):
    """x264 with B-frames: the edit list starts at the first displayed frame; the scan's dts
    start below zero like FFmpeg's, pts at 0, and a decode of every frame matches PyAV's."""
    path = made["h264_b"]
    slow, fast = _scans(path)
    assert fast.pts[0] == 0 and fast.dts_sorted[0] < 0
    import avpipe

    frames, _ = reference_frames(path)
    with avpipe.VideoDecoder(path, device="cpu") as dec:
        assert dec._scan is not None
        got = dec.get_frames(list(range(len(frames)))).data
    assert np.array_equal(np.asarray(got), np.stack(frames))


def test_short_files(tmp_path, monkeypatch):
    """Below the packet count where a demux scan may not see a frame, the fast path steps
    aside; its tables still match (colour tags aside, which the demux scan may lack)."""
    cases = {
        "one_h264": dict(n=1),
        "two_h264": dict(n=2, opts=_x264("bframes=2")),
        "seventeen": dict(n=17, opts=_x264("bframes=2")),
        "one_hevc": dict(n=1, codec="libx265", opts=_x265("")),
    }
    for name, kw in cases.items():
        p = encode(tmp_path / f"{name}.mp4", **kw)
        slow, fast = _scans(p)
        assert fast is None
        monkeypatch.setattr(vs, "_MP4_MIN_PACKETS", 0)
        slow, fast = _scans(p)
        monkeypatch.undo()
        assert fast is not None, name
        skip = ("color_space", "color_range", "pix_fmt", "bit_depth") if slow.color_space is None else ()
        assert_same(slow, fast, skip)


# --------------------------------------------------------------------------------------------
# rewriting boxes: rotation matrices, co64
# --------------------------------------------------------------------------------------------

_CONT = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts"}


_PREFIX = {b"stsd": 8, b"avc1": 78, b"hvc1": 78, b"hev1": 78}  # bytes before child boxes


def _parse(buf, a, b):
    out = []
    while a + 8 <= b:
        size, typ = struct.unpack_from(">I4s", buf, a)
        if typ in _CONT or typ in _PREFIX:
            k = _PREFIX.get(typ, 0)
            prefix = [bytes(buf[a + 8 : a + 8 + k])] if k else []
            out.append([typ, prefix + _parse(buf, a + 8 + k, a + size)])
        else:
            out.append([typ, bytes(buf[a + 8 : a + size])])
        a += size
    return out


def _ser(boxes):
    out = b""
    for box in boxes:
        if isinstance(box, bytes):  # a container's fixed prefix
            out += box
            continue
        typ, body = box
        data = _ser(body) if isinstance(body, list) else body
        out += struct.pack(">I4s", 8 + len(data), typ) + data
    return out


def rewrite_moov(src, dst, fn):
    """Copy a file whose moov is its last box, with fn applied to the moov's box tree."""
    buf = open(src, "rb").read()
    top = _parse(buf, 0, len(buf))
    assert top[-1][0] == b"moov", "moov must be last for offsets to hold"
    fn(top[-1][1])
    with open(dst, "wb") as f:
        f.write(_ser(top))
    return dst


def _video_trak(moov):
    for typ, body in moov:
        if typ == b"trak":
            mdia = next(b for t, b in body if t == b"mdia")
            hdlr = next(b for t, b in mdia if t == b"hdlr")
            if hdlr[8:12] == b"vide":
                return body
    raise AssertionError("no video trak")


def _set_matrix(moov, m):
    trak = _video_trak(moov)
    for box in trak:
        if box[0] == b"tkhd":
            body = bytearray(box[1])
            at = 4 + (32 if body[0] == 1 else 20) + 16
            body[at : at + 36] = struct.pack(">9i", *m)
            box[1] = bytes(body)


def _stco_to_co64(moov):
    trak = _video_trak(moov)
    mdia = next(b for t, b in trak if t == b"mdia")
    minf = next(b for t, b in mdia if t == b"minf")
    stbl = next(b for t, b in minf if t == b"stbl")
    for box in stbl:
        if box[0] == b"stco":
            n = struct.unpack_from(">I", box[1], 4)[0]
            offs = struct.unpack_from(f">{n}I", box[1], 8)
            box[0] = b"co64"
            box[1] = box[1][:8] + struct.pack(f">{n}Q", *offs)


ONE = 1 << 16
MATRICES = {
    90: [0, ONE, 0, -ONE, 0, 0, 0, 0, 1 << 30],
    180: [-ONE, 0, 0, 0, -ONE, 0, 0, 0, 1 << 30],
    270: [0, -ONE, 0, ONE, 0, 0, 0, 0, 1 << 30],
    "flip": [-ONE, 0, 0, 0, ONE, 0, 0, 0, 1 << 30],
    "zero": [0] * 8 + [1 << 30],
}


@pytest.mark.parametrize("which", list(MATRICES))
def test_rotation_matrix(made, tmp_path, which):
    dst = rewrite_moov(made["h264_b"], tmp_path / "r.mp4", lambda m: _set_matrix(m, MATRICES[which]))
    slow, fast = _scans(dst)
    assert fast is not None
    assert_same(slow, fast)
    if isinstance(which, int):
        assert fast.rotation != 0


@pytest.mark.parametrize("name", ["h264_b", "hevc_b", "h264_audio_first"])
def test_co64(made, tmp_path, name):
    dst = rewrite_moov(made[name], tmp_path / "c.mp4", _stco_to_co64)
    assert b"co64" in open(dst, "rb").read()
    slow, fast = _scans(dst)
    assert fast is not None
    assert_same(slow, fast)


def test_stream_index_and_wiring(made, tmp_path):
    path = made["h264_audio_first"]
    slow, fast = _scans(path, 1)
    assert fast is not None and fast.stream_index == 1
    assert_same(slow, fast)
    with pytest.raises(ValueError):  # the audio stream: the demux scan's error
        vs.scan_stream(open_source(path), path, 0)
    # a path without an MP4 name or ftyp never reaches the reader
    mkv = tmp_path / "x.mkv"
    encode(mkv, fmt="matroska", opts=_x264("bframes=2"))
    src = open_source(str(mkv))
    assert vs._scan_mp4(src, src.name) is None
    # an MP4 under another name is recognised by its ftyp box
    other = tmp_path / "clip.bin"
    shutil.copy(made["h264_b"], other)
    src = open_source(str(other))
    assert vs._scan_mp4(src, src.name) is not None


def test_damaged_files_fall_back_or_match(made, tmp_path):
    """Truncations and corrupted moov bytes: the reader returns None or the demux scan's answer,
    never raises."""
    rng = np.random.default_rng(0)
    for name in ("h264_b", "hevc_b", "h264_faststart"):
        data = open(made[name], "rb").read()
        moov = data.find(b"moov") - 4
        variants = [data[:k] for k in (0, 7, 8, 100, len(data) // 2, moov + 50, len(data) - 1)]
        for _ in range(60):
            buf = bytearray(data)
            for _ in range(int(rng.integers(1, 4))):
                at = int(rng.integers(moov, len(data)))
                buf[at] = int(rng.integers(0, 256))
            variants.append(bytes(buf))
        for i, v in enumerate(variants):
            p = tmp_path / f"{name}_{i}.mp4"
            p.write_bytes(v)
            src = open_source(str(p))
            fast = vs._scan_mp4(src, src.name)  # must not raise
            if fast is None:
                continue
            try:
                slow = vs._scan_stream(src, src.name)
            except Exception:  # noqa: BLE001
                slow = None
            if slow is not None and slow.color_space is not None:
                assert_same(slow, fast)


def test_absurd_counts_do_not_allocate(made, tmp_path):
    """A table whose entry count exceeds its box is refused before anything is allocated."""
    def blow(moov):
        trak = _video_trak(moov)
        mdia = next(b for t, b in trak if t == b"mdia")
        minf = next(b for t, b in mdia if t == b"minf")
        stbl = next(b for t, b in minf if t == b"stbl")
        for box in stbl:
            if box[0] == b"stsz":
                box[1] = box[1][:8] + struct.pack(">I", 0xFFFFFFF0) + box[1][12:]

    dst = rewrite_moov(made["h264_b"], tmp_path / "a.mp4", blow)
    with pytest.raises(_mp4.DemuxScanNeeded):
        _mp4.read_video_track(str(dst))
    src = open_source(str(dst))
    assert vs._scan_mp4(src, src.name) is None


def _stbl(moov):
    trak = _video_trak(moov)
    mdia = next(b for t, b in trak if t == b"mdia")
    minf = next(b for t, b in mdia if t == b"minf")
    return trak, next(b for t, b in minf if t == b"stbl")


def _two_edits(moov):
    trak, _ = _stbl(moov)
    edts = next(b for t, b in trak if t == b"edts")
    for box in edts:
        if box[0] == b"elst":
            entry = box[1][8:20]
            box[1] = box[1][:4] + struct.pack(">I", 2) + entry + entry


def _stts_short(moov):
    _, stbl = _stbl(moov)
    for box in stbl:
        if box[0] == b"stts":
            n, cnt, delta = struct.unpack_from(">III", box[1], 4)
            box[1] = box[1][:4] + struct.pack(">III", 1, cnt - 1, delta)


def _no_stsz(moov):
    _, stbl = _stbl(moov)
    stbl[:] = [b for b in stbl if b[0] != b"stsz"]


@pytest.mark.parametrize("breakage", [_two_edits, _stts_short, _no_stsz], ids=lambda f: f.__name__)
def test_tables_it_does_not_map_fall_back(made, tmp_path, breakage):
    dst = rewrite_moov(made["h264_b"], tmp_path / "b.mp4", breakage)
    src = open_source(str(dst))
    assert vs._scan_mp4(src, src.name) is None
    try:
        want = vs._scan_stream(src, src.name)
    except Exception as e:  # noqa: BLE001
        with pytest.raises(type(e)):
            vs.scan_stream(src, src.name)
    else:
        assert_same(want, vs.scan_stream(src, src.name))


def test_other_codecs_in_mp4_fall_back(tmp_path):
    p = encode(tmp_path / "m.mp4", codec="mpeg4", pix="yuv420p", opts={})
    src = open_source(p)
    assert vs._scan_mp4(src, src.name) is None
    with pytest.raises(UnsupportedFormatError):
        vs.scan_stream(src, src.name)


def _entry(moov):
    _, stbl = _stbl(moov)
    stsd = next(b for t, b in stbl if t == b"stsd")
    return stsd[1][1]  # the one sample entry's [prefix, children...]


def _colr(matrix, full=None):
    body = b"nclx" if full is not None else b"nclc"
    body += struct.pack(">HHH", 1, 1, matrix) + (bytes([full << 7]) if full is not None else b"")
    return [b"colr", body]


def _set_colr(box):
    def fn(moov):
        entry = _entry(moov)
        entry[:] = [x for x in entry if isinstance(x, bytes) or x[0] != b"colr"] + ([box] if box else [])
    return fn


def _drop_pasp(moov):
    entry = _entry(moov)
    entry[:] = [x for x in entry if isinstance(x, bytes) or x[0] != b"pasp"]


@pytest.mark.parametrize("name", ["h264_b", "h264_bt709", "h264_fullrange", "hevc_b", "hevc_full"])
@pytest.mark.parametrize("colr", [None, (6, 1), (5, 0), (1, None), (13, 1)], ids=str)
def test_colr_box_against_sps(made, tmp_path, name, colr):
    """H.264 takes colour tags from a colr box where its SPS says nothing; HEVC never does."""
    box = None if colr is None else _colr(*colr)
    dst = rewrite_moov(made[name], tmp_path / "c.mp4", _set_colr(box))
    slow, fast = _scans(dst)
    assert fast is not None
    assert_same(slow, fast)


@pytest.mark.parametrize("name", ["h264_sar", "h264_b"])
def test_sar_from_the_sps_without_pasp(made, tmp_path, name):
    dst = rewrite_moov(made[name], tmp_path / "s.mp4", _drop_pasp)
    slow, fast = _scans(dst)
    assert fast is not None
    assert_same(slow, fast)
    if name == "h264_sar":
        assert fast.sample_aspect_ratio == fractions.Fraction(4, 3)


def _multi_nal_video(path, codec, options):
    with av.open(str(path), "w", format="mp4") as out:
        st = out.add_stream(codec, rate=25)
        st.width, st.height, st.pix_fmt = 160, 96, "yuv420p"
        st.options = options
        for i in range(40):
            f = av.VideoFrame.from_ndarray(synth_frame(i, 160, 96), format="rgb24")
            for pkt in st.encode(f.reformat(format="yuv420p")):
                out.mux(pkt)
        for pkt in st.encode(None):
            out.mux(pkt)
    return str(path)


@pytest.mark.parametrize("codec,options", [
    ("libx264", {"x264-params": "slices=3:aud=1:bframes=2:b-pyramid=none"}),
    ("libx264", {"x264-params": "slices=2:bframes=3:b-pyramid=normal:keyint=12"}),
    ("libx265", {"x265-params": "slices=2:bframes=2:keyint=12:log-level=none"}),
])  # fmt: skip
def test_vector_nal_walk_equals_the_scalar_walk(tmp_path, codec, options, monkeypatch):
    """Samples of several NAL units (slices, access unit delimiters, SEI) are walked together
    (``_walk_many``); the result equals walking each sample alone (``_walk``)."""
    from avpipe.decoding.video import _mp4

    if codec not in av.codecs_available:
        pytest.skip(f"{codec} not in this PyAV")
    path = _multi_nal_video(tmp_path / "m.mp4", codec, options)
    walked = []
    vector = _mp4._walk_many

    def spy(arr, file_size, pos, size, ls, v):
        out = vector(arr, file_size, pos, size, ls, v)
        walked.append((pos.size, int(out[3].sum())))
        return out

    monkeypatch.setattr(_mp4, "_walk_many", spy)
    fast = _mp4.read_video_track(path)
    n, rest = walked[0]
    assert n == fast.pos.size and rest < n  # every sample holds several units; most walked fast

    def scalar_only(arr, file_size, pos, size, ls, v):
        n = pos.size
        return np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, np.int64), np.ones(n, bool)

    monkeypatch.setattr(_mp4, "_walk_many", scalar_only)
    slow = _mp4.read_video_track(path)
    np.testing.assert_array_equal(fast.disposable, slow.disposable)
    np.testing.assert_array_equal(fast.key, slow.key)
    assert fast.disposable.any() and fast.key.any() and not fast.key.all()


def test_mp4_reader_takes_its_extensions_from_the_registry(tmp_path):
    """The MP4 family's names (and the other containers', never sniffed) live in avpipe.formats:
    an MP4 under another container's name is not read as MP4, one under an unknown name is."""
    from avpipe.decoding.video._mp4 import looks_like_mp4
    from avpipe.formats import MP4_EXTENSIONS, NON_MP4_CONTAINER_EXTENSIONS, VIDEO_EXTENSIONS

    assert set(MP4_EXTENSIONS) <= set(VIDEO_EXTENSIONS)
    assert not set(MP4_EXTENSIONS) & set(NON_MP4_CONTAINER_EXTENSIONS)
    head = b"\x00\x00\x00\x18ftypisom" + bytes(16)
    for ext in (".bin", ".MKV", ".ts", ".M4V"):
        (tmp_path / f"a{ext}").write_bytes(head)
    assert looks_like_mp4(str(tmp_path / "a.bin"))
    assert looks_like_mp4(str(tmp_path / "a.M4V"))
    assert not looks_like_mp4(str(tmp_path / "a.MKV")) and not looks_like_mp4(str(tmp_path / "a.ts"))
