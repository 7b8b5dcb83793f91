"""Items from WebDataset shards, NeMo tarred audio and lhotse Shar (a Shar that lhotse itself
writes), local and over HTTP / S3 servers on 127.0.0.1."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import soundfile as sf
from servers import http_server
from shard_media import write_tar

import avpipe
from avpipe.pipeline import sharded, shards

SR = 16000


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AVPIPE_CACHE_DIR", str(tmp_path / "cache"))


def flac_bytes(i, seconds=0.5):
    x = (np.sin(np.arange(int(SR * seconds)) * (0.01 + 0.003 * i)) * 0.3).astype(np.float32)
    b = io.BytesIO()
    sf.write(b, x, SR, format="FLAC")
    return b.getvalue()



def audio_shards(d, n_shards=2, per=3):
    ref = {}
    for s in range(n_shards):
        members = []
        for k in range(per):
            key = f"s{s}u{k}"
            audio = flac_bytes(s * per + k)
            meta = {"text": f"text {s} {k}", "duration": 0.5, "speaker": f"spk{k}"}
            members += [(f"{key}.flac", audio), (f"{key}.json", json.dumps(meta).encode())]
            ref[key] = (audio, meta)
        write_tar(d / f"train-{s:06d}.tar", members)
    return ref


def test_webdataset_audio_items(tmp_path):
    ref = audio_shards(tmp_path)
    spec = str(tmp_path / "train-{000000..000001}.tar")
    assert sharded.is_shard_spec(spec) and not sharded.is_shard_spec(str(tmp_path / "m.json"))
    got = sharded.read_webdataset(spec, kind="audio")
    assert got.errors == []
    assert [it.path.rsplit("#", 1)[1] for it in got.items] == list(ref)
    for it in got.items:
        key = it.path.rsplit("#", 1)[1]
        audio, meta = ref[key]
        assert it.path == shards.sample_name(str(tmp_path / f"train-{key[1]:0>6}.tar"), key)
        assert it.locator.read() == audio
        assert it.text == meta["text"] and it.duration == 0.5
        assert it.fields == {"speaker": meta["speaker"]}
        # the bytes decode as the file would
        a = avpipe.load_audio(it.locator.read())
        b = avpipe.load_audio(io.BytesIO(audio))
        np.testing.assert_array_equal(a.samples, b.samples)


def test_webdataset_labels_and_damage(tmp_path):
    members = [("a.jpg", b"J1"), ("a.cls", b"3"),
               ("b.png", b"P2"), ("b.json", b'{"label": "cat", "w": 2}'),
               ("c.json", b'{"label": 1}'),  # no image
               ("d.jpg", b"J4"), ("d.cls", b"three"),  # not an integer
               ("e.tif", b"T5"), ("e.json", b"{not json")]
    write_tar(tmp_path / "img.tar", members)
    got = sharded.read_webdataset(str(tmp_path / "img.tar"), kind="image")
    assert [(it.path.rsplit("#", 1)[1], it.label) for it in got.items] == [("a", 3), ("b", "cat")]
    assert got.items[1].fields == {"w": 2}
    errs = dict(got.errors)
    name = str(tmp_path / "img.tar") + "#"
    assert "no image member" in errs[name + "c"]
    assert "integer label" in errs[name + "d"]
    assert "metadata" in errs[name + "e"]
    with pytest.raises(ValueError, match="kind must be one of"):
        sharded.read_webdataset(str(tmp_path / "img.tar"), kind="text")


def test_webdataset_over_http(tmp_path):
    ref = audio_shards(tmp_path, n_shards=3, per=2)
    with http_server(tmp_path, fail_every=5) as (base, _srv):
        got = sharded.read_webdataset([base + "/train-000000.tar",
                                       base + "/train-{000001..000002}.tar"], kind="audio")
        assert got.errors == [] and len(got.items) == 6
        for it in got.items:
            assert it.locator.read() == ref[it.path.rsplit("#", 1)[1]][0]


def test_lhotse_shar(tmp_path):
    lhotse = pytest.importorskip("lhotse")
    from lhotse import CutSet, Recording, SupervisionSegment

    cuts = []
    for i in range(5):
        p = tmp_path / f"u{i}.flac"
        p.write_bytes(flac_bytes(i, seconds=1.0 + 0.25 * i))
        c = Recording.from_file(str(p), recording_id=f"u{i}").to_cut()
        if i == 2:
            c = c.truncate(offset=0.25, duration=0.5)
        c.supervisions = [SupervisionSegment(id=f"s{i}", recording_id=f"u{i}", start=0,
                                             duration=c.duration, text=f"hello {i}")]
        cuts.append(c)
    out = tmp_path / "shar"
    out.mkdir()
    CutSet.from_cuts(cuts).to_shar(str(out), fields={"recording": "flac"}, shard_size=2)
    assert sharded.is_shar_spec(str(out)) and not sharded.is_shar_spec(str(tmp_path / "u0.flac"))
    got = sharded.read_shar(str(out))
    assert got.errors == []
    ref = list(CutSet.from_shar(in_dir=str(out)))
    assert [it.text for it in got.items] == [c.supervisions[0].text for c in ref]
    for it, c in zip(got.items, ref):
        a = avpipe.load_audio(it.locator.read(), offset=it.offset, duration=it.duration)
        want = c.load_audio()[0]
        assert a.sample_rate == c.sampling_rate
        np.testing.assert_allclose(a.samples, want, atol=1e-4)
    assert lhotse.__version__


def test_nemo_tarred_audio(tmp_path):
    """NeMo's layout: members named by base name, the manifest naming them with a shard_id; the
    pattern in braces or NeMo's _OP_/_CL_."""
    ref = {}
    lines = []
    for s in range(3):
        members = []
        for k in range(2):
            name = f"utt_{s}_{k}.flac"
            ref[name] = flac_bytes(s * 2 + k)
            members.append((name, ref[name]))
            lines.append({"audio_filepath": f"some/dir/{name}", "duration": 0.5,
                          "text": f"t{s}{k}", "shard_id": s, "lang": "en"})
        write_tar(tmp_path / f"audio_{s}.tar", members)
    lines.append({"audio_filepath": "missing.flac", "duration": 1.0, "text": "x", "shard_id": 1})
    lines.append({"audio_filepath": "utt_0_0.flac", "duration": 1.0, "text": "x", "shard_id": 7})
    man = tmp_path / "tarred_manifest.json"
    man.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    for pattern in (str(tmp_path / "audio__OP_0..2_CL_.tar"), str(tmp_path / "audio_{0..2}.tar")):
        got = sharded.read_nemo_tarred(man, pattern)
        assert [it.text for it in got.items] == [x["text"] for x in lines[:6]]
        for it in got.items:
            assert it.locator.read() == ref[it.raw_path.rsplit("/", 1)[1]]
            assert it.fields == {"lang": "en"} and it.duration == 0.5
        errs = sorted(m for _, m in got.errors)
        assert len(errs) == 2 and "no member 'missing.flac'" in errs[0]
        assert "shard_id must be an integer in [0, 3), got 7" in errs[1]
