"""Damage is never silent in the RNN-T feed: a file that holds fewer samples than its header or
its manifest ``duration`` declares fails as CorruptDataError (skipped, in ``feed.errors`` with
the reason) by default, or trains with a warning (``on_damage="warn"``), through the threads'
``load_audio`` and the batch loader's worker processes alike; and a short item of a long file
reads its span, not the file."""

from __future__ import annotations

import json
import os
import struct
import warnings

import numpy as np
import pytest
import soundfile as sf

from avpipe.recipes import rnnt_feed

SR = 16000


def _manifest(folder, rows):
    p = os.path.join(folder, "m.jsonl")
    with open(p, "w") as f:
        for name, dur in rows:
            f.write(json.dumps({"audio_filepath": name, "duration": dur, "text": name}) + "\n")
    return p


def _epoch(feed):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        paths = [os.path.basename(p) for b in feed for p in b.paths]
    return sorted(paths), [str(x.message) for x in w if x.category is RuntimeWarning]


@pytest.fixture
def damaged(tmp_path):
    x = (0.3 * np.sin(np.arange(12 * SR) / 7)).astype(np.float32)
    sf.write(tmp_path / "good.wav", x, SR, subtype="PCM_16")
    data = (tmp_path / "good.wav").read_bytes()
    (tmp_path / "cut.wav").write_bytes(data[: len(data) // 3])  # header: 12 s, holds 4 s
    sf.write(tmp_path / "short.wav", x[: 4 * SR], SR, subtype="PCM_16")  # clean, 4 s
    rows = [("good.wav", 12.0), ("cut.wav", 12.0), ("short.wav", 12.0)]
    return _manifest(str(tmp_path), rows)


@pytest.mark.parametrize("decoder", ["threads", "processes"])
def test_feed_skips_and_reports_damaged_items(damaged, decoder):
    feed = rnnt_feed(damaged, batch_size=3, device="cpu", training=False, decoder=decoder)
    paths, warned = _epoch(feed)
    assert paths == ["good.wav"] and not warned
    why = {os.path.basename(p): m for p, m in feed.errors}
    assert set(why) == {"cut.wav", "short.wav"}
    assert why["cut.wav"].startswith("CorruptDataError") and "truncated" in why["cut.wav"]
    assert "4.000 s of the 12.000 s the manifest declares" in why["short.wav"]


@pytest.mark.parametrize("decoder", ["threads", "processes"])
def test_feed_with_on_damage_warn_trains_them_and_warns(damaged, decoder):
    feed = rnnt_feed(damaged, batch_size=3, device="cpu", training=False, decoder=decoder,
                     on_damage="warn")
    paths, warned = _epoch(feed)
    assert paths == ["cut.wav", "good.wav", "short.wav"] and feed.errors == []
    assert {os.path.basename(p) for p in feed.task.damaged} == {"cut.wav", "short.wav"}
    assert len(warned) == 2 and all("on_damage='warn'" in m for m in warned)


def test_a_manifest_duration_within_the_tolerance_is_not_damage(tmp_path):
    sf.write(tmp_path / "a.wav", np.full(SR, 0.1, np.float32), SR, subtype="PCM_16")
    m = _manifest(str(tmp_path), [("a.wav", 1.05)])  # 0.05 s over: manifest rounding
    paths, _ = _epoch(rnnt_feed(m, batch_size=1, device="cpu", training=False))
    assert paths == ["a.wav"]


def _rchar():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
def test_short_item_of_a_long_file_reads_its_span(tmp_path):
    """A 256 MB WAV (sparse: written as 3 s of audio, then its data chunk extended) with a
    manifest duration of 3 s: the feed reads a few hundred kB of it, not the file."""
    p = tmp_path / "long.wav"
    sf.write(p, (0.3 * np.sin(np.arange(3 * SR) / 7)).astype(np.float32), SR, subtype="PCM_16")
    b = bytearray(p.read_bytes())
    size = 256 << 20
    at = b.find(b"data")
    struct.pack_into("<I", b, 4, size - 8)
    struct.pack_into("<I", b, at + 4, size - (at + 8))
    with open(p, "wb") as f:
        f.write(b)
        f.truncate(size)  # the rest: a hole
    m = _manifest(str(tmp_path), [("long.wav", 3.0)])
    feed = rnnt_feed(m, batch_size=1, device="cpu", training=False)
    before = _rchar()
    paths, _ = _epoch(feed)
    read = _rchar() - before
    assert paths == ["long.wav"] and feed.errors == []
    assert read < 16 << 20, f"read {read} bytes of a 256 MB file for a 3 s item"
    feed = rnnt_feed(m, batch_size=1, device="cpu", training=False, decoder="processes")
    assert _epoch(feed)[0] == ["long.wav"]
    assert feed.task._loader.max_samples <= 3 * SR + 2  # the ring holds the span, not the file


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_extract_lists_damaged_audio_in_errors_and_strict_counts_it(damaged, tmp_path):
    """``avpipe extract`` over a manifest: the cut WAV and the clean file 8 s shorter than its
    manifest duration fail (errors.jsonl, the summary's errors, ``--strict`` exits 3);
    ``--allow-damaged`` keeps them, each with ``info.damaged`` in its index row."""
    from click.testing import CliRunner

    from avpipe.cli.main import cli
    from avpipe.recipes.extract import run_extract

    out = tmp_path / "out"
    s = run_extract(damaged, preset="nemo", out_dir=str(out), device="cpu")
    errs = {os.path.basename(r["path"]): r for r in _jsonl(out / "errors.jsonl")}
    assert set(errs) == {"cut.wav", "short.wav"} and s.errors == 2 and s.total_errors == 2
    assert errs["cut.wav"]["error"] == "CorruptDataError" and "truncated" in errs["cut.wav"][
        "message"]
    assert "the manifest declares" in errs["short.wav"]["message"]
    r = CliRunner().invoke(cli, ["extract", damaged, "--preset", "nemo", "--out",
                                 str(tmp_path / "cli"), "--devices", "cpu", "--strict"])
    assert r.exit_code == 3, r.output
    kept = tmp_path / "kept"
    s = run_extract(damaged, preset="nemo", out_dir=str(kept), device="cpu", on_damage="warn")
    assert s.errors == 0 and s.total_written == 3
    rows = {os.path.basename(r["source"]): r for r in _jsonl(kept / "index.jsonl")}
    assert all(r["status"] == "ok" for r in rows.values())
    assert "damaged" not in rows["good.wav"]["info"]
    assert "truncated" in rows["cut.wav"]["info"]["damaged"]
    assert rows["cut.wav"]["info"]["seconds"] == pytest.approx(4.0, abs=0.01)
    assert "the manifest declares" in rows["short.wav"]["info"]["damaged"]
    r = CliRunner().invoke(cli, ["extract", damaged, "--preset", "nemo", "--out",
                                 str(tmp_path / "cli2"), "--devices", "cpu", "--strict",
                                 "--allow-damaged"])
    assert r.exit_code == 0, r.output
