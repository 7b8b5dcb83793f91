"""avpipe.pipeline.clips.ClipFeed on the CPU: batches of transformed clips, errors skipped."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from paths import REPO

from avpipe.errors import DecodeError
from avpipe.pipeline.clips import ClipFeed

SAMPLES = pathlib.Path(REPO) / "samples" / "video"


def _videos():
    return sorted(str(p) for p in SAMPLES.iterdir() if p.suffix in (".mp4", ".webm", ".avi"))


def test_clip_feed_batches_and_epochs(tmp_path):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video")
    paths = _videos()[:3] + [str(bad)]
    feed = ClipFeed(paths, clip_length=4, stride=2, crop_size=32, batch_size=3, threads=2,
                    device="cpu", seed=1)
    assert len(feed) == 2
    batches = list(feed)
    shapes = [b.clips.shape for b in batches if b.clips is not None]
    assert sum(s[0] for s in shapes) == 3 and all(s[1:] == (4, 3, 32, 32) for s in shapes)
    assert all(b.clips.dtype == np.float16 for b in batches if b.clips is not None)
    assert all(len(b.paths) == (0 if b.clips is None else len(b.clips)) for b in batches)
    errors = [e for b in batches for e in b.errors]
    assert len(errors) == 1 and isinstance(errors[0][1], DecodeError)
    again = ClipFeed(paths, clip_length=4, stride=2, crop_size=32, batch_size=3, threads=1,
                     device="cpu", seed=1)
    for a, b in zip(batches, again):  # the same arguments give the same clips
        assert a.paths == b.paths
        if a.clips is not None:
            np.testing.assert_array_equal(a.clips, b.clips)
    with pytest.raises(DecodeError):
        list(ClipFeed([str(bad)], device="cpu", on_error="raise"))


def test_clip_feed_clip_matches_sampler_and_transform():
    import avpipe
    from avpipe.ops.image import resize_crop_normalize
    from avpipe.pipeline import samplers

    path = _videos()[0]
    feed = ClipFeed([path], clip_length=4, stride=3, crop_size=48, device="cpu")
    c = feed.clip(path, 7)
    with avpipe.VideoDecoder(path, device="cpu") as dec:
        ref = samplers.sample_random_clips(dec, clip_length=4, stride=3, seed=7)
    np.testing.assert_array_equal(c.indices, ref.indices[0])
    want = resize_crop_normalize(ref.data[0], short_side=48, crop_size=48, antialias=False)
    np.testing.assert_array_equal(c.data, want)
    assert c.backend == "pyav"


def test_clip_feed_keeps_every_thread_busy_across_batches(monkeypatch):
    """Iterating does not wait for a batch's slowest clip before starting the next batch's:
    with 4 threads and batches of 2, four clips decode at once; batches keep the epoch's order
    and at most ``_window()`` (2 * threads + batch_size) clips are decoded ahead."""
    import threading
    import time

    from avpipe.pipeline.clips import Clip

    paths = [f"v{i}.mp4" for i in range(12)]
    feed = ClipFeed(paths, batch_size=2, threads=4, device="cpu", shuffle=False)
    monkeypatch.setattr(feed, "_scan_ahead", lambda: type("Off", (), {"active": False})())
    lock = threading.Lock()
    state = {"now": 0, "peak": 0, "started": 0}
    threads = set()

    def clip(path, seed):
        with lock:
            threads.add(threading.get_ident())
            state["now"] += 1
            state["started"] += 1
            state["peak"] = max(state["peak"], state["now"])
        time.sleep(0.05)
        with lock:
            state["now"] -= 1
        return Clip(data=np.zeros((1,), np.float16), indices=np.zeros(1, np.int64),
                    pts_seconds=np.zeros(1), path=path, backend="pyav")

    monkeypatch.setattr(feed, "clip", clip)
    it = iter(feed)
    first = next(it)
    time.sleep(0.2)  # the consumer is slow: the threads went on, within the window
    assert 4 < state["started"] <= 2 + feed._window()
    rest = list(it)
    assert state["peak"] == 4
    assert [p for b in [first, *rest] for p in b.paths] == paths
    # the next epoch runs on the same threads (each keeps its decoder session); close() ends them
    assert sum(len(b.paths) for b in feed) == len(paths) and len(threads) == 4
    pool = feed._threads()  # the executor running the epochs
    feed.close()
    assert feed._pool is None and pool._shutdown
    assert sum(len(b.paths) for b in feed) == len(paths)  # a later epoch starts them again
    feed.close()


_CLOSE_AND_FORK = """
import os, signal, sys
import numpy as np
from avpipe.pipeline.clips import Clip, ClipFeed

paths = [f"v{i}.mp4" for i in range(12)]
feed = ClipFeed(paths, batch_size=2, threads=2, device="cpu", shuffle=False)
feed._scan_ahead = lambda: type("Off", (), {"active": False})()
feed.clip = lambda path, seed: Clip(data=np.zeros((1,), np.float16),
                                    indices=np.zeros(1, np.int64), pts_seconds=np.zeros(1),
                                    path=path, backend="pyav")
it = iter(feed)
next(it)
feed.close()
try:
    list(it)
    sys.exit("no RuntimeError after close()")
except RuntimeError as e:
    assert "close" in str(e), e
assert sum(len(b.paths) for b in feed) == len(paths)  # the next epoch starts anew
pid = os.fork()
if pid == 0:  # the child: an epoch within 20 s, else the alarm's default action ends it
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(20)
    try:
        n = sum(len(b.paths) for b in feed)
        os._exit(0 if n == len(paths) else 1)
    except BaseException:
        os._exit(2)
_, status = os.waitpid(pid, 0)
feed.close()
print("child", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_clip_feed_close_during_an_epoch_and_a_forked_child(tmp_path):
    """``close()`` while an epoch is iterated ends it with a RuntimeError saying so; a forked
    child iterating a feed its parent iterated starts its own threads (the parent's pool has
    none in the child) instead of waiting for ever. In a process of its own: a fork of the test
    process would copy whatever locks its other threads (an S3 client's event loop, a progress
    monitor) hold at that moment, which is not the feed's to answer for."""
    from scripts import run_script

    p = run_script(tmp_path, _CLOSE_AND_FORK)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["child", "0"], (p.stdout, p.stderr[-2000:])


def test_clip_feed_skips_a_missing_file_and_one_too_short(tmp_path):
    """A missing file and a video shorter than one clip are reported like a bad one, not ended
    the epoch (they raised out of it)."""
    from video_media import make_video

    short = make_video(tmp_path / "short.mp4", codec="h264", num_frames=5, width=64, height=48)
    paths = _videos()[:2] + [str(tmp_path / "gone.mp4"), str(short)]
    feed = ClipFeed(paths, clip_length=4, stride=2, crop_size=32, batch_size=2, threads=2,
                    device="cpu", shuffle=False)
    batches = list(feed)
    assert sum(len(b.clips) for b in batches if b.clips is not None) == 2
    errors = [e for b in batches for _, e in b.errors]
    assert sorted(type(e).__name__ for e in errors) == ["FileNotFoundError", "ValueError"]
    with pytest.raises(FileNotFoundError):
        list(ClipFeed([str(tmp_path / "gone.mp4")], device="cpu", on_error="raise"))


def test_clip_feed_deadline_gives_up_a_clip_that_never_returns(monkeypatch):
    """A clip still decoding ``deadline`` seconds after its thread started it (a read that
    never returns) is a DecodeTimeoutError naming its file in its batch's ``errors``; the
    epoch, the next one and ``close()`` go on without waiting for its thread. ``deadline``
    defaults to ``AVPIPE_FEED_DEADLINE``."""
    import threading
    import time

    from avpipe.errors import DecodeTimeoutError
    from avpipe.pipeline.clips import Clip

    monkeypatch.setenv("AVPIPE_FEED_DEADLINE", "7")
    assert ClipFeed(["a.mp4"], device="cpu").deadline == 7.0
    assert ClipFeed(["a.mp4"], device="cpu", deadline=None).deadline is None
    with pytest.raises(ValueError, match="deadline"):
        ClipFeed(["a.mp4"], device="cpu", deadline=-1)
    paths = [f"v{i}.mp4" for i in range(6)]
    feed = ClipFeed(paths, batch_size=2, threads=2, device="cpu", shuffle=False, deadline=1)
    monkeypatch.setattr(feed, "_scan_ahead", lambda: type("Off", (), {"active": False})())
    release = threading.Event()

    def clip(path, seed):
        if path == "v1.mp4":
            release.wait()
        return Clip(data=np.zeros((1,), np.float16), indices=np.zeros(1, np.int64),
                    pts_seconds=np.zeros(1), path=path, backend="pyav")

    monkeypatch.setattr(feed, "clip", clip)
    try:
        for _ in range(2):
            t0 = time.monotonic()
            batches = list(feed)
            assert time.monotonic() - t0 < 1 + 5
            assert [p for b in batches for p in b.paths] == [p for p in paths if p != "v1.mp4"]
            errors = [e for b in batches for e in b.errors]
            assert len(errors) == 1 and errors[0][0] == 1, errors
            assert isinstance(errors[0][1], DecodeTimeoutError)
            assert "v1.mp4" in str(errors[0][1])
        t0 = time.monotonic()
        feed.close()
        assert time.monotonic() - t0 < 1
    finally:
        release.set()


def test_clip_feed_epochs_come_in_the_feeds_order(monkeypatch):
    """ClipFeed visits its files in the feeds' epoch order (a keyed permutation of (seed,
    epoch): :class:`avpipe.pipeline.feed.EpochOrder`), each epoch a new one, the same for the
    same seed; each clip's start is drawn from (seed, epoch, position in the list)."""
    from avpipe.pipeline.clips import Clip
    from avpipe.pipeline.feed import plans

    paths = [f"v{i}.mp4" for i in range(11)]
    seeds = []

    def clip(path, seed):
        seeds.append(seed)
        return Clip(data=np.zeros((1,), np.float16), indices=np.zeros(1, np.int64),
                    pts_seconds=np.zeros(1), path=path, backend="pyav")

    feed = ClipFeed(paths, batch_size=4, threads=2, device="cpu", seed=5)
    monkeypatch.setattr(feed, "_scan_ahead", lambda: type("Off", (), {"active": False})())
    monkeypatch.setattr(feed, "clip", clip)
    epochs = [[p for b in feed for p in b.paths] for _ in range(2)]
    for e, got in enumerate(epochs):
        assert got == [paths[i] for i in plans.permutation(len(paths), seed=5, epoch=e)]
    assert epochs[0] != epochs[1]
    assert sorted(tuple(s) for s in seeds[:11]) == [(5, 0, i) for i in range(11)]
    feed.close()
