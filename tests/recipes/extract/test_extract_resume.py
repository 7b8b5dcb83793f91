"""Crash safety: ``avpipe extract`` killed with SIGKILL and run again gives exactly the files,
bytes and index of an uninterrupted run."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import REPO

ROOT = Path(REPO)
SAMPLES = ROOT / "samples"
ARGS = ["--preset", "quickstart", "--shard-size", "2", "--batch-size", "2"]
REF_SECONDS = []  # how long the uninterrupted reference run took


def tree(out) -> dict:
    out = Path(out)
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file()}


def _cmd(inp, out, devices):
    return [sys.executable, "-m", "avpipe", "extract", str(inp), "--out", str(out),
            "--devices", devices, *ARGS]


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}


def _run(inp, out, devices="cpu"):
    r = subprocess.run(_cmd(inp, out, devices), capture_output=True, text=True, cwd=ROOT,
                       env=_env(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def _start(inp, out, devices):
    return subprocess.Popen(_cmd(inp, out, devices), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=ROOT, env=_env())


def _kill(p) -> bool:
    """SIGKILL; True where the process was still running (the kill cut a run short)."""
    alive = p.poll() is None
    if alive:
        os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    return alive


def _parts(out):
    d = Path(out) / "parts"
    return len([f for f in os.listdir(d) if f.endswith(".jsonl")]) if d.is_dir() else 0


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Audio, images and video (17 inputs: 9 shards of 2), one bad file; and the reference
    output of one uninterrupted run."""
    d = tmp_path_factory.mktemp("in")
    shutil.copytree(SAMPLES / "speech", d / "speech")
    shutil.copytree(SAMPLES / "images", d / "images")
    for name in ("circles_vp9.webm", "squares_h264.mp4", "squares_mjpeg.avi", "labels.csv"):
        (d / "video").mkdir(exist_ok=True)
        shutil.copy(SAMPLES / "video" / name, d / "video" / name)
    (d / "speech" / "zz_bad.flac").write_bytes(b"fLaC" + os.urandom(64))
    (d / "images" / "zz_trunc.jpg").write_bytes((SAMPLES / "images" / "scene.jpg").read_bytes()[:300])
    ref = tmp_path_factory.mktemp("ref") / "out"
    t0 = time.monotonic()
    _run(d, ref)
    REF_SECONDS.append(time.monotonic() - t0)
    t = tree(ref)
    assert len([k for k in t if k.startswith("shards/")]) == 9
    return d, t


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4, 8])
def test_killed_after_k_shards_then_resumed(data, tmp_path, k):
    inp, ref = data
    out = tmp_path / "out"
    p = _start(inp, out, "cpu")
    deadline = time.monotonic() + 120
    while _parts(out) < k and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    _kill(p)
    assert _parts(out) < 9 or k == 8  # it was cut short (the last k may finish first)
    _run(inp, out)
    assert tree(out) == ref


@pytest.mark.slow
@pytest.mark.parametrize("devices", ["cpu", "cpu,cpu"])
def test_killed_at_random_times_then_resumed(data, tmp_path, devices):
    inp, ref = data
    out = tmp_path / "out"
    rng = random.Random(1234 + len(devices))
    # kill times within the reference run's length, so that the kills land inside runs
    span = max(1.0, REF_SECONDS[0])
    cut = []
    for _ in range(4):
        p = _start(inp, out, devices)
        time.sleep(rng.uniform(0.1, 0.6) * span)
        cut.append(_kill(p))
    time.sleep(0.5)  # spawned workers die with their parent
    assert cut[0], "the first kill came after its run had finished: nothing was interrupted"
    _run(inp, out, devices)
    assert tree(out) == ref
