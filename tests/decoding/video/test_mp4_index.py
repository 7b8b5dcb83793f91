"""The persisted video index: build_index, VideoIndex.lookup, VideoDecoder(index=), `avpipe index`."""

from __future__ import annotations

import os
import shutil

import numpy as np
import paths
import pytest
from test_mp4_scan import _x264, assert_same, encode

import avpipe
from avpipe._source import open_source
from avpipe.decoding import VideoIndex, build_index, load_index
from avpipe.decoding.video import _scan as vs
from avpipe.decoding.video import decoder as video_mod

SAMPLES = os.path.join(paths.SAMPLES, "video")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("idx")
    for name in ("circles_h264.mp4", "circles_hevc.mp4", "circles_vp9.webm", "squares_mjpeg.avi"):
        shutil.copy(os.path.join(SAMPLES, name), d / name)
    encode(d / "short.mp4", n=10, opts=_x264("bframes=2"))  # a demux-scanned MP4
    (d / "broken.mp4").write_bytes(b"\x00" * 100)
    whole = open(os.path.join(SAMPLES, "circles_vp9.webm"), "rb").read()
    (d / "cut.webm").write_bytes(whole[: len(whole) * 6 // 10])  # scanned, marked damaged
    return d


@pytest.mark.parametrize("workers", [0, 2])
def test_index_equals_scans(folder, tmp_path, workers):
    paths = sorted(str(p) for p in folder.iterdir())
    out = tmp_path / "index.npz"
    summary = build_index(paths, out, workers=workers, progress=False)
    assert summary["indexed"] == len(paths) - 1
    assert [os.path.basename(p) for p, _ in summary["failed"]] == ["broken.mp4"]
    idx = load_index(out)
    assert isinstance(idx, VideoIndex) and len(idx) == len(paths) - 1
    for p in paths:
        if p.endswith("broken.mp4"):
            assert p not in idx and idx.lookup(p) is None
            continue
        got = idx.lookup(p, p)
        want = vs.scan_stream(open_source(p), p)
        assert got is not None
        assert_same(want, got)
        assert got.pts_to_index == want.pts_to_index
        assert (got.damaged is not None) == p.endswith("cut.webm"), (p, got.damaged)


def test_decoder_uses_fresh_entries_only(folder, tmp_path, monkeypatch):
    src = tmp_path / "clip.mp4"
    shutil.copy(folder / "circles_h264.mp4", src)
    out = tmp_path / "i.npz"
    build_index([src], out, workers=0, progress=False)
    with avpipe.VideoDecoder(str(src), device="cpu") as ref:
        want = np.asarray(ref.get_frames([0, 7, 20]).data)

    calls = []
    real = video_mod.scan_stream

    def counting(*a, **k):
        calls.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(video_mod, "scan_stream", counting)
    vs._CACHE.clear()
    for index in (str(out), load_index(out)):
        with avpipe.VideoDecoder(str(src), device="cpu", index=index) as dec:
            assert np.array_equal(np.asarray(dec.get_frames([0, 7, 20]).data), want)
    assert calls == []  # both opens came from the index
    # another stream asked for: scanned
    with pytest.raises(ValueError):
        avpipe.VideoDecoder(str(src), device="cpu", index=out, stream_index=1)
    assert len(calls) == 1
    # same size, another mtime: stale, scanned again
    st = os.stat(src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert load_index(out).lookup(str(src)) is None
    avpipe.VideoDecoder(str(src), device="cpu", index=out).close()
    assert len(calls) == 2
    # different content and size: scanned, and the new scan is what the decoder uses
    shutil.copy(folder / "circles_hevc.mp4", src)
    with avpipe.VideoDecoder(str(src), device="cpu", index=out) as dec:
        assert dec.metadata.codec == "hevc"
    assert len(calls) == 3
    # bytes sources ignore the index
    avpipe.VideoDecoder((folder / "circles_h264.mp4").read_bytes(), device="cpu", index=out).close()
    assert len(calls) == 4
    with pytest.raises(TypeError):
        avpipe.VideoDecoder(str(src), device="cpu", index=123)


def test_index_file_is_plain_npz(folder, tmp_path):
    out = tmp_path / "i.npz"
    build_index([folder / "circles_h264.mp4"], out, workers=0, progress=False)
    with np.load(out, allow_pickle=False) as z:
        assert "header" in z.files and z["pts"].dtype == np.int64
    (tmp_path / "bad.npz").write_bytes(b"junk")
    with pytest.raises(Exception):  # noqa: B017 — numpy's own error for a non-archive
        load_index(tmp_path / "bad.npz")


def test_cli_index(folder, tmp_path):
    from avpipe.cli.main import main

    out = tmp_path / "cli.npz"
    assert main(["index", str(folder), "--out", str(out), "--workers", "1"]) in (0, None)
    assert len(load_index(out)) == 6  # seven files, broken.mp4 skipped
    lst = tmp_path / "list.txt"
    lst.write_text(f"{folder / 'circles_h264.mp4'}\n{folder / 'circles_vp9.webm'}\n")
    out2 = tmp_path / "cli2.npz"
    main(["index", str(lst), "--out", str(out2), "--workers", "1"])
    assert len(load_index(out2)) == 2
    out3 = tmp_path / "cli3.npz"
    main(["index", str(folder / "*.mp4"), "--out", str(out3), "--workers", "1"])
    assert len(load_index(out3)) == 3  # four .mp4, broken.mp4 skipped
