"""A native crash while decoding one input costs that input, not the run: the worker process
is replaced, and the input that ends workers is found and reported as an error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from paths import REPO

ROOT = REPO
SAMPLES = os.path.join(ROOT, "samples")

# Loaded at the start of every Python process (the spawned workers too): once avpipe's extract
# module is imported, decoding a video whose name holds "crashme" kills the process with SIGSEGV,
# as a native decoder's fault would.
SITECUSTOMIZE = '''
import builtins, os, signal, sys
_real_import = builtins.__import__

def _import(name, *a, **k):
    mod = _real_import(name, *a, **k)
    p = sys.modules.get("avpipe.recipes.extract._process")
    if p is not None and hasattr(p, "_video_one") and not getattr(p, "_crash_patched", False):
        p._crash_patched = True
        real = p._video_one
        def crashing(item, vcfg, dev):
            if "crashme" in item.path:
                os.kill(os.getpid(), signal.SIGSEGV)
            return real(item, vcfg, dev)
        p._video_one = crashing
    return mod

builtins.__import__ = _import
'''


def _extract_with_crashes(tmp_path, names, shard_size):
    inp = tmp_path / "in"
    inp.mkdir()
    for name, src in names.items():
        shutil.copy(os.path.join(SAMPLES, "video", src), inp / name)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), ROOT]))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "avpipe", "extract", str(inp), "--preset",
                        "quickstart", "--out", str(out), "--device", "cpu", "--shard-size",
                        str(shard_size)], capture_output=True, text=True, env=env, timeout=600)
    return r, out


def test_a_crashing_input_is_reported_and_the_run_finishes(tmp_path):
    r, out = _extract_with_crashes(tmp_path, {"circles_h264.mp4": "circles_h264.mp4",
                                              "squares_h264.mp4": "squares_h264.mp4",
                                              "b_crashme.mp4": "circles_h264.mp4"}, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "was ended by a signal 11" in r.stderr
    rows = [json.loads(x) for x in (out / "index.jsonl").read_text().splitlines()]
    status = {row["source"]: row["status"] for row in rows}
    assert status == {"b_crashme.mp4": "error", "circles_h264.mp4": "ok",
                      "squares_h264.mp4": "ok"}
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert [e["source"] for e in errors] == ["b_crashme.mp4"]
    assert "crashed on it (signal 11)" in errors[0]["message"]


def test_a_crashing_input_decoded_ahead_of_its_shard_is_found(tmp_path):
    """The worker decodes ahead of the shards it writes: a crash is charged to the first shard
    without a part, which need not hold the culprit (here one input a shard, the culprit the
    tenth); the inputs after that shard are probed too, so the run still finishes."""
    names = {f"v{i:02d}.mp4": "squares_h264.mp4" for i in range(12)}
    names["v09_crashme.mp4"] = names.pop("v09.mp4")
    r, out = _extract_with_crashes(tmp_path, names, 1)
    assert r.returncode == 0, r.stderr[-3000:]
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert [e["source"] for e in errors] == ["v09_crashme.mp4"]
    rows = [json.loads(x) for x in (out / "index.jsonl").read_text().splitlines()]
    assert sum(row["status"] == "ok" for row in rows) == 11
