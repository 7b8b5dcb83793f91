"""State attacks on the training feeds: random mutations of real ``feed.state_dict()`` states.

Each attack takes a state a feed wrote mid-epoch (on some rank of some world size, with failing
items so that replacements are counted), changes it (:func:`mutate`: a field set to a value of
another type or out of range, a field dropped or added, an item of ``rebase`` changed, the state
wrapped in lists or tuples, numpy scalars for ints, another rank's state, the state replaced by
something else) and loads it into a fresh feed built with the same arguments. Outcomes:

* ``typed_error`` - ``load_state_dict`` raised :class:`avpipe.errors.StateError`;
* ``exact`` - it loaded, and the rest of the epoch is exactly the uninterrupted feed's;
* ``untyped_error`` - any other exception, from the load or from the epoch after it (failure);
* ``inexact`` - it loaded, and the rest of the epoch differs (failure: a state the feed did not
  write was taken as one it did).

::

    python3 -m tests.fuzz.states --rounds 2000 --seed 1
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import traceback
from collections import Counter

import numpy as np

FAILING = ("untyped_error", "inexact")

# values of every kind a field may be set to
_ODD = [None, True, False, 0, 1, -1, 2, 3, -100, 10**6, 10**9, 2**31, 2**32, 2**63, -(2**63),
        10**30, 0.0, 1.0, 3.7, -1.5, float("nan"), float("inf"), "", "0", "3", "x" * 40,
        [], [0], [[]], {}, {"a": 1}, (1, 2), b"3"]


def _rand_value(rng: random.Random, old):
    """A replacement for a field's value: an odd value, or one near the old one."""
    r = rng.random()
    if r < 0.5:
        return copy.deepcopy(rng.choice(_ODD))
    if isinstance(old, bool) or not isinstance(old, (int, float)):
        return copy.deepcopy(rng.choice(_ODD))
    if r < 0.8:
        return type(old)(old + rng.choice([-3, -2, -1, 1, 2, 3]))
    return rng.choice([float(old), str(old), np.int64(int(old)), -old, old * 1000])


def _mutate_rebase(rng: random.Random, rebase):
    rebase = copy.deepcopy(rebase)
    k = rng.random()
    if not rebase or k < 0.25:
        rebase.append({"world_size": rng.choice([1, 2, 3, 0, -1, "2"]),
                       "step": rng.choice([0, 1, 5, -1, 10**6]),
                       "exclude": rng.choice([[], [0], [1, 0], [10**6], [0, 0], "x", None])})
        return rebase
    r = rng.choice(rebase)
    if k < 0.5:
        key = rng.choice(["world_size", "step", "exclude"])
        r[key] = _rand_value(rng, r[key])
    elif k < 0.7:
        del r[rng.choice(list(r))]
    elif k < 0.85:
        r["exclude"] = list(r["exclude"]) + [rng.randrange(-5, 200)]
    else:
        rebase.pop(rng.randrange(len(rebase)))
    return rebase


def mutate(rng: random.Random, state: dict, others: list):
    """One random change of ``state`` (a dict); ``others``: the other ranks' states of the
    same save. Returns the changed state (a new object) and a short description."""
    s = copy.deepcopy(state)
    k = rng.random()
    keys = list(s)
    if k < 0.45:
        f = rng.choice(keys)
        s[f] = _rand_value(rng, s[f])
        return s, f"{f}={s[f]!r}"
    if k < 0.55:
        f = rng.choice(keys)
        del s[f]
        return s, f"without {f}"
    if k < 0.6:
        s[rng.choice(["extra", "Step", "stage", ""])] = 1
        return s, "an extra field"
    if k < 0.7:
        s["rebase"] = _mutate_rebase(rng, s["rebase"])
        return s, f"rebase={s['rebase']!r}"
    if k < 0.78:  # benign: the same state in other clothes
        how = rng.choice(["list", "nested", "tuple", "numpy", "all ranks"])
        if how == "list":
            return [s], how
        if how == "nested":
            return [[s]], how
        if how == "tuple":
            return (s,), how
        if how == "numpy":
            return {k2: (np.int64(v) if type(v) is int else v) for k2, v in s.items()}, how
        return [*others, s], how
    if k < 0.86:  # two fields at once, kept consistent with each other where they pair up
        s["step"] = _rand_value(rng, s["step"])
        if isinstance(s["step"], int) and not isinstance(s["step"], bool):
            unit = s["consumed"] // max(1, state["step"] * s["world_size"]) if state["step"] \
                else 1
            s["consumed"] = s["step"] * s["world_size"] * unit
        return s, f"step={s['step']!r} with consumed={s['consumed']!r}"
    if k < 0.93:  # another rank's state, or a mix of ranks
        if others:
            o = copy.deepcopy(rng.choice(others))
            if rng.random() < 0.5:
                o["borrowed"] = s["borrowed"]
            return [o, s] if rng.random() < 0.5 else o, "another rank's state"
        return [], "an empty list"
    return copy.deepcopy(rng.choice([None, 0, "state", [], [None], {}, [{}], b"x", 1.5])), \
        "not a state"


def _epoch_ids(feed):
    return [np.asarray(b.ids).tolist() for b in feed]


def attack(make_feed, rng: random.Random, rounds: int, *, world_sizes=(1, 2, 3)) -> list:
    """``rounds`` attacks on states of feeds ``make_feed(rank=, world_size=)`` (one epoch each
    way); one record per attack: ``{"outcome", "mutation", "error"}``."""
    from avpipe.errors import StateError

    saves = {}  # (W, k) -> (states of every rank, each rank's rest of the epoch)
    out = []
    for _ in range(rounds):
        W = rng.choice(world_sizes)
        full0 = None
        if (W, None) not in saves:
            saves[(W, None)] = [_epoch_ids(make_feed(rank=r, world_size=W)) for r in range(W)]
        full = saves[(W, None)]
        k = rng.randrange(len(full[0]) + 1)
        if (W, k) not in saves:
            states = []
            for r in range(W):
                f = make_feed(rank=r, world_size=W)
                it = iter(f)
                for _ in range(k):
                    next(it)
                states.append(f.state_dict())
                it.close()
                f.close()
            saves[(W, k)] = states
        states = saves[(W, k)]
        r = rng.randrange(W)
        bad, what = mutate(rng, states[r], [s for j, s in enumerate(states) if j != r])
        g = make_feed(rank=r, world_size=W)
        rec = {"mutation": what[:200], "world_size": W, "rank": r, "step": k}
        try:
            try:
                g.load_state_dict(bad)
            except StateError as e:
                rec.update(outcome="typed_error", error=str(e)[:200])
                out.append(rec)
                continue
            rest = _epoch_ids(g)
            full0 = full[r][k:]
            rec["outcome"] = "exact" if rest == full0 else "inexact"
            if rest != full0:
                rec["error"] = f"rest {rest[:3]}... != {full0[:3]}..."
        except Exception as e:  # noqa: BLE001 - the finding
            rec.update(outcome="untyped_error", error=f"{type(e).__name__}: {e}"[:300],
                       traceback=traceback.format_exc(limit=6)[-1500:])
        finally:
            g.close()
        out.append(rec)
    return out


def synthetic_feed_factory(n=23, bad=(0, 1, 5, 9, 17, 21, 22), batch_size=3, pad="repeat",
                           max_duration=None):
    """Feeds over ``n`` in-memory items (item i decodes to i; ``bad`` ones fail), for fast
    attacks on the generic feed (both pads, fixed size or duration buckets)."""
    from avpipe.pipeline.feed import Feed, Task
    from avpipe.pipeline.sources import Item

    class _Task(Task):
        array_fields = ("x",)
        threads = 2

        def decode_one(self, i, item):
            if i in bad:
                raise ValueError(f"bad item {item.path}")
            return np.full(2, i, np.int64)

        def collate(self, values, pairs, epoch, step):
            return {"x": np.stack(values) if values else np.zeros((0, 2), np.int64)}

    items = [Item(path=f"/data/{i}.bin", raw_path=f"{i}.bin", duration=0.5 + (i % 7))
             for i in range(n)]
    kw = (dict(batch_size=batch_size) if max_duration is None else
          dict(max_duration=max_duration, durations=[it.duration for it in items]))

    def make(*, rank, world_size):
        return Feed(items, _Task(), device="cpu", seed=3, rank=rank, world_size=world_size,
                    pad=pad, prefetch=0, **kw)

    return make


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="random state attacks on the feeds")
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    recs = []
    for pad in ("repeat", "empty"):
        for md in (None, 9.0):
            recs += attack(synthetic_feed_factory(pad=pad, max_duration=md), rng, a.rounds // 4)
    counts = Counter(r["outcome"] for r in recs)
    print(dict(counts))
    bad = [r for r in recs if r["outcome"] in FAILING]
    for r in bad[:20]:
        print(r)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
