"""avpipe.recipes.extract: presets over samples/, inputs, formats, index, errors, workers."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from paths import REPO

import avpipe
from avpipe.recipes.extract import (
    PRESETS,
    EmptyInputError,
    PresetError,
    resolve_inputs,
    resolve_preset,
    run_extract,
    uniform_indices,
)
from avpipe.recipes.extract._presets import extensions_of
from avpipe.recipes.extract._writers import make_shards

ROOT = Path(REPO)
SAMPLES = ROOT / "samples"


def jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_outputs(out) -> dict:
    """source -> (array, KEY.json meta) from every shard / file of an output folder."""
    out = Path(out)
    got = {}
    for row in jsonl(out / "index.jsonl"):
        if row["status"] != "ok":
            continue
        if "output" in row:
            got[row["source"]] = (np.load(out / row["output"]), None)
        elif row["shard"].endswith(".tar"):
            with tarfile.open(out / row["shard"]) as tf:
                arr = np.load(io.BytesIO(tf.extractfile(f"{row['key']}.npy").read()))
                meta = json.loads(tf.extractfile(f"{row['key']}.json").read())
            got[row["source"]] = (arr, meta)
        else:
            import pyarrow.parquet as pq

            t = pq.read_table(out / row["shard"]).to_pylist()
            r = next(x for x in t if x["key"] == row["key"])
            arr = np.frombuffer(r["data"], dtype=r["dtype"]).reshape(r["shape"])
            got[row["source"]] = (arr, json.loads(r["meta"]))
        arr = got[row["source"]][0]
        assert list(arr.shape) == row["shape"] and str(arr.dtype) == row["dtype"], row
    return got


def tree(out) -> dict:
    """relative path -> bytes of every file in a folder."""
    out = Path(out)
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file()}


def cli(*args, **kw):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}
    return subprocess.run([sys.executable, "-m", "avpipe", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=240, **kw)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("quick")
    summary = run_extract(SAMPLES, preset="quickstart", out_dir=out, device="cpu", shard_size=5)
    return out, summary


@pytest.fixture
def speech(tmp_path):
    """12 audio files in two folders (the samples' speech twice) and the NeMo manifest."""
    d = tmp_path / "speech"
    for sub in ("a", "b"):
        shutil.copytree(SAMPLES / "speech", d / sub)
    return d


# --- the quickstart preset on samples/ ------------------------------------------------------


def test_quickstart_outputs(quick):
    out, summary = quick
    rows = jsonl(out / "index.jsonl")
    assert len(rows) == 18 and [r["index"] for r in rows] == list(range(18))
    assert summary.written == {"audio": 6, "video": 6, "image": 6}
    assert summary.errors == 0 and summary.skipped == 0 and summary.complete
    assert summary.ignored == 0  # manifest, labels, README, the script: metadata, not ignored
    assert jsonl(out / "errors.jsonl") == []
    # 18 inputs in shards of 5: named by input range
    assert sorted(os.listdir(out / "shards")) == [
        "shard-000000-000004.tar", "shard-000005-000009.tar", "shard-000010-000014.tar",
        "shard-000015-000017.tar",
    ]
    got = load_outputs(out)
    for r in rows:
        arr, meta = got[r["source"]]
        assert meta["source"] == r["source"] and meta["kind"] == r["kind"]
        assert r["params"]["preset"] == "quickstart"
        if r["kind"] == "audio":
            assert arr.dtype == np.float32 and arr.shape[0] == 80
            assert r["params"]["sample_rate"] == 16000 and r["params"]["ops"][0]["op"] == "log_mel"
            assert meta["text"] and meta["duration"] > 0  # the manifest's fields
        elif r["kind"] == "video":
            assert arr.shape == (8, 224, 224, 3) and arr.dtype == np.uint8
            assert meta["label"] in ("circles", "squares")  # labels.csv
            assert len(r["info"]["frame_indices"]) == 8 and len(r["info"]["times"]) == 8
        else:
            assert arr.shape == (224, 224, 3) and arr.dtype == np.uint8
    text = summary.format()
    assert f"features written to {out}" in text and "6 audio" in text and "0 error" in text
    meta = json.loads((out / "extract.json").read_text())
    assert meta["preset"]["name"] == "quickstart" and meta["shard_size"] == 5
    assert meta["input"]["count"] == 18


def test_tar_members_are_deterministic(quick):
    out, _ = quick
    with tarfile.open(out / "shards" / "shard-000005-000009.tar") as tf:
        members = tf.getmembers()
    assert [m.name for m in members] == [
        f"{k:09d}.{ext}" for k in range(5, 10) for ext in ("npy", "json")
    ]
    assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.uname == "" and m.mode == 0o644
               for m in members)


def test_audio_features_are_nemo_log_mel(quick):
    out, _ = quick
    got = load_outputs(out)
    for row in jsonl(SAMPLES / "speech" / "manifest.jsonl"):
        feats, meta = got["speech/" + row["audio_filepath"]]
        assert meta["text"] == row["text"]
        assert feats.shape[1] == pytest.approx(row["duration"] * 100, abs=2)
        assert np.isfinite(feats).all() and feats.std() > 0.1
    a = avpipe.load_audio(str(SAMPLES / "speech" / "utt03.flac"), sample_rate=16000)
    ref, lengths = avpipe.ops.log_mel(a.samples, preset="nemo")
    np.testing.assert_allclose(got["speech/utt03.flac"][0], ref[0, :, : int(lengths[0])],
                               rtol=0, atol=1e-5)


def test_stereo_pcm16_features_are_log_mel_of_load_audio(tmp_path):
    """A stereo 16-bit WAV beside a mono one (one loader group): the channels' mean is not an
    integer, so it must not travel as int16; both equal ops.log_mel of load_audio."""
    import soundfile as sf

    rng = np.random.default_rng(0)
    t = np.arange(32000) / 16000
    left = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)
    right = 0.2 * np.sin(2 * np.pi * 660 * t + 0.3) + 0.05 * rng.standard_normal(t.size)
    d = tmp_path / "in"
    d.mkdir()
    sf.write(d / "stereo.wav", np.stack([left, right], 1), 16000, subtype="PCM_16")
    sf.write(d / "mono.wav", left, 16000, subtype="PCM_16")
    out = tmp_path / "o"
    s = run_extract(d, preset="nemo", out_dir=out, device="cpu")
    assert s.written == {"audio": 2}
    got = load_outputs(out)
    for name in ("stereo.wav", "mono.wav"):
        a = avpipe.load_audio(str(d / name), sample_rate=16000)
        ref, n = avpipe.ops.log_mel(a.samples[None], preset="nemo")
        np.testing.assert_allclose(got[name][0], ref[0, :, : int(n[0])], rtol=0, atol=1e-5,
                                   err_msg=name)


def test_video_features_are_uniform_frames(quick):
    out, _ = quick
    got, _ = load_outputs(out)["video/squares_vp8.webm"]
    with avpipe.VideoDecoder(str(SAMPLES / "video" / "squares_vp8.webm"), device="cpu") as dec:
        idx = uniform_indices(dec.metadata.num_frames, 8)
        frames = dec.get_frames(idx.tolist()).data
    from avpipe.ops import image as im

    np.testing.assert_array_equal(got, im.center_crop(im.resize(frames, short_side=224), 224))
    assert np.abs(got[0].astype(int) - got[-1]).mean() > 1.0


def test_image_thumbnail(quick):
    out, _ = quick
    got, _ = load_outputs(out)["images/scene.png"]
    from PIL import Image

    im = Image.open(SAMPLES / "images" / "scene.png").convert("RGB").resize((299, 224),
                                                                             Image.BILINEAR)
    left = round((299 - 224) / 2)
    assert np.abs(got.astype(int) - np.asarray(im)[:, left : left + 224]).mean() < 1.5


def test_formats_hold_the_same_arrays(quick, tmp_path):
    out, _ = quick
    ref = load_outputs(out)
    for fmt in ("parquet", "npy"):
        o = tmp_path / fmt
        s = run_extract(SAMPLES, preset="quickstart", out_dir=o, device="cpu", shard_size=5,
                        format=fmt)
        assert s.total_written == 18
        got = load_outputs(o)
        assert sorted(got) == sorted(ref)
        for k, (arr, meta) in got.items():
            np.testing.assert_array_equal(arr, ref[k][0])
            if meta is not None:
                assert meta == ref[k][1]
    assert (tmp_path / "npy" / "features" / "speech" / "utt01.wav.npy").is_file()
    assert sorted(os.listdir(tmp_path / "parquet" / "shards"))[0] == "shard-000000-000004.parquet"


# --- inputs ---------------------------------------------------------------------------------


def test_nemo_manifest_carries_fields_and_offsets(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(SAMPLES / "speech", d / "audio")
    rows = [
        {"audio_filepath": "audio/utt01.wav", "duration": 2.9, "text": "one"},
        {"audio_filepath": "audio/utt03.flac", "duration": 1.0, "offset": 0.5, "text": "two"},
        {"audio_filepath": "audio/utt03.flac", "duration": 1.5, "offset": 1.5, "text": "three"},
        {"audio_filepath": "audio/missing.wav", "duration": 1.0, "text": "gone"},
    ]
    (d / "train.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o"
    s = run_extract(d / "train.json", preset="nemo", out_dir=out, device="cpu", format="npy")
    idx = jsonl(out / "index.jsonl")
    assert [r["source"] for r in idx] == ["audio/utt01.wav", "audio/utt03.flac",
                                          "audio/utt03.flac", "audio/missing.wav"]
    assert [r["fields"]["text"] for r in idx] == ["one", "two", "three", "gone"]
    assert [r["status"] for r in idx] == ["ok", "ok", "ok", "error"]
    assert s.errors == 1 and s.total_written == 3
    # offset / duration select the span: 1.0 s -> 100 frames, 1.5 s -> 150
    assert idx[1]["shape"] == [80, 100] and idx[2]["shape"] == [80, 150]
    # one file listed twice: two outputs
    assert idx[1]["output"] != idx[2]["output"]
    a = avpipe.load_audio(str(d / "audio" / "utt03.flac"), sample_rate=16000, offset=0.5,
                          duration=1.0)
    ref, n = avpipe.ops.log_mel(a.samples, preset="nemo")
    np.testing.assert_allclose(np.load(out / idx[1]["output"]), ref[0, :, : int(n[0])],
                               atol=1e-5)
    (err,) = jsonl(out / "errors.jsonl")
    assert err["source"] == "audio/missing.wav" and err["path"].endswith("missing.wav")


def test_csv_manifest_glob_and_file_list(tmp_path):
    exts = extensions_of(resolve_preset("clips"))
    inp = resolve_inputs(SAMPLES / "video" / "labels.csv", exts)
    assert inp.form == "manifest" and len(inp.items) == 6
    assert inp.items[0].source == "circles_h264.mp4" and inp.items[0].fields == {"label": "circles"}
    g = resolve_inputs(str(SAMPLES / "**" / "*.ogg"), extensions_of(resolve_preset("nemo")))
    assert g.form == "glob" and [i.source for i in g.items] == ["speech/utt05.ogg",
                                                                 "speech/utt06.ogg"]
    lst = tmp_path / "files.txt"
    lst.write_text(f"# two files\n{SAMPLES}/images/scene.jpg\n\n{SAMPLES}/images/scene.png\n")
    f = resolve_inputs(lst, extensions_of(resolve_preset("thumbnails")))
    assert f.form == "list" and [i.kind for i in f.items] == ["image", "image"]
    one = resolve_inputs(SAMPLES / "speech" / "utt01.wav", exts | extensions_of(PRESETS["nemo"]))
    assert one.form == "file" and one.items[0].source == "utt01.wav"


def test_empty_input_says_what_was_looked_for(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "notes.txt").write_text("x")
    with pytest.raises(EmptyInputError, match=r"\.flac.*under the folder"):
        run_extract(tmp_path / "in", preset="nemo", out_dir=tmp_path / "o", device="cpu")
    r = cli("extract", tmp_path / "in", "--preset", "nemo", "--out", tmp_path / "o",
            "--devices", "cpu")
    assert r.returncode != 0 and ".wav" in r.stderr and "in" in r.stderr
    with pytest.raises(EmptyInputError, match="glob"):
        run_extract(str(tmp_path / "*.flac"), preset="nemo", out_dir=tmp_path / "o",
                    device="cpu")


# --- presets --------------------------------------------------------------------------------


def test_mlperf_and_mfcc_presets(tmp_path):
    src = SAMPLES / "speech" / "utt04.flac"
    a = avpipe.load_audio(str(src), sample_rate=16000)
    out = tmp_path / "ml"
    run_extract(src, preset="mlperf_rnnt", out_dir=out, device="cpu")
    (got, meta), = load_outputs(out).values()
    ref, n = avpipe.ops.log_mel(a.samples, preset="mlperf_rnnt")
    np.testing.assert_allclose(got, ref[0, :, : int(n[0])], atol=1e-5)
    out = tmp_path / "mfcc"
    run_extract(src, preset="mfcc", out_dir=out, device="cpu")
    (got, _), = load_outputs(out).values()
    import librosa

    x = np.asarray(a.samples, dtype=np.float32)
    mel = librosa.feature.melspectrogram(y=x, sr=16000, n_fft=512, win_length=400,
                                         hop_length=160, n_mels=80, window="hann")
    ref = librosa.feature.mfcc(S=librosa.power_to_db(mel, top_db=80.0), n_mfcc=20)
    assert got.shape[0] == 20 and abs(got.shape[1] - ref.shape[1]) <= 1
    t = min(got.shape[1], ref.shape[1]) - 2
    # the window differs (symmetric here, periodic in librosa): close, not equal
    assert np.abs(got[:, 1:t] - ref[:, 1:t]).mean() < 0.05 * np.abs(ref).mean()


def test_frames_and_clips_presets(tmp_path):
    src = SAMPLES / "video" / "squares_h264.mp4"
    out = tmp_path / "f"
    run_extract(src, preset="frames", out_dir=out, device="cpu", fps=4)
    (row,) = jsonl(out / "index.jsonl")
    with avpipe.VideoDecoder(str(src), device="cpu") as dec:
        dur = dec.metadata.duration_seconds
    assert row["shape"][0] == int(np.ceil(dur * 4 - 1e-9)) and row["shape"][1:] == [224, 224, 3]
    assert row["params"]["fps"] == 4.0
    times = row["info"]["times"]
    assert np.allclose(np.diff(times), 0.25, atol=0.05)
    out = tmp_path / "c"
    run_extract(src, preset="clips", out_dir=out, device="cpu")
    (row,) = jsonl(out / "index.jsonl")
    assert row["shape"] == [4, 16, 224, 224, 3]
    fi = np.array(row["info"]["frame_indices"])
    assert fi.shape == (4, 16) and (np.diff(fi, axis=1) == 1).all()
    with pytest.raises(PresetError, match="fps"):
        resolve_preset("clips", fps=2)


def test_toml_preset(tmp_path):
    p = tmp_path / "small_mel.toml"
    p.write_text(
        'description = "64 mels, stacked"\n'
        "batch_size = 4\n"
        "[audio]\nsample_rate = 16000\n"
        'ops = [{op = "log_mel", preset = "nemo", n_mels = 64},\n'
        '       {op = "stack_frames", stacking = 2, subsampling = 2}]\n'
        "[image]\n"
        'ops = [{op = "resize", size = [32, 48]}]\n'
    )
    out = tmp_path / "o"
    s = run_extract(SAMPLES, preset=str(p), out_dir=out, device="cpu")
    assert s.preset == "small_mel" and s.written == {"audio": 6, "image": 6}
    rows = jsonl(out / "index.jsonl")
    for r in rows:
        if r["kind"] == "audio":
            assert r["shape"][0] == 128
            assert r["params"]["ops"][0] == {"op": "log_mel", "preset": "nemo", "n_mels": 64}
        else:
            assert r["shape"] == [32, 48, 3]
    bad = tmp_path / "bad.toml"
    bad.write_text('[audio]\nops = [{op = "fft"}]\n')
    with pytest.raises(PresetError, match="unknown operator 'fft'"):
        resolve_preset(str(bad))
    bad.write_text('[audio]\nops = [{op = "log_mel", n_mel = 64}]\n')
    with pytest.raises(PresetError, match="n_mel"):
        resolve_preset(str(bad))
    r = cli("extract", SAMPLES, "--preset", bad, "--out", tmp_path / "x")
    assert r.returncode == 2 and "--preset" in r.stderr


@pytest.mark.parametrize("ops, names", [
    ('[{op = "log_mel", preset = "bogus"}]', ("ops[0] (log_mel)", "preset", "'bogus'")),
    ('[{op = "log_mel"}, {op = "normalize", mode = "per_frame"}]',
     ("ops[1] (normalize)", "mode", "'per_frame'")),
])
def test_toml_preset_values_are_checked_before_anything_is_written(tmp_path, ops, names):
    """A bad operator value fails the command when the preset is read (naming the operator,
    the argument and the value), not every input at run time with exit status 0."""
    p = tmp_path / "bad_value.toml"
    p.write_text(f"[audio]\nops = {ops}\n")
    with pytest.raises(PresetError, match="must be"):
        resolve_preset(str(p))
    out = tmp_path / "o"
    r = cli("extract", SAMPLES / "speech", "--preset", p, "--out", out, "--devices", "cpu")
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = " ".join(r.stderr.split())  # click wraps the message
    assert "--preset" in err and all(n in err for n in names), r.stderr
    assert not out.exists()


def test_help_lists_every_preset():
    r = cli("extract", "--help")
    assert r.returncode == 0, r.stderr
    for name in ("quickstart", "nemo", "mlperf_rnnt", "mfcc", "frames", "clips", "thumbnails"):
        assert f"\n  {name} " in r.stdout
    for opt in ("--format", "--shard-size", "--devices", "--engine", "--strict", "--fps"):
        assert opt in r.stdout


# --- errors, strict, resume -----------------------------------------------------------------


def test_corrupt_inputs_only_in_the_report(speech, tmp_path):
    (speech / "a" / "bad.flac").write_bytes(b"fLaC" + b"\x00" * 40)
    (speech / "b" / "empty.wav").write_bytes(b"")
    out = tmp_path / "o"
    r = cli("extract", speech, "--preset", "nemo", "--out", out, "--devices", "cpu",
            "--shard-size", "4")
    assert r.returncode == 0, r.stderr
    assert "2 error(s)" in r.stdout and "errors.jsonl" in r.stdout
    errs = jsonl(out / "errors.jsonl")
    assert [e["source"] for e in errs] == ["a/bad.flac", "b/empty.wav"]
    assert all(e["error"] and e["message"] and e["path"] for e in errs)
    rows = jsonl(out / "index.jsonl")
    bad = {r["index"] for r in rows if r["status"] == "error"}
    assert len(rows) == 14 and len(bad) == 2
    assert all("shard" not in r and "key" not in r for r in rows if r["status"] == "error")
    names = set()
    for t in sorted((out / "shards").iterdir()):
        with tarfile.open(t) as tf:
            names |= set(tf.getnames())
    assert len(names) == 2 * 12
    assert not any(n.startswith(f"{i:09d}") for i in bad for n in names)
    # --strict: same folder, nothing to redo, but inputs failed -> non-zero
    r = cli("extract", speech, "--preset", "nemo", "--out", out, "--devices", "cpu",
            "--shard-size", "4", "--strict")
    assert r.returncode == 3 and "12 already done" in r.stdout
    assert "2 input(s) failed in an earlier run" in r.stdout


def test_resume_refuses_another_config(speech, tmp_path):
    out = tmp_path / "o"
    run_extract(speech, preset="nemo", out_dir=out, device="cpu", shard_size=4)
    for kw in ({"preset": "mlperf_rnnt"}, {"shard_size": 3}, {"format": "npy"}):
        args = {"preset": "nemo", "shard_size": 4, **kw}
        with pytest.raises(ValueError, match="another"):
            run_extract(speech, out_dir=out, device="cpu", **args)
    s = run_extract(speech, preset="nemo", out_dir=out, device="cpu", shard_size=4)
    assert s.total_written == 0 and s.skipped == 12


def test_deleted_shard_is_redone(speech, tmp_path):
    out = tmp_path / "o"
    run_extract(speech, preset="nemo", out_dir=out, device="cpu", shard_size=4)
    before = tree(out)
    os.remove(out / "shards" / "shard-000004-000007.tar")
    (out / "parts" / "shard-000008-000011.jsonl").write_text('{"index": 8}\n')  # cut short
    s = run_extract(speech, preset="nemo", out_dir=out, device="cpu", shard_size=4)
    assert s.total_written == 8 and s.skipped == 4
    assert tree(out) == before


def test_two_workers_on_one_device_match_one(speech, tmp_path):
    a, b = tmp_path / "one", tmp_path / "two"
    r1 = cli("extract", speech, "--preset", "nemo", "--out", a, "--devices", "cpu",
             "--shard-size", "3", "--batch-size", "2")
    r2 = cli("extract", speech, "--preset", "nemo", "--out", b, "--devices", "cpu,cpu",
             "--shard-size", "3", "--batch-size", "2", "--workers", "1")
    assert r1.returncode == 0 and r2.returncode == 0, (r1.stderr, r2.stderr)
    assert "cpu,cpu" in r2.stdout
    assert tree(a) == tree(b)


def test_retry_errors_redoes_the_shards_with_failures(speech, tmp_path):
    bad = speech / "a" / "utt03.flac"
    good = bad.read_bytes()
    bad.write_bytes(b"fLaC" + b"\x00" * 40)
    out = tmp_path / "o"
    s = run_extract(speech, preset="nemo", out_dir=out, device="cpu", shard_size=4)
    assert s.errors == 1 and s.total_written == 11
    bad.write_bytes(good)
    s = run_extract(speech, preset="nemo", out_dir=out, device="cpu", shard_size=4)
    assert s.total_written == 0 and s.earlier_errors == 1 and s.total_errors == 1
    s = run_extract(speech, preset="nemo", out_dir=out, device="cpu", shard_size=4,
                    retry_errors=True)
    assert s.total_written == 4 and s.errors == 0 and s.total_errors == 0
    assert jsonl(out / "errors.jsonl") == []
    ref = tmp_path / "ref"
    run_extract(speech, preset="nemo", out_dir=ref, device="cpu", shard_size=4)
    assert tree(out) == tree(ref)


def test_tar_header_is_tarfiles():
    """The shard writer's ustar header template gives tarfile's bytes (names of every length
    it takes, sizes up to its largest)."""
    from avpipe.recipes.extract._writers import _tar_header, _tar_header_slow

    for name in ("000000001.npy", "123456789.json", "a", "x" * 99, "x" * 100, "d/" * 60 + "x",
                 "é.npy", ""):
        for size in (0, 1, 511, 512, 10**6, 8**11 - 1, 123_456_789):
            assert _tar_header(name, size) == _tar_header_slow(name, size), (name, size)


def test_device_is_one_device_devices_the_list(speech, tmp_path, monkeypatch):
    """device= means one device as everywhere in avpipe ("cuda" is cuda:0); devices= is the
    list ("cuda": every GPU); with neither the job takes every GPU; both is an error. The
    machine is made to show two GPUs; the workers are not started (their devices recorded)."""
    import avpipe.device
    from avpipe.recipes.extract import _engine_local

    monkeypatch.delenv("AVPIPE_DISABLE_GPU", raising=False)
    monkeypatch.setattr(avpipe.device.devices, "_cuda_device_count", lambda: 2)
    ran = []

    def run_local(devices, *a, **k):
        ran.append(devices)
        return []

    monkeypatch.setattr(_engine_local, "run_local", run_local)
    for i, (kw, want) in enumerate([
        ({"device": "cuda"}, ["cuda:0"]),
        ({"device": "cuda:1"}, ["cuda:1"]),
        ({"device": "cpu"}, ["cpu"]),
        ({"devices": "cuda"}, ["cuda:0", "cuda:1"]),
        ({"devices": ["cuda:1", "cuda:1"]}, ["cuda:1", "cuda:1"]),
        ({}, ["cuda:0", "cuda:1"]),
    ]):
        s = run_extract(speech, preset="nemo", out_dir=tmp_path / str(i), **kw)
        assert ran[-1] == want and s.devices == want, kw
    with pytest.raises(ValueError, match=r"device or devices.*device='cpu'.*devices='cpu'"):
        run_extract(speech, preset="nemo", out_dir=tmp_path / "both", device="cpu",
                    devices="cpu")
    assert not (tmp_path / "both").exists()
    with pytest.raises(ValueError, match="devices="):
        run_extract(speech, preset="nemo", out_dir=tmp_path / "list", device="cpu,cpu")


def test_device_cpu_runs_one_cpu_worker(speech, tmp_path):
    s = run_extract(speech, preset="nemo", out_dir=tmp_path / "o", device="cpu", shard_size=4)
    assert s.devices == ["cpu"] and s.complete and s.total_written == 12
    r = cli("extract", speech, "--preset", "nemo", "--out", tmp_path / "c", "--device", "cpu",
            "--devices", "cpu")
    assert r.returncode == 2 and "--devices or --device" in r.stderr


def test_extract_modules_import_at_module_level():
    """The recipe's modules import what they use at their top (it all loads with the package
    anyway): no lazy import table, no avpipe or light standard module imported inside a
    function; only the engine chosen at run time and optional or heavy libraries are."""
    import ast

    lazy_ok = {"avpipe.recipes.extract._engine_local", "avpipe.recipes.extract._engine_ray"}
    light = {"collections", "fcntl", "json", "multiprocessing", "os", "sys", "time",
             "threading", "dataclasses", "importlib"}
    bad = []
    for path in sorted((ROOT / "avpipe" / "recipes" / "extract").glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if fn.name == "__getattr__":
                bad.append(f"{path.name}: a module __getattr__")
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    mod = ("avpipe.recipes.extract." if node.level == 1 else
                           "avpipe." if node.level else "") + (node.module or "")
                    names = [mod.rstrip(".") + "." + a.name if node.level and not node.module
                             else mod for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for n in names:
                    if n in lazy_ok:
                        continue
                    if n.startswith("avpipe") or n.split(".")[0] in light:
                        bad.append(f"{path.name}:{node.lineno}: {n} imported in {fn.name}()")
    assert not bad, "\n".join(bad)


def test_progress_is_sent_per_batch():
    from avpipe.pipeline.sources import Item
    from avpipe.recipes.extract._engine_local import _Tally
    from avpipe.recipes.extract._process import Result

    sent = []
    t = _Tally(sent.append, every=3)
    ok = Result(Item(index=0, source="a", path="a", kind="audio", fields={}),
                np.zeros(1), {"seconds": 1.5})
    bad = Result(Item(index=1, source="b", path="b", kind="image", fields={}), error="E")
    for r in (ok, bad, ok, ok):
        t(r)
    assert sent == [(3, 1, 3.0, 0.0)]
    t.flush()
    t.flush()
    assert sent == [(3, 1, 3.0, 0.0), (1, 0, 1.5, 0.0)]


@pytest.mark.parametrize("inp, preset, unit, total", [
    # audio only, durations from the folder's manifest: hours, known before the first file
    ("speech", "nemo", "audio-h", "manifest"),
    # audio only, no durations known: hours, the total estimated from the files done
    ("speech/*.ogg", "nemo", "audio-h", "estimated"),
    ("video/squares_vp8.webm", "quickstart", "frame", 8),  # 8 uniform frames per video
    ("video/squares_vp8.webm", "clips", "frame", 64),  # 4 clips of 16
    ("images", "thumbnails", "file", 6),  # images are not frames
    ("video/squares_vp8.webm", "frames", "file", 1),  # --fps: frames per video not known
])
def test_progress_bar_unit_fits_the_inputs(tmp_path, monkeypatch, capsys, inp, preset, unit,
                                           total):
    import avpipe.recipes.extract as ex

    bars = []

    class Recorded(ex._Progress):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            bars.append(self)
            self.first_total = self.bar.total

    monkeypatch.setattr(ex, "_Progress", Recorded)
    s = run_extract(str(SAMPLES / inp), preset=preset, out_dir=tmp_path / "o", device="cpu",
                    progress=True)
    assert s.complete and s.errors == 0
    (bar,) = bars
    err = capsys.readouterr().err
    assert bar.unit == unit, bar.unit
    assert f" {unit} [" in err and "files/s" in err, err[-300:]  # rates: per second
    assert f"s/ {unit}" not in err and f"s/{unit}" not in err, err[-300:]
    if total == "manifest":
        durations = [r["duration"] for r in jsonl(SAMPLES / "speech" / "manifest.jsonl")]
        assert bar.first_total == pytest.approx(sum(durations) / 3600)
        assert bar.bar.n == pytest.approx(bar.first_total, rel=1e-3)
    elif total == "estimated":
        assert bar.first_total is None
        assert bar.bar.total == pytest.approx(s.audio_seconds / 3600) and s.audio_seconds > 1
        assert bar.bar.n == pytest.approx(bar.bar.total)
    else:
        assert bar.first_total == total and bar.bar.n == total
    if preset == "thumbnails":
        assert s.frames == 0 and "frames/s" not in s.format()


@pytest.mark.parametrize("preset", ["nemo", "nemo_v1", "mlperf_rnnt", "mfcc"])
def test_audio_warm_up_runs_the_presets_operators(preset, monkeypatch):
    """The warm-up (run in a thread on a GPU while the loader opens the files) goes through the
    preset's operators without an error (errors are swallowed there: checked here)."""
    from avpipe.device import resolve_device
    from avpipe.recipes.extract import _process

    calls = []
    real = _process.apply_audio_ops

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out[0].shape)
        return out

    monkeypatch.setattr(_process, "apply_audio_ops", spy)
    cfg = resolve_preset(preset)["audio"]
    threads = _process.warm_up_audio(cfg, resolve_device("cpu"))
    for t in threads:
        t.join()
    assert len(threads) == 1 and len(calls) == 1 and calls[0][0] == 2


def test_float16_audio_features(speech, tmp_path):
    """--dtype float16: the float32 features rounded, recorded in extract.json and the index;
    the default writes no dtype key (float32 outputs are what they were)."""
    a, b = tmp_path / "f32", tmp_path / "f16"
    run_extract(speech, preset="nemo", out_dir=a, device="cpu", shard_size=5)
    s = run_extract(speech, preset="nemo", out_dir=b, device="cpu", shard_size=5,
                    dtype="float16")
    assert s.complete and s.errors == 0
    full, half = load_outputs(a), load_outputs(b)
    assert set(full) == set(half) and len(full) == 12
    for src, (arr, meta) in half.items():
        assert arr.dtype == np.float16 and meta["dtype"] == "float16"
        np.testing.assert_array_equal(arr, full[src][0].astype(np.float16))
    rows = jsonl(b / "index.jsonl")
    assert all(r["params"]["dtype"] == "float16" and r["dtype"] == "float16" for r in rows)
    assert all("dtype" not in r["params"] and r["dtype"] == "float32"
               for r in jsonl(a / "index.jsonl"))
    assert json.loads((b / "extract.json").read_text())["preset"]["audio"]["dtype"] == "float16"
    with pytest.raises(ValueError, match="another preset"):  # resume with another dtype
        run_extract(speech, preset="nemo", out_dir=b, device="cpu", shard_size=5)
    s = run_extract(speech, preset="nemo", out_dir=a, device="cpu", shard_size=5,
                    dtype="float32")  # the default, given: the same job
    assert s.skipped == 12


def test_dtype_is_checked(speech, tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of float32, float16, got 'int8'"):
        run_extract(speech, preset="nemo", out_dir=tmp_path / "o", device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="dtype='float16' applies to audio"):
        run_extract(speech, preset="frames", out_dir=tmp_path / "o", device="cpu",
                    dtype="float16")
    toml = tmp_path / "p.toml"
    toml.write_text('[audio]\nops = [{op = "log_mel"}]\ndtype = "bfloat16"\n')
    with pytest.raises(PresetError, match=r"\[audio\] dtype must be one of float32, float16, "
                                          r"got 'bfloat16'"):
        resolve_preset(str(toml))
    r = cli("extract", speech, "--preset", "nemo", "--out", tmp_path / "c", "--dtype", "half")
    assert r.returncode == 2 and "--dtype" in r.stderr and "half" in r.stderr


def test_standby_worker_is_ended_when_unused(speech, tmp_path, monkeypatch):
    """The worker started ahead (Standby) is ended when the run fails before it is handed work,
    and when there is nothing to do; a used one finishes its shards."""
    from avpipe.pipeline import workers

    def children() -> set:  # this process's child processes still running (Linux)
        me, out = str(os.getpid()), set()
        for d in os.listdir("/proc"):
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                out.add(int(d))
        return out

    started = []
    init = workers.Worker.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        started.append(self.pid)

    monkeypatch.setattr(workers.Worker, "__init__", record)
    with pytest.raises(PresetError):
        run_extract(speech, preset="nope", out_dir=tmp_path / "o", device="cpu")
    assert not children() & set(started)
    s = run_extract(speech, preset="nemo", out_dir=tmp_path / "o", device="cpu", shard_size=6)
    assert s.total_written == 12 and started and not children() & set(started)
    s = run_extract(speech, preset="nemo", out_dir=tmp_path / "o", device="cpu", shard_size=6)
    assert s.skipped == 12 and s.total_written == 0 and not children() & set(started)


def _shard_arrays(speech, monkeypatch, fail, *, at_collect=False):
    """Every audio input's features through iter_shards in this process on the CPU (batches of
    4), with ``apply_audio_ops`` raising where ``fail(lengths)`` says so (``at_collect``: the
    wait for the batch's copy raises instead, as a device error would surface there)."""
    from avpipe.device import resolve_device
    from avpipe.recipes.extract import _process

    real_ops, real_download = _process.apply_audio_ops, _process.download

    class Failed:
        def synchronize(self):
            raise RuntimeError("injected at the copy")

    def flaky(x, lengths, *a, **k):
        if not at_collect and fail(list(lengths)):
            raise ValueError("injected")
        out = real_ops(x, lengths, *a, **k)
        flaky.last = list(lengths)
        return out

    def download(arrays):
        host, event = real_download(arrays)
        return host, (Failed() if at_collect and fail(flaky.last) else event)

    monkeypatch.setattr(_process, "apply_audio_ops", flaky)
    monkeypatch.setattr(_process, "download", download)
    cfg = resolve_preset("nemo")
    cfg["batch_size"] = 4
    items = resolve_inputs(speech, extensions_of(cfg)).items
    shards = make_shards(len(items), 5)
    out = {}
    for _, rs in _process.iter_shards(shards, items, cfg, resolve_device("cpu"), workers=1):
        for r in rs:
            out[r.item.source] = r.array if r.ok else r.error
    return out


def test_a_failing_batch_is_computed_item_by_item(speech, monkeypatch):
    """A batch whose features raise is computed again one item at a time: the items that
    compute alone give their batch's values, those that fail alone are the only errors."""
    ref = _shard_arrays(speech, monkeypatch, lambda lens: False)
    assert len(ref) == 12 and all(isinstance(v, np.ndarray) for v in ref.values())
    batches = _shard_arrays(speech, monkeypatch, lambda lens: len(lens) > 1)
    assert batches.keys() == ref.keys()
    for k, v in ref.items():
        np.testing.assert_allclose(batches[k], v, rtol=1e-4, atol=1e-4)
    frames = max(v.shape[-1] for v in ref.values())  # nemo: n // 160 frames
    longest = sorted(k for k, v in ref.items() if v.shape[-1] == frames)
    one = _shard_arrays(speech, monkeypatch, lambda lens: max(lens) >= frames * 160)
    assert sorted(k for k, v in one.items() if isinstance(v, str)) == longest
    assert all(one[k] == "ValueError" for k in longest) and len(longest) < len(ref)
    for k, v in ref.items():
        if k not in longest:
            np.testing.assert_allclose(one[k], v, rtol=1e-4, atol=1e-4)


def test_a_batch_failing_when_collected_is_computed_item_by_item(speech, monkeypatch):
    """The same when the batch fails at its wait (a device error surfaces there): the items
    that fail alone are the only errors, named by the error's type."""
    ref = _shard_arrays(speech, monkeypatch, lambda lens: False)
    batches = _shard_arrays(speech, monkeypatch, lambda lens: len(lens) > 1, at_collect=True)
    assert batches.keys() == ref.keys()
    for k, v in ref.items():
        np.testing.assert_allclose(batches[k], v, rtol=1e-4, atol=1e-4)
    frames = max(v.shape[-1] for v in ref.values())
    longest = sorted(k for k, v in ref.items() if v.shape[-1] == frames)
    one = _shard_arrays(speech, monkeypatch, lambda lens: max(lens) >= frames * 160,
                        at_collect=True)
    assert sorted(k for k, v in one.items() if isinstance(v, str)) == longest
    assert all(one[k] == "RuntimeError" for k in longest)


@pytest.mark.parametrize("mb", ["0", "1"])
def test_tar_shard_writeback_writes_the_same_bytes(tmp_path, monkeypatch, mb):
    """A tar shard's early writeback (AVPIPE_EXTRACT_WRITEBACK_MB) hands each MB written to the
    disk as it goes (in order, no gaps) and changes no byte of the shard."""
    from avpipe.pipeline.sources import Item
    from avpipe.recipes.extract import _writers
    from avpipe.recipes.extract._process import Result, Shard

    calls = []
    monkeypatch.setattr(_writers, "_SYNC_FILE_RANGE",
                        lambda fd, off, n, flags: calls.append((off, n, flags)) or 0)
    monkeypatch.setenv("AVPIPE_EXTRACT_WRITEBACK_MB", mb)
    rng = np.random.default_rng(0)
    results = [Result(Item(index=i, path=f"/x/{i}.flac", source=f"{i}.flac", kind="audio"),
                      rng.standard_normal((80, 3000 + i)).astype(np.float16), {"frames": 3000 + i})
               for i in range(8)]
    cfg = {"name": "nemo", "audio": {}}
    _writers.write_shard(str(tmp_path), Shard(0, 8), results, cfg, "tar", 8)
    data = (tmp_path / "shards" / "shard-000000-000007.tar").read_bytes()
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        names = tf.getnames()
        arr = np.load(io.BytesIO(tf.extractfile("000000003.npy").read()))
    assert names[:2] == ["000000000.npy", "000000000.json"] and len(names) == 16
    np.testing.assert_array_equal(arr, results[3].array)
    if mb == "0":
        assert calls == []
    else:
        # from the start, no gaps, at least a MB each, all but the last MB (+ a member) handed
        assert [c[0] for c in calls] == [sum(c[1] for c in calls[:k]) for k in range(len(calls))]
        assert all(c[1] >= 1 << 20 and c[2] == 2 for c in calls)
        assert len(calls) >= 2 and sum(c[1] for c in calls) > len(data) - (1 << 20) - 500_000
    # the same bytes either way
    monkeypatch.setenv("AVPIPE_EXTRACT_WRITEBACK_MB", "0")
    _writers.write_shard(str(tmp_path / "plain"), Shard(0, 8), results, cfg, "tar", 8)
    assert (tmp_path / "plain" / "shards" / "shard-000000-000007.tar").read_bytes() == data


def test_an_image_deleted_mid_run_fails_alone(tmp_path):
    """Images are matched to the files found at the start: one deleted after that fails alone
    (FileNotFoundError), and every other input keeps its own thumbnail (a deleted file once
    shifted every later image's features onto the next input)."""
    from avpipe.device import resolve_device
    from avpipe.recipes.extract._process import _image_stream

    d = tmp_path / "in"
    d.mkdir()
    names = ["scene.jpg", "exif_rotate6.jpg", "gray16.png", "scene.png"] * 2
    for i, n in enumerate(names):
        shutil.copy(SAMPLES / "images" / n, d / f"{i}_{n}")
    cfg = resolve_preset("thumbnails")
    items = resolve_inputs(d, extensions_of(cfg)).items
    dev = resolve_device("cpu")
    alone = {it.index: next(_image_stream([it], cfg["image"], dev, 2)) for it in items}
    stream = _image_stream(items, cfg["image"], dev, 2)
    got = [next(stream)]
    os.remove(items[4].path)  # in the third batch of two, not decoded yet
    got += list(stream)
    assert [r.item.index for r in got] == [it.index for it in items]
    assert got[4].error == "FileNotFoundError"
    for r in got[:4] + got[5:]:
        assert r.ok and np.array_equal(r.array, alone[r.item.index].array), r.item.source


def test_resume_names_what_changed_in_the_input(speech, tmp_path):
    out = tmp_path / "o"
    run_extract(speech, preset="nemo", out_dir=out, device="cpu", shard_size=4)
    victim = next((speech / "a").glob("*.flac"), None) or next((speech / "a").iterdir())
    victim.unlink()
    with pytest.raises(ValueError, match=r"12 files then, 11 now"):
        run_extract(speech, preset="nemo", out_dir=out, device="cpu", shard_size=4)


def test_a_shard_redone_loses_its_old_part_before_its_outputs_change(tmp_path, monkeypatch):
    """Redoing a shard (--retry-errors) removes its old part (its done mark) before writing the
    new outputs: killed between the new tar and the new part, the shard is not taken as done
    (its old part named the old tar's members: an "ok" row whose output was gone)."""
    from avpipe.pipeline.sources import Item
    from avpipe.recipes.extract import _writers
    from avpipe.recipes.extract._process import Result, Shard

    cfg = resolve_preset("nemo")
    items = [Item(index=i, source=f"x{i}.wav", path=str(tmp_path / f"x{i}.wav"), kind="audio")
             for i in range(2)]
    first = [Result(items[0], np.zeros((80, 3), np.float32)),
             Result(items[1], error="CorruptDataError", message="bad")]
    _writers.write_shard(str(tmp_path), Shard(0, 2), first, cfg, "tar", total=2)
    assert _writers.read_part(str(tmp_path), Shard(0, 2), 2) is not None
    real = _writers.atomic_write

    def killed_at_the_part(path, write, **kw):
        if os.sep + _writers.PARTS_DIR + os.sep in path:
            raise KeyboardInterrupt("killed")
        return real(path, write, **kw)

    monkeypatch.setattr(_writers, "atomic_write", killed_at_the_part)
    again = [Result(items[0], error="CorruptDataError", message="now bad"),
             Result(items[1], np.ones((80, 3), np.float32))]
    with pytest.raises(KeyboardInterrupt):
        _writers.write_shard(str(tmp_path), Shard(0, 2), again, cfg, "tar", total=2)
    assert _writers.read_part(str(tmp_path), Shard(0, 2), 2) is None


def test_npy_outputs_of_names_that_clash_stay_apart(tmp_path):
    """An absolute input "/x/a.wav" (outside the list's folder) and a relative "x/a.wav" both
    wrote features/x/a.wav.npy, one output lost: names that clash take the input's key."""
    far = tmp_path / "far" / "a.wav"
    far.parent.mkdir()
    shutil.copy(SAMPLES / "speech" / "utt01.wav", far)
    lst = tmp_path / "lst"
    near = lst / str(far).lstrip("/")
    near.parent.mkdir(parents=True)
    shutil.copy(SAMPLES / "speech" / "utt02.wav", near)
    (lst / "l.txt").write_text(f"{far}\n{str(far).lstrip('/')}\n")
    out = tmp_path / "o"
    run_extract(lst / "l.txt", preset="nemo", out_dir=out, device="cpu", format="npy")
    rows = jsonl(out / "index.jsonl")
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert rows[0]["output"] != rows[1]["output"]
    alone = tmp_path / "alone"
    run_extract(near, preset="nemo", out_dir=alone, device="cpu", format="npy")
    (want,) = [np.load(alone / r["output"]) for r in jsonl(alone / "index.jsonl")]
    np.testing.assert_array_equal(np.load(out / rows[1]["output"]), want)
