"""A feed's epoch order: which items each rank gets in each epoch, and the resume state.

Epoch ``e``'s order is a keyed Feistel permutation of the items (seed, epoch; :mod:`.plans`)
cut into global batches (a *plan*); global batch ``k`` goes to step ``k // W``, rank ``k % W``.
Every rank gets the same number of batches; the remainder rule is in :mod:`.plans`.
:class:`EpochOrder` holds the rule for one feed's arguments; every feed takes its epochs from
it: :class:`~avpipe.pipeline.feed.Feed` (and through it the recipes),
:class:`~avpipe.pipeline.clips.ClipFeed` and :class:`~avpipe.pipeline.image_folder.ImageFolder`
(one rank: the permutation, cut into batches in order).

Resume: a feed's state holds the position as ``(epoch, step)`` in one global order -
``consumed = step * world_size * batch_size`` items of the epoch's permutation (fixed batch
size; with ``max_duration``, ``step * world_size`` global batches) - plus ``borrowed``, the
number of replacement items this rank took from the end of its share. Each rank loads its
own state (or a list of the ranks' states that holds it): a feed built with the same arguments
that loads it yields exactly the batches the uninterrupted one would have. With a different
``world_size`` (or torch DataLoader worker count) the rest of the epoch, ``plan[step * W_old:]``
minus the replacements already used, is re-cut for the new world size (ranks disjoint, all
remaining items); the rule is recorded in the state (``rebase``), so later resumes stay exact.
That needs every old rank's state (a list: their ``borrowed`` counts say which items the old
ranks already took as replacements; ``FeedDataset.state_dict`` gives its workers' states as
such a list). Anything else - a list without this rank's state at the
same world size, or an old rank's state missing on a world size change - raises ``ValueError``
naming the missing rank(s) and the world size (another rank's count would make the resume
inexact: items lost or repeated).

A state names what it belongs to and is checked on load (:meth:`EpochOrder.check_state`): its
``version`` (:data:`STATE_VERSION`), the feed's arguments that decide the order (``n``,
``seed``, ``shuffle``, ``mode``, ``batch_size``, ``max_duration``), ``items`` (a hash of the item
list in order: each item's path as the manifest / list wrote it, offset, duration, label and eval
view, :func:`items_fingerprint`), every field's type and range (against the epoch's plan:
``step``, ``borrowed``, ``rebase``) and ``check``, a hash of the other fields. A state that
is not one the feed wrote - another item list (reordered, changed, longer), a field edited, of
another type, missing or added, ``None`` - raises :class:`avpipe.errors.StateError` (a
``ValueError``) naming the field and value, and the feed is left as it was.
"""

from __future__ import annotations

import collections.abc
import hashlib
import json
import numbers

import numpy as np

from ...errors import StateError
from . import plans

__all__ = ["EpochOrder", "STATE_VERSION", "items_fingerprint", "state_check", "start_of",
           "flat_states"]


def start_of(epoch):
    """The position at the start of ``epoch``."""
    return {"epoch": int(epoch), "step": 0, "borrowed": 0, "rebase": []}


def flat_states(state) -> list:
    """A state, or a list of states (or of lists of states): the states, in order."""
    if isinstance(state, (list, tuple)):
        return [s for x in state for s in flat_states(x)]
    return [state]


# the state_dict format; load_state_dict takes this version only
STATE_VERSION = 2
_STATE_KEYS = ("version", "n", "seed", "shuffle", "order", "mode", "batch_size", "max_duration",
               "items",
               "epoch", "step", "borrowed", "rebase", "rank", "world_size", "consumed", "check")
_REBASE_KEYS = ("world_size", "step", "exclude")
_MAX_EPOCH = 1 << 32  # the order's counters hold the epoch in 32 bits
# a state's world sizes (its own, its re-cuts'): a plan holds at least one batch per rank, so
# an absurd one would be built before it could be refused
MAX_STATE_WORLD_SIZE = 1 << 16


def _item_key(it) -> str:
    """An item's identity for :func:`items_fingerprint`: its path as the list wrote it, span
    (offset, duration), label and eval view (the fields that decide what it decodes to)."""
    raw = getattr(it, "raw_path", None)
    if raw is None:
        return repr(it)
    extra = getattr(it, "extra", None) or {}
    return (f"{raw}\x1f{getattr(it, 'offset', None)!r}\x1f{getattr(it, 'duration', None)!r}"
            f"\x1f{getattr(it, 'label', None)!r}\x1f{extra.get('video')!r}"
            f"\x1f{extra.get('view')!r}")


def items_fingerprint(items) -> str:
    """A hash (hex) of the item list in order: each item's path as the manifest / list wrote
    it (so a dataset moved as a whole keeps it), offset, duration, label and eval view. One
    pass over the items (about a second per million)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{len(items)}\x1e".encode())
    h.update("\x1e".join(_item_key(it) for it in items).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def state_check(state: dict) -> str:
    """The ``check`` field of a state: a hash of its other fields (canonical JSON). A field
    changed after the feed wrote the state no longer matches it."""
    body = {k: state[k] for k in _STATE_KEYS if k != "check"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _plain(v):
    """A state as plain JSON types (mappings -> dict, sequences -> list, numpy scalars ->
    Python's), as a checkpoint library may hand it back."""
    if isinstance(v, collections.abc.Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)) or (isinstance(v, collections.abc.Sequence)
                                        and not isinstance(v, (str, bytes))):
        return [_plain(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    return v


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _int_field(s, name, lo, hi=None, where=None) -> int:
    v = s[name]
    label = name if where is None else f"{where}.{name}"
    if not _is_int(v):
        raise StateError(label, v, f"not an integer (a {type(v).__name__})")
    if v < lo or (hi is not None and v >= hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise StateError(label, v, f"out of range (must be {rng})")
    return int(v)


def _same(v, want) -> bool:
    """A state's fingerprint value ``v`` is the feed's ``want``, of the same kind."""
    if want is None or isinstance(want, bool):
        return v is want or (isinstance(v, (bool, np.bool_)) and want is not None
                             and bool(v) == want)
    if isinstance(want, int):
        return _is_int(v) and int(v) == want
    if isinstance(want, float):
        return isinstance(v, (numbers.Real)) and not isinstance(v, (bool, np.bool_)) \
            and float(v) == want
    return type(v) is type(want) and v == want


def _check_fields(s, fp: dict, n: int) -> None:
    """One state's fields: present, of their types, in their ranges, this version and this
    feed's fingerprint (:meth:`Feed.check_state`; the plan-dependent bounds are checked
    there)."""
    if not isinstance(s, dict):
        raise StateError("state", s, f"a {type(s).__name__}, not a feed state (a dict, or a "
                                     "list of the ranks' dicts)")
    for k in _STATE_KEYS:
        if k not in s:
            raise StateError(k, None, "missing (not a state a feed wrote)")
    for k in s:
        if k not in _STATE_KEYS:
            raise StateError(str(k), s[k], "not a field of a feed state")
    if not _is_int(s["version"]) or s["version"] != STATE_VERSION:
        raise StateError("version", s["version"],
                         f"this feed reads state version {STATE_VERSION} only")
    for k, v in fp.items():
        if not _same(s[k], v):
            what = ("the item list (paths, spans, labels or their order) differs from this "
                    "feed's" if k == "items" else f"this feed has {k}={v!r}")
            raise StateError(k, s[k], f"saved by a different feed: {what}")
    W = _int_field(s, "world_size", 1, MAX_STATE_WORLD_SIZE + 1)
    r = _int_field(s, "rank", 0)
    if r >= W:
        raise StateError("rank", r, f"rank {r} is not a rank of world_size={W}")
    _int_field(s, "epoch", 0, _MAX_EPOCH)
    _int_field(s, "step", 0)
    _int_field(s, "borrowed", 0)
    _int_field(s, "consumed", 0)
    rebase = s["rebase"]
    if not isinstance(rebase, list):
        raise StateError("rebase", rebase, f"a {type(rebase).__name__}, not a list")
    for j, r in enumerate(rebase):
        where = f"rebase[{j}]"
        if not isinstance(r, dict) or sorted(r) != sorted(_REBASE_KEYS):
            raise StateError(where, r, f"not a dict of {', '.join(_REBASE_KEYS)}")
        _int_field(r, "world_size", 1, MAX_STATE_WORLD_SIZE + 1, where=where)
        _int_field(r, "step", 0, where=where)
        ex = r["exclude"]
        if not isinstance(ex, list) or not all(_is_int(i) and 0 <= i < n for i in ex) \
                or any(a >= b for a, b in zip(ex, ex[1:])):
            raise StateError(f"{where}.exclude", ex,
                             f"not an increasing list of item indices in [0, {n})")


class EpochOrder:
    """The epoch order of ``n`` items for one feed's arguments: each epoch's plan (its global
    batches), each rank's share of it, the re-cut on a world size change, and the states that
    record a position in it (module docstring).

    ``batch_size`` (items per batch) or ``max_duration`` (seconds of padded audio per batch,
    with ``durations``, batches bucketed over ``bucket_window`` items); ``seed``, ``shuffle``;
    ``pad``: ``"repeat"`` or ``"empty"`` (:mod:`.plans`); ``groups``: a group id per item for
    an order that keeps each group's items together (:func:`.plans.grouped_permutation`);
    ``items``: the item list the states' ``items`` fingerprint is taken of (None:
    ``range(n)``)."""

    def __init__(self, n: int, *, batch_size=None, max_duration=None, durations=None,
                 seed=0, shuffle=True, bucket_window=100, pad="repeat", groups=None,
                 items=None):
        self.n = int(n)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.max_duration = None if max_duration is None else float(max_duration)
        self.durations = durations
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.bucket_window = int(bucket_window)
        self.pad = pad
        self.groups = groups
        self._items = items
        self._items_fp = None
        self._plans: dict = {}

    @property
    def mode(self) -> str:
        return "fixed" if self.batch_size is not None else "duration"

    # -- plans -----------------------------------------------------------------------------
    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order of the items (all of them, before the cut into batches)."""
        if self.groups is None:
            return plans.permutation(self.n, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        return plans.grouped_permutation(self.groups, seed=self.seed, epoch=epoch,
                                          shuffle=self.shuffle)

    def base_plan(self, epoch: int, world_size: int) -> list:
        """Epoch ``epoch``'s global batches for ``world_size`` ranks, from its start."""
        order = self.permutation(epoch)
        if self.mode == "fixed":
            return plans.plan_fixed(order, self.batch_size, world_size, pad=self.pad)
        return plans.plan_buckets(order, self.durations, self.max_duration, world_size,
                                   seed=self.seed, epoch=epoch, window=self.bucket_window,
                                   shuffle=self.shuffle, pad=self.pad)

    def recut_rest(self, plan: list, old_w: int, step: int, exclude, new_w: int) -> list:
        """The rest of ``plan`` (cut for ``old_w`` ranks) from ``step`` on, less the items in
        ``exclude`` (replacements already taken), cut again for ``new_w`` ranks."""
        ex = set(int(i) for i in exclude)
        rest = [np.array([i for i in b if int(i) not in ex], np.int64) for b in plan[step * old_w:]]
        if self.mode == "fixed":
            seq, seen = [], set()
            for b in rest:
                for i in b.tolist():
                    if i not in seen:  # wrap padding may repeat an item: once is enough
                        seen.add(i)
                        seq.append(i)
            return plans.plan_fixed(np.array(seq, np.int64), self.batch_size, new_w,
                                     pad=self.pad)
        return plans.make_divisible([b for b in rest if len(b)], new_w, pad=self.pad)

    def plan(self, epoch: int, rebase, world_size: int) -> list:
        """Epoch ``epoch``'s global batches for ``world_size`` ranks after the re-cuts a state
        recorded (``rebase``); the last few plans are kept."""
        W = int(world_size)
        key = (epoch, repr(rebase), W)
        p = self._plans.get(key)
        if p is None:
            ws = [r["world_size"] for r in rebase] + [W]
            p = self.base_plan(epoch, ws[0])
            for j, r in enumerate(rebase):
                p = self.recut_rest(p, r["world_size"], r["step"], r["exclude"], ws[j + 1])
            if len(self._plans) > 4:
                self._plans.clear()
            self._plans[key] = p
        return p

    @staticmethod
    def rank_batches(plan, rank: int, world_size: int) -> list:
        """Rank ``rank``'s batches of ``plan``, in step order (global batches ``rank``,
        ``rank + world_size``, ...)."""
        return [plan[k] for k in range(int(rank), len(plan), int(world_size))]

    def steps(self, pos: dict, world_size: int) -> int:
        """Batches per rank in the epoch of position ``pos``."""
        if self.mode == "fixed" and not pos["rebase"]:
            return plans.steps_fixed(self.n, self.batch_size, world_size)
        return len(self.plan(pos["epoch"], pos["rebase"], world_size)) // world_size

    # -- states ----------------------------------------------------------------------------
    def items_fingerprint(self) -> str:
        """A hash of the item list, in order (:func:`items_fingerprint`; computed once)."""
        if self._items_fp is None:
            self._items_fp = items_fingerprint(
                range(self.n) if self._items is None else self._items)
        return self._items_fp

    def fingerprint(self) -> dict:
        """The state fields that name the order (checked on load)."""
        return {"n": self.n, "seed": self.seed, "shuffle": self.shuffle,
                "order": "global" if self.groups is None else "grouped",
                "mode": self.mode, "batch_size": self.batch_size,
                "max_duration": self.max_duration, "items": self.items_fingerprint()}

    def state(self, pos: dict, rank: int, world_size: int) -> dict:
        """The JSON-serializable state of position ``pos`` on ``rank`` of ``world_size``."""
        W = int(world_size)
        unit = (self.batch_size or 1) if self.mode == "fixed" else 1
        st = {
            "version": STATE_VERSION, **self.fingerprint(),
            "epoch": pos["epoch"], "step": pos["step"], "borrowed": pos["borrowed"],
            "rebase": [dict(r, exclude=[int(i) for i in r["exclude"]]) for r in pos["rebase"]],
            "rank": int(rank), "world_size": W,
            "consumed": pos["step"] * W * unit, "check": "",
        }
        st["check"] = state_check(st)
        return st

    def borrowed_ids(self, state) -> list:
        """The replacement items the state's rank took from the end of its share."""
        b = int(state["borrowed"])
        if b == 0:
            return []
        W, r = int(state["world_size"]), int(state["rank"])
        share = self.rank_batches(self.plan(state["epoch"], state["rebase"], W), r, W)
        flat = np.concatenate(share) if share else np.zeros(0, np.int64)
        return flat[len(flat) - b:].tolist()

    def check_state(self, state) -> list:
        """The states of ``state`` (one rank's state, or a list of ranks' states), checked to be
        ones a feed of this order (built with the same arguments over the same item list, at any
        rank and world size) can have written: every field present and of its type, no other
        field, this ``STATE_VERSION``, the fingerprint (``n``, ``seed``, ``shuffle``, ``order``,
        ``mode``, ``batch_size``, ``max_duration``, ``items``) this order's, ``rank`` /
        ``world_size`` / ``epoch`` / ``step`` / ``borrowed`` / ``consumed`` / ``rebase``
        within what the epoch's plan allows, and a list's states at one position, one per
        rank. Anything else raises :class:`~avpipe.errors.StateError` naming the field and
        value. Returns the states (a list of dicts)."""
        states = [_plain(s) for s in flat_states(_plain(state))]
        if not states:
            raise StateError("state", state, "an empty list of states")
        fp = self.fingerprint()
        for s in states:
            _check_fields(s, fp, self.n)
        s0 = states[0]
        for s in states[1:]:
            for k in ("epoch", "step", "world_size", "rebase"):
                if s[k] != s0[k]:
                    raise StateError(k, s[k], f"the ranks' states are not at one position "
                                              f"(another state has {k}={s0[k]!r})")
        by_rank = {}
        for s in states:
            r = int(s["rank"])
            if r in by_rank and int(by_rank[r]["borrowed"]) != int(s["borrowed"]):
                raise StateError("rank", r, f"two different states of rank {r} "
                                            f"(world_size={int(s['world_size'])})")
            by_rank[r] = s
        self._check_position(s0, list(by_rank.values()))
        for s in states:
            if s["check"] != state_check(s):
                raise StateError("check", s["check"], "does not match the state's fields: the "
                                                      "state was changed after it was written")
        return states

    def _check_position(self, s0, states) -> None:
        """The epoch's plans bound ``rebase``'s steps and items, ``step`` and each rank's
        ``borrowed`` (a feed at step k has taken at most the rank's items past its first k - 1
        batches as replacements, none at step 0)."""
        epoch, W = int(s0["epoch"]), int(s0["world_size"])
        rebase = s0["rebase"]
        n = self.n
        for j, r in enumerate(rebase):
            rw, rs = int(r["world_size"]), int(r["step"])
            nxt = int(rebase[j + 1]["world_size"]) if j + 1 < len(rebase) else W
            if nxt == rw:
                raise StateError(f"rebase[{j}].world_size", rw,
                                 "a re-cut to the same world size (a feed never writes one)")
            plan = self.plan(epoch, rebase[:j], rw)
            steps = len(plan) // rw
            if rs > steps:
                raise StateError(f"rebase[{j}].step", rs,
                                 f"past the end of the epoch ({steps} steps at "
                                 f"world_size={rw})")
            rest = set(np.concatenate(plan[rs * rw:]).tolist()) if plan[rs * rw:] else set()
            bad = [i for i in r["exclude"] if i >= n or i not in rest]
            if bad:
                raise StateError(f"rebase[{j}].exclude", bad[:8],
                                 "items that are not in the rest of the epoch")
        plan = self.plan(epoch, rebase, W)
        steps = len(plan) // W
        step = int(s0["step"])
        if step > steps:
            raise StateError("step", step, f"past the end of the epoch ({steps} steps at "
                                           f"world_size={W})")
        unit = (self.batch_size or 1) if self.mode == "fixed" else 1
        if int(s0["consumed"]) != step * W * unit:
            raise StateError("consumed", s0["consumed"],
                             f"not step * world_size * {unit} = {step * W * unit}")
        for s in states:
            if int(s["consumed"]) != int(s0["consumed"]):
                raise StateError("consumed", s["consumed"], "the ranks' states differ")
            share = self.rank_batches(plan, int(s["rank"]), W)
            total = sum(len(b) for b in share)
            # a batch borrows from past its own end: the borrowed items lie past the first
            # batch (a state's own count is vouched for by its check)
            room = 0 if step == 0 else total - (len(share[0]) if share else 0)
            if int(s["borrowed"]) > room:
                raise StateError("borrowed", s["borrowed"],
                                 f"more than the {room} items rank {int(s['rank'])} has past "
                                 f"step {step}")

    def resume(self, state, rank: int, world_size: int) -> dict:
        """The position on ``rank`` of ``world_size`` that resumes ``state`` (one rank's state,
        or a list of ranks' states; lists of lists are flattened). With the saving feed's
        ``world_size`` it must hold this rank's state; with another ``world_size`` every saving
        rank's state (module docstring: the resume rule). A state this order cannot have
        written (:meth:`check_state`) or a list that misses a rank it needs raises
        :class:`~avpipe.errors.StateError` (a ``ValueError``)."""
        states = self.check_state(state)
        s0 = states[0]
        old_w = int(s0["world_size"])
        by_rank = {int(s["rank"]): s for s in states}
        rebase = [dict(r, exclude=[int(i) for i in r["exclude"]]) for r in s0["rebase"]]
        if old_w == world_size:
            if rank not in by_rank:
                raise StateError(
                    "rank", sorted(by_rank),
                    f"no state of rank {rank} (world_size={old_w}) among the given "
                    "ranks; each rank resumes from its own state (it holds the rank's "
                    "replacement count)")
            return {"epoch": int(s0["epoch"]), "step": int(s0["step"]),
                    "borrowed": int(by_rank[rank]["borrowed"]), "rebase": rebase}
        missing = sorted(set(range(old_w)) - set(by_rank))
        if missing:
            raise StateError(
                "rank", sorted(by_rank),
                f"resuming world_size={old_w} with world_size={world_size} needs "
                f"every rank's state of world_size={old_w} (they hold the ranks' "
                f"replacement counts); missing rank(s) {missing}")
        exclude = sorted({i for s in by_rank.values() for i in self.borrowed_ids(s)})
        rebase.append({"world_size": old_w, "step": int(s0["step"]), "exclude": exclude})
        return {"epoch": int(s0["epoch"]), "step": 0, "borrowed": 0, "rebase": rebase}
