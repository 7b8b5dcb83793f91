"""The generic training feed: order, shards, prefetch, errors, resume, stats, torch / JAX faces.

A :class:`Feed` is an iterable of batches: each ``iter(feed)`` runs one epoch (a new shuffle),
the next ``iter`` the next epoch. A recipe (:mod:`avpipe.recipes`) supplies a :class:`Task`
(how items are decoded and how decoded items become a batch); the feed does the rest.

Order (:mod:`avpipe.pipeline._order`): epoch ``e``'s order is a keyed Feistel permutation of
the items (seed, epoch) cut into global batches; global batch ``k`` goes to step ``k // W``,
rank ``k % W``. Every rank gets the same number of batches (``len(feed)``); the remainder rule
is in :mod:`avpipe.pipeline._order`.

Errors (``on_error="skip"``): an item that fails (decode error, missing file, past the
``deadline``) is reported in the batch's ``errors`` and in ``feed.errors`` as ``(path,
message)`` (``feed.errors`` lists each pair once per feed: a file that fails every epoch, or
every view of a bad video, is listed once), and replaced by the *last not yet used item of the
same rank's epoch*, not by the next one:
the rank's items are its batches in order, and replacements are taken from the end of that
sequence backwards (its last item, then the one before, ...), never from the failing batch
itself or an earlier one, and go at the end of the batch; a replacement that fails is reported
and replaced the same way. So ranks stay disjoint, no good item is lost, batches stay full, and
only the rank's last batch(es) of the epoch run out of unused items. With ``max_duration`` the
same rule applies while the replacement fits the batch's budget (``count * longest <=
max_duration``); the first one that does not fit ends the refill. Then:

* training feeds (``pad="repeat"``: ``training=True`` / ``train=True``) fill the batch to its
  planned size with *repeats*: items of the rank's epoch already handed out (its earlier
  batches' items in order, then the replacements it borrowed), then, for a rank without enough
  good items of its own, the epoch's other items in plan order; a candidate already in the
  batch, failed before in this run, or (``max_duration``) not fitting the budget is passed over.
  A training batch is therefore never empty (unless no item of the epoch decodes at all) and
  ``len(feed)`` stays the same on every rank. The repeats depend only on the position, so a
  resume repeats the same items (as ``DistributedSampler`` pads with the epoch's first items).
* evaluation feeds (``pad="empty"``) never repeat: every item is in exactly one batch on one
  rank or in the errors, and the rank's last batches come out short, or empty where fewer good
  items are left than batches (``len(feed)`` is fixed before anything is decoded, the same on
  every rank; rank padding, below, can give empty batches as well). An empty batch is
  well-formed: every array field with 0 rows and its other axes (the recipes' shapes).

``on_error="raise"`` raises the item's error. Exact resume assumes an item that failed fails
again (a missing or corrupt file does; a deadline missed under load may not).

Across processes: a batch made in a torch DataLoader worker carries its ``errors``; unpickled in
the main process it records them into the feed ``torch_dataset`` was called on (the same feed
also gets the errors of the dataset's replica iterated in the main process, ``num_workers=0``).

Deadline: an item still decoding ``deadline`` seconds after a thread started it (the recipes'
default ``"auto"``: ``AVPIPE_FEED_DEADLINE``, 60 s; None or 0: no limit) fails as a
:class:`~avpipe.DecodeTimeoutError` naming the file: a read that never returns (a stalled
network mount, a device file with a media name) costs that item and the thread stuck in it.
The decoding threads are daemon threads that nothing joins (:mod:`._threads`): the stuck one is
replaced, and neither the rest of the epoch, the next epoch, ``close()``, a dropped feed nor
the interpreter's exit waits for it (a producer told to stop stops waiting for its items).

Resume: ``feed.state_dict()`` holds the position as ``(epoch, step)`` in one global order -
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

A state names what it belongs to and is checked on load (:meth:`Feed.check_state`): its
``version`` (:data:`STATE_VERSION`), the feed's arguments that decide the order (``n``,
``seed``, ``shuffle``, ``mode``, ``batch_size``, ``max_duration``), ``items`` (a hash of the item
list in order: each item's path as the manifest / list wrote it, offset, duration, label and eval
view, :func:`items_fingerprint`), every field's type and range (against the epoch's plan:
``step``, ``borrowed``, ``rebase``) and ``check``, a hash of the other fields. A state that
is not one the feed wrote - another item list (reordered, changed, longer), a field edited, of
another type, missing or added, ``None`` - raises :class:`avpipe.errors.StateError` (a
``ValueError``) naming the field and value, and the feed is left as it was.

Execution: a background thread decodes and collates batches ahead into a queue of ``prefetch``
batches; while the queue is full it holds one more, so at most ``prefetch + 1`` collated
batches are ahead of the consumer (decoding reads further ahead by :meth:`Task.decode_groups`'
rule). Dropping (or ``close()``-ing) the iterator mid-epoch stops and joins it. On a GPU the
producer works on its own CUDA stream and records an event after each batch; the consumer's
current stream (cupy's, or torch's with ``framework="torch"``) waits on it, so batches arrive
ordered on the consumer's stream without a host sync. When the consumer asks for the next
batch, the previous batch's arrays go back to the producer with an event recorded on the
consumer's stream; the producer's stream waits on it before they are dropped, so their memory
(from the producer stream's pool) is reused only after the consumer's work on them. A batch the
consumer keeps past the next ``next()`` and uses later: synchronize before dropping it.

Between epochs the producer does not stop: past an epoch's last batch it goes on with the next
epoch's first batches (the same bound: ``prefetch + 1``), and the next ``iter(feed)`` takes
them over when it starts where they start (the next epoch from its beginning, as after a full
epoch or ``set_epoch`` of that epoch), so an epoch starts without waiting for its first batches
to decode. Any other start (``set_epoch`` of another epoch, ``load_state_dict``) drops them; so
does ``feed.close()``, and the producer drops them itself when no ``iter`` takes them within
:data:`AHEAD_IDLE_S` seconds (a feed that is not iterated again holds no thread or memory).
"""

from __future__ import annotations

import atexit
import collections
import collections.abc
import concurrent.futures as cf
import contextlib
import functools
import hashlib
import json
import numbers
import os
import queue
import threading
import time
import weakref
from types import SimpleNamespace

import numpy as np

from .._validate import check_choice, check_on_error, pos_float, pos_int
from ..device import export, resolve_device
from ..errors import DecodeTimeoutError, StateError
from ..ops import random as _rnd
from . import _order
from ._threads import ProcessThreads

__all__ = ["Feed", "Task", "Batch", "dataset_class", "map_with_deadline", "resolve_deadline",
           "items_fingerprint", "STATE_VERSION"]  # + FeedDataset (lazy)

_STAGES = ("read", "decode", "gpu", "wait", "step")

# seconds the next epoch's first batches, decoded ahead, wait for an ``iter`` to take them
AHEAD_IDLE_S = 10.0


def _start(epoch):
    return {"epoch": int(epoch), "step": 0, "borrowed": 0, "rebase": []}


def _flat_states(state) -> list:
    """A state, or a list of states (or of lists of states): the states, in order."""
    if isinstance(state, (list, tuple)):
        return [s for x in state for s in _flat_states(x)]
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


# live feeds of this process by token: where the errors of batches that arrive from
# DataLoader workers go (Batch.__reduce__)
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class Batch(SimpleNamespace):
    """One batch: recipe fields (arrays and lists) plus ``ids`` (item indices in the feed's
    item list), ``epoch``, ``step`` and ``errors``: the ``(path, message)`` of each item skipped
    while this batch was made (failed items and failed replacements; each pair once).

    A batch pickled in a torch DataLoader worker and unpickled in the main process records its
    ``errors`` into the main process's feed (the one ``torch_dataset`` was called on), so that
    ``feed.errors`` there lists the workers' skipped items as their batches arrive."""

    __slots__ = ("_sink",)

    def __reduce__(self):
        return (_arrive, (getattr(self, "_sink", None), dict(self.__dict__)))


def _arrive(sink, fields):
    """Unpickling a :class:`Batch`: rebuilt, its errors recorded into the feed ``sink`` names
    when that feed lives in this process."""
    b = Batch(**fields)
    b._sink = sink
    errs = fields.get("errors")
    if sink is not None and errs:
        feed = _LIVE.get(sink)
        if feed is not None:
            feed._record_errors(errs)
    return b


class Task:
    """What a recipe plugs into :class:`Feed`.

    ``decode_groups(groups)``: for an iterator of groups (each a list of ``(id, item)``), yield
    per group a list with one decoded value or exception per item, in order (read ahead as you
    like; the default decodes each group with :meth:`decode_items`, one group ahead).
    ``decode_items(pairs)``: decode single items (used for replacements).
    ``epoch``: set by the feed to the epoch being decoded (for ``decode_one``'s draws).
    ``collate(values, pairs, epoch, step)``: decoded values -> a dict of batch fields (runs on
    the producer thread, inside the producer's CUDA stream on a GPU).
    ``array_fields``: the names of the fields that are arrays (moved to ``framework``).
    ``ahead(pairs)``: the random words ``decode_one`` will draw for these items, drawn at once
    on the submitting thread (:func:`avpipe.ops.random.draw_ahead`; None: no draws); each item
    then decodes inside :func:`avpipe.ops.random.drawn_from` of it.
    """

    array_fields: tuple = ()
    threads: int = 8
    _deadline: float | None = None

    @property
    def deadline(self) -> float | None:
        """Seconds one item may take on a decoding thread (None: no limit); set from a
        recipe's ``deadline`` option through :func:`resolve_deadline` (``"auto"``: the
        ``AVPIPE_FEED_DEADLINE`` setting)."""
        return self._deadline

    @deadline.setter
    def deadline(self, value) -> None:
        self._deadline = resolve_deadline(value)

    def __init__(self):
        self._pool = None
        self.timings = None  # set by the feed: a callable (stage, seconds)
        self._all_items = []  # set by the feed: every item of the feed
        self.epoch = 0  # set by the feed: the epoch being decoded (one at a time)

    def bind(self, items):
        """The feed hands the task its whole item list (for loaders that plan ahead)."""
        self._all_items = items

    def pool(self):
        """The decoding threads (:class:`._threads.ProcessThreads`: kept across epochs, a
        forked child's own)."""
        return self.threads_owner().get()

    def threads_owner(self) -> ProcessThreads:
        """The :class:`._threads.ProcessThreads` behind :meth:`pool`."""
        if self._pool is None:
            self._pool = ProcessThreads(self.threads, "avpipe-feed")
        return self._pool

    def start(self, fn, arg, pair) -> _Work:
        """``fn(*arg)`` on the decoding threads, for item ``pair`` (collected by
        :func:`_collect`, which gives up threads stuck past the deadline)."""
        return _Work(self.threads_owner(), fn, arg, pair)

    def decode_one(self, item_id, item):  # pragma: no cover - recipes override
        raise NotImplementedError

    def decode_items(self, pairs):
        return self._submit(pairs)()

    # groups decoded ahead of the one being collated: enough that the pool holds about two
    # items per thread (a batch's slowest item then leaves no thread idle), at least two and at
    # most MAX_AHEAD groups
    MAX_AHEAD = 8

    def decode_groups(self, groups):
        """The values of each group of ``(id, item)`` pairs, in order; later groups are
        decoding while one is handed out (bounded, see ``MAX_AHEAD``)."""
        groups = iter(groups)
        pending = collections.deque()  # (result function, group size)

        def fill():
            while len(pending) < self.MAX_AHEAD and (
                    len(pending) < 2 or sum(n for _, n in pending) < 2 * self.threads):
                g = next(groups, None)
                if g is None:
                    return
                pending.append((self._submit(g), len(g)))

        fill()
        while pending:
            fut, _ = pending.popleft()
            fill()
            yield fut()

    def ahead(self, pairs):
        """The draws of ``pairs``' ``decode_one`` made at once (a table for
        :func:`avpipe.ops.random.drawn_from`), or None (the default: no draws)."""
        return None

    def _submit(self, pairs):
        """Start decoding ``pairs`` on the pool; returns a function giving the values."""
        if any(getattr(it, "locator", None) is not None for _, it in pairs):
            from .sharded import read_ahead

            read_ahead([it for _, it in pairs], self)  # remote shard members: read ahead
            self._reads_planned = True
        table = self.ahead(pairs)
        fn = self.decode_one if table is None else functools.partial(_drawn, table,
                                                                        self.decode_one)
        futs = [self.start(fn, p, p) for p in pairs]

        def result():
            out, span = _collect(futs, self.deadline)
            if self.timings is not None and span is not None:
                self.timings("decode", span)
            return out

        return result

    def collate(self, values, pairs, epoch, step):  # pragma: no cover - recipes override
        raise NotImplementedError

    def close(self):
        if getattr(self, "_reads_planned", False):
            from .sharded import forget_reads

            forget_reads(self)
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def resolve_deadline(deadline) -> float | None:
    """A feed's ``deadline`` option in seconds: ``"auto"`` is the ``AVPIPE_FEED_DEADLINE``
    setting (default :data:`avpipe.settings.FEED_DEADLINE_S`); None or 0: no limit."""
    from .. import settings

    if isinstance(deadline, str) and deadline == "auto":
        return settings.feed_deadline()
    if deadline is None or (not isinstance(deadline, bool)
                            and isinstance(deadline, (int, float)) and deadline == 0):
        return None
    return pos_float("deadline", deadline, " of seconds, 'auto', or None / 0 for no limit")


# the stop event of the producer running on this thread (set around its decoding calls):
# _collect stops waiting for its items once the producer is told to stop
_producing = threading.local()


@contextlib.contextmanager
def _stopping(event):
    before = getattr(_producing, "stop", None)
    _producing.stop = event
    try:
        yield
    finally:
        _producing.stop = before


def _drawn(table, fn, *args):
    """``fn(*args)`` with the random words of ``table`` at hand (``Task.ahead``)."""
    with _rnd.drawn_from(table):
        return fn(*args)


def _timed(fn, pair):
    t0 = time.perf_counter()
    v = fn(*pair)
    return t0, time.perf_counter(), v


class _Work:
    """One job on a feed's decoding threads (``ProcessThreads``): ``fn(*arg)`` for ``pair``,
    with the threads' generation it was queued on."""

    __slots__ = ("threads", "fn", "arg", "pair", "gen", "fut")

    def __init__(self, threads, fn, arg, pair):
        self.threads, self.fn, self.arg, self.pair = threads, fn, arg, pair
        self.submit()

    def submit(self):
        self.gen = self.threads.gen
        self.fut = self.threads.get().submit(_timed, self.fn, self.arg)

    def requeue(self) -> bool:
        """Queued on threads given up since and not started: submit it to the current ones."""
        if self.gen != self.threads.gen and self.fut.cancel():
            self.submit()
            return True
        return False


def _collect(works, deadline):
    """Results of ``works`` (:class:`_Work`, or ``(future, pair)``) and the span (first start
    to last end, seconds); an item running longer than ``deadline`` seconds (from when a thread
    started it) becomes a :class:`~avpipe.DecodeTimeoutError`. Its thread is left to finish in
    the background and the threads it belongs to are given up (``ProcessThreads.retire``):
    later work goes to fresh threads, and work queued behind it is submitted to them again, so
    stuck decodes never take the feed's threads one by one until nothing runs. A producer
    told to stop (the feed closed or collected, the iterator dropped, interpreter exit) stops
    waiting at once: what is not done becomes a :class:`~avpipe.DecodeTimeoutError` too (the
    batch is never handed out) and queued work is cancelled."""
    out = [None] * len(works)
    started = {}
    t_first, t_last = None, None
    pending = set(range(len(works)))
    stop = getattr(_producing, "stop", None)

    def fut(i):
        w = works[i]
        return w.fut if isinstance(w, _Work) else w[0]

    while pending:
        if stop is not None and stop.is_set():
            for i in pending:
                fut(i).cancel()
                out[i] = DecodeTimeoutError(_name(works[i].pair if isinstance(works[i], _Work)
                                                  else works[i][1]), "the feed stopped")
            break
        for i in list(pending):
            w = works[i]
            f = fut(i)
            if f.done() and not f.cancelled():
                try:
                    t0, t1, out[i] = f.result()
                    t_first = t0 if t_first is None else min(t_first, t0)
                    t_last = t1 if t_last is None else max(t_last, t1)
                except Exception as e:  # noqa: BLE001 - reported per item
                    out[i] = e
                pending.discard(i)
            elif deadline is not None and f.running():
                started.setdefault(i, time.monotonic())
                if time.monotonic() - started[i] > deadline:
                    pair = w.pair if isinstance(w, _Work) else w[1]
                    out[i] = DecodeTimeoutError(
                        _name(pair), f"no result within the {deadline:g} s deadline")
                    pending.discard(i)
                    if isinstance(w, _Work) and w.gen == w.threads.gen:
                        w.threads.retire()
            elif isinstance(w, _Work) and w.requeue():
                pass
            elif f.cancelled():  # cancelled by its pool's shutdown (the owner closed)
                out[i] = cf.CancelledError(f"{_name(w.pair if isinstance(w, _Work) else w[1])}: "
                                           "cancelled (its threads were shut down)")
                pending.discard(i)
        if pending:
            cf.wait([fut(i) for i in pending],
                    timeout=0.05 if deadline or stop is not None else None,
                    return_when=cf.FIRST_COMPLETED)
    return out, (None if t_first is None else t_last - t_first)


def _name(pair):
    it = pair[1]
    return getattr(it, "path", str(it))


def map_with_deadline(pool, fn, pairs, deadline):
    """``fn(pair)`` for each pair on ``pool``: values or exceptions, in order (see Task)."""
    futs = [(pool.submit(_timed, lambda *p: fn(p), p), p) for p in pairs]
    return _collect(futs, deadline)[0]


# ---------------------------------------------------------------------------------------------
# the feed
# ---------------------------------------------------------------------------------------------


class Feed:
    """Batches of ``items`` decoded and collated by ``task``; see the module docstring.

    ``batch_size`` (items per batch) or ``max_duration`` (seconds of padded audio per batch,
    with ``durations``); ``seed``, ``shuffle``; ``rank`` / ``world_size``; ``prefetch`` batches
    decoded ahead (a background thread; 0: decode in the consumer's thread); ``on_error``:
    ``"skip"`` or ``"raise"``; ``device`` (None: the GPU when usable); ``framework``: None
    (numpy / cupy), ``"torch"`` or ``"jax"`` (DLPack, no copies); ``classes``: label names.
    ``errors`` starts with ``initial_errors`` (items left out up front) and lists each
    ``(path, message)`` once. ``pad``: where there are too few items (or batches) for every
    rank, ``"repeat"`` gives those ranks the epoch's first items again and fills batches short
    of good items with repeats (training), ``"empty"`` empty batches and no repeats
    (evaluation: every item exactly once across the ranks); the recipes choose by their
    ``training`` / ``train``. ``groups``: a group id per item (its shard) for an order that keeps
    each group's items together (:func:`._order.grouped_permutation`); None: one permutation
    of all items.
    """

    def __init__(self, items, task: Task, *, batch_size=None, max_duration=None,
                 durations=None, seed=0, shuffle=True, rank=0, world_size=1, prefetch=2,
                 on_error="skip", device=None, framework=None, bucket_window=100,
                 initial_errors=(), classes=None, spec=None, pad="repeat", groups=None):
        if (batch_size is None) == (max_duration is None):
            raise ValueError("give exactly one of batch_size and max_duration, got "
                             f"batch_size={batch_size!r}, max_duration={max_duration!r}")
        if batch_size is not None:
            batch_size = pos_int("batch_size", batch_size)
        if max_duration is not None:
            max_duration = pos_float("max_duration", max_duration, " of seconds")
        check_on_error(on_error)
        check_choice("framework", framework, (None, "numpy", "cupy", "torch", "jax"))
        check_choice("pad", pad, ("repeat", "empty"))
        self.pad = pad
        world_size, rank = int(world_size), int(rank)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, "
                             f"world_size={world_size}")
        self.items = list(items)
        if groups is not None:
            groups = np.asarray(groups, np.int64).reshape(-1)
            if len(groups) != len(self.items):
                raise ValueError(f"groups: one group id per item, got {len(groups)} for "
                                 f"{len(self.items)} items")
        self.groups = groups
        self.task = task
        self.batch_size = None if batch_size is None else int(batch_size)
        self.max_duration = None if max_duration is None else float(max_duration)
        self.durations = None if durations is None else np.asarray(durations, np.float64)
        if self.max_duration is not None and self.durations is None:
            raise ValueError("max_duration needs the items' durations")
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.rank, self.world_size = rank, world_size
        self.prefetch = int(prefetch)
        self.on_error = on_error
        self.device = resolve_device(device)
        self.framework = framework
        self.bucket_window = int(bucket_window)
        self.classes = classes
        self._lock = threading.Lock()
        self.errors: list = []
        self._error_seen: set = set()
        self._record_errors(initial_errors)
        # feed.errors of DataLoader workers' batches arrive here (_sink, Batch.__reduce__)
        self._token = os.urandom(12).hex()
        self._errors_to = None  # a replica's: its parent feed's token
        _LIVE[self._token] = self
        self._spec = spec
        self._pos = {"epoch": 0, "step": 0, "borrowed": 0, "rebase": []}
        self._pending = False  # a loaded state waits for the next iter
        self._next_epoch = 0
        self._plans: dict = {}
        self._active = None
        self._ahead = None  # the next epoch's producer, ahead (_Shared of a live producer)
        self._stream = None
        self._times = {k: collections.deque(maxlen=2048) for k in _STAGES}
        self._steps = collections.deque(maxlen=2048)  # (consumer work, wait) per batch
        task.timings = _Recorder(self)  # weak: no feed <-> task cycle
        task.bind(self.items)

    # -- plan ------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return "fixed" if self.batch_size is not None else "duration"

    def _base_plan(self, epoch: int, world_size: int) -> list:
        if self.groups is None:
            order = _order.permutation(len(self.items), seed=self.seed, epoch=epoch,
                                       shuffle=self.shuffle)
        else:
            order = _order.grouped_permutation(self.groups, seed=self.seed, epoch=epoch,
                                               shuffle=self.shuffle)
        if self.mode == "fixed":
            return _order.plan_fixed(order, self.batch_size, world_size, pad=self.pad)
        return _order.plan_buckets(order, self.durations, self.max_duration, world_size,
                                   seed=self.seed, epoch=epoch, window=self.bucket_window,
                                   shuffle=self.shuffle, pad=self.pad)

    def _recut(self, plan: list, old_w: int, step: int, exclude, new_w: int) -> list:
        ex = set(int(i) for i in exclude)
        rest = [np.array([i for i in b if int(i) not in ex], np.int64) for b in plan[step * old_w:]]
        if self.mode == "fixed":
            seq, seen = [], set()
            for b in rest:
                for i in b.tolist():
                    if i not in seen:  # wrap padding may repeat an item: once is enough
                        seen.add(i)
                        seq.append(i)
            return _order.plan_fixed(np.array(seq, np.int64), self.batch_size, new_w,
                                     pad=self.pad)
        return _order.make_divisible([b for b in rest if len(b)], new_w, pad=self.pad)

    def _plan(self, epoch: int, rebase, world_size=None) -> list:
        W = self.world_size if world_size is None else int(world_size)
        key = (epoch, repr(rebase), W)
        p = self._plans.get(key)
        if p is None:
            ws = [r["world_size"] for r in rebase] + [W]
            p = self._base_plan(epoch, ws[0])
            for j, r in enumerate(rebase):
                p = self._recut(p, r["world_size"], r["step"], r["exclude"], ws[j + 1])
            if len(self._plans) > 4:
                self._plans.clear()
            self._plans[key] = p
        return p

    def _lane(self, plan) -> list:
        W, r = self.world_size, self.rank
        return [plan[k] for k in range(r, len(plan), W)]

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank): of the epoch in progress
        (or loaded), else of the next one. With a fixed batch size it is the same every epoch;
        with ``max_duration`` it can differ by a batch or two between epochs."""
        p = self._pos
        if self.mode == "fixed" and not p["rebase"]:
            return _order.steps_fixed(len(self.items), self.batch_size, self.world_size)
        return len(self._plan(p["epoch"], p["rebase"])) // self.world_size

    @property
    def epoch(self) -> int:
        """The epoch of the current position (``state_dict()``'s)."""
        return self._pos["epoch"]

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter`` at the beginning of ``epoch``; where a state loaded by
        :meth:`load_state_dict` waits for the next ``iter`` in that same epoch, keep it (the
        ``DistributedSampler`` habit, ``set_epoch(e)`` before every epoch, resumed one
        included, would otherwise start the resumed epoch over)."""
        if self._pending and self._pos["epoch"] == int(epoch):
            return
        self._pos = _start(epoch)
        self._next_epoch = int(epoch)
        self._pending = False

    # -- resume ----------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        return {"n": len(self.items), "seed": self.seed, "shuffle": self.shuffle,
                "order": "global" if self.groups is None else "grouped",
                "mode": self.mode, "batch_size": self.batch_size,
                "max_duration": self.max_duration, "items": self.items_fingerprint()}

    def items_fingerprint(self) -> str:
        """A hash of the item list, in order (:func:`items_fingerprint`; computed once)."""
        fp = getattr(self, "_items_fp", None)
        if fp is None:
            fp = self._items_fp = items_fingerprint(self.items)
        return fp

    def state_dict(self) -> dict:
        """JSON-serializable position (module docstring: the resume rule)."""
        p = self._pos
        W = self.world_size
        unit = (self.batch_size or 1) if self.mode == "fixed" else 1
        st = {
            "version": STATE_VERSION, **self._fingerprint(),
            "epoch": p["epoch"], "step": p["step"], "borrowed": p["borrowed"],
            "rebase": [dict(r, exclude=[int(i) for i in r["exclude"]]) for r in p["rebase"]],
            "rank": self.rank, "world_size": W,
            "consumed": p["step"] * W * unit, "check": "",
        }
        st["check"] = state_check(st)
        return st

    def _borrowed_ids(self, state) -> list:
        """The replacement items the state's rank took from the end of its share."""
        b = int(state["borrowed"])
        if b == 0:
            return []
        W, r = int(state["world_size"]), int(state["rank"])
        plan = self._plan(state["epoch"], state["rebase"], W)
        lane = [plan[k] for k in range(r, len(plan), W)]
        flat = np.concatenate(lane) if lane else np.zeros(0, np.int64)
        return flat[len(flat) - b:].tolist()

    def check_state(self, state) -> list:
        """The states of ``state`` (one rank's state, or a list of ranks' states), checked to be
        ones this feed (a feed built with the same arguments over the same item list, at any
        rank and world size) can have written: every field present and of its type, no other
        field, this ``STATE_VERSION``, the fingerprint (``n``, ``seed``, ``shuffle``, ``order``,
        ``mode``, ``batch_size``, ``max_duration``, ``items``) this feed's, ``rank`` /
        ``world_size`` / ``epoch`` / ``step`` / ``borrowed`` / ``consumed`` / ``rebase``
        within what the epoch's plan allows, and a list's states at one position, one per
        rank. Anything else raises :class:`~avpipe.errors.StateError` naming the field and
        value. Returns the states (a list of dicts)."""
        states = [_plain(s) for s in _flat_states(_plain(state))]
        if not states:
            raise StateError("state", state, "an empty list of states")
        fp = self._fingerprint()
        for s in states:
            _check_fields(s, fp, len(self.items))
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
        n = len(self.items)
        for j, r in enumerate(rebase):
            rw, rs = int(r["world_size"]), int(r["step"])
            nxt = int(rebase[j + 1]["world_size"]) if j + 1 < len(rebase) else W
            if nxt == rw:
                raise StateError(f"rebase[{j}].world_size", rw,
                                 "a re-cut to the same world size (a feed never writes one)")
            plan = self._plan(epoch, rebase[:j], rw)
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
        plan = self._plan(epoch, rebase, W)
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
            lane = [plan[k] for k in range(int(s["rank"]), len(plan), W)]
            total = sum(len(b) for b in lane)
            # a batch borrows from past its own end: the borrowed items lie past the first
            # batch (a state's own count is vouched for by its check)
            room = 0 if step == 0 else total - (len(lane[0]) if lane else 0)
            if int(s["borrowed"]) > room:
                raise StateError("borrowed", s["borrowed"],
                                 f"more than the {room} items rank {int(s['rank'])} has past "
                                 f"step {step}")

    def load_state_dict(self, state) -> None:
        """Resume at ``state``: one rank's state, or a list of ranks' states (lists of lists are
        flattened). With the saving feed's ``world_size`` it must hold this rank's state; with
        another ``world_size`` every saving rank's state (module docstring: the resume rule).
        A state this feed cannot have written (:meth:`check_state`) or a list that misses a
        rank it needs raises :class:`~avpipe.errors.StateError` (a ``ValueError``)."""
        states = self.check_state(state)
        s0 = states[0]
        old_w = int(s0["world_size"])
        by_rank = {int(s["rank"]): s for s in states}
        rebase = [dict(r, exclude=[int(i) for i in r["exclude"]]) for r in s0["rebase"]]
        if old_w == self.world_size:
            if self.rank not in by_rank:
                raise StateError(
                    "rank", sorted(by_rank),
                    f"no state of rank {self.rank} (world_size={old_w}) among the given "
                    "ranks; each rank resumes from its own state (it holds the rank's "
                    "replacement count)")
            self._pos = {"epoch": int(s0["epoch"]), "step": int(s0["step"]),
                         "borrowed": int(by_rank[self.rank]["borrowed"]), "rebase": rebase}
        else:
            missing = sorted(set(range(old_w)) - set(by_rank))
            if missing:
                raise StateError(
                    "rank", sorted(by_rank),
                    f"resuming world_size={old_w} with world_size={self.world_size} needs "
                    f"every rank's state of world_size={old_w} (they hold the ranks' "
                    f"replacement counts); missing rank(s) {missing}")
            exclude = sorted({i for s in by_rank.values() for i in self._borrowed_ids(s)})
            rebase.append({"world_size": old_w, "step": int(s0["step"]), "exclude": exclude})
            self._pos = {"epoch": int(s0["epoch"]), "step": 0, "borrowed": 0, "rebase": rebase}
        self._pending = True

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self):
        if self._active is not None:
            it = self._active()
            if it is not None:
                it.close()
        if not self._pending:
            self._pos = _start(self._next_epoch)
        self._pending = False
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead.adopt(self._pos):
            self._discard(ahead)
            ahead = None
        it = _EpochIterator(self, dict(self._pos), ahead=ahead)
        self._active = weakref.ref(it)
        return it

    def _drop_ahead(self):
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._discard(ahead)

    def _discard(self, ahead):
        """Stop a parked producer; the batches the consumer had are dropped after the
        producer stream waits on the consumer's events (as the producer would have)."""
        ahead.drop()
        stream = _stream_of(self)
        with _on(self.device, stream):
            _retire(ahead, stream)

    def _advance(self, pos, finished):
        if finished:
            self._pos = _start(pos["epoch"] + 1)
            self._next_epoch = pos["epoch"] + 1
        else:
            self._pos = pos

    def _abandon(self):
        """An epoch's iterator went away mid-epoch: ``state_dict()`` still says where the
        consumer got to (resume a new feed from there), and the next ``iter`` of this feed
        starts the next epoch."""
        self._next_epoch = self._pos["epoch"] + 1

    def close(self):
        if self._active is not None:
            it = self._active()
            if it is not None:
                it.close()
        self._drop_ahead()
        self.task.close()

    # -- errors ------------------------------------------------------------------------------
    def _record_errors(self, pairs) -> None:
        """Add ``(path, message)`` pairs to ``errors``, each pair once per feed (an item that
        fails again in a later epoch, or another view of one bad video, is not listed again)."""
        with self._lock:
            for path, msg in pairs:
                key = (path, msg)
                if key not in self._error_seen:
                    self._error_seen.add(key)
                    self.errors.append(key)

    def _sink(self) -> str:
        """The token of the feed whose ``errors`` this feed's skipped items also go to (its own,
        or for a replica of a torch dataset its parent's)."""
        return self._errors_to or self._token

    # -- telemetry ---------------------------------------------------------------------------
    def _record(self, stage, seconds):
        self._times[stage].append(float(seconds))

    def _record_step(self, work, wait):
        self._times["step"].append(float(work + wait))
        self._steps.append((float(work), float(wait)))

    def stats(self) -> dict:
        """Per-stage seconds per batch (``read``, ``decode``, ``gpu``: producer side, ``gpu``
        timed by CUDA events on a GPU; ``wait``: the consumer blocked in ``next``; ``step``:
        from one batch handed over to the next) at p50 / p99 over the last 2048 batches;
        ``wait_fraction``: the consumer's time spent waiting for input (the first batch of an
        epoch left out); ``input_bound``: ``wait_fraction > 0.1``; ``verdict``: in words."""
        out = {}
        for k, d in self._times.items():
            a = np.array(d, np.float64)
            out[k] = ({"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
                       "mean": float(a.mean()), "n": int(a.size)} if a.size else
                      {"p50": None, "p99": None, "mean": None, "n": 0})
        st = np.array(self._steps, np.float64).reshape(-1, 2)
        tot = float(st.sum()) if st.size else 0.0
        frac = float(st[:, 1].sum() / tot) if tot > 0 else 0.0
        out["wait_fraction"] = frac
        out["input_bound"] = frac > 0.1
        out["verdict"] = (
            f"the consumer waits on input {100 * frac:.0f}% of its time: input-bound "
            "(decode / GPU ops are slower than the model step)" if frac > 0.1 else
            f"the consumer waits on input {100 * frac:.0f}% of its time: not input-bound")
        return out

    # -- faces -----------------------------------------------------------------------------
    def replica(self, *, rank: int, world_size: int, **overrides):
        """A feed with the same arguments for another (rank, world_size)."""
        if self._spec is None:
            raise RuntimeError("this feed was not built by a recipe: no replica")
        fn, kw = self._spec
        return fn(**{**kw, **overrides, "rank": rank, "world_size": world_size})

    def _worker_replica(self, *, rank: int, world_size: int, **overrides):
        """A replica for a torch dataset's process: its skipped items also go to this feed's
        ``errors`` (directly in this process; from a worker, with the batches)."""
        f = self.replica(rank=rank, world_size=world_size, **overrides)
        f._errors_to = self._sink()
        return f

    def torch_dataset(self, *, num_workers: int = 0):
        """A torch ``IterableDataset`` for ``DataLoader(ds, batch_size=None, num_workers=N,
        multiprocessing_context="forkserver")`` ("spawn" works too; both need the usual
        ``if __name__ == "__main__":`` guard in a script). Torch's default on Linux forks the
        calling process, and a fork copies the locks its other threads hold (a feed's
        producer, BLAS threads): such a worker can hang.

        ``num_workers``: the DataLoader's ``N``, for ``len(ds)``. N workers split the epoch as
        ``N * world_size`` ranks, which can give a few more batches than ``len(feed)`` where
        the items do not divide evenly; with it ``len(ds)`` (and the DataLoader's length) is
        the number of batches the workers yield."""
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        ds = dataset_class()(self)
        ds._num_workers = num_workers
        return ds

    def __getstate__(self):
        if self._spec is None:
            raise TypeError("only feeds built by a recipe can be pickled")
        return {"spec": self._spec, "pos": self._pos, "pending": self._pending,
                "next_epoch": self._next_epoch, "sink": self._sink()}

    def __setstate__(self, st):
        fn, kw = st["spec"]
        other = fn(**kw)
        self.__dict__.update(other.__dict__)
        self.task.timings = _Recorder(self)
        _LIVE[self._token] = self
        self._pos, self._pending = st["pos"], st["pending"]
        self._next_epoch = st["next_epoch"]
        # (in the pickling process itself this is the original feed's token: its errors
        # are recorded there once, the pairs being deduplicated)
        self._errors_to = st.get("sink")


class _Recorder:
    """``task.timings``: records into the feed's stats without keeping the feed alive."""

    def __init__(self, feed):
        self._ref = weakref.ref(feed)

    def __call__(self, stage, seconds):
        feed = self._ref()
        if feed is not None:
            feed._record(stage, seconds)


# ---------------------------------------------------------------------------------------------
# one epoch: producer thread + consumer iterator
# ---------------------------------------------------------------------------------------------


class _Shared:
    """What a producer thread and its consumer share (one per producer thread, kept across the
    epochs it runs ahead into)."""

    def __init__(self):
        self.stop = threading.Event()
        # batches handed over, each with an event recorded on the consumer's stream when the
        # next batch was asked for: the producer's stream waits on it before dropping them
        self.retire = collections.deque()
        self.lock = threading.Lock()
        self.ahead = None  # (start position, monotonic time) while waiting to be taken over
        self.q = None
        self.thread = None
        self.gone = None  # finalizer of the feed while parked (watch)

    def park(self, pos):
        """The consumer finished an epoch: the producer's next epoch (from ``pos``) waits for
        an ``iter`` to take it over. False if the producer has stopped."""
        with self.lock:
            if self.stop.is_set() or self.thread is None or not self.thread.is_alive():
                return False
            self.ahead = (dict(pos), time.monotonic())
            return True

    def watch(self, feed):
        """Stop the parked producer when ``feed`` is collected."""
        self.gone = weakref.finalize(feed, self.stop.set)

    def adopt(self, pos) -> bool:
        """Take the parked producer over for an epoch starting at ``pos`` (False: it does not
        start there, or it has stopped)."""
        with self.lock:
            if self.ahead is None or self.ahead[0] != pos or self.stop.is_set() \
                    or not self.thread.is_alive():
                return False
            self.ahead = None
            if self.gone is not None:
                self.gone.detach()
                self.gone = None
            return True

    def expired(self) -> bool:
        """Producer side: parked for longer than AHEAD_IDLE_S (then it stops itself)."""
        with self.lock:
            if self.ahead is not None and time.monotonic() - self.ahead[1] > AHEAD_IDLE_S:
                self.stop.set()
            return self.stop.is_set()

    def drop(self):
        _stop(self, self.q, self.thread)


def _stream_of(feed):
    """The feed's producer stream (one per feed: its memory pool arena is reused)."""
    dev = feed.device
    if not dev.is_cuda:
        return None
    if feed._stream is None:
        import cupy

        with cupy.cuda.Device(dev.index):
            feed._stream = cupy.cuda.Stream(non_blocking=True)
    return feed._stream


@contextlib.contextmanager
def _on(dev, stream):
    """The producer's device and stream for the block (nothing on the CPU)."""
    if stream is None:
        yield
        return
    import cupy

    with cupy.cuda.Device(dev.index), stream:
        yield


def _retire(shared, stream):
    """Drop the batches the consumer is done with, after the producer stream waits on the
    consumer's event: memory they free is reused only by work ordered after the consumer's."""
    while shared.retire:
        try:
            held, ev = shared.retire.popleft()
        except IndexError:
            break
        if stream is not None and ev is not None:
            stream.wait_event(ev)
        del held


def _produce(feed, pos, q, shared):
    """Producer: decode, handle errors, collate; put ("batch", batch, pos_after, event,
    gpu_timing), ("end", pos) or ("error", exc) into ``q`` (bounded: blocks when full). Past an
    epoch's end it goes on with the next epoch (the module docstring: between epochs)."""
    def put(msg):
        while not shared.expired():
            try:
                q.put(msg, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    while True:
        gen = _batches(feed, pos, shared)
        ended = None
        try:
            for msg in gen:
                if not put(msg):
                    return
                if msg[0] == "end":
                    ended = msg[1]
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put(("error", e))
            return
        finally:
            gen.close()
        if ended is None or shared.stop.is_set():
            return
        pos = _start(ended["epoch"] + 1)


def _batches(feed, pos, shared):
    """The epoch's batches for this rank from ``pos`` (generator; runs on the producer)."""
    epoch, rebase = pos["epoch"], pos["rebase"]
    plan = feed._plan(epoch, rebase)
    lane = feed._lane(plan)
    steps = len(lane)
    flat = np.concatenate(lane) if lane else np.zeros(0, np.int64)
    starts = np.cumsum([0] + [len(b) for b in lane])
    state = {"borrowed": pos["borrowed"]}
    refill = feed.on_error == "skip"
    durs = feed.durations if feed.mode == "duration" else None
    items = feed.items
    task = feed.task
    dev = feed.device
    stream = _stream_of(feed)
    task.epoch = epoch  # decode_one's random draws are keyed by it
    known_bad = set()  # items that failed in this run of the epoch (not tried again as repeats)

    def live(s):
        """Step s's items not yet taken as replacements, in order. Replacements come from the
        end of the lane, so the live items of a step are always a prefix of its items."""
        end = min(int(starts[s + 1]), len(flat) - state["borrowed"])
        return [int(i) for i in flat[int(starts[s]) : max(end, int(starts[s]))]]

    def groups():
        for s in range(pos["step"], steps):
            yield [(i, items[i]) for i in live(s)]

    decoded = task.decode_groups(groups())
    try:
        for s in range(pos["step"], steps):
            if shared.stop.is_set():
                return
            # GPU decoders' work goes on the producer stream
            with _on(dev, stream), _stopping(shared.stop):
                group_vals = next(decoded)
            # the group was pulled before later replacements were taken: keep its live prefix
            planned = live(s)
            good_ids, good_vals = [], []
            failed = []  # (path, message): reported when the consumer takes this batch
            for i, v in zip(planned, group_vals):
                if isinstance(v, BaseException):
                    known_bad.add(i)
                    _fail(feed, i, v, failed)
                else:
                    good_ids.append(i)
                    good_vals.append(v)
            want = len(planned)
            last_of_batch = int(starts[s + 1]) - 1
            while refill and len(good_ids) < want:
                # replacements: this rank's last unused items, taken from the end one by one
                cand = []
                while len(cand) < want - len(good_ids):
                    j = len(flat) - state["borrowed"] - 1
                    if j <= last_of_batch:
                        break
                    if durs is not None:  # max_duration: only a replacement that fits
                        now = good_ids + [c for c, _ in cand] + [int(flat[j])]
                        if len(now) * float(durs[now].max()) > feed.max_duration:
                            break
                    state["borrowed"] += 1
                    cand.append((int(flat[j]), items[int(flat[j])]))
                if not cand:
                    break
                with _on(dev, stream), _stopping(shared.stop):
                    for i, v in _decode_good(feed, cand, known_bad, failed):
                        good_ids.append(i)
                        good_vals.append(v)
            full = int(starts[s + 1] - starts[s])  # the batch's size in the plan
            if refill and feed.pad == "repeat" and len(good_ids) < full:
                # training: no unused item left to replace the failed (or borrowed) ones: the
                # batch is filled with repeats of the epoch's items, never left short or empty
                for i, v in _repeat_fill(feed, plan, flat, int(starts[s]), state["borrowed"],
                                         good_ids, full, failed, known_bad, dev, stream):
                    good_ids.append(i)
                    good_vals.append(v)
            pairs = [(i, items[i]) for i in good_ids]
            if stream is not None:
                import cupy

                with cupy.cuda.Device(dev.index), stream:
                    _retire(shared, stream)
                    g0 = cupy.cuda.Event()
                    g0.record(stream)
                    fields = task.collate(good_vals, pairs, epoch, s)
                    g1 = cupy.cuda.Event()
                    g1.record(stream)
                event, gpu_timing = g1, (g0, g1)
            else:
                t1 = time.perf_counter()
                fields = task.collate(good_vals, pairs, epoch, s)
                event, gpu_timing = None, None
                feed._record("gpu", time.perf_counter() - t1)
            batch = Batch(**fields, ids=np.array(good_ids, np.int64), epoch=epoch, step=s,
                          errors=list(dict.fromkeys(failed)))
            batch._sink = feed._sink()
            after = {"epoch": epoch, "step": s + 1, "borrowed": state["borrowed"],
                     "rebase": rebase}
            yield ("batch", batch, after, event, gpu_timing, failed)
        yield ("end", {"epoch": epoch})
    finally:
        close = getattr(decoded, "close", None)
        if close is not None:
            close()


def _repeat_candidates(plan, flat, start, borrowed):
    """Training repeats for a batch of a rank's lane ``flat`` that starts at ``start``: the
    rank's items of the epoch already handed out (its earlier batches' items in order, then
    the replacements it borrowed from its end), then every item of the epoch's plan in order
    (other ranks' items, for a rank with too few good items of its own)."""
    yield from flat[:start].tolist()
    if borrowed:
        yield from flat[len(flat) - borrowed:].tolist()
    for b in plan:
        yield from b.tolist()


def _repeat_fill(feed, plan, flat, start, borrowed, good_ids, want, failed, known_bad, dev,
                 stream):
    """``(id, value)`` of the repeats that fill a training batch to ``want`` items (the
    module docstring's rule). The candidates (:func:`_repeat_candidates`) depend only on the
    position (``start``, ``borrowed``), so a resumed feed repeats the same items. A candidate
    already in the batch, known to fail in this run, or (``max_duration``) not fitting the
    batch's budget is passed over; one that fails is reported and passed over."""
    durs = feed.durations if feed.mode == "duration" else None
    have = set(good_ids)
    ids = list(good_ids)
    out = []
    cands = _repeat_candidates(plan, flat, start, borrowed)
    while len(ids) < want:
        take = []
        for i in cands:
            i = int(i)
            if i in have or i in known_bad:
                continue
            if durs is not None:
                now = ids + [c for c, _ in take] + [i]
                if len(now) * float(durs[now].max()) > feed.max_duration:
                    continue
            have.add(i)
            take.append((i, feed.items[i]))
            if len(ids) + len(take) >= want:
                break
        if not take:
            break  # no good item of the epoch left to repeat (every one failed)
        with _on(dev, stream):
            for i, v in _decode_good(feed, take, known_bad, failed):
                ids.append(i)
                out.append((i, v))
    return out


def _decode_good(feed, pairs, known_bad, failed) -> list:
    """``(id, value)`` of the ``pairs`` that decode (``task.decode_items``); each one that
    fails is noted in ``known_bad`` and reported through :func:`_fail`, in order."""
    good = []
    for (i, _), v in zip(pairs, feed.task.decode_items(pairs)):
        if isinstance(v, BaseException):
            known_bad.add(i)
            _fail(feed, i, v, failed)
        else:
            good.append((i, v))
    return good


def _fail(feed, i, exc, failed):
    """Item ``i`` failed: raise (``on_error="raise"``) or note it in ``failed``, the batch's
    list, which goes into ``feed.errors`` when the consumer takes the batch (so a producer
    running ahead into the next epoch reports nothing before that epoch is iterated)."""
    it = feed.items[i]
    path = getattr(it, "path", str(it))
    if feed.on_error == "raise":
        raise exc
    failed.append((path, f"{type(exc).__name__}: {exc}"))


class _EpochIterator:
    """One epoch's batches; closing (or dropping) it stops and joins the producer thread."""

    def __init__(self, feed: Feed, pos: dict, ahead: _Shared | None = None):
        self._feed = feed
        self._done = False
        self._last = None
        self._pending_gpu = collections.deque()
        self._held = None  # the last batch's device arrays (see _Shared.retire)
        self._sync = feed.prefetch <= 0
        if ahead is not None:  # the producer already running this epoch (taken over)
            self._shared, self._gen = ahead, None
            self._q, self._thread = ahead.q, ahead.thread
        elif self._sync:
            self._shared = _Shared()
            self._gen = _batches(feed, pos, self._shared)
            self._thread = None
            self._q = None
        else:
            self._shared = _Shared()
            self._gen = None
            self._q = queue.Queue(maxsize=feed.prefetch)
            # the producer holds the feed weakly: a feed dropped while its producer is parked
            # between epochs is collected, and its finalizer stops the producer
            self._thread = threading.Thread(
                target=_produce, args=(weakref.proxy(feed), pos, self._q, self._shared),
                name="avpipe-feed-producer", daemon=True)
            self._shared.q, self._shared.thread = self._q, self._thread
            _track_producer(self._shared)
            self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._shared, self._q, self._thread)

    def __iter__(self):
        return self

    def _get(self):
        if self._sync:
            try:
                return next(self._gen)
            except BaseException as e:  # noqa: BLE001
                return ("error", e)
        while True:
            try:
                return self._q.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive() and self._q.empty():
                    return ("error", RuntimeError("the feed's producer thread ended"))

    def __next__(self):
        if self._done:
            raise StopIteration
        feed = self._feed
        t_now = time.perf_counter()
        self._consumer_event()
        msg = self._get()
        t_got = time.perf_counter()
        if msg[0] == "batch":
            feed._record("wait", t_got - t_now)
            if self._last is not None:  # the consumer's whole step: its work + this wait
                feed._record_step(t_now - self._last, t_got - t_now)
            self._last = t_got
        kind = msg[0]
        if kind == "error":
            self._finish()
            raise msg[1]
        if kind == "end":
            feed._advance(msg[1], finished=True)
            if self._thread is not None and self._shared.park(feed._pos):
                # the producer goes on into the next epoch: the next iter takes it over
                self._finalizer.detach()
                self._done = True
                feed._drop_ahead()
                feed._ahead = self._shared
                self._shared.watch(feed)
                raise StopIteration
            self._finish()
            raise StopIteration
        _, batch, after, event, gpu_timing, failed = msg
        if failed:
            feed._record_errors(failed)
            if feed._errors_to is not None:  # a replica: its parent's too, if in this process
                parent = _LIVE.get(feed._errors_to)
                if parent is not None and parent is not feed:
                    parent._record_errors(failed)
        if event is not None:
            self._held = [getattr(batch, k, None) for k in feed.task.array_fields]
            self._wait_on(event)
            self._pending_gpu.append(gpu_timing)
            self._drain_gpu_timing()
        feed._advance(after, finished=False)
        return self._export(batch)

    def _consumer_event(self):
        """Hand the previous batch's arrays back with an event on the consumer's stream."""
        dev = self._feed.device
        if not dev.is_cuda or self._held is None:
            return
        import cupy

        with cupy.cuda.Device(dev.index):
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(_consumer_stream(self._feed.framework, dev))
        self._shared.retire.append((self._held, ev))
        self._held = None

    def _wait_on(self, event):
        dev = self._feed.device
        with dev.activate():
            _consumer_stream(self._feed.framework, dev).wait_event(event)

    def _drain_gpu_timing(self):
        while self._pending_gpu and self._pending_gpu[0][1].done:
            g0, g1 = self._pending_gpu.popleft()
            import cupy

            self._feed._record("gpu", cupy.cuda.get_elapsed_time(g0, g1) / 1000.0)

    def _export(self, batch):
        fw = self._feed.framework
        if fw is None:
            return batch
        for k in self._feed.task.array_fields:
            v = getattr(batch, k, None)
            if v is not None:
                setattr(batch, k, export(v, fw))
        batch.ids = export(batch.ids, fw) if fw in ("torch", "jax") else batch.ids
        return batch

    def _finish(self):
        self._done = True
        self._finalizer()
        if self._gen is not None:
            self._gen.close()
        if self._feed.device.is_cuda and (self._held is not None or self._shared.retire):
            # the producer has stopped: drop the held batches once the consumer is done
            try:
                with self._feed.device.activate():
                    _consumer_stream(self._feed.framework, self._feed.device).synchronize()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
            self._held = None
            self._shared.retire.clear()

    def close(self):
        """Stop the producer and join it (mid-epoch: the next ``iter`` starts the next epoch)."""
        if not self._done:
            self._finish()
            self._feed._abandon()

    def __del__(self):
        try:
            if not self._done:
                self._finish()
                self._feed._abandon()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _consumer_stream(framework, dev):
    """The consumer's current stream on ``dev``: torch's with ``framework="torch"``, else
    cupy's (call inside ``dev.activate()``)."""
    import cupy

    if framework == "torch":
        import torch

        ptr = torch.cuda.current_stream(dev.index).cuda_stream
        return cupy.cuda.ExternalStream(ptr, dev.index)
    return cupy.cuda.get_current_stream()


# Producer threads are daemons (a feed left unfinished must not keep the process alive), but a
# daemon thread inside a native call (a decoder, a CUDA library, DALI) when the interpreter
# finalizes is ended by pthread_exit as it takes the GIL back, and a C++ frame it unwinds
# through calls std::terminate: the process aborts at exit ("terminate called without an active
# exception", seen on the CPU with the image and the audio feeds). So the producers still
# running are stopped and joined by an atexit hook, before the interpreter finalizes.
_PRODUCERS: weakref.WeakSet = weakref.WeakSet()
_EXIT_HOOK = {"registered": False}
EXIT_WAIT_S = 30.0  # at most this long, over all producers, at interpreter exit


def _track_producer(shared) -> None:
    _PRODUCERS.add(shared)
    if not _EXIT_HOOK["registered"]:
        _EXIT_HOOK["registered"] = True
        atexit.register(_stop_producers)


def _stop_producers(wait_s: float | None = None) -> None:
    """Stop every producer thread still running and join it (the atexit hook above)."""
    deadline = time.monotonic() + (EXIT_WAIT_S if wait_s is None else wait_s)
    live = list(_PRODUCERS)
    for shared in live:
        shared.stop.set()
    for shared in live:
        _stop(shared, shared.q, shared.thread, timeout=max(0.0, deadline - time.monotonic()))


def _stop(shared, q, thread, timeout=30.0):
    shared.stop.set()
    if q is not None:
        try:
            while True:
                q.get_nowait()
        except queue.Empty:
            pass
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=timeout)


# ---------------------------------------------------------------------------------------------
# torch face
# ---------------------------------------------------------------------------------------------


def _iterable_dataset_base():
    try:
        from torch.utils.data import IterableDataset

        return IterableDataset
    except ImportError:  # pragma: no cover - no torch
        return object


class _FeedDataset:
    """A torch ``IterableDataset`` over a feed, for ``DataLoader(ds, batch_size=None,
    num_workers=N)``. In worker ``w`` of ``N`` it iterates a replica of the feed for rank
    ``rank * N + w`` of ``world_size * N``: the workers split the same global permutation
    (disjoint, equal counts), and the DataLoader's in-order round robin yields the global
    batches in the same order as ``N * world_size`` ranks would. ``len(ds)``: batches per
    epoch over all workers of this rank.

    Epochs: each process that iterates the dataset (a worker, or the main process with
    ``num_workers=0``) keeps its replica on its copy of the dataset, and each ``iter`` runs
    the replica's next epoch (the feed's own advance). ``set_epoch`` / ``load_state_dict``
    apply once, to the next ``iter`` of each process's replica, and reach a worker only when
    the worker starts (it copies the dataset then). Persistent workers need no ``set_epoch``:
    they start where the main process's dataset says (epoch 0, or what ``set_epoch`` /
    ``load_state_dict`` gave before their first epoch) and go on with the next epochs. Workers
    started anew each epoch (not persistent) copy the main process's dataset each epoch: call
    ``set_epoch(e)`` before each epoch (as with torch's ``DistributedSampler``), else every
    epoch repeats the first. ``load_state_dict(state)`` before building the DataLoader resumes
    from a feed state (rebased for the workers). Start the workers with
    ``multiprocessing_context="forkserver"`` (or "spawn"), not by forking the calling process
    (:meth:`Feed.torch_dataset`)."""

    def __init__(self, feed: Feed):
        self.feed = feed
        self._epoch = None
        self._state = None
        self._order = 0  # counts set_epoch / load_state_dict calls
        # this process's replica: ((pid, worker id, workers), the _order it applied, feed)
        self._replica = None

    def _workers(self):
        import torch.utils.data as tud

        info = tud.get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def set_epoch(self, epoch: int):
        st = _flat_states(self._state)[0] if self._state is not None else None
        if st is not None and int(st.get("epoch", -1)) == int(epoch):
            return  # a loaded state in that epoch: kept (Feed.set_epoch)
        self._epoch = int(epoch)
        self._state = None
        self._order += 1

    def load_state_dict(self, state):
        """Resume from a feed state (checked here: :meth:`Feed.check_state`; a bad one raises
        :class:`~avpipe.errors.StateError` before any worker starts)."""
        self.feed.check_state(state)
        self._state = state
        self._order += 1

    def state_dict(self, batches_consumed: int, num_workers: int) -> list:
        """The feed state after ``batches_consumed`` batches of this epoch from a DataLoader
        with ``num_workers`` workers: a list of the workers' states (ranks ``rank * N + w`` of
        ``world_size * N``, as ``load_state_dict`` of a feed or of this dataset takes them);
        exact at multiples of ``num_workers`` (the round robin's full rounds) and when no item
        was replaced (the workers' replacement counts stay in the workers: 0 here)."""
        f = self.feed
        nw = max(1, int(num_workers))
        base = f.state_dict()
        W = f.world_size * nw
        step = int(batches_consumed) // nw
        unit = (f.batch_size or 1) if f.mode == "fixed" else 1
        out = [dict(base, world_size=W, rank=f.rank * nw + w, step=step, borrowed=0,
                    consumed=step * W * unit,
                    rebase=[dict(r, exclude=list(r["exclude"])) for r in base["rebase"]])
               for w in range(nw)]
        for st in out:
            st["check"] = state_check(st)
        return out

    _num_workers = 0  # the DataLoader's, as torch_dataset(num_workers=) gave it

    def __len__(self):
        nw = self._num_workers
        if nw <= 1:
            return len(self.feed)
        f = self.feed
        if getattr(self, "_len_of", None) is None or self._len_of[0] != (f.epoch, nw):
            one = f.replica(rank=f.rank * nw, world_size=f.world_size * nw, framework=None,
                            device="cpu")
            one.set_epoch(f.epoch)
            self._len_of = ((f.epoch, nw), nw * len(one))
        return self._len_of[1]

    def __iter__(self):
        wid, nw = self._workers()
        me = (os.getpid(), wid, nw)
        rep = self._replica
        if rep is None or rep[0] != me:
            # this process's first iter (a worker's copy of the dataset may hold the main
            # process's replica: not this process's)
            f = self.feed
            if nw > 1 or f.framework != "torch":
                f = f._worker_replica(rank=f.rank * nw + wid, world_size=f.world_size * nw,
                                      framework="torch",
                                      **({"device": "cpu"} if nw > 1 else {}))
            rep = (me, None, f)
        f = rep[2]
        if rep[1] != self._order:  # a set_epoch / load_state_dict not applied here yet
            if self._epoch is not None:
                f.set_epoch(self._epoch)
            if self._state is not None:
                f.load_state_dict(self._state)
        self._replica = (me, self._order, f)
        return iter(f)



_DATASET_CLASS: list = []


def dataset_class():
    """``FeedDataset``: :class:`_FeedDataset` on torch's ``IterableDataset``, made on first use
    so that importing avpipe does not import torch."""
    if not _DATASET_CLASS:
        base = _iterable_dataset_base()
        bases = (_FeedDataset,) if base is object else (_FeedDataset, base)
        _DATASET_CLASS.append(
            type("FeedDataset", bases, {"__doc__": _FeedDataset.__doc__, "__module__": __name__})
        )
    return _DATASET_CLASS[0]


def __getattr__(name: str):
    if name == "FeedDataset":
        return dataset_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
