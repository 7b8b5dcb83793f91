"""extract's input resolution shortcuts give what the general code gives: sources relative
to the input's root (posix paths by string), and the input fingerprint recorded for resume."""

from __future__ import annotations

import hashlib
import json

import pytest

from avpipe.pipeline.sources import Item
from avpipe.recipes.extract import _fingerprint
from avpipe.recipes.extract._inputs import Inputs, _rel, _rel_any


@pytest.mark.parametrize("path,root", [
    ("/data/a/b.flac", "/data"), ("/data/a/b.flac", "/data/"), ("/data/a/b.flac", "/"),
    ("/data2/b.flac", "/data"), ("/data", "/data"), ("/x/../data/./b.flac", "/data"),
    ("/data/b.flac", "/data/a"), ("/é/ü b.flac", "/é"), ("//data/b.flac", "/data"),
    ("/data/a/b.flac", "/data/a/../"), ("/data/..hidden.flac", "/data"),
    ("/data/...x/a.flac", "/data"), ("/data/.x/a.flac", "/data"),
])
def test_rel_equals_relpath(path, root):
    assert _rel(path, root) == _rel_any(path, root)


def test_fingerprint_equals_the_json_lines_digest():
    items = [Item(index=0, source="a.flac", path="/r/a.flac", kind="audio"),
             Item(index=1, source='é "q"\\\\x.flac', path="/r/x.flac", kind="audio"),
             Item(index=2, source="v.mp4", path="/r/v.mp4", kind="video",
                  fields={"label": "cat", "b": [1, 2], "a": None}),
             Item(index=3, source="line\nbreak.wav", path="/r/l.wav", kind="audio", fields={})]
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps([it.source, it.kind, it.fields], sort_keys=True).encode())
        h.update(b"\n")
    assert _fingerprint(Inputs("/r", "list", items)) == h.hexdigest()
