"""Feed states: a state the feed did not write, or wrote over another item list, is refused with
a typed error (avpipe.errors.StateError, a ValueError) naming the field and value; real states
still resume exactly (test_feed.py: mid-epoch, across world sizes, torch workers)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from paths import SAMPLES
from test_feed import Synth, _take, epoch_ids, items, make

from avpipe import StateError
from avpipe.pipeline.feed import STATE_VERSION, Feed, items_fingerprint
from avpipe.pipeline.sources import Item
from avpipe.recipes import image_classification, rnnt_feed, video_classification

ROOT = SAMPLES
MANIFEST = os.path.join(ROOT, "speech", "manifest.jsonl")
LABELS = os.path.join(ROOT, "video", "labels.csv")


def _state_after(f, k):
    got, it = _take(f, k)
    st = json.loads(json.dumps(f.state_dict()))
    it.close()
    return got, st


def test_a_state_names_its_version_and_item_list():
    st = make(30).state_dict()
    assert st["version"] == STATE_VERSION == 2
    assert st["items"] == items_fingerprint(items(30))


def test_resume_on_the_same_lines_reversed_is_refused():
    """The issue's case: the same manifest lines in another order resumed 14 items twice and
    14 never, silently (n, seed, batch size all equal)."""
    n = 56
    f = make(n, seed=3)
    first, st = _state_after(f, 7)
    g = Feed(items(n)[::-1], Synth(), batch_size=4, device="cpu", seed=3)
    with pytest.raises(StateError) as e:
        g.load_state_dict(st)
    assert e.value.field == "items" and "item list" in str(e.value)
    # the same list again resumes (and exactly: the rest of the epoch)
    h = make(n, seed=3)
    h.load_state_dict(st)
    assert first + epoch_ids(h) == epoch_ids(make(n, seed=3))


def test_rnnt_resume_on_a_reordered_or_changed_manifest_is_refused(tmp_path):
    lines = [json.loads(x) for x in open(MANIFEST) if x.strip()]
    for d in lines:
        d["audio_filepath"] = os.path.join(ROOT, "speech", d["audio_filepath"])

    def manifest(name, rows):
        p = tmp_path / name
        p.write_text("".join(json.dumps(d) + "\n" for d in rows))
        return p

    st = rnnt_feed(manifest("a.jsonl", lines), batch_size=2, device="cpu").state_dict()
    for name, rows in [("reversed.jsonl", lines[::-1]),
                       ("longer.jsonl", [dict(lines[0], duration=lines[0]["duration"] + 1)]
                        + lines[1:]),
                       ("offset.jsonl", [dict(lines[0], offset=0.25)] + lines[1:]),
                       ("renamed.jsonl", [dict(lines[0], audio_filepath="other.wav")]
                        + lines[1:])]:
        with pytest.raises(StateError, match="items=") as e:
            rnnt_feed(manifest(name, rows), batch_size=2, device="cpu").load_state_dict(st)
        assert e.value.field == "items", name
    rnnt_feed(manifest("same.jsonl", lines), batch_size=2, device="cpu").load_state_dict(st)


def test_items_fingerprint_follows_identity_not_location():
    a = [Item(path=f"/a/{i}.wav", raw_path=f"{i}.wav", duration=1.0 + i) for i in range(5)]
    moved = [Item(path=f"/b/{i}.wav", raw_path=f"{i}.wav", duration=1.0 + i) for i in range(5)]
    assert items_fingerprint(a) == items_fingerprint(moved)  # a dataset moved as a whole
    assert items_fingerprint(a) != items_fingerprint(a[::-1])
    assert items_fingerprint(a) != items_fingerprint(a[:4])
    assert items_fingerprint(a) != items_fingerprint(
        a[:4] + [Item(path="/a/4.wav", raw_path="4.wav", duration=5.5)])


# (mutation, the field the error names)
TAMPERED = [
    (dict(step=-1), "step"),  # was accepted: an empty first batch
    (dict(step=10**9), "step"),  # was accepted: an empty epoch
    (dict(borrowed=10**6), "borrowed"),  # was accepted
    (dict(epoch=-1), "epoch"),  # was accepted
    (dict(step=3.7), "step"),  # was accepted
    (dict(step=3.0), "step"),
    (dict(step="3"), "step"),  # was accepted
    (dict(step=True), "step"),
    (dict(version=99), "version"),  # was accepted
    (dict(version=1), "version"),
    (dict(step=-100), "step"),  # was an IndexError
    (dict(world_size=0), "world_size"),  # was a ZeroDivisionError
    (dict(world_size=-2), "world_size"),
    (dict(world_size="1"), "world_size"),
    (dict(rank=-1), "rank"),
    (dict(rank=1), "rank"),
    (dict(epoch=2**40), "epoch"),
    (dict(epoch=None), "epoch"),
    (dict(consumed=5), "consumed"),
    (dict(seed=4.0), "seed"),
    (dict(shuffle=1), "shuffle"),
    (dict(n=31), "n"),
    (dict(batch_size=5), "batch_size"),
    (dict(mode="duration"), "mode"),
    (dict(items="0" * 32), "items"),
    (dict(rebase={}), "rebase"),
    (dict(rebase=[None]), "rebase[0]"),
    (dict(rebase=[{"world_size": 1, "step": 0, "exclude": []}]), "rebase[0].world_size"),
    (dict(rebase=[{"world_size": 3, "step": 99, "exclude": []}]), "rebase[0].step"),
    (dict(rebase=[{"world_size": 3, "step": 1, "exclude": [77]}]), "rebase[0].exclude"),
    (dict(rebase=[{"world_size": 3, "step": 1, "exclude": [5, 5]}]), "rebase[0].exclude"),
    (dict(extra=1), "extra"),
    # in range, of the right type, but not what the feed wrote: the state's check
    (dict(step=2), "consumed"),
    (dict(borrowed=1), "check"),
    (dict(consumed=8, step=2), "check"),
    (dict(check="0" * 24), "check"),
]


@pytest.mark.parametrize("mutation,field", TAMPERED, ids=[f"{k}" for k, _ in TAMPERED])
def test_tampered_states_raise_a_state_error_naming_the_field(mutation, field):
    _, st = _state_after(make(30, seed=1), 3)
    bad = {**st, **mutation}
    f = make(30, seed=1)
    with pytest.raises(StateError) as e:
        f.load_state_dict(bad)
    assert isinstance(e.value, ValueError)
    assert e.value.field == field, (mutation, str(e.value))
    assert str(e.value).startswith(f"state: {field}=")
    # the feed is untouched: it still runs its first epoch from the start
    assert epoch_ids(f) == epoch_ids(make(30, seed=1))


@pytest.mark.parametrize("state,field", [
    (None, "state"), (3, "state"), ("x", "state"), ([], "state"), ([None], "state"),
    ({}, "version"),
])
def test_states_that_are_not_dicts_raise_a_state_error(state, field):
    with pytest.raises(StateError) as e:  # None was an AttributeError
        make(30).load_state_dict(state)
    assert e.value.field == field


def test_a_missing_field_is_named():
    st = make(30).state_dict()
    del st["borrowed"]
    with pytest.raises(StateError, match="borrowed"):
        make(30).load_state_dict(st)


def test_ranks_states_at_different_positions_are_refused():
    states = [_state_after(make(40, rank=r, world_size=2, seed=2), 2)[1] for r in range(2)]
    other = _state_after(make(40, rank=1, world_size=2, seed=2), 3)[1]
    with pytest.raises(StateError) as e:
        make(40, seed=2).load_state_dict([states[0], other])
    assert e.value.field == "step"
    with pytest.raises(StateError) as e:  # a rank's state missing on a world size change
        make(40, seed=2).load_state_dict(states[:1])
    assert e.value.field == "rank" and "missing rank(s) [1]" in str(e.value)
    make(40, seed=2).load_state_dict(states)  # all of them: fine


def test_borrowed_bound_admits_every_state_the_feed_writes():
    """Every state a feed with failures writes, at every step of an epoch, on every rank, in
    both modes and pads, loads and resumes exactly (the bounds are not too tight)."""
    bad = {0, 1, 2, 3, 5, 9, 17, 18, 19}
    for pad in ("empty", "repeat"):
        for W in (1, 2, 3):
            for r in range(W):
                full = epoch_ids(make(21, task=Synth(bad=bad), rank=r, world_size=W, pad=pad))
                for k in range(len(full) + 1):
                    f = make(21, task=Synth(bad=bad), rank=r, world_size=W, pad=pad)
                    got, st = _state_after(f, k)
                    g = make(21, task=Synth(bad=bad), rank=r, world_size=W, pad=pad)
                    g.load_state_dict(st)
                    assert got + epoch_ids(g) == full, (pad, W, r, k)


def test_every_recipe_refuses_a_tampered_state(tmp_path):
    img = tmp_path / "imgs"
    for c in ("a", "b"):
        (img / c).mkdir(parents=True)
    src = os.path.join(ROOT, "images")
    for i, name in enumerate(sorted(os.listdir(src))[:4]):
        os.symlink(os.path.join(src, name), img / ("a" if i % 2 else "b") / name)
    for mk in (lambda: rnnt_feed(MANIFEST, batch_size=2, device="cpu"),
               lambda: video_classification(LABELS, batch_size=2, device="cpu"),
               lambda: video_classification(LABELS, batch_size=2, device="cpu", train=False),
               lambda: image_classification(str(img), batch_size=2, device="cpu")):
        st = mk().state_dict()
        for mutation in (dict(step=-1), dict(version=99), dict(items="x")):
            with pytest.raises(StateError):
                mk().load_state_dict({**st, **mutation})
        mk().load_state_dict(st)


def test_torch_dataset_refuses_a_bad_state_before_its_workers_start():
    pytest.importorskip("torch")
    from test_feed import synth_feed

    ds = synth_feed(24, seed=5).torch_dataset()
    st = ds.state_dict(batches_consumed=4, num_workers=2)
    with pytest.raises(StateError) as e:
        ds.load_state_dict([dict(st[0], step=-1), st[1]])
    assert e.value.field == "step"
    with pytest.raises(StateError):
        ds.load_state_dict(None)
    ds.load_state_dict(st)


def test_state_error_pickles():
    import pickle

    e = StateError("step", -1, "out of range")
    f = pickle.loads(pickle.dumps(e))
    assert (f.field, f.value, str(f)) == ("step", -1, str(e))


def test_a_state_handed_back_as_numpy_scalars_and_tuples_still_loads():
    """Checkpoint libraries may return ints as numpy scalars and lists as tuples: the same
    state, loaded as such."""
    f = make(30, seed=1)
    got, st = _state_after(f, 3)
    odd = {k: (np.int64(v) if type(v) is int else tuple(v) if isinstance(v, list) else v)
           for k, v in st.items()}
    g = make(30, seed=1)
    g.load_state_dict(odd)
    assert got + epoch_ids(g) == epoch_ids(make(30, seed=1))
