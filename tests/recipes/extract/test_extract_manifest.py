"""Manifests and inputs, for the feeds and for extraction: one rule for a manifest line, typed
errors naming file:line, field and value, ``root=``, every row of the input accounted for,
strict JSON outputs, names that are not UTF-8, and the extraction's messages."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from paths import REPO, TESTS

from avpipe.errors import ManifestError, OutsideRootError
from avpipe.pipeline.sources import Item, read_csv, read_list, read_manifest
from avpipe.recipes.extract import ExtractSummary, resolve_inputs, run_extract
from avpipe.recipes.extract._presets import extensions_of, resolve_preset
from avpipe.recipes.extract._writers import dumps

ROOT = Path(REPO)
SAMPLES = ROOT / "samples"
NEMO = extensions_of(resolve_preset("nemo"))


def strict_jsonl(path) -> list:
    """Rows of a JSON-lines file, refusing NaN / Infinity (not JSON)."""
    def refuse(c):
        raise ValueError(f"{c} in {path}")

    with open(path, encoding="utf-8") as f:
        return [json.loads(x, parse_constant=refuse) for x in f if x.strip()]


def cli(*args, **kw):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}
    return subprocess.run([sys.executable, "-m", "avpipe", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=240, **kw)


def manifest(tmp_path, *lines, name="m.jsonl") -> Path:
    p = tmp_path / name
    p.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return p


GOOD = '{"audio_filepath": "a.wav", "duration": 1.0, "text": "hi"}'

# (the line 2, the field the error names, a piece of the value as named)
BAD_LINES = [
    ('{"audio_filepath": 3, "duration": 1}', "audio_filepath", "3"),
    ('{"audio_filepath": null}', "audio_filepath", "None"),
    ('{"audio_filepath": "b.wav", "offset": {"s": 1}}', "offset", "{'s': 1}"),
    ('{"audio_filepath": "b.wav", "duration": "3.5"}', "duration", "'3.5'"),
    ('{"audio_filepath": "b.wav", "duration": true}', "duration", "True"),
    ('{"audio_filepath": "b.wav", "duration": -1}', "duration", "-1"),
    ('{"audio_filepath": "b.wav", "offset": -0.5, "duration": 1}', "offset", "-0.5"),
    ('{"audio_filepath": "b.wav", "duration": ' + "1" * 401 + "}", "duration", "chars)"),
    ('{"audio_filepath": "b.wav", "text": 42}', "text", "42"),
]


@pytest.mark.parametrize("line,field,value", BAD_LINES)
def test_a_bad_field_is_a_manifest_error_naming_file_line_field_value(tmp_path, line, field,
                                                                      value):
    m = manifest(tmp_path, GOOD, line)
    with pytest.raises(ManifestError) as e:
        read_manifest(m)
    assert (e.value.manifest, e.value.line, e.value.field) == (str(m), 2, field)
    assert f"m.jsonl:2: field {field!r}" in str(e.value) and value in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_are_refused_in_any_field(tmp_path, raw):
    for f in ("duration", "offset", "score"):
        m = manifest(tmp_path, GOOD, f'{{"audio_filepath": "b.wav", "{f}": {raw}}}')
        with pytest.raises(ManifestError, match=r"m\.jsonl:2: not a JSON line"):
            read_manifest(m)


def test_null_offset_and_duration_are_absent_and_zero_is_fine(tmp_path):
    m = manifest(tmp_path, '{"audio_filepath": "a.wav", "offset": null, "duration": null}',
                 '{"audio_filepath": "b.wav", "offset": 0, "duration": 0, "text": null}')
    a, b = read_manifest(m)
    assert (a.offset, a.duration, b.offset, b.duration, b.text) == (0.0, None, 0.0, 0.0, "")


def test_line_numbers_count_newlines_only(tmp_path):
    """A transcript may hold U+2028, form feeds, ... (valid in a JSON string): one line each."""
    odd = json.dumps({"audio_filepath": "a.wav", "text": "a\u2028b\x0cc\x1dd\u0085e"},
                     ensure_ascii=False)
    m = manifest(tmp_path, odd, odd, '{"audio_filepath": 1}')
    with pytest.raises(ManifestError, match=r"m\.jsonl:3: field 'audio_filepath'"):
        read_manifest(m)
    inp = resolve_inputs(m, NEMO)
    assert [it.fields.get("text") for it in inp.items[:2]] == ["a\u2028b\x0cc\x1dd\u0085e"] * 2
    assert "m.jsonl:3:" in inp.items[2].error[1]


def test_a_json_array_manifest_names_the_row(tmp_path):
    m = tmp_path / "m.json"
    m.write_text('[{"audio_filepath": "a.wav"}, {"audio_filepath": "b.wav", "offset": "1"}]')
    with pytest.raises(ManifestError, match=r"m\.json: field 'offset' = '1': row 2: seconds"):
        read_manifest(m)
    inp = resolve_inputs(m, NEMO)
    assert inp.items[0].error is None and inp.items[1].error[0] == "ManifestError"


def test_a_manifest_that_is_not_utf8_names_file_and_line(tmp_path):
    m = manifest(tmp_path, GOOD, GOOD, b'{"audio_filepath": "caf\xe9.wav"}')
    with pytest.raises(ManifestError, match=r"m\.jsonl:3: not UTF-8 text \(byte 0xe9"):
        read_manifest(m)
    (tmp_path / "l.csv").write_bytes(b"path,label\na.wav,x\ncaf\xe9.wav,y\n")
    with pytest.raises(ManifestError, match=r"l\.csv:3: not UTF-8"):
        read_csv(tmp_path / "l.csv")
    (tmp_path / "l.txt").write_bytes(b"a.wav\n\xff.wav\n")
    with pytest.raises(ManifestError, match=r"l\.txt:2: not UTF-8"):
        read_list(tmp_path / "l.txt")
    with pytest.raises(ManifestError, match=r"m\.jsonl:3: not UTF-8"):
        resolve_inputs(m, NEMO)


def test_a_csv_row_without_label_or_path_is_named_never_class_empty(tmp_path):
    (tmp_path / "l.csv").write_text("path,label\na.mp4,dog\nb.mp4,\n")
    with pytest.raises(ManifestError, match=r"l\.csv:3: field 'label' = '': no label"):
        read_csv(tmp_path / "l.csv")
    (tmp_path / "p.csv").write_text("path,label\na.mp4,dog\n ,cat\n")
    with pytest.raises(ManifestError, match=r"p\.csv:3: field 'path'.*no path"):
        read_csv(tmp_path / "p.csv")
    from avpipe.recipes.video import video_classification

    with pytest.raises(ManifestError, match="l.csv:3"):
        video_classification(tmp_path / "l.csv", device="cpu")
    # extraction: the row is an error of its own, the others go on
    inp = resolve_inputs(tmp_path / "l.csv", extensions_of(resolve_preset("clips")))
    assert [it.error is None for it in inp.items] == [True, False]
    assert inp.items[1].error[0] == "ManifestError" and "l.csv:3" in inp.items[1].error[1]


def test_root_refuses_paths_outside_in_the_feeds(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.wav").write_bytes(b"")
    os.symlink("/etc/passwd", data / "link.wav")
    m = manifest(data, '{"audio_filepath": "a.wav"}', '{"audio_filepath": "../../etc/passwd"}')
    assert len(read_manifest(m)) == 2  # no root: no check
    with pytest.raises(OutsideRootError, match=r"m\.jsonl:2: '\.\./\.\./etc/passwd' lies outside"):
        read_manifest(m, root=data)
    for lines in (['{"audio_filepath": "/etc/passwd"}'], ['{"audio_filepath": "link.wav"}']):
        with pytest.raises(OutsideRootError) as e:
            read_manifest(manifest(data, GOOD, *lines, name="n.jsonl"), root=data)
        assert e.value.line == 2 and e.value.root == str(data.resolve())
    assert [it.raw_path for it in read_manifest(manifest(data, GOOD, name="g.jsonl"),
                                                root=data)] == ["a.wav"]
    (data / "l.csv").write_text("path,label\na.wav,x\n../x.wav,y\n")
    with pytest.raises(OutsideRootError, match="l.csv:3"):
        read_csv(data / "l.csv", root=data)
    (data / "l.txt").write_text("a.wav\n/etc/passwd\n")
    with pytest.raises(OutsideRootError, match="l.txt:2"):
        read_list(data / "l.txt", root=data)
    from avpipe.recipes.rnnt import rnnt_feed

    with pytest.raises(OutsideRootError, match="m.jsonl:2"):
        rnnt_feed(m, batch_size=1, device="cpu", root=data)


def test_one_rule_for_feeds_and_extraction(tmp_path):
    """A line the feed refuses is refused by extraction, with the same message (a duration
    given without an offset is checked either way)."""
    lines = [GOOD] + [x for x, _, _ in BAD_LINES]
    m = manifest(tmp_path, *lines)
    inp = resolve_inputs(m, NEMO)
    assert len(inp.items) == len(lines)
    for i, line in enumerate(lines[1:], 1):
        with pytest.raises(ManifestError) as e:
            read_manifest(manifest(tmp_path, *[GOOD] * i, line, name="one.jsonl"))
        it = inp.items[i]
        assert it.error == ("ManifestError", str(e.value).replace("one.jsonl", "m.jsonl")), line


def speech_manifest(tmp_path) -> Path:
    """A mixed manifest: good, missing, wrong kind, outside root, a bad line, a video with an
    audio track, a video without one, a corrupt file."""
    d = tmp_path / "data"
    shutil.copytree(SAMPLES / "speech", d / "audio")
    shutil.copy(SAMPLES / "video" / "circles_h264.mp4", d / "audio")  # AAC track
    shutil.copy(SAMPLES / "video" / "squares_h264.mp4", d / "audio")  # no audio track
    (d / "audio" / "notes.txt").write_text("x")
    (d / "audio" / "bad.wav").write_bytes(b"RIFF\x00\x00garbage")
    rows = [
        '{"audio_filepath": "audio/utt01.wav", "duration": 2.9, "text": "one"}',
        '{"audio_filepath": "audio/missing.wav", "text": "gone"}',
        '{"audio_filepath": "audio/notes.txt"}',
        '{"audio_filepath": "../../etc/passwd"}',
        '{"audio_filepath": "audio/utt02.wav", "duration": "2"}',
        '{"audio_filepath": "audio/circles_h264.mp4", "text": "video"}',
        '{"audio_filepath": "audio/squares_h264.mp4"}',
        '{"audio_filepath": "audio/bad.wav"}',
        '{"audio_filepath": "audio/utt03.flac", "duration": 1.0, "offset": 0.5}',
    ]
    return manifest(d, *rows, name="train.jsonl")


def test_every_row_of_a_mixed_manifest_is_in_index_or_errors(tmp_path):
    m = speech_manifest(tmp_path)
    out = tmp_path / "o"
    s = run_extract(m, preset="nemo", out_dir=out, device="cpu", shard_size=4,
                    root=m.parent, progress=False)
    idx = strict_jsonl(out / "index.jsonl")
    errs = strict_jsonl(out / "errors.jsonl")
    n = len(m.read_text().splitlines())
    assert [r["index"] for r in idx] == list(range(n))
    ok = {r["index"] for r in idx if r["status"] == "ok"}
    assert ok | {e["index"] for e in errs} == set(range(n)) and not ok & {e["index"] for e in errs}
    why = {e["index"]: (e["error"], e["message"]) for e in errs}
    assert ok == {0, 5, 8}  # the mp4's AAC track is audio
    assert why[1][0] == "FileNotFoundError"
    assert why[2][0] == "UnsupportedFormatError" and "train.jsonl:3" in why[2][1]
    assert why[3][0] == "OutsideRootError" and "train.jsonl:4: '../../etc/passwd'" in why[3][1]
    assert why[4][0] == "ManifestError" and "train.jsonl:5: field 'duration'" in why[4][1]
    assert 6 in why and 7 in why
    assert s.ignored == 0 and s.errors == 6 and s.complete
    assert json.loads((out / "extract.json").read_text())["input"]["count"] == n


def test_root_refuses_links_out_of_a_folder_input(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    shutil.copy(SAMPLES / "speech" / "utt01.wav", d / "a.wav")
    outside = tmp_path / "elsewhere.wav"
    shutil.copy(SAMPLES / "speech" / "utt02.wav", outside)
    os.symlink(outside, d / "b.wav")
    assert all(it.error is None for it in resolve_inputs(d, NEMO).items)
    a, b = resolve_inputs(d, NEMO, root=d).items
    assert a.error is None and b.error[0] == "OutsideRootError"
    assert "'" + str(d / "b.wav") + "' lies outside root=" in b.error[1]
    s = run_extract(d, preset="nemo", out_dir=tmp_path / "o", device="cpu", root=d,
                    progress=False)
    (e,) = strict_jsonl(tmp_path / "o" / "errors.jsonl")
    assert (e["source"], e["error"]) == ("b.wav", "OutsideRootError") and s.total_written == 1


def test_files_a_folder_walk_ignores_are_named(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    shutil.copy(SAMPLES / "speech" / "utt01.wav", d / "a.wav")
    for n in ("clip.mp4", "x.bin", "y.bin", "z.bin", "w.bin", "v.bin"):
        (d / n).write_bytes(b"x")
    s = run_extract(d, preset="nemo", out_dir=tmp_path / "o", device="cpu", progress=False)
    assert s.ignored == 6 and s.ignored_names == ["clip.mp4", "v.bin", "w.bin", "x.bin", "y.bin"]
    assert "6 file(s) ignored (not nemo inputs): clip.mp4, v.bin, w.bin, x.bin, y.bin, ..." \
        in s.format()


def test_cli_root_flag(tmp_path):
    m = speech_manifest(tmp_path)
    r = cli("extract", m, "--preset", "nemo", "--out", tmp_path / "o", "--devices", "cpu",
            "--root", m.parent / "audio")
    assert r.returncode == 0, r.stderr
    errs = strict_jsonl(tmp_path / "o" / "errors.jsonl")
    outside = [e for e in errs if e["error"] == "OutsideRootError"]
    assert [e["index"] for e in outside] == [3]


def test_a_file_name_that_is_not_utf8_is_written_with_its_shard(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    shutil.copy(SAMPLES / "speech" / "utt01.wav", d / "good.wav")
    bad = os.fsdecode(b"caf\xe9.wav")
    shutil.copy(SAMPLES / "speech" / "utt02.wav", os.path.join(os.fsencode(d), b"caf\xe9.wav"))
    out = tmp_path / "o"
    for fmt in ("tar", "npy", "parquet"):
        o = out / fmt
        s = run_extract(d, preset="nemo", out_dir=o, device="cpu", format=fmt, progress=False)
        assert s.complete and s.errors == 0 and s.total_written == 2, s.format()
        idx = strict_jsonl(o / "index.jsonl")
        row = next(r for r in idx if "source_bytes" in r)
        assert row["source"] == "caf\\xe9.wav"
        assert base64.b64decode(row["source_bytes"]) == b"caf\xe9.wav"
        assert os.fsdecode(base64.b64decode(row["source_bytes"])) == bad
        if fmt == "tar":
            with tarfile.open(o / row["shard"]) as tf:
                meta = json.loads(tf.extractfile(f"{row['key']}.json").read())
            assert meta["source"] == "caf\\xe9.wav" and meta["source_bytes"] == row["source_bytes"]
        # a rerun finds it done
        assert run_extract(d, preset="nemo", out_dir=o, device="cpu", format=fmt,
                           progress=False).skipped == 2


def test_json_outputs_never_hold_nan():
    row = {"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": -float("inf")},
           "s": os.fsdecode(b"x\xff")}
    text = dumps(row)
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == \
        {"a": None, "b": [None, 1.5], "c": {"d": None}, "s": "x\\xff"}
    text.encode("utf-8")
    assert dumps({"a": 1.0}) == '{"a":1.0}'


def test_nan_in_a_result_never_reaches_json_outputs(tmp_path):
    import numpy as np

    import avpipe.recipes.extract._writers as w
    from avpipe.recipes.extract._process import Result, Shard

    it = Item(index=0, source="a.wav", path=str(tmp_path / "a.wav"), kind="audio",
              fields={"text": "x"})
    cfg = {"name": "nemo", "audio": {}}
    res = [Result(it, np.zeros((2, 3), np.float32), {"seconds": float("nan")})]
    w.write_shard(str(tmp_path), Shard(0, 1), res, cfg, "tar", 1)
    (part,) = (tmp_path / "parts").iterdir()
    assert strict_jsonl(part)[0]["info"]["seconds"] is None
    with tarfile.open(next((tmp_path / "shards").iterdir())) as tf:
        meta = tf.extractfile("000000000.json").read().decode()
    json.loads(meta, parse_constant=lambda c: pytest.fail(c))


def test_refused_items_travel_to_workers():
    it = Item(index=3, source="x", path="/x", kind=None, fields={},
              error=("ManifestError", "m:1: bad"))
    assert Item.from_task(json.loads(json.dumps(it.to_task()))) == it
    ok = Item(index=1, source="a", path="/a", kind="audio", fields={"t": 1})
    assert Item.from_task(ok.to_task()) == ok and len(ok.to_task()) == 5


# --- messages ------------------------------------------------------------------------------


def summary(**kw) -> str:
    base = dict(input_path="in", out_dir="OUT", preset="nemo", devices=["cpu"], inputs=2,
                shards_total=1, shards_done=1)
    return ExtractSummary(**{**base, **kw}).format()


def test_summary_says_written_only_when_something_was():
    assert "features written to OUT" in summary(written={"audio": 2})
    assert "\nfeatures written to" not in summary(errors=2, total_errors=2)
    assert "no features written to OUT" in summary(errors=2, total_errors=2)
    assert "nothing new written" in summary(skipped=2)


@pytest.mark.parametrize("failure,helps", [
    ("cpu: UnicodeEncodeError: 'utf-8' codec can't encode: surrogates not allowed", False),
    ("cpu: TypeError: bad", False),
    ("cpu: shard 0-511 ended 8 workers (last: signal 11)", False),
    ("cpu: signal 9", True),
    ("cpu: OSError: [Errno 28] No space left on device", True),
    ("cpu: worker ended without finishing (exit code 1)", True),
])
def test_resume_hint_only_when_a_rerun_can_help(failure, helps):
    text = summary(shards_done=0, failures=[failure])
    assert ("run the same command again to resume" in text) == helps, text
    assert "0 of 1 shards done" in text


def test_progress_bar_rate_is_per_second(monkeypatch):
    import io

    from avpipe.recipes.extract import _Progress

    its = [Item(index=0, source="a.wav", path="/a.wav", kind="audio", fields={"duration": 3600.0})]
    f = io.StringIO()
    monkeypatch.setattr(sys, "stderr", f)
    p = _Progress(its, {"video": {}}, True)
    p.t0 -= 10
    p._last = -1.0
    p((1, 0, 360.0, 0.0))
    p.bar.refresh()
    p.close()
    text = f.getvalue()
    assert "s/ audio-h" not in text and "s/audio-h" not in text, text
    assert "audio-h [" in text and "audio-s/s" in text and "files/s" in text, text


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    for i in range(40):
        shutil.copy(SAMPLES / "speech" / "utt01.wav", d / f"{i:03d}.wav")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "avpipe", "extract", str(d), "--preset", "nemo",
                          "--out", str(tmp_path / "o"), "--devices", "cpu", "--shard-size", "1",
                          "--workers", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "o" / "parts").is_dir():
        time.sleep(0.1)
    assert (tmp_path / "o" / "parts").is_dir()
    os.killpg(p.pid, signal.SIGINT)  # the terminal sends it to the whole group
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == \
        "avpipe extract: interrupted; run the same command again to resume"


def _sigint_ignored(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(x.split()[1], 16) for x in f if x.startswith("SigIgn:"))
    return bool(mask & (1 << (signal.SIGINT - 1)))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_worker_processes_start_with_ctrl_c_ignored():
    """Ctrl-C goes to the whole terminal group: the workers ignore it from their first
    instruction (none prints a KeyboardInterrupt traceback from its imports), the parent
    ends them."""
    from avpipe.recipes.extract._engine_local import Standby

    before = signal.getsignal(signal.SIGINT)
    sb = Standby()
    try:
        assert _sigint_ignored(sb.proc.pid)
        assert signal.getsignal(signal.SIGINT) is before  # the parent's own is kept
    finally:
        sb.stop()


def test_ctrl_c_before_the_work_starts_exits_130(monkeypatch, capsys):
    import avpipe.recipes.extract as ex
    from avpipe.cli.main import main

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ex, "run_extract", interrupted)
    assert main(["extract", "in", "--preset", "nemo", "--out", "o"]) == 130
    assert capsys.readouterr().err.strip() == \
        "avpipe extract: interrupted; run the same command again to resume"
    import avpipe._info

    monkeypatch.setattr(avpipe._info, "info", interrupted)  # any command: click's Abort
    assert main(["info"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "avpipe: interrupted"


# --- fuzz: typed-field attacks -------------------------------------------------------------


def test_manifest_attacks_give_typed_errors_or_clean_results(tmp_path):
    sys.path.insert(0, TESTS)
    from fuzz import manifest_attacks

    cases = manifest_attacks.cases(seed=3)
    assert len(cases) > 200
    typed = (ManifestError, OutsideRootError)
    outcomes = {"clean": 0, "typed": 0}
    for name, kind, data in cases:
        p = tmp_path / f"{name}.{kind}"
        p.write_bytes(data)
        # the feeds' readers: a clean list, or a typed error
        try:
            items = read_manifest(p, root=tmp_path) if kind == "jsonl" else \
                read_csv(p, root=tmp_path)
            outcomes["clean"] += 1
            for it in items:
                json.dumps([it.path, it.text, it.offset, it.duration, it.fields],
                           allow_nan=False)
                assert isinstance(it.offset, float) and (it.duration is None or
                                                         isinstance(it.duration, float))
        except typed:
            outcomes["typed"] += 1
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{name}: untyped {type(e).__name__}: {e}")
        # extraction: every line an item (ok or refused), or a typed error for the file
        try:
            inp = resolve_inputs(p, NEMO, root=tmp_path)
            for it in inp.items:
                assert it.error is None or it.error[0] in (
                    "ManifestError", "OutsideRootError", "UnsupportedFormatError"), it
                dumps(it.fields)
        except typed:
            pass
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ != "EmptyInputError":
                pytest.fail(f"{name}: extraction: untyped {type(e).__name__}: {e}")
    assert outcomes["clean"] and outcomes["typed"]


_FORK_CHECK = """
import os, sys, threading
from avpipe.recipes.extract._engine_local import Standby

def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()

def ignored(pid):
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(x.split()[1], 16) for x in f if x.startswith("SigIgn:"))
    return bool(mask & 2)

sb = Standby(cpu=True)
try:
    print("forked", sb.forked, cmdline(sb.proc.pid) == cmdline(os.getpid()), ignored(sb.proc.pid))
finally:
    sb.stop()
stop = threading.Event()
t = threading.Thread(target=stop.wait)
t.start()
sb = Standby(cpu=True)
try:
    print("with a thread", sb.forked, cmdline(sb.proc.pid) == cmdline(os.getpid()))
finally:
    sb.stop()
    stop.set()
    t.join()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux only")
def test_cpu_standby_worker_is_forked_unless_a_thread_runs():
    """A CPU job's worker started ahead is a fork of the calling process (its modules
    imported: no interpreter start nor imports before its first shard), Ctrl-C ignored as a
    spawned one; while another thread runs in the caller (it could hold a lock the fork would
    copy held) it is spawned. (In a fresh interpreter: other tests leave threads behind.)"""
    import subprocess

    root = REPO
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _FORK_CHECK], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["forked True True True", "with a thread False False"]


def test_duration_without_offset_is_the_span_the_feed_reads(tmp_path):
    """A manifest line with a duration and no offset: extraction stores the features of
    [0, duration), as rnnt_feed and load_audio(duration=) read it, not of the whole file."""
    import io
    import tarfile

    import numpy as np

    import avpipe

    d = tmp_path / "d"
    shutil.copytree(SAMPLES / "speech", d)
    (d / "m.jsonl").write_text(
        '{"audio_filepath": "utt01.wav", "duration": 1.5, "text": "a"}\n'
        '{"audio_filepath": "utt03.flac", "duration": 2.0, "text": "b"}\n'
        '{"audio_filepath": "utt02.wav", "text": "c"}\n')
    out = tmp_path / "out"
    run_extract(str(d / "m.jsonl"), preset="nemo", out_dir=str(out), devices="cpu")
    rows = [json.loads(x) for x in (out / "index.jsonl").read_text().splitlines()]
    with tarfile.open(out / rows[0]["shard"]) as tf:
        stored = {r["source"]: np.load(io.BytesIO(tf.extractfile(f"{r['key']}.npy").read()))
                  for r in rows}
    feed = avpipe.recipes.rnnt_feed(str(d / "m.jsonl"), batch_size=1, training=False,
                                    shuffle=False, device="cpu")
    for b in feed:
        src = os.path.basename(b.paths[0])
        np.testing.assert_array_equal(
            np.asarray(b.features[0, :, : int(b.feature_lengths[0])]), stored[src])
    assert stored["utt01.wav"].shape[1] == 150 and stored["utt03.flac"].shape[1] == 200
    a = avpipe.load_audio(str(d / "utt02.wav"))
    assert stored["utt02.wav"].shape[1] == a.samples.shape[0] // 160  # no duration: whole file
