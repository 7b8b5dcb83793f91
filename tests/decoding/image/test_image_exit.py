"""An image feed's process exits cleanly (no native abort at interpreter exit).

The feed's producer is a daemon thread, and it goes on past an epoch's end: it closes the
epoch's DALI stream pipeline (joining DALI's C++ threads with the GIL released) and runs ahead
into the next epoch. When the script ended meanwhile, the interpreter began finalizing while
``PyPipeline::~PyPipeline`` ran in that thread; re-taking the GIL then ended the thread with
``pthread_exit`` inside a ``noexcept`` C++ destructor: "terminate called without an active
exception", exit code -6, about one run in four to ten (the README's image example). Now every DALI
call goes through ``_dali.native_call``, pipelines are shut down explicitly (``_dali.release``),
and an atexit hook waits for the calls under way and shuts the rest down before finalization.
"""

from __future__ import annotations

import gc
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from paths import REPO

from avpipe.decoding.image import _dali

ROOT = pathlib.Path(REPO)
IMAGES = ROOT / "samples" / "images"

_PAIRS = """
pairs = [("samples/images/scene.jpg", "photo"), ("samples/images/scene.png", "photo"),
         ("samples/images/scene.tif", "scan"), ("samples/images/scene.jp2", "scan")]
"""

# the image feed's example (README.md, docs/guide/image.md), with the batches' labels printed
FULL_EPOCH = _PAIRS + """
import avpipe
feed = avpipe.recipes.image_classification(pairs, crop_size=128, batch_size=2, seed=0)
print(feed.classes)
for batch in feed:
    print(batch.images.shape, batch.images.dtype, batch.labels.tolist())
"""

# a loop left after its first batch; the feed is never closed
BREAK_EARLY = _PAIRS + """
import avpipe
feed = avpipe.recipes.image_classification(pairs, crop_size=128, batch_size=2, seed=0)
for batch in feed:
    print(batch.images.shape)
    break
"""

# an iterator held mid-epoch to the end of the script (its producer is decoding ahead)
HELD_MID_EPOCH = _PAIRS + """
import avpipe
feed = avpipe.recipes.image_classification(pairs * 4, crop_size=128, batch_size=2, seed=0)
it = iter(feed)
print(next(it).images.shape)
"""


def _run_many(code: str, runs: int, parallel: int = 4) -> None:
    """Run ``code`` ``runs`` times (``parallel`` at once: the load makes the exit race likelier);
    every run must exit with 0 and print no native abort."""
    env = dict(os.environ, AVPIPE_DISABLE_GPU="1", PYTHONPATH=str(ROOT))
    bad = []
    for start in range(0, runs, parallel):
        procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(min(parallel, runs - start))]  # fmt: skip
        for p in procs:
            try:
                out, err = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            if p.returncode != 0 or "terminate called" in err or not out.strip():
                bad.append((p.returncode, err[-800:]))
    assert not bad, f"{len(bad)} of {runs} runs failed; first: {bad[0]}"


def test_readme_image_feed_exits_cleanly_every_time():
    # before the fix about 1 run in 4 (here, 4 at once on 2 cores: 20-35%) aborted
    _run_many(FULL_EPOCH, runs=16)


@pytest.mark.parametrize("code", [BREAK_EARLY, HELD_MID_EPOCH], ids=["break", "held"])
def test_feed_left_mid_epoch_exits_cleanly(code):
    _run_many(code, runs=4)


def test_exit_hook_shuts_the_pipelines_down_and_stops_new_calls():
    """The hook, called as atexit would (in a child: it closes the gate for good): the feed's
    pipelines (the run-ahead epoch's too) are shut down on the calling thread, and later native
    calls raise ShuttingDown instead of starting."""
    code = _PAIRS + textwrap.dedent("""
        import time
        import avpipe
        from avpipe.decoding.image import _dali, decode_image_batch

        feed = avpipe.recipes.image_classification(pairs, crop_size=128, batch_size=2, seed=0)
        for batch in feed:
            pass
        time.sleep(0.5)  # the producer runs ahead into epoch 1: its stream pipeline is built
        pipes = list(_dali._LIVE.values())
        assert pipes, "no pipeline registered"
        _dali._at_exit()
        assert not _dali._LIVE and all(p._pipe is None for p in pipes)
        try:
            decode_image_batch([pairs[0][0]], device="cpu")
        except _dali.ShuttingDown:
            print("ok")
    """)
    env = dict(os.environ, AVPIPE_DISABLE_GPU="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok", (out.stdout, out.stderr[-2000:])


def _stream_pipes():
    """Registered pipelines that are not the cached batch decoders' (stream pipelines)."""
    cached = {id(d.pipe) for d in list(_dali._CACHE.values())}
    return [p for p in list(_dali._LIVE.values()) if id(p) not in cached]


def test_stream_pipelines_are_released_deterministically():
    """A stream's pipeline is shut down when the stream ends, is closed, or its feed is closed or
    collected mid-epoch; the feed still works for later epochs."""
    import avpipe
    from avpipe.pipeline.image_stream import decode_image_stream

    paths = [str(IMAGES / n) for n in ("scene.jpg", "scene.png", "scene.tif", "scene.jp2")]
    assert len(list(decode_image_stream(paths, batch_size=2, device="cpu"))) == 2
    assert not _stream_pipes()
    s = decode_image_stream(paths, batch_size=1, device="cpu")
    next(s)
    assert _stream_pipes()
    s.close()
    assert not _stream_pipes()

    pairs = [(p, "photo" if i < 2 else "scan") for i, p in enumerate(paths)]
    feed = avpipe.recipes.image_classification(pairs, crop_size=64, batch_size=2, seed=0,
                                               device="cpu")  # fmt: skip
    epochs = [[b.labels.tolist() for b in feed] for _ in range(3)]
    assert [len(e) for e in epochs] == [2, 2, 2]
    assert all(sorted(sum(e, [])) == [0, 0, 1, 1] for e in epochs)
    feed.close()
    assert not _stream_pipes()

    feed = avpipe.recipes.image_classification(pairs * 4, crop_size=64, batch_size=2, seed=0,
                                               device="cpu")  # fmt: skip
    it = iter(feed)
    next(it)
    del it, feed  # dropped mid-epoch: the producer stops and its stream's pipeline goes
    gc.collect()
    assert not _stream_pipes()


def test_a_decoder_that_loses_a_build_race_is_shut_down(monkeypatch):
    """Two threads missing the decoder cache at once both build: the one that finds the other's
    decoder cached returns that one and shuts its own pipeline down (it was held until exit)."""
    import threading

    from avpipe.decoding.image import _dali

    shut = []

    class Pipe:
        def build(self):
            pass

        def _shutdown(self):
            shut.append(self)

    class FakeDecoder:
        def __init__(self, device_index, capacity, roi, fancy, *, race=True):
            self.key = _dali._key(device_index, capacity, roi, fancy)
            self.broken = False
            self.lock = threading.Lock()
            self.pipe = _dali.build_tracked(Pipe())
            if race:  # another thread's decoder is cached while this one builds
                _dali._CACHE[self.key] = FakeDecoder(device_index, capacity, roi, fancy,
                                                     race=False)

    monkeypatch.setattr(_dali, "DaliDecoder", FakeDecoder)
    monkeypatch.setattr(_dali, "_CACHE", {})
    got = _dali.get(None, 8, False)
    assert _dali._CACHE[got.key] is got and got.pipe is not None and got.pipe not in shut
    assert len(shut) == 1 and id(shut[0]) not in _dali._LIVE
    _dali.release(got.pipe)
