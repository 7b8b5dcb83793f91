"""Extraction's worker processes are avpipe's one kind of worker (a fresh interpreter, or a fork
of the caller for a CPU worker started ahead): a script calling ``run_extract`` needs no ``if
__name__ == "__main__":`` guard (no worker runs it again), and operators registered outside
avpipe reach every worker, forked or fresh; one registered in the script itself (``__main__``)
reaches a forked worker, and a run that needs it in a fresh interpreter fails before its work,
naming it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap

import numpy as np
import pytest
from paths import REPO

from avpipe.ops import registry
from avpipe.recipes.extract import run_extract

sf = pytest.importorskip("soundfile")

# an operator module: every feature becomes 7 (what the outputs show it ran)
OPS_MODULE = '''
from avpipe.ops import registry


@registry.register("{name}", kind="audio", stage="features")
def seven(data):
    feats, frame_lengths = data
    return feats * 0 + 7.0, frame_lengths
'''


def _inputs(d, n: int = 4):
    """``n`` short WAV and FLAC files (a tone each) in ``d``."""
    d.mkdir()
    t = np.arange(8000) / 16000
    for i in range(n):
        x = (0.1 * np.sin(2 * np.pi * (200 + 50 * i) * t)).astype(np.float32)
        sf.write(d / f"u{i}.{'wav' if i % 2 else 'flac'}", x, 16000, subtype="PCM_16")
    return d


def _preset(path, op: str):
    path.write_text('[audio]\nsample_rate = 16000\n'
                    f'ops = [{{op = "log_mel", preset = "nemo"}}, {{op = "{op}"}}]\n')
    return path


def _features(out) -> dict:
    got = {}
    for line in (out / "index.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert row["status"] == "ok", row
        with tarfile.open(out / row["shard"]) as tf:
            got[os.path.basename(row["source"])] = np.load(
                io.BytesIO(tf.extractfile(f"{row['key']}.npy").read()))
    return got


def _run_script(script: str, tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (REPO, os.environ.get("PYTHONPATH")) if x)}
    env.pop("AVPIPE_EXTRACT_PROFILE", None)
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run([sys.executable, str(path), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=tmp_path)


# no `if __name__ == "__main__":` guard; two CPU workers: the one started ahead is a fork of
# this script, the other a fresh interpreter; the operator comes from an importable module
GUARDLESS = '''
import sys
sys.path.insert(0, sys.argv[1])
import seven_ops  # registers "seven_mod"
from avpipe.recipes.extract import run_extract

print("script body ran", flush=True)
s = run_extract(sys.argv[2], preset=sys.argv[3], out_dir=sys.argv[4], devices=["cpu", "cpu"],
                shard_size=2)
print("written", s.total_written, s.errors, flush=True)
'''


def test_a_script_without_a_main_guard_runs_extraction_with_an_importable_operator(tmp_path):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "seven_ops.py").write_text(OPS_MODULE.format(name="seven_mod"))
    inp = _inputs(tmp_path / "in")
    preset = _preset(tmp_path / "seven.toml", "seven_mod")
    out = tmp_path / "out"
    r = _run_script(GUARDLESS, tmp_path, mods, inp, preset, out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["script body ran", "written 4 0"], r.stderr[-3000:]
    feats = _features(out)
    assert sorted(feats) == [f"u{i}.{'wav' if i % 2 else 'flac'}" for i in range(4)]
    for arr in feats.values():  # both workers (two shards of two) ran the module's operator
        assert arr.shape[0] == 80 and arr.shape[1] > 0 and (arr == 7.0).all()


def test_an_operator_in_an_importable_module_reaches_a_fresh_worker(tmp_path, monkeypatch):
    """Here (the test process) the module is imported by name from a folder on sys.path; the
    workers are fresh interpreters, which import it before their work."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "seven_ops_here.py").write_text(OPS_MODULE.format(name="seven_here"))
    monkeypatch.syspath_prepend(str(mods))
    import seven_ops_here  # noqa: F401 - registers "seven_here"

    try:
        assert "seven_ops_here" in registry.modules()
        assert registry.get("seven_here", "audio").module == "seven_ops_here"
        inp = _inputs(tmp_path / "in")
        s = run_extract(inp, preset=str(_preset(tmp_path / "p.toml", "seven_here")),
                        out_dir=tmp_path / "out", devices=["cpu", "cpu"], shard_size=2)
        assert s.total_written == 4 and s.errors == 0
        assert all((a == 7.0).all() for a in _features(tmp_path / "out").values())
    finally:
        registry.unregister("seven_here", "audio")
        sys.modules.pop("seven_ops_here", None)


def test_an_operator_registered_in_main_fails_the_run_before_its_work(tmp_path, monkeypatch):
    """An operator of the running script (its module is ``__main__``) cannot reach a fresh
    interpreter: the run fails before any work, naming the operator and the fix."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "seven_ops_main.py").write_text(OPS_MODULE.format(name="seven_main"))
    monkeypatch.syspath_prepend(str(mods))
    import seven_ops_main  # noqa: F401

    try:
        monkeypatch.setattr(registry.get("seven_main", "audio"), "module", "__main__")
        assert "seven_ops_main" not in registry.modules()
        inp = _inputs(tmp_path / "in")
        out = tmp_path / "out"
        with pytest.raises(registry.OperatorNotImportableError,
                           match=r"'seven_main'.*__main__.*importable module"):
            run_extract(inp, preset=str(_preset(tmp_path / "p.toml", "seven_main")),
                        out_dir=out, devices=["cpu", "cpu"], shard_size=2)
        assert not out.exists() or not any(p.suffix == ".tar" for p in out.rglob("*"))
    finally:
        registry.unregister("seven_main", "audio")
        sys.modules.pop("seven_ops_main", None)


# the operator is the script's own (__main__); one CPU worker, a fork of this script
MAIN_OP = '''
import sys
from avpipe.ops import registry
from avpipe.recipes.extract import run_extract

@registry.register("seven_main_fork", kind="audio", stage="features")
def seven(data):
    feats, frame_lengths = data
    return feats * 0 + 7.0, frame_lengths

s = run_extract(sys.argv[1], preset=sys.argv[2], out_dir=sys.argv[3], devices=["cpu"],
                shard_size=2)
print("written", s.total_written, s.errors, flush=True)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux only")
def test_an_operator_registered_in_main_reaches_a_forked_worker(tmp_path):
    inp = _inputs(tmp_path / "in")
    out = tmp_path / "out"
    r = _run_script(MAIN_OP, tmp_path, inp, _preset(tmp_path / "p.toml", "seven_main_fork"),
                    out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["written 4 0"], r.stderr[-3000:]
    assert all((a == 7.0).all() for a in _features(out).values())
