"""Item sources: paths relative to the manifest / list file, fields kept, bad lines named."""

from __future__ import annotations

import os

import pytest

from avpipe.pipeline.sources import class_index, read_csv, read_folder, read_list, read_manifest


def test_manifest_relative_paths_offsets_and_fields(tmp_path):
    d = tmp_path / "sub"
    d.mkdir()
    (d / "m.jsonl").write_text(
        '{"audio_filepath": "a/x.wav", "duration": 1.5, "text": "hi", "offset": 2.0, "lang": "en"}\n'
        "\n"
        '{"audio_filepath": "/abs/y.flac", "duration": 3, "text": "yo"}\n')
    a, b = read_manifest(d / "m.jsonl")
    assert a.path == os.path.join(str(d), "a", "x.wav") and a.raw_path == "a/x.wav"
    assert (a.offset, a.duration, a.text) == (2.0, 1.5, "hi")
    # the line's fields, in its order (the transcript and the span too)
    assert list(a.fields.items()) == [("duration", 1.5), ("text", "hi"), ("offset", 2.0),
                                      ("lang", "en")]
    assert b.path == "/abs/y.flac" and b.offset == 0.0 and b.duration == 3.0
    (d / "bad.jsonl").write_text('{"audio_filepath": "a.wav"}\n{"text": "no path"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_manifest(d / "bad.jsonl")


def test_csv_and_classes(tmp_path):
    (tmp_path / "l.csv").write_text("path,label,extra\nv/a.mp4,dog,1\nb.mp4,cat,2\n\n")
    items = read_csv(tmp_path / "l.csv")
    assert [it.path for it in items] == [str(tmp_path / "v" / "a.mp4"), str(tmp_path / "b.mp4")]
    assert class_index(items) == (["cat", "dog"], [1, 0])
    (tmp_path / "n.csv").write_text("file,cls\na,b\n")
    with pytest.raises(ValueError, match="path"):
        read_csv(tmp_path / "n.csv")


def test_folder_and_lists(tmp_path):
    for c, names in {"b": ["2.jpg", "1.png"], "a": ["x.jpg", "notes.txt"]}.items():
        (tmp_path / c).mkdir()
        for n in names:
            (tmp_path / c / n).write_bytes(b"")
    items = read_folder(tmp_path, extensions=(".jpg", ".png"))
    assert [(os.path.basename(it.path), it.label) for it in items] == \
        [("x.jpg", "a"), ("1.png", "b"), ("2.jpg", "b")]
    (tmp_path / "list.txt").write_text("# comment\na/x.jpg\n\nb/1.png\n")
    assert [it.path for it in read_list(tmp_path / "list.txt")] == \
        [str(tmp_path / "a" / "x.jpg"), str(tmp_path / "b" / "1.png")]
    pairs = read_list([("/p/q.jpg", "q"), "/p/r.jpg"])
    assert [(it.path, it.label) for it in pairs] == [("/p/q.jpg", "q"), ("/p/r.jpg", None)]


def test_files_saved_with_a_byte_order_mark(tmp_path):
    """Excel and Notepad save UTF-8 with a BOM: the first header / line still reads."""
    bom = "\ufeff"
    (tmp_path / "m.jsonl").write_text(bom + '{"audio_filepath": "a.wav", "duration": 1}\n',
                                      encoding="utf-8")
    (tmp_path / "l.csv").write_text(bom + "path,label\na.mp4,dog\n", encoding="utf-8")
    (tmp_path / "l.txt").write_text(bom + "a.mp4\n", encoding="utf-8")
    assert read_manifest(tmp_path / "m.jsonl")[0].raw_path == "a.wav"
    assert read_csv(tmp_path / "l.csv")[0].label == "dog"
    assert read_list(tmp_path / "l.txt")[0].path == str(tmp_path / "a.mp4")
    from avpipe.recipes.extract import resolve_inputs

    for name in ("m.jsonl", "l.csv", "l.txt"):
        items = resolve_inputs(tmp_path / name, {".wav": "audio", ".mp4": "video"}).items
        assert [os.path.basename(it.path) for it in items] in (["a.wav"], ["a.mp4"]), name
