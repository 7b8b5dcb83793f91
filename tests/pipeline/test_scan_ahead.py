"""The video feed's scan-ahead: MP4 / MOV sample tables read in other processes a few batches
before their files are opened (avpipe.pipeline.scan_ahead), used only where they are the scan
the open itself would make."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections import OrderedDict

import numpy as np
import pytest
from paths import SAMPLES

from avpipe import VideoDecoder
from avpipe._source import open_source
from avpipe.decoding.video import _scan
from avpipe.pipeline import scan_ahead
from avpipe.pipeline.scan_ahead import ScanAhead, lookahead
from avpipe.recipes import video_classification

VIDEO = os.path.join(SAMPLES, "video"
)


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(_scan, "_CACHE", OrderedDict())


def _copy(tmp_path, name, new):
    dst = os.path.join(tmp_path, new)
    shutil.copyfile(os.path.join(VIDEO, name), dst)
    return dst


def _settle(ahead, paths, timeout=60.0):
    """Wait until the scans of ``paths`` have finished (take() would not wait for them)."""
    import time

    t0 = time.monotonic()
    for p in paths:
        fut = ahead._futs[str(p)]
        while not fut.done() and time.monotonic() - t0 < timeout:
            time.sleep(0.01)


def _same(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x is not None and y is not None, f.name
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        else:
            assert x == y, f.name


@pytest.mark.parametrize("name", ["circles_h264.mp4", "circles_hevc.mp4"])
def test_a_scan_made_in_another_process_is_the_opens_own_scan(tmp_path, name):
    p = _copy(tmp_path, name, "v.mp4")
    ahead = ScanAhead(1, wait=60)
    try:
        assert ahead.active
        ahead.submit([p])
        _settle(ahead, [p])
        assert ahead.take(p) and (ahead.taken, ahead.missed) == (1, 0)
        assert _scan.is_scan_cached(p)
        ((key, got),) = _scan._CACHE.items()
    finally:
        ahead.close()
    _scan._CACHE.clear()
    own = _scan.scan_stream(open_source(p), p)
    assert _scan._cache_key(p) == key
    _same(got, own)


def test_other_containers_and_changed_files_are_scanned_by_the_open(tmp_path):
    webm = _copy(tmp_path, "circles_vp9.webm", "v.webm")
    assert _scan.scan_mp4_file(webm) is None
    ahead = ScanAhead(1, wait=60)
    try:
        ahead.submit([webm])
        _settle(ahead, [webm])
        assert not ahead.take(webm) and ahead.missed == 1
        assert not ahead.take(webm)  # nothing submitted for it any more
    finally:
        ahead.close()
    assert not _scan.is_scan_cached(webm)
    # a scan remembered for a file that changed afterwards is never used
    p = _copy(tmp_path, "circles_h264.mp4", "v.mp4")
    key, scan = _scan.scan_mp4_file(p)
    os.utime(p, ns=(key[2] + 10**9, key[2] + 10**9))
    _scan.remember_scan(key, scan)
    assert not _scan.is_scan_cached(p)
    with VideoDecoder(p, device="cpu") as dec:
        assert dec._scan is not scan and len(dec) == len(scan.pts)
    assert _scan.is_scan_cached(p)


def test_a_closed_scan_ahead_submits_nothing(tmp_path):
    p = _copy(tmp_path, "circles_h264.mp4", "v.mp4")
    ahead = ScanAhead(1)
    ahead.close()
    assert not ahead.active
    ahead.submit([p])
    assert not ahead.take(p)
    off = ScanAhead(0)
    assert not off.active


def test_a_scan_not_started_is_not_waited_for(tmp_path, monkeypatch):
    """take() waits only for a scan under way: one still queued (the processes busy or
    starting) is cancelled and the open scans the file itself."""
    import threading

    gate = threading.Event()
    p = _copy(tmp_path, "circles_h264.mp4", "a.mp4")
    q = _copy(tmp_path, "circles_h264.mp4", "b.mp4")
    ahead = ScanAhead(1, wait=60)
    real = ahead._pool._call
    monkeypatch.setattr(ahead._pool, "_call", lambda fn, args: gate.wait(30) and real(fn, args))
    try:
        ahead.submit([p, q])  # p occupies the one thread; q waits behind it
        import time

        t0 = time.monotonic()
        assert not ahead.take(q) and time.monotonic() - t0 < 5 and ahead.missed == 1
        gate.set()
        assert ahead.take(p) and ahead.taken == 1
    finally:
        ahead.close()


def test_scan_processes_do_not_run_an_unguarded_script_again(tmp_path):
    """The scan processes never import the caller's __main__: a script without an
    ``if __name__ == "__main__":`` guard runs once."""
    from unguarded import top_level_runs

    v = _copy(tmp_path, "circles_h264.mp4", "v.mp4")
    assert top_level_runs(tmp_path, (
        "import time\n"
        "from avpipe.pipeline.scan_ahead import ScanAhead\n"
        "a = ScanAhead(2, wait=60)\n"
        f"a.submit([{v!r}])\n"
        f"f = a._futs[{v!r}]\n"
        "while not f.done(): time.sleep(0.01)\n"
        f"assert a.take({v!r})\n"
        "a.close()\n"
        "print('ok')\n")) == 1


def test_lookahead_shows_each_group_depth_groups_early():
    seen, out = [], []
    for g in lookahead(iter(range(6)), 2, seen.append):
        out.append(g)
        assert seen == list(range(min(6, g + 3)))
    assert out == list(range(6))
    assert list(lookahead(iter([]), 2, seen.append)) == []


def _csv(tmp_path, copies):
    rows = []
    for k in range(copies):
        for cls in ("circles", "squares"):
            rows.append((_copy(tmp_path, f"{cls}_h264.mp4", f"{cls}_{k}.mp4"), cls))
    path = os.path.join(tmp_path, "labels.csv")
    with open(path, "w") as f:
        f.write("path,label\n" + "".join(f"{p},{c}\n" for p, c in rows))
    return path, [p for p, _ in rows]


def test_the_video_feed_takes_scans_read_ahead_and_gives_the_same_clips(tmp_path, monkeypatch):
    monkeypatch.setattr(scan_ahead.ScanAhead, "WAIT", 60.0)  # a slow CI machine's pool start
    csv, files = _csv(tmp_path, 5)
    kw = dict(clip_length=4, stride=2, crop_size=32, batch_size=2, seed=3, device="cpu", threads=2)
    feed = video_classification(csv, **kw)
    got = [(b.paths, b.clips.copy()) for b in feed]
    ahead = feed.task._scan_ahead
    assert ahead is not None and ahead.active
    # every file's scan was read ahead; the first ones may not have started when they were
    # opened (the processes starting): those are scanned by the open
    assert ahead.taken + ahead.missed == len(files) and ahead.taken >= len(files) // 2
    feed.close()
    assert feed.task._scan_ahead is None

    monkeypatch.setenv("AVPIPE_VIDEO_SCAN_AHEAD", "0")
    _scan._CACHE.clear()
    plain = video_classification(csv, **kw)
    want = [(b.paths, b.clips.copy()) for b in plain]
    assert not plain.task._scan_ahead.active
    plain.close()
    assert [p for p, _ in got] == [p for p, _ in want]
    for (_, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_the_video_feed_with_a_persisted_index_scans_nothing_ahead(tmp_path, monkeypatch):
    from avpipe.decoding import build_index

    csv, files = _csv(tmp_path, 2)
    idx = os.path.join(tmp_path, "videos.npz")
    build_index(files, idx, workers=0, progress=False)
    calls = []
    monkeypatch.setattr(_scan, "_scan_mp4", lambda *a, **k: calls.append(a) or None)
    feed = video_classification(
        csv,
        clip_length=4,
        stride=2,
        crop_size=32,
        batch_size=2,
        seed=0,
        device="cpu",
        threads=2,
        index=idx,
    )
    n = sum(len(b.paths) for b in feed)
    assert n == len(files) and calls == []
    assert feed.task._scan_ahead.taken == 0
    feed.close()


def test_clip_feed_takes_scans_read_ahead(tmp_path, monkeypatch):
    from avpipe.pipeline import ClipFeed

    monkeypatch.setattr(scan_ahead.ScanAhead, "WAIT", 60.0)
    _, files = _csv(tmp_path, 4)
    taken = []
    real = ScanAhead.take
    monkeypatch.setattr(ScanAhead, "take", lambda self, p: taken.append(real(self, p)) or taken[-1])
    feed = ClipFeed(
        files, clip_length=4, stride=2, crop_size=32, batch_size=2, device="cpu", threads=2, seed=1
    )
    got = [b.clips.copy() for b in feed]
    assert len(taken) == len(files) and sum(taken) >= len(files) // 2
    ahead = feed._ahead
    feed.close()  # its processes stop; the next epoch starts scan-ahead anew (here: off)
    assert feed._ahead is None and not ahead.active
    monkeypatch.setenv("AVPIPE_VIDEO_SCAN_AHEAD", "0")
    _scan._CACHE.clear()
    feed.epoch = 0
    want = [b.clips.copy() for b in feed]
    assert len(taken) == len(files)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
