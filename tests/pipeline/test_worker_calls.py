"""What a worker (pipeline/workers.py) gives its callers beyond one answer per request:
messages during a call (``tell``, from any of its threads), a wait on several workers at once,
an environment of its own, a start by fork (where ``fork_is_safe``), SIGINT ignored from its
start, and the same end reporting whichever way it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from paths import REPO

from avpipe.pipeline import workers
from avpipe.pipeline.workers import Worker


def talk(n: int) -> str:
    """In a worker: ``n`` messages from this thread and ``n`` from another, then an answer."""
    t = threading.Thread(target=lambda: [workers.tell(("thread", i)) for i in range(n)])
    t.start()
    for i in range(n):
        workers.tell(("main", i))
    t.join()
    return "done"


def nap(s: float) -> float:
    time.sleep(s)
    return s


def environment() -> dict:
    return dict(os.environ)


def tell_then_exit(code: int) -> None:
    workers.tell("last words")
    workers.exit_now(code)


def test_messages_during_a_call_come_before_its_answer():
    w = Worker()
    try:
        w.send((talk, (50,)))
        got = []
        while True:
            kind, value = w.recv()
            if kind != "msg":
                break
            got.append(value)
        assert (kind, value) == ("ok", "done")
        assert sorted(got) == sorted([("main", i) for i in range(50)] +
                                     [("thread", i) for i in range(50)])
        # each thread's own messages keep their order
        assert [v for v in got if v[0] == "main"] == [("main", i) for i in range(50)]
        assert [v for v in got if v[0] == "thread"] == [("thread", i) for i in range(50)]
        w.send((tell_then_exit, (7,)))  # a message sent just before exiting is not lost
        assert w.recv() == ("msg", "last words")
        with pytest.raises(EOFError):
            w.recv()
        w.join(30)
        assert w.exitcode == 7 and w.signal is None
    finally:
        w.stop()


def test_tell_outside_a_worker_is_refused():
    with pytest.raises(RuntimeError, match="worker process"):
        workers.tell("x")


def test_wait_returns_the_workers_with_something_to_read():
    a, b = Worker(), Worker()
    try:
        a.send((nap, (30.0,)))
        b.send((nap, (0.1,)))
        assert workers.wait([a, b], timeout=60) == [b]
        assert b.recv() == ("ok", 0.1)
        assert workers.wait([a, b], timeout=0.2) == []
        a.kill()
        assert workers.wait([a, b], timeout=30) == [a]  # a dead worker's end is readable
        with pytest.raises(EOFError):
            a.recv()
        a.join(30)
        assert a.signal == signal.SIGKILL
    finally:
        a.stop()
        b.stop()


def test_a_worker_takes_its_own_environment_variables(monkeypatch):
    monkeypatch.setenv("AVPIPE_TEST_INHERITED", "parent")
    w = Worker(env={"CUDA_VISIBLE_DEVICES": "3", "AVPIPE_TEST_OWN": "x"})
    try:
        w.send((environment, ()))
        kind, env = w.recv()
        assert kind == "ok"
        assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["AVPIPE_TEST_OWN"] == "x"
        assert env["AVPIPE_TEST_INHERITED"] == "parent"
        assert os.environ.get("AVPIPE_TEST_OWN") is None  # not this process's
    finally:
        w.stop()


def _sigint_ignored(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(x.split()[1], 16) for x in f if x.startswith("SigIgn:"))
    return bool(mask & (1 << (signal.SIGINT - 1)))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_worker_starts_with_ctrl_c_ignored():
    w = Worker()
    try:
        assert _sigint_ignored(w.pid)
        assert not _sigint_ignored(os.getpid())
    finally:
        w.stop()
    got = []  # started from another thread (a pool's): it ignores SIGINT by itself
    t = threading.Thread(target=lambda: got.append(Worker()))
    t.start()
    t.join()
    (w,) = got
    try:
        w.send((workers.ping, ()))
        assert w.recv() == ("ok", True)  # up: past its first instruction
        assert _sigint_ignored(w.pid)
    finally:
        w.stop()


def test_a_fork_is_asked_for_only_where_it_is_safe():
    """Another thread runs here (the worker threads of earlier requests, if nothing else): a
    fork asked for is a fresh interpreter instead."""
    t = threading.Thread(target=time.sleep, args=(2,))
    t.start()
    try:
        w = Worker(fork=True)
        try:
            assert not w.forked
            w.send((os.getpid, ()))
            assert w.recv() == ("ok", w.pid)
        finally:
            w.stop()
    finally:
        t.join()


# in a fresh interpreter: the caller runs no thread but its main one
_FORKED = r"""
import os, signal, sys, time
from avpipe.pipeline import workers
from avpipe.pipeline.workers import Worker

def here():
    return sys.modules["__main__"].MARK, os.getpid(), os.environ.get("AVPIPE_TEST_OWN")

def ignored(pid):
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(x.split()[1], 16) for x in f if x.startswith("SigIgn:"))
    return bool(mask & 2)

def talk():
    workers.tell("hello")
    return 5

MARK = "the parent's state"
out = []
a = Worker(fork=True, env={"AVPIPE_TEST_OWN": "x"})
b = Worker(fork=True)
out.append(a.forked and b.forked)
out.append(ignored(a.pid) and not ignored(os.getpid()))
a.send((here, ()))  # a function of __main__: a fork has it
out.append(a.recv() == ("ok", (MARK, a.pid, "x")))
out.append(os.environ.get("AVPIPE_TEST_OWN") is None)
a.send((talk, ()))
out.append([a.recv(), a.recv()] == [("msg", "hello"), ("ok", 5)])
# b holds none of a's pipe ends: a sees the end of its requests and leaves (exit code 0)
a._out.close()
a.join(30)
out.append((a.exitcode, a.signal))
b.send((os._exit, (4,)))
b.join(30)
out.append((b.exitcode, b.signal))
c = Worker(fork=True)
c.kill()
c.join(30)
out.append((c.exitcode == -signal.SIGKILL, c.signal == signal.SIGKILL, c.alive))
d = Worker(fork=True)
d.end()
out.append((d.exitcode, d.signal))
for w in (a, b, c, d):
    w.stop()
print(out)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux only")
def test_a_forked_worker_answers_tells_and_ends_like_a_fresh_one():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (REPO, os.environ.get("PYTHONPATH")) if x)}
    r = subprocess.run([sys.executable, "-c", _FORKED], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == str([True, True, True, True, True, (0, None), (4, None),
                                    (True, True, False), (0, None)]), r.stderr[-3000:]


def test_a_worker_imports_the_parents_avpipe_not_one_in_the_working_directory(tmp_path):
    """``python -c`` puts the working directory first on the path: an ``avpipe`` folder there
    (another checkout, another version) must not be the one a worker imports."""
    decoy = tmp_path / "cwd" / "avpipe"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy avpipe was imported')\n")
    from scripts import run_script

    p = run_script(tmp_path, "import os\n"
                             "from avpipe.pipeline.workers import Worker\n"
                             "w = Worker()\n"
                             "w.send((os.getpid, ()))\n"
                             "kind, pid = w.recv()\n"
                             "print(kind, pid == w.pid)\n"
                             "w.stop()\n", cwd=tmp_path / "cwd")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["ok", "True"]
