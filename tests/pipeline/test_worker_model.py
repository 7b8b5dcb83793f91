"""One worker-process model: every process avpipe starts for work comes from
``avpipe.pipeline.workers`` and answers its one face (``workers.Process``: pid, alive,
exitcode, signal, kill, join). The feeds' readers, the scan-ahead and extraction all start
``Worker``s; no other module starts a process itself."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import numpy as np
import pytest
from paths import REPO

from avpipe.pipeline import workers

ROOT = Path(REPO)
PKG = ROOT / "avpipe"

# calls that start a process (or build what only a started process uses)
STARTERS = {
    "multiprocessing": {"Process", "get_context", "Pool", "Pipe", "Queue", "SimpleQueue",
                        "JoinableQueue", "set_start_method", "Manager"},
    "subprocess": {"Popen", "run", "call", "check_call", "check_output", "getoutput",
                   "getstatusoutput"},
    "os": {"fork", "forkpty", "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "spawnl",
           "spawnle", "spawnlp", "spawnvp", "system", "popen", "execv", "execve"},
    "concurrent.futures": {"ProcessPoolExecutor"},
}
# the one module that starts worker processes
HOME = PKG / "pipeline" / "workers.py"
# two process users sit in decoding, below the pipeline layer, and cannot import
# pipeline.workers: the image decoder's helper process (a decoder's own crash isolation, a
# long-lived helper it talks to over stdin/stdout) and ``avpipe index``'s scan pool
OUTSIDE_THE_MODEL = {PKG / "decoding" / "image" / "_isolated.py",
                     PKG / "decoding" / "video" / "_index.py"}


def starters_in(path: Path) -> list[str]:
    """``line: module.name`` for every process-starting call or name in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    alias: dict[str, str] = {}  # local name -> module
    named: dict[str, str] = {}  # local name -> "module.name" imported from a module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in STARTERS:
                    alias[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module in STARTERS:
            for a in node.names:
                if a.name in STARTERS[node.module]:
                    named[a.asname or a.name] = f"{node.module}.{a.name}"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            mod = alias.get(node.value.id)
            if mod is not None and node.attr in STARTERS[mod]:
                out.append(f"{node.lineno}: {mod}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in named:
            out.append(f"{node.lineno}: {named[node.id]}")
    return out


def test_no_module_but_workers_starts_processes():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path == HOME or path in OUTSIDE_THE_MODEL:
            continue
        bad += [f"{path.relative_to(ROOT)}:{s}" for s in starters_in(path)]
    assert not bad, "processes started outside avpipe/pipeline/workers.py:\n" + "\n".join(bad)
    assert starters_in(HOME)  # (the check sees the module that does start them)


def test_the_check_sees_a_process_started_elsewhere(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import multiprocessing as mp\nfrom subprocess import Popen\nimport os\n"
                 "mp.get_context('spawn').Process(target=print).start()\nPopen(['true'])\n"
                 "os.fork()\nmp.current_process()\n")
    assert sorted(s.split(": ")[1] for s in starters_in(p)) == [
        "multiprocessing.get_context", "os.fork", "subprocess.Popen"]


@pytest.fixture
def started(monkeypatch):
    """Every workers.Worker started while the test runs."""
    got: list = []
    init = workers.Worker.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        got.append(self)

    monkeypatch.setattr(workers.Worker, "__init__", record)
    return got


def _kinds(started) -> set:
    assert all(isinstance(p, workers.Process) for p in started)
    return {type(p).__name__ for p in started}


def test_audio_readers_and_decode_pool_are_workers(started, tmp_path):
    sf = pytest.importorskip("soundfile")
    from avpipe.pipeline._flac_windows import ProcessReaders
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    paths = []
    for i in range(3):
        p = tmp_path / f"u{i}.flac"
        sf.write(p, np.zeros(1000 + i, np.float32), 16000, subtype="PCM_16")
        paths.append(p)
    with AudioBatchLoader(paths, batch_size=3, num_workers=1, device="cpu") as loader:
        assert len(list(loader.batches(epochs=1))) == 1
    assert _kinds(started) == {"Worker"}
    n = len(started)
    r = ProcessReaders(1)
    try:
        assert len(started) == n + 1 and started[-1].alive
    finally:
        r.close()


def test_scan_ahead_uses_workers(started, tmp_path):
    from avpipe.pipeline.scan_ahead import ScanAhead

    p = tmp_path / "v.mp4"
    shutil.copy(ROOT / "samples" / "video" / "circles_h264.mp4", p)
    ahead = ScanAhead(1, wait=60)
    try:
        ahead.submit([str(p)])
        ahead._futs[str(p)].result(timeout=120)
    finally:
        ahead.close()
    assert _kinds(started) == {"Worker"}


def test_extraction_workers_are_workers(started, tmp_path):
    from avpipe.recipes.extract import run_extract

    d = tmp_path / "speech"
    shutil.copytree(ROOT / "samples" / "speech", d)
    s = run_extract(d, preset="nemo", out_dir=tmp_path / "o", devices=["cpu", "cpu"],
                    shard_size=3)
    assert s.total_written > 0
    assert _kinds(started) == {"Worker"} and len(started) >= 2
    # each leaves once it has answered (exit_now): exit code 0, not a kill
    assert all(not p.alive and p.exitcode == 0 and p.signal is None for p in started)


def test_a_worker_reports_how_it_ended():
    """The one face: a killed worker says SIGKILL, one that exits says its exit code."""
    import os
    import signal

    w = workers.Worker()
    assert w.alive and w.exitcode is None and w.signal is None
    w.kill()
    w.join(30)
    assert not w.alive and w.signal == signal.SIGKILL
    w.stop()
    w = workers.Worker()
    w.send((os._exit, (3,)))
    w.join(60)
    assert w.exitcode == 3 and w.signal is None
    w.stop()
    w = workers.Worker()
    w.end()
    assert w.exitcode == 0 and w.signal is None
