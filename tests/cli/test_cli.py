"""The ``avpipe`` command, run as ``python -m avpipe`` in a subprocess (as a user would)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

ROOT = Path(REPO)
SAMPLES = ROOT / "samples"


def _run(*args, cwd=None, timeout=120):
    env = dict(os.environ)
    # works where the repo is not pip-installed (the GPU machine runs tests from a checkout)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-m", "avpipe", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT, env=env,
    )


def test_info_prints_the_device_line():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    assert "default device: " in r.stdout
    assert r.stdout.startswith("avpipe ")


def test_info_json():
    r = _run("info", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["default_device"] in ("cpu",) or d["default_device"].startswith("cuda")


@pytest.fixture
def tiny(tmp_path):
    d = tmp_path / "tiny"
    (d / "a").mkdir(parents=True)
    shutil.copy(SAMPLES / "speech" / "utt01.wav", d / "a")
    shutil.copy(SAMPLES / "images" / "scene.jpg", d)
    shutil.copy(SAMPLES / "video" / "circles_vp9.webm", d)
    (d / "bad.flac").write_bytes(b"fLaC" + b"\x00" * 40)
    (d / "notes.txt").write_text("ignored")
    return d


def test_extract_end_to_end(tiny, tmp_path):
    out = tmp_path / "out"
    r = _run("extract", tiny, "--preset", "quickstart", "--out", out, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert f"features written to {out}" in r.stdout
    assert "1 error" in r.stdout
    index = [json.loads(x) for x in (out / "index.jsonl").read_text().splitlines()]
    ok = sorted(x["source"] for x in index if x["status"] == "ok")
    assert ok == ["a/utt01.wav", "circles_vp9.webm", "scene.jpg"]
    assert [x["source"] for x in index if x["status"] == "error"] == ["bad.flac"]
    assert all(x["shard"] == "shards/shard-000000-000003.tar" for x in index if "shard" in x)
    assert (out / "shards" / "shard-000000-000003.tar").is_file()
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert [e["source"] for e in errors] == ["bad.flac"]
    # no progress bar noise when stderr is not a terminal
    assert "it/s" not in r.stderr and "file/s" not in r.stderr
    # the audio loader's processes and semaphores are released before the worker exits
    assert "leaked semaphore" not in r.stderr, r.stderr
    # resume: nothing new, same index
    r2 = _run("extract", tiny, "--preset", "quickstart", "--out", out, "--device", "cpu")
    assert r2.returncode == 0, r2.stderr
    assert "3 already done" in r2.stdout
    assert len((out / "index.jsonl").read_text().splitlines()) == 4  # 3 ok, 1 error


def test_unknown_preset_fails_naming_the_option(tiny, tmp_path):
    r = _run("extract", tiny, "--preset", "nope", "--out", tmp_path / "o")
    assert r.returncode != 0
    assert "--preset" in r.stderr and "nope" in r.stderr
    assert not (tmp_path / "o").exists()


def test_missing_input_fails(tmp_path):
    r = _run("extract", tmp_path / "missing", "--preset", "quickstart", "--out", tmp_path / "o")
    assert r.returncode != 0
    assert "missing" in r.stderr


def test_extract_help_lists_presets():
    r = _run("extract", "--help")
    assert r.returncode == 0
    assert "quickstart" in r.stdout and "--out" in r.stdout
