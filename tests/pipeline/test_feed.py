"""The generic feed machinery on small synthetic items (no media): order, shards, remainder,
errors and replacements, resume (also across world sizes), bucketing, prefetch shutdown, RSS."""

from __future__ import annotations

import gc
import json
import threading
import time

import numpy as np
import pytest

from avpipe.pipeline.feed import Feed, Task
from avpipe.pipeline.feed import plans as _order
from avpipe.pipeline.sources import Item

# DataLoader workers start from a fork server, never as forks of the test process: a fork copies
# the locks its other threads hold (a feed's producer, BLAS), and such a worker can hang
CTX = "forkserver"


class Synth(Task):
    """Item i decodes to [i, i, i]; items named in ``bad`` raise; ``slow`` ones sleep."""

    array_fields = ("x",)

    def __init__(self, bad=(), slow=(), sleep=0.0, deadline=None):
        super().__init__()
        self.bad, self.slow, self.sleep = set(bad), set(slow), sleep
        self.deadline = deadline
        self.threads = 4

    def decode_one(self, i, item):
        if i in self.bad:
            raise ValueError(f"bad item {item.path}")
        if i in self.slow:
            time.sleep(self.sleep)
        return np.full(3, i, np.int64)

    def collate(self, values, pairs, epoch, step):
        return {"x": np.stack(values) if values else np.zeros((0, 3), np.int64),
                "paths": [it.path for _, it in pairs]}


def items(n):
    return [Item(path=f"/data/item{i:04d}.bin", raw_path=f"item{i:04d}.bin") for i in range(n)]


def make(n=50, task=None, **kw):
    kw.setdefault("batch_size", 4)
    kw.setdefault("device", "cpu")
    return Feed(items(n), task or Synth(), **kw)


def synth_feed(n=24, *, batch_size=2, bad=(), rank=0, world_size=1, **kw):
    """A Synth feed with a spec (replicas for torch's DataLoader workers)."""
    kw.setdefault("device", "cpu")
    spec = (synth_feed, dict(n=n, batch_size=batch_size, bad=tuple(bad), rank=rank,
                             world_size=world_size, **kw))
    return Feed(items(n), Synth(bad=bad), batch_size=batch_size, rank=rank,
                world_size=world_size, spec=spec, **kw)


def epoch_ids(feed):
    return [b.ids.tolist() for b in feed]


def flat(batches):
    return [i for b in batches for i in b]


# --- order --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1000, 4097])
def test_permutation_is_bijection_and_seeded(n):
    p = _order.permutation(n, seed=7, epoch=0)
    assert sorted(p.tolist()) == list(range(n))
    assert np.array_equal(p, _order.permutation(n, seed=7, epoch=0))
    if n >= 16:
        assert not np.array_equal(p, _order.permutation(n, seed=7, epoch=1))
        assert not np.array_equal(p, _order.permutation(n, seed=8, epoch=0))
    # any position in O(1): the same item as the whole permutation's
    pos = np.array([0, n // 2, n - 1])
    assert np.array_equal(_order.permute(pos, n, seed=7, epoch=0), p[pos])


def test_same_seed_same_order_and_epochs_differ():
    a, b = make(seed=3), make(seed=3)
    e0a, e0b = epoch_ids(a), epoch_ids(b)
    assert e0a == e0b
    e1a = epoch_ids(a)
    assert e1a != e0a and sorted(flat(e1a)) == sorted(flat(e0a)) == list(range(50))
    assert epoch_ids(make(seed=4)) != e0a
    assert flat(epoch_ids(make(shuffle=False))) == list(range(50))


# --- shards ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n,W,B", [(50, 1, 4), (50, 3, 4), (48, 4, 4), (49, 4, 4), (7, 3, 2),
                                   (10, 4, 3), (13, 5, 1)])
def test_shards_disjoint_complete_equal_len(n, W, B):
    feeds = [make(n, batch_size=B, rank=r, world_size=W, seed=1) for r in range(W)]
    lens = {len(f) for f in feeds}
    assert len(lens) == 1
    got = [epoch_ids(f) for f in feeds]
    assert all(len(g) == len(feeds[0]) for g in got)
    assert all(len(b) > 0 for g in got for b in g)
    allids = [i for g in got for i in flat(g)]
    if B == 1 and n % W:  # the documented exception: wrap-padding of the last step
        assert set(allids) == set(range(n)) and len(allids) == W * len(feeds[0])
        return
    assert len(allids) == len(set(allids)) == n  # disjoint and complete
    # every batch full except the last step's (or last two steps') items, dealt evenly
    sizes = [len(b) for g in got for b in g]
    assert sizes.count(B) >= len(sizes) - 2 * W
    assert min(sizes) >= min(B // 2, 1) and max(sizes) <= B


def test_fewer_items_than_ranks_wraps():
    feeds = [make(3, batch_size=2, rank=r, world_size=4) for r in range(4)]
    got = [epoch_ids(f) for f in feeds]
    assert all(len(g) == 1 and len(g[0]) == 1 for g in got)
    assert {i for g in got for i in flat(g)} == {0, 1, 2}


# --- errors -------------------------------------------------------------------------------


def test_skip_fills_batches_and_reports_the_file():
    """The replacement rule (both pads); evaluation's (pad="empty") batches are left short
    at the end, training's are filled with repeats (test_training_feed_*)."""
    bad = {3, 17, 30}
    f = make(40, task=Synth(bad=bad), batch_size=4, seed=2, pad="empty")
    got = epoch_ids(f)
    ids = flat(got)
    assert sorted(ids) == sorted(set(range(40)) - bad)  # all good items, once
    assert len(got) == len(f) == 10
    # only the last batch(es) come out shorter
    sizes = [len(b) for b in got]
    assert sizes == [4] * 9 + [1]  # 37 good items: nine full batches, the rest in the last
    paths = sorted(p for p, _ in f.errors)
    assert paths == [f"/data/item{i:04d}.bin" for i in sorted(bad)]
    assert all("bad item" in m for _, m in f.errors)
    # the batches' values are the items' own
    f2 = make(40, task=Synth(bad=bad), batch_size=4, seed=2)
    for b in f2:
        assert b.x[:, 0].tolist() == b.ids.tolist()
        assert b.paths == [f"/data/item{i:04d}.bin" for i in b.ids]


def test_skip_replaces_with_the_ranks_last_unused_item():
    """The documented rule: a failed item's replacement is the rank's last unused item of the
    epoch (from the end backwards, appended to the batch), not the next item."""
    f = make(20, task=Synth(bad={1, 6}), shuffle=False, pad="empty")
    assert epoch_ids(f) == [[0, 2, 3, 19], [4, 5, 7, 18], [8, 9, 10, 11], [12, 13, 14, 15],
                            [16, 17]]
    f = make(20, task=Synth(bad={1, 19}), shuffle=False)  # the replacement fails: the next one
    assert epoch_ids(f)[0] == [0, 2, 3, 18] and len(f.errors) == 2
    f = make(20, task=Synth(bad={1, 2, 3, 5, 6, 7, 9}), shuffle=False, pad="empty")
    assert epoch_ids(f) == [[0, 19, 18, 17], [4, 16, 15, 14], [8, 10, 11, 13], [12], []]
    # training: the same, then the short batches filled with repeats of the rank's items
    # handed out before them, in order (known failures passed over)
    f = make(20, task=Synth(bad={1, 2, 3, 5, 6, 7, 9}), shuffle=False)
    assert epoch_ids(f) == [[0, 19, 18, 17], [4, 16, 15, 14], [8, 10, 11, 13],
                            [12, 0, 4, 8], [0, 4, 8, 10]]
    # each rank from its own share's end (global batch k goes to rank k % 2)
    got = [epoch_ids(make(24, task=Synth(bad={1, 4}), shuffle=False, rank=r, world_size=2,
                          pad="empty")) for r in range(2)]
    assert got == [[[0, 2, 3, 19], [8, 9, 10, 11], [16, 17, 18]],
                   [[5, 6, 7, 23], [12, 13, 14, 15], [20, 21, 22]]]


def test_skip_with_ranks_keeps_them_disjoint():
    bad = {1, 2, 5, 8, 13, 21, 34}
    W = 3
    for pad in ("empty", "repeat"):
        feeds = [make(60, task=Synth(bad=bad), batch_size=4, rank=r, world_size=W, seed=5,
                      pad=pad) for r in range(W)]
        got = [epoch_ids(f) for f in feeds]
        assert len({len(g) for g in got}) == 1
        allids = [i for g in got for i in flat(g)]
        assert set(allids) == set(range(60)) - bad
        if pad == "empty":
            assert len(allids) == len(set(allids))
        else:  # training: disjoint up to the repeats that fill the ranks' last batches
            assert all(len(b) == 4 for g in got for b in g)
            firsts = [set(flat(g)) - set(flat(g[-2:])) for g in got]
            assert all(not (a & b) for a in firsts for b in firsts if a is not b)


def test_raise_raises_the_items_error():
    f = make(20, task=Synth(bad={4}), on_error="raise", shuffle=False)
    with pytest.raises(ValueError, match="item0004"):
        for _ in f:
            pass


class _Stuck(Synth):
    """Items in ``slow`` block until ``release`` is set (a decode that never returns)."""

    def __init__(self, slow, deadline):
        super().__init__(slow=slow, deadline=deadline)
        self.release = threading.Event()

    def decode_one(self, i, item):
        if i in self.slow:
            self.release.wait(120)
        return np.full(3, i, np.int64)


@pytest.mark.parametrize("n,bs,W", [(6, 1, 4), (3, 2, 4), (9, 1, 4), (5, 3, 8)])
def test_pad_empty_gives_every_item_exactly_once_across_ranks(n, bs, W):
    """Where too few items are left for every rank, evaluation (pad="empty") gives those ranks
    empty batches; training (the default, "repeat") repeats the epoch's first items. Either
    way every rank has the same number of batches."""
    for pad in ("empty", "repeat"):
        ranks = [Feed(items(n), Synth(), batch_size=bs, world_size=W, rank=r, shuffle=False,
                      device="cpu", pad=pad) for r in range(W)]
        got = [[int(i) for b in f for i in b.ids] for f in ranks]
        assert len({len(f) for f in ranks}) == 1
        every = sorted(i for g in got for i in g)
        if pad == "empty":
            assert every == list(range(n)), got
        else:
            assert sorted(set(every)) == list(range(n)) and len(every) >= n
    with pytest.raises(ValueError, match="pad"):
        Feed(items(3), Synth(), batch_size=1, device="cpu", pad="wrap")


def test_stuck_decodes_never_starve_the_feed():
    """Every decoding thread stuck in a call that never returns: the items queued behind them
    are decoded by fresh threads (they never started, so their deadline never ran: the feed
    waited for the stuck calls), epoch after epoch."""
    task = _Stuck(slow={0, 1}, deadline=0.2)
    task.threads = 2
    f = Feed(items(8), task, batch_size=2, shuffle=False, device="cpu", pad="empty")
    try:
        for epoch in range(3):
            t0 = time.monotonic()
            got = sorted(int(i) for b in f for i in b.ids)
            assert time.monotonic() - t0 < 10, epoch
            assert got == list(range(2, 8)), (epoch, got)
        # each (path, message) once per feed
        assert len(f.errors) == 2 and all("deadline" in m for _, m in f.errors)
    finally:
        task.release.set()


def test_deadline_skips_a_slow_item():
    f = make(8, task=Synth(slow={2}, sleep=1.5, deadline=0.2), batch_size=4, shuffle=False,
             pad="empty")
    t0 = time.perf_counter()
    got = epoch_ids(f)
    assert time.perf_counter() - t0 < 1.4
    assert 2 not in flat(got) and len(flat(got)) == 7
    assert f.errors[0][0].endswith("item0002.bin") and "deadline" in f.errors[0][1]


# --- resume -------------------------------------------------------------------------------


def _take(feed, k):
    it = iter(feed)
    out = [next(it).ids.tolist() for _ in range(k)]
    return out, it


@pytest.mark.parametrize("bad", [(), (4, 9, 33, 46)])
def test_resume_exact_mid_epoch(bad):
    ref = make(50, task=Synth(bad=bad), seed=9)
    full = epoch_ids(ref) + epoch_ids(ref)
    f = make(50, task=Synth(bad=bad), seed=9)
    first, it = _take(f, 5)
    state = json.loads(json.dumps(f.state_dict()))
    del it
    g = make(50, task=Synth(bad=bad), seed=9)
    g.load_state_dict(state)
    rest = epoch_ids(g)
    assert first + rest == full[: len(first) + len(rest)]
    assert epoch_ids(g) == full[len(first) + len(rest):]  # and the next epoch


def test_resume_values_and_augmentation_identical():
    a = make(30, seed=1)
    ref = [b.x.tolist() for b in a]
    f = make(30, seed=1)
    _, it = _take(f, 3)
    st = f.state_dict()
    it.close()
    g = make(30, seed=1)
    g.load_state_dict(st)
    assert [b.x.tolist() for b in g] == ref[3:]


@pytest.mark.parametrize("W0,W1", [(2, 3), (4, 1), (1, 2), (3, 2)])
@pytest.mark.parametrize("bad", [(), (0, 7, 11, 40, 55)])
def test_resume_across_world_size(W0, W1, bad):
    n, B, k = 61, 3, 2
    feeds = [make(n, task=Synth(bad=bad), batch_size=B, rank=r, world_size=W0, seed=4,
                  pad="empty") for r in range(W0)]
    seen, states = [], []
    for f in feeds:
        got, it = _take(f, k)
        seen += flat(got)
        states.append(f.state_dict())
        it.close()
    assert states[0]["consumed"] == k * W0 * B
    new = [make(n, task=Synth(bad=bad), batch_size=B, rank=r, world_size=W1, seed=4,
                pad="empty") for r in range(W1)]
    for f in new:
        f.load_state_dict(states)
    rest = [epoch_ids(f) for f in new]
    assert len({len(r) for r in rest}) == 1
    allids = seen + [i for r in rest for i in flat(r)]
    assert len(allids) == len(set(allids))  # nothing twice
    assert set(allids) == set(range(n)) - set(bad)  # nothing lost
    # resuming the rebased feed again is exact as well
    g = make(n, task=Synth(bad=bad), batch_size=B, rank=0, world_size=W1, seed=4, pad="empty")
    g.load_state_dict(states)
    got, it = _take(g, 1)
    st2 = g.state_dict()
    it.close()
    h = make(n, task=Synth(bad=bad), batch_size=B, rank=0, world_size=W1, seed=4, pad="empty")
    h.load_state_dict(json.loads(json.dumps(st2)))
    assert got + epoch_ids(h) == rest[0]


def test_resume_refuses_states_that_cannot_be_exact():
    n, B, bad = 40, 4, (0, 1, 4)

    def mk(r, W):
        return make(n, task=Synth(bad=bad), batch_size=B, rank=r, world_size=W, seed=4,
                    shuffle=False)

    states, seen = [], []
    for r in range(2):
        f = mk(r, 2)
        got, it = _take(f, 1)
        seen += flat(got)
        states.append(json.loads(json.dumps(f.state_dict())))
        it.close()
    assert [s["borrowed"] for s in states] == [2, 1]  # rank 0 replaced 2 items, rank 1 one
    # the same world size: this rank's own state, alone or in a list
    with pytest.raises(ValueError, match=r"no state of rank 1 \(world_size=2\)"):
        mk(1, 2).load_state_dict(states[0])
    with pytest.raises(ValueError, match=r"no state of rank 1 \(world_size=2\)"):
        mk(1, 2).load_state_dict([states[0]])
    full1 = epoch_ids(mk(1, 2))
    g = mk(1, 2)
    g.load_state_dict(states[::-1])
    assert epoch_ids(g) == full1[1:]
    # another world size: every old rank's state (rank 1's borrowed items are not rank 0's)
    with pytest.raises(ValueError, match=r"world_size=2 .*missing rank\(s\) \[1\]"):
        mk(0, 3).load_state_dict(states[0])
    new = [mk(r, 3) for r in range(3)]
    for f in new:
        f.load_state_dict([[states[0]], [states[1]]])  # lists of lists: flattened
    allids = seen + flat(flat(epoch_ids(f) for f in new))
    assert len(allids) == len(set(allids)) and set(allids) == set(range(n)) - set(bad)
    # ranks that are not ranks of the world size, two different states of one rank
    with pytest.raises(ValueError, match="rank 2 is not a rank of world_size=2"):
        mk(0, 2).load_state_dict([states[0], dict(states[1], rank=2)])
    with pytest.raises(ValueError, match="two different states of rank 0"):
        mk(0, 2).load_state_dict([states[0], dict(states[0], borrowed=0)])


def test_state_from_other_feed_refused():
    f = make(50, seed=1)
    with pytest.raises(ValueError, match="seed"):
        make(50, seed=2).load_state_dict(f.state_dict())


# --- bucketing ----------------------------------------------------------------------------


def _dur_feed(durs, **kw):
    return Feed(items(len(durs)), Synth(bad=kw.pop("bad", ())), max_duration=kw.pop("md", 20.0),
                durations=durs, device="cpu", **kw)


def test_max_duration_respected_and_ranks_equal():
    rng = np.random.default_rng(0)
    durs = rng.uniform(1.0, 8.0, 300)
    W = 3
    feeds = [_dur_feed(durs, rank=r, world_size=W, seed=2) for r in range(W)]
    got = [epoch_ids(f) for f in feeds]
    assert len({len(g) for g in got}) == 1 == len({len(f) for f in feeds})
    allids = [i for g in got for i in flat(g)]
    assert sorted(allids) == list(range(300))
    pad = []
    for g in got:
        for b in g:
            assert len(b) * durs[b].max() <= 20.0 + 1e-9
            pad.append(1 - durs[b].sum() / (len(b) * durs[b].max()))
    assert np.mean(pad) < 0.1  # little padding
    # the next epoch: a new order of the same items
    nxt = [epoch_ids(f) for f in feeds]
    assert nxt[0] != got[0]
    assert sorted(i for g in nxt for i in flat(g)) == list(range(300))


def test_bucketing_resume_exact():
    durs = np.random.default_rng(1).uniform(1.0, 6.0, 120)
    ref = epoch_ids(_dur_feed(durs, seed=3, bad=(5,)))
    f = _dur_feed(durs, seed=3, bad=(5,))
    first, it = _take(f, 4)
    st = f.state_dict()
    it.close()
    g = _dur_feed(durs, seed=3, bad=(5,))
    g.load_state_dict(st)
    assert first + epoch_ids(g) == ref


# --- execution ----------------------------------------------------------------------------


def _feed_threads():
    return [t for t in threading.enumerate() if t.name.startswith("avpipe-feed-producer")]


def test_dropping_the_iterator_mid_epoch_stops_the_thread():
    f = make(400, batch_size=2)
    it = iter(f)
    next(it)
    assert _feed_threads()
    del it
    gc.collect()
    for _ in range(50):
        if not _feed_threads():
            break
        time.sleep(0.05)
    assert not _feed_threads()
    # the next iter runs the next epoch, whole
    assert len(epoch_ids(f)) == len(f)


def test_producers_still_running_are_stopped_and_joined_by_the_exit_hook():
    """At interpreter exit (atexit, before finalization) every producer thread still running
    is stopped and joined: a daemon thread inside a native call while the interpreter
    finalizes aborts the process. Here: one mid-epoch, one run ahead into its next epoch."""

    from avpipe.pipeline.feed import producer

    before = set(_feed_threads())  # an earlier test's producer may still be winding down
    f = make(400, batch_size=2)
    it = iter(f)
    next(it)
    g = make(6, batch_size=2)
    list(g)  # its producer runs ahead into the next epoch, parked
    threads = [t for t in _feed_threads() if t not in before]
    assert len(threads) == 2 and producer._EXIT_HOOK["registered"]
    producer.stop_producers(wait_s=10)
    assert not any(t.is_alive() for t in threads)
    del it


def test_prefetch_zero_and_stats():
    f = make(40, prefetch=0)
    assert len(epoch_ids(f)) == len(f)
    f = make(40, task=Synth(slow=set(range(40)), sleep=0.01))
    for _ in f:
        time.sleep(0.001)
    st = f.stats()
    assert st["decode"]["n"] > 0 and st["wait"]["p50"] is not None
    assert st["input_bound"] is True and "input-bound" in st["verdict"]
    assert "not input-bound" not in st["verdict"]
    # the other direction: instant decodes and a slow consumer, which never waits on input
    f = make(40)
    for _ in f:
        time.sleep(0.05)
    st = f.stats()
    assert st["wait_fraction"] < 0.1, st["wait_fraction"]
    assert st["input_bound"] is False and "not input-bound" in st["verdict"]


class Counting(Synth):
    """Synth counting its decodes and collates (a slow consumer's run-ahead)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.lock = threading.Lock()
        self.decoded = 0
        self.collated = 0

    def decode_one(self, i, item):
        with self.lock:
            self.decoded += 1
        return super().decode_one(i, item)

    def collate(self, values, pairs, epoch, step):
        self.collated += 1  # the producer thread only
        return super().collate(values, pairs, epoch, step)


def _settle(fn, want, timeout=3.0):
    """Wait until fn() reaches want (or timeout), then a little longer: its value."""
    t0 = time.monotonic()
    while fn() < want and time.monotonic() - t0 < timeout:
        time.sleep(0.01)
    time.sleep(0.15)
    return fn()


@pytest.mark.parametrize("prefetch", [1, 3])
def test_slow_consumer_bounds_the_batches_decoded_ahead(prefetch):
    """A consumer slower than the producer: ``prefetch`` batches in the queue plus the one the
    producer holds while the queue is full, i.e. at most ``prefetch + 1`` collated batches
    ahead of the consumer; decoding reads ahead of the last collated batch by
    ``Task.decode_groups``' rule (here 2 groups: 2 * threads items). Between epochs the same
    bound holds for the next epoch's batches."""
    B, n = 4, 200
    task = Counting()
    f = make(n, task=task, batch_size=B, prefetch=prefetch)
    ahead = prefetch + 1
    it = iter(f)
    for k in range(1, 6):
        next(it)
        c = _settle(lambda: task.collated, k + ahead)
        assert c == k + ahead, (k, c)  # an unbounded queue would have collated the epoch
        assert task.decoded <= (c + 2) * B, (k, task.decoded)
        assert it._q.qsize() <= prefetch
    for _ in it:  # the rest of the epoch; the producer goes on into the next one
        pass
    assert _settle(lambda: task.collated, len(f) + ahead) == len(f) + ahead
    f.close()


def _rss_bytes():
    with open("/proc/self/statm") as fh:
        import os

        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_rss_stays_flat_over_500_batches():
    class Big(Synth):
        def decode_one(self, i, item):
            return np.full(20000, i, np.float32)  # 80 kB per item

    f = Feed(items(1000), Big(), batch_size=8, device="cpu")
    n, marks = 0, []
    while n < 600:
        for _ in f:
            n += 1
            if n in (100, 600):
                gc.collect()
                marks.append(_rss_bytes())
            if n >= 600:
                break
    assert marks[1] - marks[0] < 20 * 2**20, marks


def test_state_after_breaking_out_of_the_loop_is_mid_epoch():
    ref = make(50, seed=11)
    e0, e1 = epoch_ids(ref), epoch_ids(ref)
    f = make(50, seed=11)
    got = []
    for b in f:
        got.append(b.ids.tolist())
        if len(got) == 4:
            break
    gc.collect()
    st = f.state_dict()  # after the loop: where the consumer got to
    assert st["epoch"] == 0 and st["step"] == 4 and st["consumed"] == 16
    g = make(50, seed=11)
    g.load_state_dict(st)
    assert got + epoch_ids(g) == e0
    assert epoch_ids(f) == e1  # this feed's next iter: the next epoch, whole


def test_len_and_state_json_roundtrip_with_torch_workers_state():
    f = make(50, batch_size=4, world_size=2, rank=1)
    assert len(f) == 7
    st = json.loads(json.dumps(f.state_dict()))
    assert st["world_size"] == 2 and st["rank"] == 1 and st["epoch"] == 0


def test_no_threads_left_once_the_feed_is_gone():
    before = {t.ident for t in threading.enumerate()}
    f = make(200, batch_size=2)
    it = iter(f)
    next(it)
    next(it)
    del it, f
    gc.collect()
    for _ in range(100):
        extra = [t for t in threading.enumerate()
                 if t.ident not in before and t.name.startswith("avpipe-feed")]
        if not extra:
            break
        time.sleep(0.05)
    assert not extra, extra


@pytest.mark.parametrize("pad", ["empty", "repeat"])
@pytest.mark.parametrize("mode", ["fixed", "duration"])
def test_random_configs_resume_exact_and_cover(mode, pad):
    """Random sizes, batch sizes, world sizes and bad items: each rank's resume is exact, a
    resume with another world size loses and repeats nothing, max_duration holds (refills
    included)."""
    import random

    rnd = random.Random(7 if mode == "fixed" else 8)
    for trial in range(15):
        n, W0, W1 = rnd.randint(5, 70), rnd.randint(1, 4), rnd.randint(1, 4)
        bad = set(rnd.sample(range(n), rnd.randint(0, n // 4)))
        durs = np.random.default_rng(trial).uniform(0.5, 6, n)
        md = rnd.uniform(6, 30)
        B = rnd.randint(2, 6)

        def mk(W, r, _n=n, _bad=bad, _durs=durs, _md=md, _B=B, _t=trial):
            kw = dict(batch_size=_B) if mode == "fixed" else dict(max_duration=_md,
                                                                durations=_durs)
            return Feed(items(_n), Synth(bad=_bad), device="cpu", world_size=W, rank=r,
                        seed=_t, pad=pad, **kw)

        full = [epoch_ids(mk(W0, r)) for r in range(W0)]
        k = rnd.randint(0, len(full[0]))
        seen, states = [], []
        for r in range(W0):
            f = mk(W0, r)
            got, it = _take(f, k)
            assert got == full[r][:k]
            seen += flat(got)
            states.append(json.loads(json.dumps(f.state_dict())))
            it.close()
            g = mk(W0, r)
            g.load_state_dict(states[-1])
            assert epoch_ids(g) == full[r][k:]
            if mode == "duration":
                assert all(len(b) * durs[b].max() <= md + 1e-9 for b in full[r] if b)
        new = [mk(W1, r) for r in range(W1)]
        for f in new:
            f.load_state_dict(states)
        rest = [epoch_ids(f) for f in new]
        assert len({len(x) for x in rest}) == 1
        allids = seen + [i for x in rest for i in flat(x)]
        assert set(allids) == set(range(n)) - bad
        left = n - len(seen) - len(bad & set(range(n)) - set(seen))
        if pad == "repeat":  # training: no empty batch (the repeats fill them)
            assert all(len(b) for g in full + rest for b in g)
        elif n >= max(W0, W1) and left >= W1:  # else the documented wrap-padding
            assert len(allids) == len(set(allids)), (trial, n, B, W0, W1, k, left)


# --- between epochs: the producer runs ahead into the next epoch ----------------------------


def test_next_epoch_decoded_ahead_is_taken_over_and_equal():
    ref = make(50, seed=5, prefetch=0)
    want = [epoch_ids(ref) for _ in range(3)]
    f = make(50, seed=5)
    it = iter(f)
    got = [[b.ids.tolist() for b in it]]
    parked = f._ahead
    assert parked is not None and parked.thread.is_alive()  # epoch 1 already under way
    it2 = iter(f)
    assert it2._thread is parked.thread and f._ahead is None  # taken over, not restarted
    got.append([b.ids.tolist() for b in it2])
    got.append(epoch_ids(f))
    assert got == want
    f.close()
    assert not parked.thread.is_alive()


def test_set_epoch_or_load_state_elsewhere_drops_the_batches_ahead():
    ref = make(50, seed=5, prefetch=0)
    ref.set_epoch(7)
    e7 = epoch_ids(ref)
    f = make(50, seed=5)
    epoch_ids(f)
    parked = f._ahead
    f.set_epoch(7)
    assert epoch_ids(f) == e7
    assert not parked.thread.is_alive()
    # a loaded mid-epoch state after a full epoch: exact, from the loaded position
    g = make(50, seed=5)
    part = []
    for b in g:
        part.append(b.ids.tolist())
        if len(part) == 3:
            break
    st = g.state_dict()
    h = make(50, seed=5)
    epoch_ids(h)  # its producer parks at epoch 1
    h.load_state_dict(st)
    assert part + epoch_ids(h) == epoch_ids(make(50, seed=5))


def test_batches_ahead_are_dropped_when_not_taken(monkeypatch):
    from avpipe.pipeline.feed import producer

    monkeypatch.setattr(producer, "AHEAD_IDLE_S", 0.2)
    f = make(50, seed=2)
    e0 = epoch_ids(f)
    parked = f._ahead
    parked.thread.join(timeout=5)
    assert not parked.thread.is_alive()  # stopped itself: nothing held
    ref = make(50, seed=2, prefetch=0)
    assert e0 == epoch_ids(ref)
    assert epoch_ids(f) == epoch_ids(ref)  # a fresh producer gives the next epoch


def test_a_dropped_feed_stops_its_producer_ahead():
    f = make(200, batch_size=2)
    epoch_ids(f)
    thread = f._ahead.thread
    assert thread.is_alive()
    del f
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_errors_of_the_epoch_ahead_appear_only_when_it_is_iterated():
    f = make(20, batch_size=4, task=Synth(bad={0, 1, 2, 3, 5, 8, 13}))
    epoch_ids(f)
    n = len(f.errors)
    assert n == 7
    time.sleep(0.3)  # the producer has run ahead into epoch 1 (its failures not reported yet)
    assert len(f.errors) == n
    epoch_ids(f)
    assert len(f.errors) == n  # each (path, message) once per feed, not once per epoch


# --- torch DataLoader workers ---------------------------------------------------------------


def _loader_epoch(dl):
    return [b.ids.tolist() for b in dl]


def test_torch_persistent_workers_run_the_next_epoch_and_set_epoch_still_works():
    torch = pytest.importorskip("torch")
    n, nw = 24, 2
    # the DataLoader's round robin over 2 workers = the feed with 2 ranks, in global order
    ref = [synth_feed(n, seed=3, rank=r, world_size=nw) for r in range(nw)]
    want = [[b for pair in zip(*[epoch_ids(f) for f in ref]) for b in pair] for _ in range(3)]
    assert want[0] != want[1] != want[2]
    ds = synth_feed(n, seed=3).torch_dataset()
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=nw,
                                     persistent_workers=True, multiprocessing_context=CTX)
    got = [_loader_epoch(dl) for _ in range(3)]  # no set_epoch: the workers advance
    for e in got:
        assert sorted(flat(e)) == list(range(n))  # each epoch: every item exactly once
    assert got == want
    del dl
    # in the main process (no workers): the same, each iter the next epoch
    ds = synth_feed(n, seed=3).torch_dataset()
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    one = [flat(_loader_epoch(dl)) for _ in range(2)]
    assert one[0] != one[1] and sorted(one[0]) == sorted(one[1]) == list(range(n))
    # workers started anew each epoch: set_epoch picks the epoch, as before
    ds = synth_feed(n, seed=3).torch_dataset()
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=nw,
                                     multiprocessing_context=CTX)
    for e in (0, 2, 1):
        ds.set_epoch(e)
        assert _loader_epoch(dl) == want[e]
    # persistent workers started after set_epoch(1): epochs 1, 2
    ds = synth_feed(n, seed=3).torch_dataset()
    ds.set_epoch(1)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=nw,
                                     persistent_workers=True, multiprocessing_context=CTX)
    assert [_loader_epoch(dl) for _ in range(2)] == want[1:]
    del dl


@pytest.mark.parametrize("n,bs,nw", [(24, 2, 5), (50, 4, 3)])
def test_torch_dataset_length_counts_what_its_workers_yield(n, bs, nw):
    """N workers split the epoch as N ranks: where the items do not divide evenly they yield
    more batches than len(feed); torch_dataset(num_workers=N) says how many."""
    torch = pytest.importorskip("torch")
    ds = synth_feed(n, batch_size=bs, seed=1).torch_dataset(num_workers=nw)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=nw,
                                     multiprocessing_context=CTX)
    got = _loader_epoch(dl)
    assert len(ds) == len(dl) == len(got) > len(synth_feed(n, batch_size=bs))
    assert sorted(flat(got)) == list(range(n))
    with pytest.raises(ValueError, match="num_workers"):
        synth_feed(n).torch_dataset(num_workers=-1)


def test_torch_dataset_state_is_its_workers_states_and_resumes_its_workers():
    torch = pytest.importorskip("torch")
    ref = [epoch_ids(synth_feed(24, seed=5, rank=r, world_size=2)) for r in range(2)]
    want = [b for pair in zip(*ref) for b in pair]
    st = json.loads(json.dumps(synth_feed(24, seed=5).torch_dataset().state_dict(
        batches_consumed=4, num_workers=2)))
    assert [(s["rank"], s["world_size"], s["step"]) for s in st] == [(0, 2, 2), (1, 2, 2)]
    ds = synth_feed(24, seed=5).torch_dataset()
    ds.load_state_dict(st)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                     multiprocessing_context=CTX)
    assert _loader_epoch(dl) == want[4:]
    g = synth_feed(24, seed=5)  # a plain feed of the saving world size (1): all its ranks
    g.load_state_dict(st)
    assert epoch_ids(g) == want[4:]  # the rest of the global order, re-cut for 1 rank


_TASK_THREADS_AND_FORK = """
import os, signal
from avpipe.pipeline.feed import Task

task = Task()
task.threads = 2
first = task.pool()
assert first.submit(lambda: 7).result() == 7 and task.pool() is first
pid = os.fork()
if pid == 0:  # the child: an answer within 20 s, else the alarm's default action ends it
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(20)
    try:
        pool = task.pool()
        os._exit(0 if pool is not first and pool.submit(lambda: 8).result() == 8 else 1)
    except BaseException:
        os._exit(2)
_, status = os.waitpid(pid, 0)
assert task.pool() is first  # the parent's pool, still
task.close()
assert first._shutdown and task._pool is None
print("child", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_task_threads_kept_across_epochs_and_a_forked_childs_own(tmp_path):
    """A feed task's decoding threads (``_threads.ProcessThreads``) are kept from call to call;
    a forked child of a process that used them gets its own (the parent's copy has no threads
    there: work handed to it would wait for ever); ``close()`` stops them. In a process of its
    own, whose only threads are the task's (a fork of the test process would copy the locks its
    other threads hold)."""
    from scripts import run_script

    p = run_script(tmp_path, _TASK_THREADS_AND_FORK)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["child", "0"], (p.stdout, p.stderr[-2000:])


def _epoch_and_a_state_in_it(ref, feed, epoch, k):
    """Epoch ``epoch`` of ``ref`` whole, the first ``k`` batches of it from ``feed`` (alike),
    and ``feed``'s state after them."""
    ref.set_epoch(epoch)
    whole = epoch_ids(ref)
    feed.set_epoch(epoch)
    head = []
    for b in feed:
        head.append(b.ids.tolist())
        if len(head) == k:
            break
    return whole, head, feed.state_dict()


def test_set_epoch_of_the_loaded_state_keeps_its_position():
    """set_epoch(e) before every epoch (DistributedSampler's habit), the resumed one included,
    keeps a loaded mid-epoch state of epoch e (it started the epoch over: items trained twice);
    another epoch still starts that epoch, and after the resumed iter set_epoch(e) is honoured."""
    ref = make(40, seed=2)
    e1, head, st = _epoch_and_a_state_in_it(ref, make(40, seed=2), 1, 3)
    f = make(40, seed=2)
    f.load_state_dict(st)
    f.set_epoch(1)
    assert head + epoch_ids(f) == e1
    f.set_epoch(1)
    assert epoch_ids(f) == e1
    h = make(40, seed=2)
    h.load_state_dict(st)
    h.set_epoch(2)
    ref.set_epoch(2)
    assert epoch_ids(h) == epoch_ids(ref)


def test_torch_dataset_set_epoch_keeps_a_loaded_state_of_that_epoch():
    pytest.importorskip("torch")
    e1, head, st = _epoch_and_a_state_in_it(synth_feed(24, seed=4), synth_feed(24, seed=4), 1, 2)
    ds = synth_feed(24, seed=4).torch_dataset()
    ds.load_state_dict(st)
    ds.set_epoch(1)
    assert head + [b.ids.tolist() for b in ds] == e1


def test_a_task_that_plans_its_own_jobs_overrides_submit_and_waits_with_collect():
    """The hooks a recipe implements: ``submit(pairs)`` starts a group's jobs (here one job
    for each pair of items, as the video recipe has one job per video's views) with
    ``start`` and returns a function that waits for them with ``collect``; the deadline
    applies to those jobs, and the feed reports an item past it in ``feed.errors``."""

    class Pairs(Synth):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.groups = 0

        def decode_two(self, pairs):
            return [self.decode_one(*p) for p in pairs]

        def submit(self, pairs):
            self.groups += 1
            halves = [pairs[k:k + 2] for k in range(0, len(pairs), 2)]
            jobs = [self.start(self.decode_two, (h,), h[0]) for h in halves]

            def result():
                got = self.collect(jobs)
                return [g if isinstance(g, BaseException) else g[j]
                        for h, g in zip(halves, got) for j in range(len(h))]

            return result

    task = Pairs(slow={5}, sleep=2.0, deadline=0.5)
    f = make(16, task=task, shuffle=False, pad="empty")
    got = flat(epoch_ids(f))
    assert task.groups >= 4  # every group went through submit
    assert sorted(got) == [i for i in range(16) if i not in (4, 5)]  # 5's job held 4 too
    assert {p for p, _ in f.errors} == {"/data/item0004.bin", "/data/item0005.bin"}
    assert all("DecodeTimeoutError" in m for _, m in f.errors)
    f.close()
