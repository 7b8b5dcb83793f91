"""The RNN-T feed over sharded data: WebDataset shards (local, HTTP with a flaky server, S3),
NeMo tarred audio and lhotse Shar give the features of the same files read loose; damage in a
shard is reported by name; order, ranks and resume hold as for loose files."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
import soundfile as sf
from servers import http_server, s3_server
from shard_media import write_tar

from avpipe.recipes import rnnt_feed

SR = 16000
KW = dict(batch_size=3, device="cpu", training=False, seed=1)


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("AVPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AVPIPE_DISABLE_GPU", "1")


def _signal(i, n):
    t = np.arange(n) / SR
    return (0.3 * np.sin(2 * np.pi * (180 + 37 * i) * t) * np.hanning(n)).astype(np.float32)


@pytest.fixture
def dataset(tmp_path):
    """10 utterances as loose files + a manifest, and the same as 3 WebDataset shards."""
    loose = tmp_path / "loose"
    loose.mkdir()
    lines, members = [], [[], [], []]
    for i in range(10):
        n = int(SR * (0.4 + 0.13 * i))
        ext = ("flac", "wav", "ogg")[i % 3]
        name = f"utt{i:02d}.{ext}"
        sf.write(loose / name, _signal(i, n), SR)
        meta = {"text": f"utterance {i}", "duration": n / SR}
        lines.append({"audio_filepath": name, **meta})
        members[i % 3] += [(f"utt{i:02d}.{ext}", (loose / name).read_bytes()),
                           (f"utt{i:02d}.json", json.dumps(meta).encode())]
    (loose / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    shards = tmp_path / "shards"
    shards.mkdir()
    for s, mem in enumerate(members):
        write_tar(shards / f"train-{s:06d}.tar", mem)
    return loose, shards



def by_key(feed):
    """key (the file's name without extension) -> its features, over one epoch."""
    out = {}
    for b in feed:
        for r, p in enumerate(b.paths):
            key = os.path.basename(p.rsplit("#", 1)[-1]).split(".")[0]
            out[key] = np.asarray(b.features[r, :, : int(b.feature_lengths[r])])
    return out


def test_local_shards_give_the_loose_files_features(dataset):
    loose, shards = dataset
    ref = by_key(rnnt_feed(str(loose / "manifest.jsonl"), **KW))
    feed = rnnt_feed(str(shards / "train-{000000..000002}.tar"), **KW)
    assert len(feed) == 4 and feed.errors == []
    got = by_key(feed)
    assert sorted(got) == sorted(ref)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], atol=1e-5)
    b = next(iter(feed))
    assert all("#" in p and p.split("#")[0].endswith(".tar") for p in b.paths)
    assert all(t.startswith("utterance") for t in b.transcripts)


def test_flaky_http_and_s3_give_the_same_features(dataset):
    loose, shards = dataset
    ref = by_key(rnnt_feed(str(loose / "manifest.jsonl"), **KW))
    with http_server(shards, fail_every=5) as (base, srv):
        got = by_key(rnnt_feed(base + "/train-{000000..000002}.tar", **KW))
        assert srv.requests > 10
    assert sorted(got) == sorted(ref)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], atol=1e-5)
    pytest.importorskip("s3fs")
    import boto3

    with s3_server():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="asr")
        for p in sorted(shards.iterdir()):
            s3.upload_file(str(p), "asr", f"train/{p.name}")
        feed = rnnt_feed("s3://asr/train/train-{000000..000002}.tar", **KW)
        got = by_key(feed)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], atol=1e-5)


def test_damage_in_shards_is_named(dataset, tmp_path):
    _, shards = dataset
    bad = tmp_path / "bad"
    bad.mkdir()
    # a member whose audio is garbage, and a shard cut inside a member
    with tarfile.open(shards / "train-000000.tar") as tf:
        mem = [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]
    mem[0] = (mem[0][0], b"fLaC" + bytes(200))
    write_tar(bad / "a.tar", mem)
    raw = (shards / "train-000001.tar").read_bytes()
    (bad / "b.tar").write_bytes(raw[: len(raw) // 2])
    feed = rnnt_feed([str(bad / "a.tar"), str(bad / "b.tar")], **KW)
    seen = [p for b in feed for p in b.paths]
    names = [p for p, _ in feed.errors]
    assert f"{bad / 'a.tar'}#utt00" in names  # the garbage member, named by shard and key
    assert any(n.startswith(f"{bad / 'b.tar'}#") and "cut short" in m
               for n, m in feed.errors)  # the sample the cut took
    assert not set(seen) & set(names)


def test_order_ranks_and_resume_over_shards(dataset):
    _, shards = dataset
    spec = str(shards / "train-{000000..000002}.tar")
    kw = dict(KW, batch_size=2, training=True)
    full = [b.paths for b in rnnt_feed(spec, **kw)]
    f = rnnt_feed(spec, **kw)
    it = iter(f)
    head = [next(it).paths for _ in range(2)]
    g = rnnt_feed(spec, **kw)
    g.load_state_dict(f.state_dict())
    assert head + [b.paths for b in g] == full
    ranks = [rnnt_feed(spec, rank=r, world_size=2, **kw) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1])
    a, b = ([p for x in r for p in x.paths] for r in ranks)
    assert not set(a) & set(b) and len(set(a) | set(b)) == 10


def test_nemo_tarred_audio_feed(dataset, tmp_path):
    loose, _ = dataset
    ref = by_key(rnnt_feed(str(loose / "manifest.jsonl"), **KW))
    lines = [json.loads(x) for x in (loose / "manifest.jsonl").read_text().splitlines()]
    tars = tmp_path / "tarred"
    tars.mkdir()
    groups = [[], []]
    for i, x in enumerate(lines):
        x["shard_id"] = i % 2
        groups[i % 2].append((x["audio_filepath"], (loose / x["audio_filepath"]).read_bytes()))
    for s, g in enumerate(groups):
        write_tar(tars / f"audio_{s}.tar", g)
    man = tars / "tarred_audio_manifest.json"
    man.write_text("".join(json.dumps(x) + "\n" for x in lines))
    feed = rnnt_feed(str(man), tarred_audio_filepaths=str(tars / "audio__OP_0..1_CL_.tar"), **KW)
    got = by_key(feed)
    assert sorted(got) == sorted(ref) and feed.errors == []
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], atol=1e-5)


def test_lhotse_shar_feed(dataset, tmp_path):
    pytest.importorskip("lhotse")
    from lhotse import CutSet, Recording, SupervisionSegment

    loose, _ = dataset
    ref = by_key(rnnt_feed(str(loose / "manifest.jsonl"), **KW))
    cuts = []
    for x in (json.loads(t) for t in (loose / "manifest.jsonl").read_text().splitlines()):
        if not x["audio_filepath"].endswith(".flac"):
            continue
        rid = x["audio_filepath"].split(".")[0]
        c = Recording.from_file(str(loose / x["audio_filepath"]), recording_id=rid).to_cut()
        c.supervisions = [SupervisionSegment(id=rid, recording_id=rid, start=0,
                                             duration=c.duration, text=x["text"])]
        cuts.append(c)
    out = tmp_path / "shar"
    out.mkdir()
    CutSet.from_cuts(cuts).to_shar(str(out), fields={"recording": "flac"}, shard_size=2)
    feed = rnnt_feed(str(out), **KW)
    got = by_key(feed)
    assert feed.errors == [] and len(got) == len(cuts)
    for k in got:
        np.testing.assert_allclose(got[k], ref[k], atol=1e-5)


def _video_bytes(tmp_path, name, frames):
    from video_media import make_video

    return open(make_video(tmp_path / name, codec="h264", num_frames=frames), "rb").read()


def test_video_and_image_feeds_over_shards(tmp_path):
    """Video shards (KEY.mp4 + KEY.cls: the class index) and image shards (KEY.png +
    KEY.json label) through the recipes, over an HTTP server; a bad member named."""
    from avpipe.recipes import image_classification, video_classification

    vids = [(f"v{i}.mp4", _video_bytes(tmp_path, f"v{i}.mp4", 12 + i)) for i in range(4)]
    members = []
    for i, (name, data) in enumerate(vids):
        members += [(name, data), (name.replace(".mp4", ".cls"), str(i % 3).encode())]
    members += [("v9.mp4", b"not a video"), ("v9.cls", b"1")]
    write_tar(tmp_path / "videos.tar", members)
    from PIL import Image

    imgs = []
    for i in range(5):
        b = io.BytesIO()
        Image.fromarray(np.full((40, 50, 3), 30 * i, np.uint8)).save(b, format="PNG")
        imgs += [(f"im{i}.png", b.getvalue()),
                 (f"im{i}.json", json.dumps({"label": "cat" if i % 2 else "dog"}).encode())]
    write_tar(tmp_path / "images.tar", imgs)
    with http_server(tmp_path, fail_every=7) as (base, _srv):
        vf = video_classification(base + "/videos.tar", clip_length=4, stride=1, crop_size=32,
                                  batch_size=2, device="cpu", train=True, seed=0)
        assert vf.classes == [0, 1, 2]
        got = {}
        for b in vf:
            assert b.clips.shape[1:] == (4, 3, 32, 32)
            for p, lab in zip(b.paths, b.labels.tolist()):
                got[p.rsplit("#", 1)[1]] = lab
        assert {k: v for k, v in got.items() if k != "v9"} == {f"v{i}": i % 3 for i in range(4)}
        assert [p for p, _ in vf.errors] == [base + "/videos.tar#v9"]
        imf = image_classification(base + "/images.tar", crop_size=16, resize_size=20,
                                   batch_size=2, device="cpu", train=False)
        assert imf.classes == ["cat", "dog"] and imf.errors == []
        seen = {}
        for b in imf:
            for p, lab in zip(b.paths, b.labels.tolist()):
                seen[p.rsplit("#", 1)[1]] = imf.classes[lab]
        assert seen == {f"im{i}": "cat" if i % 2 else "dog" for i in range(5)}


def test_grouped_order_keeps_shards_together():
    from avpipe.pipeline.feed.plans import grouped_permutation

    groups = [0, 1, 2, 0, 1, 2, 0, 1, 2, 2, 2, 5]
    a = grouped_permutation(groups, seed=3, epoch=0)
    assert sorted(a.tolist()) == list(range(len(groups)))
    runs = [groups[i] for i in a]
    # each group's items form one run
    assert len([k for k in range(len(runs)) if k == 0 or runs[k] != runs[k - 1]]) == 4
    assert a.tolist() == grouped_permutation(groups, seed=3, epoch=0).tolist()
    assert a.tolist() != grouped_permutation(groups, seed=3, epoch=1).tolist()
    assert grouped_permutation(groups, seed=3, epoch=0, shuffle=False).tolist() == [
        0, 3, 6, 1, 4, 7, 2, 5, 8, 9, 10, 11]


def test_shard_order_feed_resumes_and_refuses_the_other_order(dataset):
    import avpipe

    _, shards = dataset
    spec = str(shards / "train-{000000..000002}.tar")
    kw = dict(KW, batch_size=1, training=True)
    f = rnnt_feed(spec, shard_order=True, **kw)
    full = [b.paths[0] for b in f]
    shard_of = [p.split("#")[0] for p in full]
    assert len([k for k in range(10) if k == 0 or shard_of[k] != shard_of[k - 1]]) == 3
    g = rnnt_feed(spec, shard_order=True, **kw)
    it = iter(g)
    head = [next(it).paths[0] for _ in range(4)]
    state = g.state_dict()
    h = rnnt_feed(spec, shard_order=True, **kw)
    h.load_state_dict(state)
    assert head + [b.paths[0] for b in h] == full
    with pytest.raises(avpipe.StateError, match="order"):
        rnnt_feed(spec, **kw).load_state_dict(state)
    loose, _ = dataset
    with pytest.raises(ValueError, match="shard_order=True takes sharded sources"):
        rnnt_feed(str(loose / "manifest.jsonl"), shard_order=True, **kw)


def test_weighted_mix_of_sources(dataset):
    """NeMo input_cfg style: loose files weighted 3, shards weighted 1: 20 items of which 15
    loose and 5 from shards (the shards' 10 items subsampled); the same per seed."""
    loose, shards = dataset
    cfg = [{"manifest_filepath": str(loose / "manifest.jsonl"), "weight": 3},
           {"source": str(shards / "train-{000000..000002}.tar"), "weight": 1.0}]
    kw = dict(KW, batch_size=4, shuffle=False)
    f = rnnt_feed(cfg, **kw)
    paths = [p for b in f for p in b.paths]
    assert len(paths) == 20
    from_shards = [p for p in paths if "#" in p]
    assert len(from_shards) == 5 and len(set(from_shards)) == 5
    loose_paths = [p for p in paths if "#" not in p]
    assert len(loose_paths) == 15 and len(set(loose_paths)) == 10  # all 10, 5 twice
    assert [p for b in rnnt_feed(cfg, **kw) for p in b.paths] == paths
    other = [p for b in rnnt_feed(cfg, **dict(kw, seed=7)) for p in b.paths]
    assert sorted(p for p in other if "#" in p) != sorted(from_shards)
    with pytest.raises(ValueError, match="weight must be a number > 0, got -1"):
        rnnt_feed([{"source": str(loose / "manifest.jsonl"), "weight": -1}], **kw)
