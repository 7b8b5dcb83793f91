"""extract's input resolution shortcuts give what the general code gives: sources relative
to the input's root (posix paths by string), and the input fingerprint recorded for resume."""

from __future__ import annotations

import hashlib
import json

import pytest

from avpipe.recipes.extract import _fingerprint
from avpipe.recipes.extract._inputs import Inputs, Item, _rel, _rel_any


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
    items = [Item(0, "a.flac", "/r/a.flac", "audio"),
             Item(1, 'é "q"\\\\x.flac', "/r/x.flac", "audio"),
             Item(2, "v.mp4", "/r/v.mp4", "video", {"label": "cat", "b": [1, 2], "a": None}),
             Item(3, "line\nbreak.wav", "/r/l.wav", "audio", {})]
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps([it.source, it.kind, it.fields], sort_keys=True).encode())
        h.update(b"\n")
    assert _fingerprint(Inputs("/r", "list", items)) == h.hexdigest()
