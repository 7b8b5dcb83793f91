"""Extraction's audio features are a function of the file and the preset alone: the same
bytes from the local engine with one decode worker and with four, from Ray, whatever the
feature batch size, and equal bit for bit to ``ops.log_mel`` of ``load_audio`` of the file."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from paths import REPO

import avpipe
from avpipe.recipes.extract import run_extract

ROOT = Path(REPO)


def _signal(n, sr, seed, channels=1):
    rng = np.random.default_rng(seed)
    t = np.arange(n) / sr
    f0 = rng.uniform(90, 250)
    x = sum(np.sin(2 * np.pi * k * f0 * t + rng.uniform(0, 6)) / k for k in range(1, 12))
    x = 0.1 * x * (1 - np.cos(2 * np.pi * 3 * t)) + 0.01 * rng.standard_normal(n)
    if channels == 2:
        return np.stack([x, 0.7 * np.roll(x, 37) + 0.01 * rng.standard_normal(n)], 1)
    return x


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """14 files: FLAC and WAV, 16 kHz and 44.1 kHz, mono and stereo, 16- and 24-bit and
    float, 0.2 s to 7 s (deterministic)."""
    import soundfile as sf

    d = tmp_path_factory.mktemp("mixed")
    kinds = [("flac", 16000, "PCM_16", 1), ("wav", 44100, "PCM_16", 1),
             ("flac", 44100, "PCM_24", 1), ("wav", 16000, "FLOAT", 1),
             ("wav", 44100, "PCM_16", 2), ("flac", 16000, "PCM_16", 2),
             ("wav", 16000, "PCM_16", 1)]  # fmt: skip
    rng = np.random.default_rng(5)
    for i in range(14):
        ext, sr, sub, ch = kinds[i % len(kinds)]
        n = int(rng.uniform(0.2, 7.0) * sr)
        sf.write(d / f"f{i:02d}.{ext}", _signal(n, sr, i, ch), sr, subtype=sub)
    return d


def _shards(out) -> dict:
    out = Path(out)
    return {p.name: p.read_bytes() for p in sorted((out / "shards").glob("*.tar"))}


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "AVPIPE_DISABLE_GPU": "1"}})
    yield
    ray.shutdown()


def _stored(out) -> dict:
    """file name -> stored features, from the tar shards."""
    got = {}
    for p in sorted((Path(out) / "shards").glob("*.tar")):
        with tarfile.open(p) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".npy"):
                    arr = np.load(io.BytesIO(tf.extractfile(m).read()))
                    src = tf.extractfile(m.name[:-4] + ".json").read().decode()
                    got[m.name[:-4]] = (arr, src)
    return got


def test_local_features_are_log_mel_of_load_audio_and_batch_free(mixed, tmp_path):
    """One decode worker, batches of 64, against four workers and batches of 3: the same
    shard bytes; every stored array equals ops.log_mel(load_audio(file)) bit for bit."""
    a, b = tmp_path / "one", tmp_path / "four"
    s1 = run_extract(mixed, preset="nemo", out_dir=a, devices="cpu", workers=1, shard_size=5,
                     batch_size=64)
    s2 = run_extract(mixed, preset="nemo", out_dir=b, devices="cpu", workers=4, shard_size=5,
                     batch_size=3)
    assert s1.complete and s2.complete and s1.written == s2.written == {"audio": 14}
    assert _shards(a) == _shards(b)
    stored = _stored(a)
    assert len(stored) == 14
    for path in sorted(mixed.iterdir()):
        arr, meta = next(v for v in stored.values() if path.name in v[1])
        x = avpipe.load_audio(str(path), sample_rate=16000)
        ref, fl = avpipe.ops.log_mel(x.samples, preset="nemo")
        assert np.array_equal(arr, ref[0, :, : int(fl[0])]), path.name


def test_int16_transport_features_are_log_mel_of_load_audio(mixed, tmp_path):
    """Mono 16-bit files at the preset's rate alone: the loader carries them as int16; their
    stored features equal ops.log_mel(load_audio(file)) bit for bit too."""
    import shutil

    import soundfile as sf

    d = tmp_path / "pcm16"
    d.mkdir()
    for p in sorted(mixed.iterdir()):
        i = sf.info(str(p))
        if i.samplerate == 16000 and i.channels == 1 and i.subtype == "PCM_16":
            shutil.copy(p, d / p.name)
    names = sorted(p.name for p in d.iterdir())
    assert len(names) >= 3
    out = tmp_path / "o"
    s = run_extract(d, preset="nemo", out_dir=out, devices="cpu", workers=2, batch_size=2)
    assert s.complete and s.written == {"audio": len(names)}
    stored = _stored(out)
    for name in names:
        arr, _ = next(v for v in stored.values() if name in v[1])
        x = avpipe.load_audio(str(d / name), sample_rate=16000)
        ref, fl = avpipe.ops.log_mel(x.samples, preset="nemo")
        assert np.array_equal(arr, ref[0, :, : int(fl[0])]), name


@pytest.mark.slow
def test_ray_writes_the_local_engines_bytes(mixed, tmp_path, local_ray):
    """Ray's workers (two, batches of 5) write the shards the local engine writes."""
    a, b = tmp_path / "local", tmp_path / "ray"
    s1 = run_extract(mixed, preset="nemo", out_dir=a, devices="cpu", workers=1, shard_size=5)
    s2 = run_extract(mixed, preset="nemo", out_dir=b, devices="cpu,cpu", shard_size=5,
                     batch_size=5, engine="ray")
    assert s1.complete and s2.complete, s2.failures
    assert _shards(a) == _shards(b) and len(_shards(a)) == 3
