"""avpipe.recipes.extract: the quickstart preset over samples/, bookkeeping, resume, bad inputs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import avpipe
from avpipe.recipes import extract as ex
from avpipe.recipes.extract import PRESETS, Preset, run_extract, uniform_indices

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples"


def _jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _media(root):
    exts = PRESETS["quickstart"].extensions
    return sorted(
        p.relative_to(root).as_posix()
        for p in Path(root).rglob("*")
        if p.is_file() and p.suffix.lower() in exts and not p.name.startswith(".")
    )


def _check_complete(out, expected_sources):
    rows = _jsonl(out / "index.jsonl")
    sources = [r["source"] for r in rows]
    assert len(sources) == len(set(sources)), "duplicate index lines"
    assert sorted(sources) == sorted(expected_sources)
    for r in rows:
        arr = np.load(out / r["output"])
        assert list(arr.shape) == r["shape"] and str(arr.dtype) == r["dtype"], r
    return rows


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    out = tmp_path_factory.mktemp("feats")
    summary = run_extract(SAMPLES, preset="quickstart", out_dir=out, device="cpu")
    return out, summary


# --- the quickstart preset on the committed samples ---------------------------------------------


def test_quickstart_outputs(extracted):
    out, summary = extracted
    expected = _media(SAMPLES)
    assert len(expected) == 18
    rows = _check_complete(out, expected)
    assert _jsonl(out / "errors.jsonl") == []
    assert summary.written == {"audio": 6, "video": 6, "image": 6}
    assert summary.errors == 0 and summary.skipped == 0
    assert summary.ignored >= 4  # manifest, labels, README, the script
    for r in rows:
        # outputs mirror the input tree
        assert r["output"] == f"features/{r['source']}.npy"
        assert (out / "features" / (r["source"] + ".npy")).is_file()
        if r["kind"] == "audio":
            assert r["dtype"] == "float32" and r["shape"][0] == 80
        elif r["kind"] == "video":
            assert r["shape"] == [8, 224, 224, 3] and r["dtype"] == "uint8"
        else:
            assert r["shape"] == [224, 224, 3] and r["dtype"] == "uint8"
    text = summary.format()
    assert f"features written to {out}" in text and "6 audio" in text and "0 error" in text


def test_audio_features_are_nemo_log_mel(extracted):
    out, _ = extracted
    manifest = _jsonl(SAMPLES / "speech" / "manifest.jsonl")
    for row in manifest:
        feats = np.load(out / "features" / "speech" / (row["audio_filepath"] + ".npy"))
        # 10 ms hop: about 100 frames a second
        assert feats.shape[1] == pytest.approx(row["duration"] * 100, abs=2)
        assert np.isfinite(feats).all() and feats.std() > 0.1
    a = avpipe.load_audio(str(SAMPLES / "speech" / "utt03.flac"), sample_rate=16000)
    ref, lengths = avpipe.ops.log_mel(a.samples, preset="nemo")
    got = np.load(out / "features" / "speech" / "utt03.flac.npy")
    np.testing.assert_allclose(got, ref[0, :, : int(lengths[0])], rtol=0, atol=1e-5)


def test_video_features_are_uniform_frames(extracted):
    out, _ = extracted
    src = SAMPLES / "video" / "squares_vp8.webm"
    got = np.load(out / "features" / "video" / "squares_vp8.webm.npy")
    with avpipe.VideoDecoder(str(src), device="cpu") as dec:
        idx = uniform_indices(dec.metadata.num_frames, 8)
        frames = dec.get_frames(idx.tolist()).data
    from avpipe.ops import image as im

    ref = im.center_crop(im.resize(frames, short_side=224), 224)
    np.testing.assert_array_equal(got, ref)
    # 320x240 -> 299x224 -> central 224 columns: the frames move
    assert np.abs(got[0].astype(int) - got[-1]).mean() > 1.0


def test_image_thumbnail(extracted):
    out, _ = extracted
    got = np.load(out / "features" / "images" / "scene.png.npy")
    from PIL import Image

    # resize short side to 224 (320x240 -> 299x224), center crop 224: compare with PIL
    im = Image.open(SAMPLES / "images" / "scene.png").convert("RGB").resize((299, 224), Image.BILINEAR)
    left = round((299 - 224) / 2)
    ref = np.asarray(im)[:, left : left + 224]
    assert np.abs(got.astype(int) - ref).mean() < 1.5
    rot = np.load(out / "features" / "images" / "exif_rotate6.jpg.npy")
    assert rot.shape == (224, 224, 3)


def test_second_run_is_a_no_op(extracted, tmp_path):
    out, _ = extracted
    before = (out / "index.jsonl").read_bytes()
    s = run_extract(SAMPLES, preset="quickstart", out_dir=out, device="cpu")
    assert s.written == {} and s.skipped == 18 and s.errors == 0
    assert (out / "index.jsonl").read_bytes() == before
    assert "18 already done" in s.format()


def test_uniform_indices():
    assert uniform_indices(50, 8).tolist() == [3, 9, 15, 21, 28, 34, 40, 46]
    assert uniform_indices(8, 8).tolist() == list(range(8))
    assert uniform_indices(3, 8).tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="num_frames"):
        uniform_indices(0, 8)


# --- resume, crashes and bad inputs ------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path):
    """A copy of the speech and image samples plus one video, and three corrupt files."""
    d = tmp_path / "in"
    shutil.copytree(SAMPLES / "speech", d / "speech")
    shutil.copytree(SAMPLES / "images", d / "images")
    (d / "video").mkdir()
    shutil.copy(SAMPLES / "video" / "circles_h264.mp4", d / "video")
    good = (SAMPLES / "video" / "squares_h264.mp4").read_bytes()
    (d / "video" / "truncated.mp4").write_bytes(good[: len(good) // 3])
    (d / "speech" / "noise.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunkjunkjunk" * 4)
    (d / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    (d / ".hidden.wav").write_bytes(b"not walked")
    return d


BAD = {"video/truncated.mp4", "speech/noise.wav", "images/broken.png"}


class Crash(BaseException):
    """A simulated kill: not an Exception, so the job does not catch it."""


def _crashing(after: int):
    """Extractors that behave like the real ones but crash once ``after`` calls have been made."""
    calls = {"n": 0}

    def wrap(fn):
        def f(path, device):
            calls["n"] += 1
            if calls["n"] > after:
                raise Crash()
            return fn(path, device)

        return f

    return {k: wrap(fn) for k, fn in PRESETS["quickstart"].extractors.items()}


def test_bad_inputs_are_listed_and_skipped(media_dir, tmp_path):
    out = tmp_path / "out"
    s = run_extract(media_dir, preset="quickstart", out_dir=out, device="cpu")
    good = sorted(set(_media(media_dir)) - BAD)
    _check_complete(out, good)
    errs = _jsonl(out / "errors.jsonl")
    assert sorted(e["source"] for e in errs) == sorted(BAD)
    for e in errs:
        assert e["error"] and e["message"] and e["kind"] in ("audio", "video", "image")
        # content errors are typed avpipe errors
        assert issubclass(getattr(avpipe.errors, e["error"]), avpipe.DecodeError), e
    assert s.errors == 3 and s.total_written == len(good)
    assert "errors.jsonl" in s.format()
    # again: nothing new, the bad ones are retried and listed once
    s2 = run_extract(media_dir, preset="quickstart", out_dir=out, device="cpu")
    assert s2.total_written == 0 and s2.skipped == len(good) and s2.errors == 3
    assert sorted(e["source"] for e in _jsonl(out / "errors.jsonl")) == sorted(BAD)
    _check_complete(out, good)
    # a fixed input is picked up and leaves errors.jsonl
    shutil.copy(SAMPLES / "images" / "scene.png", media_dir / "images" / "broken.png")
    s3 = run_extract(media_dir, preset="quickstart", out_dir=out, device="cpu")
    assert s3.written == {"image": 1} and s3.errors == 2
    _check_complete(out, good + ["images/broken.png"])


def test_resume_after_a_crash(media_dir, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(Crash):
        run_extract(media_dir, preset="quickstart", out_dir=out, device="cpu",
                    extractors=_crashing(after=5))
    rows = _jsonl(out / "index.jsonl")
    assert 1 <= len(rows) <= 5  # the first five inputs (some of them bad) got done
    first = {r["source"]: (out / r["output"]).stat().st_mtime_ns for r in rows}

    s = run_extract(media_dir, preset="quickstart", out_dir=out, device="cpu")
    good = sorted(set(_media(media_dir)) - BAD)
    _check_complete(out, good)
    assert s.skipped == len(rows) and s.total_written == len(good) - len(rows)
    # finished outputs were not redone
    for src, mtime in first.items():
        assert (out / "features" / (src + ".npy")).stat().st_mtime_ns == mtime


def test_resume_repairs_index_and_missing_outputs(media_dir, tmp_path):
    out = tmp_path / "out"
    run_extract(media_dir, preset="quickstart", out_dir=out, device="cpu")
    good = sorted(set(_media(media_dir)) - BAD)
    rows = _jsonl(out / "index.jsonl")
    lines = (out / "index.jsonl").read_text().splitlines(keepends=True)
    # 1) an output deleted, 2) an output whose index line never made it (crash between the
    # rename and the append), 3) a duplicated line, 4) a line cut short by a crash
    os.remove(out / rows[0]["output"])
    del lines[1]
    lines.append(lines[2])
    lines.append(lines[3][: len(lines[3]) // 2])
    (out / "index.jsonl").write_text("".join(lines))
    s = run_extract(media_dir, preset="quickstart", out_dir=out, device="cpu")
    assert s.total_written == 2  # rows[0] and rows[1] again; nothing else
    _check_complete(out, good)
    # a duplicated line alone (no other damage) is removed too
    with open(out / "index.jsonl", "a") as f:
        f.write((out / "index.jsonl").read_text().splitlines(keepends=True)[0])
    s = run_extract(media_dir, preset="quickstart", out_dir=out, device="cpu")
    assert s.total_written == 0
    _check_complete(out, good)


def test_output_inside_input_is_not_walked(media_dir):
    out = media_dir / "feats"
    run_extract(media_dir, preset="quickstart", out_dir=out, device="cpu")
    s = run_extract(media_dir, preset="quickstart", out_dir=out, device="cpu")
    assert s.total_written == 0
    assert not any(r["source"].startswith("feats/") for r in _jsonl(out / "index.jsonl"))


def test_single_file_input(tmp_path):
    out = tmp_path / "out"
    s = run_extract(SAMPLES / "images" / "scene.jp2", preset="quickstart", out_dir=out, device="cpu")
    assert s.written == {"image": 1}
    (row,) = _jsonl(out / "index.jsonl")
    assert row["source"] == "scene.jp2" and row["shape"] == [224, 224, 3]


def test_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        run_extract(SAMPLES, preset="nope", out_dir=tmp_path / "o")
    with pytest.raises(FileNotFoundError):
        run_extract(tmp_path / "missing", preset="quickstart", out_dir=tmp_path / "o", device="cpu")
    with pytest.raises(ValueError, match="extractors"):
        run_extract(SAMPLES, preset="quickstart", out_dir=tmp_path / "o", device="cpu",
                    extractors={"text": lambda p, d: np.zeros(1)})
    # an out folder made by another preset is not mixed into
    other = Preset(name="other", description="", extensions={".png": "image"},
                   extractors={"image": lambda p, d: np.zeros(3, np.uint8)})
    run_extract(SAMPLES / "images", preset=other, out_dir=tmp_path / "o2", device="cpu")
    with pytest.raises(ValueError, match="preset"):
        run_extract(SAMPLES / "images", preset="quickstart", out_dir=tmp_path / "o2", device="cpu")
    # nor one made from another input (same relative names would pass for done)
    with pytest.raises(ValueError, match="is not the input"):
        run_extract(SAMPLES / "speech", preset=other, out_dir=tmp_path / "o2", device="cpu")


def test_writes_are_atomic(media_dir, tmp_path, monkeypatch):
    """A crash inside np.save leaves no file under the final name (only a .partial)."""
    out = tmp_path / "out"
    real_save = np.save

    def bad_save(f, arr, **kw):
        f.write(b"\x93NUMPY")  # a few bytes, then the process "dies"
        raise Crash()

    monkeypatch.setattr(ex.np, "save", bad_save)
    with pytest.raises(Crash):
        run_extract(SAMPLES / "images" / "scene.png", preset="quickstart", out_dir=out, device="cpu")
    assert not (out / "features" / "scene.png.npy").exists()
    assert _jsonl(out / "index.jsonl") == []
    monkeypatch.setattr(ex.np, "save", real_save)
    s = run_extract(SAMPLES / "images" / "scene.png", preset="quickstart", out_dir=out, device="cpu")
    assert s.written == {"image": 1}
    assert np.load(out / "features" / "scene.png.npy").shape == (224, 224, 3)


# --- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_quickstart_on_gpu_matches_cpu(extracted, tmp_path):
    cpu_out, _ = extracted
    out = tmp_path / "gpu"
    s = run_extract(SAMPLES, preset="quickstart", out_dir=out, device="cuda")
    assert s.device.startswith("cuda") and s.errors == 0, _jsonl(out / "errors.jsonl")
    rows = _check_complete(out, _media(SAMPLES))
    for r in rows:
        g = np.load(out / r["output"])
        c = np.load(cpu_out / r["output"])
        assert g.shape == c.shape and g.dtype == c.dtype, r
        if r["kind"] == "audio":
            # normalized log-mel: float32 FFT / resampler differences between numpy and cupy
            np.testing.assert_allclose(g, c, atol=1e-2, rtol=0, err_msg=r["source"])
            assert np.abs(g - c).mean() < 1e-3, r["source"]
        else:
            # NVDEC / nvJPEG colour conversion and IDCT differ from FFmpeg / libjpeg by a few levels
            diff = np.abs(g.astype(np.int32) - c.astype(np.int32))
            assert diff.mean() < 3.0, (r["source"], diff.mean())
