"""Training from an extraction's output (avpipe.recipes.feature_feed): the stored features,
batched and padded, in the feed's order, with ranks, resume and errors; local and over S3."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from paths import REPO

import avpipe
from avpipe.recipes import feature_feed
from avpipe.recipes.extract import run_extract

ROOT = Path(REPO)
SPEECH = ROOT / "samples" / "speech"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AVPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AVPIPE_DISABLE_GPU", "1")


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    d = tmp_path_factory.mktemp("fx")
    shutil.copytree(SPEECH, d / "speech")
    (d / "speech" / "broken.flac").write_bytes(b"fLaC" + os.urandom(40))
    with open(d / "speech" / "manifest.jsonl", "a") as f:
        f.write('{"audio_filepath": "broken.flac", "duration": 1.0, "text": "x"}\n')
    out = {}
    for fmt in ("tar", "npy"):
        o = d / f"out_{fmt}"
        run_extract(str(d / "speech" / "manifest.jsonl"), preset="nemo", out_dir=str(o),
                    shard_size=4, devices="cpu", format=fmt)
        out[fmt] = o
    return d, out


def _stored(out):
    """source -> the stored array, read straight from the index's npy members / files."""
    import io
    import json
    import tarfile

    got = {}
    for line in (out / "index.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["status"] != "ok":
            continue
        if r.get("shard"):
            with tarfile.open(out / r["shard"]) as tf:
                got[r["source"]] = np.load(io.BytesIO(tf.extractfile(f"{r['key']}.npy").read()))
        else:
            got[r["source"]] = np.load(out / r["output"])
    return got


@pytest.mark.parametrize("fmt", ["tar", "npy"])
def test_batches_hold_the_stored_features(extracted, fmt):
    _, out = extracted
    ref = _stored(out[fmt])
    feed = feature_feed(str(out[fmt]), batch_size=2, seed=3, device="cpu")
    assert len(feed) == 3 and len(ref) == 6
    assert [p for p, _ in feed.errors] == ["broken.flac"]
    seen = []
    for b in feed:
        assert b.features.ndim == 3 and b.features.shape[1] == 80
        for r, p in enumerate(b.paths):
            n = int(b.feature_lengths[r])
            np.testing.assert_array_equal(b.features[r, :, :n], ref[p])
            assert not b.features[r, :, n:].any()  # padding is zeros
            assert b.transcripts[r]
            seen.append(p)
    assert sorted(seen) == sorted(ref)


def test_features_equal_computing_them_from_the_file(extracted):
    d, out = extracted
    ref = _stored(out["tar"])
    for src, arr in ref.items():
        a = avpipe.load_audio(str(d / "speech" / src), sample_rate=16000)
        f, n = avpipe.ops.log_mel(a.samples[None], preset="nemo")
        np.testing.assert_allclose(np.asarray(f[0, :, : int(n[0])]), arr, atol=1e-5)


def test_resume_and_ranks(extracted):
    _, out = extracted
    kw = dict(batch_size=1, seed=5, device="cpu")
    full = [b.paths for b in feature_feed(str(out["tar"]), **kw)]
    f = feature_feed(str(out["tar"]), **kw)
    it = iter(f)
    first = [next(it).paths for _ in range(2)]
    state = f.state_dict()
    g = feature_feed(str(out["tar"]), **kw)
    g.load_state_dict(state)
    assert first + [b.paths for b in g] == full
    ranks = [[p for b in feature_feed(str(out["tar"]), rank=r, world_size=2, **kw)
              for p in b.paths] for r in range(2)]
    assert not set(ranks[0]) & set(ranks[1]) and len(ranks[0]) == len(ranks[1]) == 3


def test_feature_feed_over_s3(extracted, tmp_path):
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    from servers import s3_server

    _, out = extracted
    ref = _stored(out["tar"])
    with s3_server():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="feats")
        for p in out["tar"].rglob("*"):
            if p.is_file():
                s3.upload_file(str(p), "feats", "run1/" + p.relative_to(out["tar"]).as_posix())
        feed = feature_feed("s3://feats/run1", batch_size=3, device="cpu", shuffle=False)
        n = 0
        for b in feed:
            for r, p in enumerate(b.paths):
                np.testing.assert_array_equal(b.features[r, :, : int(b.feature_lengths[r])],
                                              ref[p])
                n += 1
        assert n == 6


def test_not_an_output(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an avpipe extract output"):
        feature_feed(str(tmp_path), batch_size=2)
