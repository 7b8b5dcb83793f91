"""What a recipe plugs into a :class:`~avpipe.pipeline.feed.Feed`: the :class:`Task` and its
decoding threads, and the :class:`Batch` a feed hands out.

A task decodes items and collates decoded items into a batch's fields. Its two hooks:

* :meth:`Task.submit` starts decoding a group of ``(id, item)`` pairs on the task's threads
  and returns a function that gives their values (one value or exception per item, in order).
  The default runs :meth:`Task.decode_one` per item; a recipe that plans its own work (the
  video recipe's packet reads, the image recipe's chunked loads) overrides it.
* :meth:`Task.collect` waits for the jobs a task started (:meth:`Task.start`) under the task's
  ``deadline`` (:func:`collect_works`) and gives their values.

Deadline: an item still decoding ``deadline`` seconds after a thread started it (the recipes'
default ``"auto"``: ``AVPIPE_FEED_DEADLINE``, 60 s; None or 0: no limit) fails as a
:class:`~avpipe.DecodeTimeoutError` naming the file: a read that never returns (a stalled
network mount, a device file with a media name) costs that item and the thread stuck in it.
The decoding threads are daemon threads that nothing joins (:mod:`.._threads`): the stuck one
is replaced, and neither the rest of the epoch, the next epoch, ``close()``, a dropped feed nor
the interpreter's exit waits for it (a producer told to stop stops waiting for its items).

Across processes: a batch made in a torch DataLoader worker carries its ``errors``; unpickled in
the main process it records them into the feed ``torch_dataset`` was called on (:data:`LIVE`).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import functools
import threading
import time
import weakref
from types import SimpleNamespace

from ..._validate import pos_float
from ...errors import DecodeTimeoutError
from ...ops import random as _rnd
from .._threads import ProcessThreads

__all__ = ["Task", "Batch", "Work", "collect_works", "map_with_deadline", "resolve_deadline",
           "stopping", "LIVE"]

# live feeds of this process by token: where the errors of batches that arrive from
# DataLoader workers go (Batch.__reduce__)
LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


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
        feed = LIVE.get(sink)
        if feed is not None:
            feed._record_errors(errs)
    return b


class Task:
    """What a recipe plugs into :class:`Feed`.

    ``submit(pairs)`` / ``collect(works)``: start a group's decoding on the task's threads /
    wait for jobs under the deadline (the hooks a recipe overrides or calls; module docstring).
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
        self.feed_items = []  # set by the feed: every item of the feed
        self.epoch = 0  # set by the feed: the epoch being decoded (one at a time)

    def bind(self, items):
        """The feed hands the task its whole item list (for loaders that plan ahead)."""
        self.feed_items = items

    def pool(self):
        """The decoding threads (:class:`.._threads.ProcessThreads`: kept across epochs, a
        forked child's own)."""
        return self.threads_owner().get()

    def threads_owner(self) -> ProcessThreads:
        """The :class:`.._threads.ProcessThreads` behind :meth:`pool`."""
        if self._pool is None:
            self._pool = ProcessThreads(self.threads, "avpipe-feed")
        return self._pool

    def start(self, fn, arg, pair) -> Work:
        """``fn(*arg)`` on the decoding threads, for item ``pair`` (waited for by
        :meth:`collect`, which gives up threads stuck past the deadline)."""
        return Work(self.threads_owner(), fn, arg, pair)

    def decode_one(self, item_id, item):  # pragma: no cover - recipes override
        raise NotImplementedError

    def decode_items(self, pairs):
        return self.submit(pairs)()

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
                pending.append((self.submit(g), len(g)))

        fill()
        while pending:
            fut, _ = pending.popleft()
            fill()
            yield fut()

    def ahead(self, pairs):
        """The draws of ``pairs``' ``decode_one`` made at once (a table for
        :func:`avpipe.ops.random.drawn_from`), or None (the default: no draws)."""
        return None

    def submit(self, pairs):
        """Start decoding ``pairs`` (a group of ``(id, item)``) on the task's threads; returns a
        function giving their values (one value or exception per item, in order). The default
        runs :meth:`decode_one` per item (inside its draws, :meth:`ahead`); a recipe that plans
        its own jobs overrides it, starting them with :meth:`start` and waiting for them with
        :meth:`collect`."""
        if any(getattr(it, "locator", None) is not None for _, it in pairs):
            from ..sharded import read_ahead

            read_ahead([it for _, it in pairs], self)  # remote shard members: read ahead
            self._reads_planned = True
        table = self.ahead(pairs)
        fn = self.decode_one if table is None else functools.partial(_drawn, table,
                                                                        self.decode_one)
        futs = [self.start(fn, p, p) for p in pairs]
        return lambda: self.collect(futs)

    def collect(self, works, *, timed=True) -> list:
        """The values of ``works`` (jobs :meth:`start` gave), in order, each one a value or an
        exception: an item past :attr:`deadline` is a :class:`~avpipe.DecodeTimeoutError`
        (:func:`collect_works`). ``timed``: the jobs' span (first start to last end) goes
        to the feed's ``decode`` stats."""
        out, span = collect_works(works, self.deadline)
        if timed and self.timings is not None and span is not None:
            self.timings("decode", span)
        return out

    def collate(self, values, pairs, epoch, step):  # pragma: no cover - recipes override
        raise NotImplementedError

    def close(self):
        if getattr(self, "_reads_planned", False):
            from ..sharded import forget_reads

            forget_reads(self)
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def resolve_deadline(deadline) -> float | None:
    """A feed's ``deadline`` option in seconds: ``"auto"`` is the ``AVPIPE_FEED_DEADLINE``
    setting (default :data:`avpipe.settings.FEED_DEADLINE_S`); None or 0: no limit."""
    from ... import settings

    if isinstance(deadline, str) and deadline == "auto":
        return settings.feed_deadline()
    if deadline is None or (not isinstance(deadline, bool)
                            and isinstance(deadline, (int, float)) and deadline == 0):
        return None
    return pos_float("deadline", deadline, " of seconds, 'auto', or None / 0 for no limit")


# the stop event of the producer running on this thread (set around its decoding calls):
# collect_works stops waiting for its items once the producer is told to stop
_producing = threading.local()


@contextlib.contextmanager
def stopping(event):
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


class Work:
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


def collect_works(works, deadline):
    """Results of ``works`` (:class:`Work`, or ``(future, pair)``) and the span (first start
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
        return w.fut if isinstance(w, Work) else w[0]

    while pending:
        if stop is not None and stop.is_set():
            for i in pending:
                fut(i).cancel()
                out[i] = DecodeTimeoutError(_name(works[i].pair if isinstance(works[i], Work)
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
                    pair = w.pair if isinstance(w, Work) else w[1]
                    out[i] = DecodeTimeoutError(
                        _name(pair), f"no result within the {deadline:g} s deadline")
                    pending.discard(i)
                    if isinstance(w, Work) and w.gen == w.threads.gen:
                        w.threads.retire()
            elif isinstance(w, Work) and w.requeue():
                pass
            elif f.cancelled():  # cancelled by its pool's shutdown (the owner closed)
                out[i] = cf.CancelledError(f"{_name(w.pair if isinstance(w, Work) else w[1])}: "
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
    return collect_works(futs, deadline)[0]
