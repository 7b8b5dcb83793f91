"""avpipe extract over WebDataset shards: each sample's media is an input named URL#KEY, its
features are the same as the loose file's, damage is listed, every sample accounted for; local
shards and an HTTP server."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from paths import REPO
from servers import http_server
from shard_media import write_tar

from avpipe.recipes.extract import run_extract

ROOT = Path(REPO)
SPEECH = ROOT / "samples" / "speech"
IMAGES = ROOT / "samples" / "images"


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("AVPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AVPIPE_DISABLE_GPU", "1")



def _arrays(out):
    """source -> stored array, and source -> index row."""
    rows = [json.loads(x) for x in (Path(out) / "index.jsonl").read_text().splitlines()]
    got = {}
    for r in rows:
        if r["status"] == "ok":
            with tarfile.open(Path(out) / r["shard"]) as tf:
                got[r["source"]] = np.load(io.BytesIO(tf.extractfile(f"{r['key']}.npy").read()))
    return got, {r["source"]: r for r in rows}


@pytest.fixture
def shards(tmp_path):
    lines = [json.loads(x) for x in (SPEECH / "manifest.jsonl").read_text().splitlines()]
    a, b = [], []
    for k, x in enumerate(lines):
        key = os.path.splitext(x["audio_filepath"])[0]
        ext = os.path.splitext(x["audio_filepath"])[1]
        member = [(key + ext, (SPEECH / x["audio_filepath"]).read_bytes()),
                  (key + ".json", json.dumps({"text": x["text"]}).encode())]
        (a if k % 2 else b).extend(member)
    b += [("broken.flac", b"fLaC" + bytes(64)), ("nomedia.json", b'{"text": "x"}')]
    b += [(f"{n.stem}_{n.suffix[1:]}{n.suffix}", n.read_bytes())
          for n in sorted(IMAGES.glob("scene.*"))[:2]]  # scene_jp2.jp2, scene_jpg.jpg
    d = tmp_path / "shards"
    d.mkdir()
    write_tar(d / "part-0.tar", a)
    write_tar(d / "part-1.tar", b)
    return d, lines


def test_extract_from_shards_equals_the_loose_files(shards, tmp_path):
    d, lines = shards
    run_extract(str(SPEECH / "manifest.jsonl"), preset="nemo", out_dir=str(tmp_path / "ref"),
                devices="cpu", shard_size=4)
    ref, _ = _arrays(tmp_path / "ref")
    out = tmp_path / "out"
    run_extract(str(d / "part-{0..1}.tar"), preset="nemo", out_dir=str(out), devices="cpu",
                    shard_size=4)
    got, rows = _arrays(out)
    for x in lines:
        key = os.path.splitext(x["audio_filepath"])[0]
        shard = "part-0.tar" if lines.index(x) % 2 else "part-1.tar"
        name = f"{d / shard}#{key}"
        np.testing.assert_array_equal(got[name], ref[x["audio_filepath"]])
        assert rows[name]["fields"]["text"] == x["text"]
    # every sample is in index.jsonl: the broken one, and those without audio, with reasons
    bad = {k.rsplit("#", 1)[1]: r for k, r in rows.items() if r["status"] != "ok"}
    assert set(bad) == {"broken", "nomedia", "scene_jp2", "scene_jpg"}, bad
    assert all(k.startswith(f"{d / 'part-1.tar'}#") for k, r in rows.items()
               if r["status"] != "ok")
    assert "no media member" in bad["nomedia"]["message"]
    assert "not a readable audio file" in bad["broken"]["message"]
    assert len(rows) == len(lines) + 4


def test_cli_extract_from_http_shards(shards, tmp_path):
    d, lines = shards
    with http_server(d, fail_every=6) as (base, _srv):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        r = subprocess.run([sys.executable, "-m", "avpipe", "extract", base + "/part-{0..1}.tar",
                            "--preset", "quickstart", "--out", str(tmp_path / "o"),
                            "--devices", "cpu"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    _, rows = _arrays(tmp_path / "o")
    ok = [k for k, v in rows.items() if v["status"] == "ok"]
    assert len(ok) == len(lines) + 2  # the speech and the two images
    assert all(k.startswith(base + "/part-") and "#" in k for k in rows)
