"""avpipe's worker processes (pipeline/workers.py): Worker and WorkerPool answer
requests, report a dead or stuck worker as WorkerLost and replace it, pass a worker's own
exception through, and stop everything on close."""

from __future__ import annotations

import operator
import os
import signal
import time

import pytest

from avpipe.pipeline.workers import Worker, WorkerLost, WorkerPool


def test_worker_answers_and_reports_errors():
    w = Worker()
    try:
        w.send((operator.add, (2, 3)))
        assert w.recv() == ("ok", 5)
        w.send((int, ("x",)))
        kind, e = w.recv()
        assert kind == "error" and isinstance(e, ValueError)
    finally:
        w.stop()
    assert w.proc.poll() is not None


def test_pool_replaces_dead_and_stuck_workers():
    pool = WorkerPool(1, answer_s=1.0)
    try:
        assert pool.submit(operator.mul, 6, 7).result(30) == 42
        with pytest.raises(ZeroDivisionError):
            pool.submit(operator.truediv, 1, 0).result(30)
        (w,) = pool._state["workers"]
        os.kill(w.pid, signal.SIGKILL)
        w.proc.wait()
        with pytest.raises(WorkerLost, match="died|gone"):
            pool.submit(operator.add, 1, 1).result(30)
        assert pool.submit(operator.add, 1, 1).result(30) == 2  # a new worker
        t0 = time.monotonic()
        with pytest.raises(WorkerLost, match="within 1 s"):
            pool.submit(time.sleep, 30).result(30)
        assert time.monotonic() - t0 < 15
        assert pool.submit(operator.add, 2, 2).result(30) == 4
        assert len(pool._state["workers"]) == 1
    finally:
        pool.close()


def test_pool_close_stops_workers_and_cancels_waiting_requests():
    pool = WorkerPool(1, answer_s=60.0)
    busy = pool.submit(time.sleep, 1.0)
    waiting = pool.submit(operator.add, 1, 2)
    time.sleep(0.5)
    workers = list(pool._state["workers"])
    pool.close()
    assert waiting.cancelled()
    with pytest.raises(WorkerLost):
        busy.result(30)
    assert all(w.proc.poll() is not None for w in workers)
    with pytest.raises(RuntimeError):
        pool.submit(operator.add, 1, 2)


def test_workers_that_cannot_start_here_give_up_and_readers_fall_back(monkeypatch):
    """Where this interpreter cannot start its workers (an embedding application's
    sys.executable), a WorkerPool gives up after a few (submit raises RuntimeError, the
    scan-ahead turns itself off) and the GPU FLAC readers are not used (threads read)."""
    import sys

    from avpipe.pipeline import _flac_windows
    from avpipe.pipeline._flac_windows import ProcessReaders, start_readers, start_readers_ahead
    from avpipe.pipeline.scan_ahead import ScanAhead

    monkeypatch.setattr(sys, "executable", "/bin/false")
    pool = WorkerPool(1, answer_s=10.0)
    try:
        for _ in range(WorkerPool.MAX_FAILED_STARTS):
            with pytest.raises(WorkerLost):
                pool.submit(operator.add, 1, 1).result(30)
        assert pool.broken
        with pytest.raises(RuntimeError, match="do not start"):
            pool.submit(operator.add, 1, 1)
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="do not start"):
        ProcessReaders(2)
    assert start_readers(2) is None
    start_readers_ahead(2)  # started without waiting: the failure shows when they are taken
    assert start_readers(2) is None
    assert not _flac_windows._AHEAD
    ahead = ScanAhead(1)
    ahead._pool._state["failed_starts"] = WorkerPool.MAX_FAILED_STARTS
    ahead.submit(["/nonexistent.mp4"])
    assert not ahead.active


def test_readers_started_ahead_are_taken_by_the_next_start_and_dropped_when_not(tmp_path):
    """start_readers_ahead starts the GPU FLAC readers without waiting for them; the next
    start_readers of that size takes those very processes (already running), and
    drop_readers_ahead ends readers nobody took."""
    from avpipe.pipeline import _flac_windows
    from avpipe.pipeline._flac_windows import drop_readers_ahead, start_readers, start_readers_ahead

    start_readers_ahead(2)
    assert len(_flac_windows._AHEAD) == 1
    ahead = _flac_windows._AHEAD[0]
    pids = [w.pid for w in ahead._state["procs"]]
    r = start_readers(2)
    try:
        assert r is ahead and not _flac_windows._AHEAD
        assert [w.pid for w in r._state["procs"]] == pids
        f = tmp_path / "x.txt"
        f.write_text("abc")
        assert r.map(os.path.getsize, [str(f)] * 5, chunksize=1) == [3] * 5
    finally:
        r.close()
    start_readers_ahead(2)
    procs = [w.proc for w in _flac_windows._AHEAD[0]._state["procs"]]
    drop_readers_ahead()
    assert not _flac_windows._AHEAD
    assert all(p.wait(10) is not None for p in procs)


def test_a_worker_started_from_a_thread_outlives_that_thread():
    """A worker asks for SIGKILL when its parent dies, which Linux ties to the thread that
    started it: workers are started from one long-lived thread, so one made (and answering)
    in a thread that then ends keeps working (a reader replaced from a window's thread did
    not)."""
    import threading

    box = []

    def make():
        w = Worker()
        w.send((operator.add, (1, 2)))
        assert w.poll(30)
        box.append((w, w.recv()))  # answered: its death signal is set up

    t = threading.Thread(target=make)
    t.start()
    t.join()
    w, first = box[0]
    try:
        assert first == ("ok", 3)
        time.sleep(0.3)  # (a signal on the thread's end would have arrived by now)
        assert w.proc.poll() is None
        w.send((operator.add, (2, 3)))
        assert w.poll(30)
        assert w.recv() == ("ok", 5)
    finally:
        w.stop()


def test_readers_interrupted_while_starting_are_closed_not_left_half_started():
    """An interrupt while the readers' first answers are taken closes them (their answers half
    taken, none could be trusted), so the next request fails at once instead of waiting a
    minute for an answer already taken."""
    from avpipe.pipeline._flac_windows import ProcessReaders

    r = ProcessReaders(2, wait=False)
    second = r._state["procs"][1]

    def interrupted(timeout):
        raise KeyboardInterrupt

    second.poll = interrupted
    with pytest.raises(KeyboardInterrupt):
        r.boot()
    assert not r.alive
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        r.map(os.path.getsize, [__file__])
    assert time.monotonic() - t0 < 5
