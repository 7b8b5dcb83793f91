"""The committed sample media in samples/: present, small, every format, consistent metadata,
decodable by avpipe, and regenerable deterministically by samples/make_samples.py."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf
from paths import REPO
from PIL import Image

import avpipe

ROOT = Path(REPO)
SAMPLES = ROOT / "samples"
SPEECH = SAMPLES / "speech"
VIDEO = SAMPLES / "video"
IMAGES = SAMPLES / "images"
MAX_TOTAL = 5 * 1024 * 1024


def _manifest():
    with open(SPEECH / "manifest.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _labels():
    with open(VIDEO / "labels.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_samples", SAMPLES / "make_samples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_total_size_is_small():
    total = sum(p.stat().st_size for p in SAMPLES.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert 100_000 < total <= MAX_TOTAL, total


def test_readme_and_generator_exist():
    assert (SAMPLES / "README.md").stat().st_size > 500
    assert (SAMPLES / "make_samples.py").is_file()


# --- speech -------------------------------------------------------------------------------------


def test_speech_formats_by_content():
    formats = {}
    for row in _manifest():
        info = sf.info(str(SPEECH / row["audio_filepath"]))
        formats.setdefault(info.format, []).append(info.subtype)
        assert info.samplerate == 16000 and info.channels == 1
    assert set(formats) == {"WAV", "FLAC", "OGG"}
    assert "VORBIS" in formats["OGG"]


def test_manifest_matches_audio():
    rows = _manifest()
    assert len(rows) >= 6
    for row in rows:
        assert set(row) >= {"audio_filepath", "duration", "text"}
        assert not os.path.isabs(row["audio_filepath"])
        path = SPEECH / row["audio_filepath"]
        assert path.is_file(), path
        info = sf.info(str(path))
        assert row["duration"] == pytest.approx(info.frames / info.samplerate, abs=1e-3)
        assert 2.0 <= row["duration"] <= 8.0
        text = row["text"]
        assert text == text.lower() and len(text.split()) >= 5
    # every audio file in speech/ is in the manifest
    listed = {r["audio_filepath"] for r in rows}
    on_disk = {p.name for p in SPEECH.iterdir() if p.suffix in (".wav", ".flac", ".ogg")}
    assert listed == on_disk


def test_speech_is_speech_like():
    """espeak output, not silence or a tone: energy varies over time and sits in the speech band."""
    x, sr = sf.read(str(SPEECH / _manifest()[0]["audio_filepath"]), dtype="float32")
    frames = x[: len(x) // 400 * 400].reshape(-1, 400)
    rms = np.sqrt((frames**2).mean(axis=1))
    assert rms.max() > 0.05
    assert (rms < 0.2 * rms.max()).mean() > 0.05  # pauses between syllables / words
    spec = np.abs(np.fft.rfft(x))
    f = np.fft.rfftfreq(len(x), 1 / sr)
    band = spec[(f > 100) & (f < 4000)].sum() / spec.sum()
    assert band > 0.7


@pytest.mark.parametrize("row", _manifest(), ids=lambda r: r["audio_filepath"])
def test_speech_decodes_with_avpipe(row):
    a = avpipe.load_audio(str(SPEECH / row["audio_filepath"]), sample_rate=16000)
    assert a.sample_rate == 16000 and a.samples.ndim == 1
    assert a.samples.dtype == np.float32
    assert a.samples.shape[0] / 16000 == pytest.approx(row["duration"], abs=2e-3)


# --- video --------------------------------------------------------------------------------------


def _probe(path):
    with av.open(str(path)) as c:
        v = c.streams.video[0]
        pkts = [(p.pts, p.is_keyframe) for p in c.demux(v) if p.size]
        return {
            "container": c.format.name,
            "codec": v.codec_context.name,
            "size": (v.codec_context.width, v.codec_context.height),
            "fps": float(v.average_rate),
            "audio": [s.codec_context.name for s in c.streams.audio],
            "pts_decode_order": [p for p, _ in pkts],
            "keyframes": [i for i, (_, k) in enumerate(sorted(pkts)) if k],
        }


def test_video_formats_by_content():
    infos = {row["path"]: _probe(VIDEO / row["path"]) for row in _labels()}
    for path, info in infos.items():
        assert info["size"] in ((320, 240), (160, 120)), path
        assert info["fps"] in (25.0, 30.0), path
    kinds = {(i["codec"], os.path.splitext(p)[1]) for p, i in infos.items()}
    assert kinds >= {
        ("h264", ".mp4"), ("hevc", ".mp4"), ("vp8", ".webm"), ("vp9", ".webm"), ("mjpeg", ".avi")
    }
    for path, info in infos.items():
        if info["codec"] == "h264":
            # B-frames: packets arrive out of presentation order; GOP 15
            assert info["pts_decode_order"] != sorted(info["pts_decode_order"]), path
            assert info["keyframes"][:3] == [0, 15, 30], path
    audio = {a for info in infos.values() for a in info["audio"]}
    assert audio >= {"aac", "opus"}
    assert any(not i["audio"] for i in infos.values())  # and some without an audio track


def test_labels_csv():
    rows = _labels()
    assert rows and list(rows[0]) == ["path", "label"]
    labels = [r["label"] for r in rows]
    assert sorted(set(labels)) == ["circles", "squares"]
    assert min(labels.count("circles"), labels.count("squares")) >= 2
    for r in rows:
        assert (VIDEO / r["path"]).is_file(), r["path"]
    on_disk = {p.name for p in VIDEO.iterdir() if p.suffix in (".mp4", ".webm", ".avi")}
    assert {r["path"] for r in rows} == on_disk


@pytest.mark.parametrize("row", _labels(), ids=lambda r: r["path"])
def test_video_decodes_with_avpipe(row):
    with avpipe.VideoDecoder(str(VIDEO / row["path"]), device="cpu") as dec:
        m = dec.metadata
        assert m.num_frames == 50 and (m.width, m.height) == (320, 240)
        assert m.duration_seconds == pytest.approx(2.0, abs=0.05)
        batch = dec.get_frames([0, 25, 49])
    frames = batch.data
    assert frames.shape == (3, 240, 320, 3) and frames.dtype == np.uint8
    # the shape moves: consecutive sampled frames differ
    assert np.abs(frames[0].astype(int) - frames[1]).mean() > 1.0


def test_video_classes_are_visible():
    """Circles fill about pi/4 of their bounding box, squares all of it: check on the first
    frame of every clip, by the pixels that differ from the drifting background."""
    for row in _labels():
        with av.open(str(VIDEO / row["path"])) as c:
            img = next(c.decode(video=0)).to_ndarray(format="rgb24").astype(np.int32)
        # the shape is the largest flat-coloured blob: pixels far from both neighbours' gradient
        gx = np.abs(np.diff(img, axis=1)).sum(axis=2)
        gy = np.abs(np.diff(img, axis=0)).sum(axis=2)
        edges = (gx[:-1, :] > 60) | (gy[:, :-1] > 60)
        ys, xs = np.nonzero(edges)
        assert len(ys) > 20, row["path"]
        y0, y1, x0, x1 = ys.min(), ys.max(), xs.min(), xs.max()
        box = edges[y0 : y1 + 1, x0 : x1 + 1]
        # the corners of a circle's bounding box have no edge pixels; a square's do
        k = max(2, (y1 - y0) // 8)
        corner_hits = sum(box[s].any() for s in [np.s_[:k, :k], np.s_[:k, -k:], np.s_[-k:, :k], np.s_[-k:, -k:]])
        if row["label"] == "circles":
            assert corner_hits == 0, row["path"]
        else:
            assert corner_hits >= 3, row["path"]


# --- images -------------------------------------------------------------------------------------

IMAGE_FORMATS = {
    "scene.jpg": "JPEG",
    "scene.png": "PNG",
    "scene.tif": "TIFF",
    "scene.jp2": "JPEG2000",
    "gray16.png": "PNG",
    "exif_rotate6.jpg": "JPEG",
}


def test_image_formats_by_content():
    for name, fmt in IMAGE_FORMATS.items():
        with Image.open(IMAGES / name) as im:
            assert im.format == fmt, name
    with Image.open(IMAGES / "gray16.png") as im:
        assert im.mode.startswith("I;16") or im.mode == "I"
        assert np.asarray(im).max() > 255  # really 16-bit
    with Image.open(IMAGES / "exif_rotate6.jpg") as im:
        assert im.getexif().get(0x0112) == 6
        assert im.size == (320, 240)


@pytest.mark.parametrize("name", sorted(IMAGE_FORMATS))
def test_image_decodes_with_avpipe(name):
    (img,) = avpipe.decode_images([str(IMAGES / name)], device="cpu")
    assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
    # the EXIF orientation is applied: displayed portrait
    assert img.shape[:2] == ((320, 240) if name == "exif_rotate6.jpg" else (240, 320))
    if name != "gray16.png":
        ref = np.asarray(Image.open(IMAGES / "scene.png").convert("RGB")).astype(np.int32)
        if name == "exif_rotate6.jpg":
            ref = np.rot90(ref, k=-1)  # orientation 6: rotate 90 degrees clockwise to display
        assert np.abs(img.astype(np.int32) - ref).mean() < 4.0, name


# --- the generator ------------------------------------------------------------------------------


def test_generator_is_deterministic_for_video_and_images():
    gen = _load_generator()
    a, b = gen.make_videos(), gen.make_videos()
    assert a == b
    assert gen.make_images() == gen.make_images()
    assert set(a) == {f"video/{r['path']}" for r in _labels()} | {"video/labels.csv"}


def test_ogg_serial_fix_keeps_a_valid_stream(tmp_path):
    gen = _load_generator()
    x = (0.3 * np.sin(np.arange(16000) / 9.0)).astype(np.float32)
    data = gen._encode_audio(x, "t.ogg")
    assert data == gen._encode_audio(x, "t.ogg")  # libsndfile's random serial was fixed
    p = tmp_path / "t.ogg"
    p.write_bytes(data)
    y, sr = sf.read(str(p), dtype="float32")
    assert sr == 16000 and len(y) == 16000
    assert np.abs(y - x).max() < 0.1


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")
def test_speech_generation_is_deterministic():
    gen = _load_generator()
    first = gen.make_speech()
    assert first == gen.make_speech()
    assert set(first) == {f"speech/{r['audio_filepath']}" for r in _manifest()} | {"speech/manifest.jsonl"}
