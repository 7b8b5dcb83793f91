"""One input model: the feeds and extraction read a list into the same :class:`Item` objects
(extraction adds its ``index``, ``source`` and ``kind``), and both open an item's media by
:meth:`Item.media`."""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import re
from pathlib import Path

import pytest
from paths import REPO
from shard_media import write_tar

import avpipe.recipes.extract as extract_pkg
from avpipe.pipeline.sharded import sharded_listing
from avpipe.pipeline.sources import Item, read_csv, read_list, read_manifest
from avpipe.recipes.extract import resolve_inputs
from avpipe.recipes.extract._presets import extensions_of, resolve_preset

ROOT = Path(REPO)
SPEECH = ROOT / "samples" / "speech"
NEMO = extensions_of(resolve_preset("nemo"))


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("AVPIPE_CACHE_DIR", str(tmp_path / "cache"))


def _same(feed: list, extracted: list) -> None:
    """Item for item: the same class and the same values, extraction's own three aside."""
    assert len(feed) == len(extracted)
    for k, (a, b) in enumerate(zip(feed, extracted)):
        assert type(a) is Item and type(b) is Item
        assert b.index == k and b.error is None and b.kind == "audio"
        assert dataclasses.replace(b, index=None, source=None, kind=None) == a
        assert list(b.fields.items()) == list(a.fields.items())  # the line's order too
        assert b.locator == a.locator


def test_a_manifest_gives_the_feeds_and_extraction_the_same_items(tmp_path):
    (tmp_path / "sub").mkdir()
    m = tmp_path / "sub" / "m.jsonl"
    m.write_text("\n".join(json.dumps(x) for x in [
        {"audio_filepath": str(SPEECH / "utt01.wav"), "duration": 2.5, "text": "a b"},
        {"text": "c", "lang": "de", "audio_filepath": "../x/./y.flac", "offset": 0.5},
        {"audio_filepath": "z.ogg", "label": 3, "duration": None, "w": [1, {"q": 2}]},
    ]) + "\n")
    feed = read_manifest(m)
    _same(feed, resolve_inputs(str(m), NEMO).items)
    assert feed[1].path == str(tmp_path / "x" / "y.flac") and feed[1].raw_path == "../x/./y.flac"
    assert (feed[1].text, feed[1].offset, feed[2].label, feed[2].text) == ("c", 0.5, 3, "")


def test_a_csv_and_a_list_give_the_same_items(tmp_path):
    c = tmp_path / "l.csv"
    c.write_text("path,label,spk\na.wav,dog,1\nsub/b.flac,cat,2\n")
    _same(read_csv(c), resolve_inputs(str(c), NEMO).items)
    t = tmp_path / "l.txt"
    t.write_text("# files\na.wav\n\n  sub/b.flac \n")
    _same(read_list(t), resolve_inputs(str(t), NEMO).items)


def test_shards_give_the_same_items(tmp_path):
    members = []
    for k, f in enumerate(["utt01.wav", "utt03.flac"]):
        key = f.split(".")[0]
        members += [(f, (SPEECH / f).read_bytes()),
                    (f"{key}.json", json.dumps({"text": f, "spk": k, "duration": 1.0}).encode())]
    write_tar(tmp_path / "s-0.tar", members)
    spec = str(tmp_path / "s-{0..0}.tar")
    feed = sharded_listing(spec, kind="audio").items
    got = resolve_inputs(spec, NEMO).items
    assert len(feed) == len(got) == 2
    for a, b, f in zip(feed, got, ["utt01.wav", "utt03.flac"]):
        assert type(a) is type(b) is Item
        assert b.source == a.path == f"{tmp_path / 's-0.tar'}#{f.split('.')[0]}"
        # extraction's fields are the sample's, with the values the reader read out of them
        assert dataclasses.replace(b, index=None, source=None, kind=None, fields=a.fields) == a
        assert b.fields == {**a.fields, "text": a.text, "duration": a.duration}
        # one way to the media: the member's bytes
        assert a.media() == b.media() == (SPEECH / f).read_bytes()
    assert read_manifest(SPEECH / "manifest.jsonl")[0].media() == str(SPEECH / "utt01.wav")


def test_extraction_has_no_item_class_of_its_own():
    own = []
    for info in pkgutil.iter_modules(extract_pkg.__path__):
        mod = importlib.import_module(f"{extract_pkg.__name__}.{info.name}")
        if getattr(mod, "Item", Item) is not Item:
            own.append(f"{mod.__name__}.Item")
        own += [f"{mod.__name__}.{n}" for n, v in vars(mod).items()
                if isinstance(v, type) and v.__module__ == mod.__name__
                and dataclasses.is_dataclass(v)
                and {"path", "source"} <= {f.name for f in dataclasses.fields(v)}]
    assert not own, own


def test_media_is_opened_by_item_media_alone():
    """No reader of an item's bytes but :meth:`Item.media` (``locator.read()`` beside it
    would be a second rule for where an item's media lies)."""
    bad = []
    for p in sorted((ROOT / "avpipe").rglob("*.py")):
        if p.name == "sources.py" and p.parent.name == "pipeline":
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\blocator\.read\(", line):
                bad.append(f"{p.relative_to(ROOT)}:{n}")
    assert not bad, bad
