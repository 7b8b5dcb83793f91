"""``avpipe extract`` on a GPU: the batched loader's GPU FLAC decode, features on cupy, workers
per GPU. The CPU runs the same code with numpy: the two agree to the log-mel tolerance."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from paths import REPO

from avpipe.recipes.extract import run_extract

ROOT = Path(REPO)
SAMPLES = ROOT / "samples"

pytestmark = pytest.mark.gpu


def _outputs(out):
    from test_extract import load_outputs

    return load_outputs(out)


def tree(out) -> dict:
    out = Path(out)
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def flacs(tmp_path_factory):
    """40 FLAC files of 0.3-9 s at 16 kHz (the GPU decoder's path), 3 WAV at 16 kHz (worker
    processes), 2 OGG at 48 kHz (resampled one by one), a corrupt FLAC and an empty one."""
    import soundfile as sf

    d = tmp_path_factory.mktemp("flac")
    rng = np.random.default_rng(0)
    for i in range(40):
        n = int(rng.uniform(0.3, 9.0) * 16000)
        x = (0.1 * rng.standard_normal(n)).clip(-1, 1)
        sf.write(d / f"f{i:02d}.flac", x, 16000, subtype="PCM_16")
    for i in range(3):
        sf.write(d / f"w{i}.wav", (0.1 * rng.standard_normal(20000 + i)).clip(-1, 1), 16000,
                 subtype="PCM_16")
    for i in range(2):
        sf.write(d / f"o{i}.ogg", (0.1 * rng.standard_normal(48000)).clip(-1, 1), 48000)
    good = (d / "f00.flac").read_bytes()
    (d / "zz_corrupt.flac").write_bytes(good[:200] + bytes(range(256)) * 20)
    (d / "zz_empty.flac").write_bytes(b"")
    return d


def test_nemo_gpu_matches_cpu(flacs, tmp_path):
    cpu = run_extract(flacs, preset="nemo", out_dir=tmp_path / "cpu", devices="cpu",
                      shard_size=16, batch_size=8)
    gpu = run_extract(flacs, preset="nemo", out_dir=tmp_path / "gpu", devices="cuda:0",
                      shard_size=16, batch_size=8)
    assert gpu.devices == ["cuda:0"] and gpu.complete
    a, b = _outputs(tmp_path / "cpu"), _outputs(tmp_path / "gpu")
    assert sorted(a) == sorted(b) and len(a) == 45
    for k in a:
        assert a[k][0].shape == b[k][0].shape, k
        np.testing.assert_allclose(b[k][0], a[k][0], atol=2e-3, rtol=0, err_msg=k)
    assert gpu.errors == cpu.errors == 2
    from test_extract import jsonl

    assert [e["source"] for e in jsonl(tmp_path / "gpu" / "errors.jsonl")] == [
        "zz_corrupt.flac", "zz_empty.flac"]


def test_float16_on_gpu_is_float32_rounded(flacs, tmp_path):
    """dtype float16: the cast happens on the GPU, round to nearest even as numpy's."""
    run_extract(flacs, preset="nemo", out_dir=tmp_path / "f32", devices="cuda:0",
                shard_size=16, batch_size=8)
    run_extract(flacs, preset="nemo", out_dir=tmp_path / "f16", devices="cuda:0",
                shard_size=16, batch_size=8, dtype="float16")
    a, b = _outputs(tmp_path / "f32"), _outputs(tmp_path / "f16")
    assert sorted(a) == sorted(b) and len(a) == 45
    for k in a:
        assert b[k][0].dtype == np.float16
        np.testing.assert_array_equal(b[k][0], a[k][0].astype(np.float16), err_msg=k)


def test_two_workers_on_one_gpu_match_one(flacs, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}
    outs = []
    for devices in ("cuda:0", "cuda:0,cuda:0"):
        out = tmp_path / devices.replace(":", "").replace(",", "_")
        r = subprocess.run([sys.executable, "-m", "avpipe", "extract", str(flacs), "--preset",
                            "nemo", "--out", str(out), "--devices", devices, "--shard-size", "8"],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        outs.append(tree(out))
    assert outs[0] == outs[1]


def test_quickstart_on_gpu(tmp_path):
    pytest.importorskip("nvidia.dali")
    out = tmp_path / "q"
    s = run_extract(SAMPLES, preset="quickstart", out_dir=out, devices="cuda:0", shard_size=8)
    assert s.complete and s.total_written == 18 and s.errors == 0, s.format()
    ref = tmp_path / "qc"
    run_extract(SAMPLES, preset="quickstart", out_dir=ref, devices="cpu", shard_size=8)
    a, b = _outputs(ref), _outputs(out)
    for k in a:
        assert a[k][0].shape == b[k][0].shape
        if a[k][0].dtype == np.uint8:
            assert np.abs(a[k][0].astype(int) - b[k][0]).mean() < 2.0, k
        else:
            np.testing.assert_allclose(b[k][0], a[k][0], atol=2e-3)


def test_speech_copies_on_gpu(tmp_path):
    d = tmp_path / "s"
    shutil.copytree(SAMPLES / "speech", d)
    s = run_extract(d / "manifest.jsonl", preset="mlperf_rnnt", out_dir=tmp_path / "o",
                    devices="cuda", shard_size=4)
    assert s.complete and s.total_written == 6
