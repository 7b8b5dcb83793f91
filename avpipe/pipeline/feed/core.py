"""The :class:`Feed`: a :class:`~.task.Task`'s batches in the epoch order of :mod:`.order`, made
ahead by the producer of :mod:`.producer`.

A :class:`Feed` is an iterable of batches: each ``iter(feed)`` runs one epoch (a new shuffle),
the next ``iter`` the next epoch. A recipe (:mod:`avpipe.recipes`) supplies a :class:`Task`
(how items are decoded and how decoded items become a batch); the feed does the rest.

Errors (``on_error="skip"``): an item that fails (decode error, missing file, past the
``deadline``) is reported in the batch's ``errors`` and in ``feed.errors`` as ``(path,
message)`` (``feed.errors`` lists each pair once per feed: a file that fails every epoch, or
every view of a bad video, is listed once), and replaced by the *last not yet used item of the
same rank's epoch* (the rule, and the repeats that fill a training batch: :mod:`.producer`).
``on_error="raise"`` raises the item's error. Exact resume assumes an item that failed fails
again (a missing or corrupt file does; a deadline missed under load may not).
"""

from __future__ import annotations

import collections
import os
import threading
import weakref

import numpy as np

from ..._validate import check_choice, check_on_error, pos_float, pos_int
from ...device import resolve_device
from .dataset import dataset_class
from .order import EpochOrder, start_of
from .producer import STAGES, EpochIterator, discard_ahead
from .task import LIVE, Task

__all__ = ["Feed"]


class Feed:
    """Batches of ``items`` decoded and collated by ``task``; the rules: :mod:`.order` (epoch
    order, ranks, resume), :mod:`.producer` (errors, replacements, prefetch), :mod:`.task`
    (deadline).

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
    each group's items together (:func:`.plans.grouped_permutation`); None: one permutation
    of all items. ``order``: the :class:`~.order.EpochOrder` built from these
    arguments.
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
        LIVE[self._token] = self
        self._spec = spec
        self._pos = {"epoch": 0, "step": 0, "borrowed": 0, "rebase": []}
        self._pending = False  # a loaded state waits for the next iter
        self._next_epoch = 0
        self.order = EpochOrder(
            len(self.items), batch_size=self.batch_size, max_duration=self.max_duration,
            durations=self.durations, seed=self.seed, shuffle=self.shuffle,
            bucket_window=self.bucket_window, pad=self.pad, groups=self.groups,
            items=self.items)
        self._active = None
        self._ahead = None  # the next epoch's producer, ahead (the Producer of a live thread)
        self._stream = None
        self._times = {k: collections.deque(maxlen=2048) for k in STAGES}
        self._steps = collections.deque(maxlen=2048)  # (consumer work, wait) per batch
        task.timings = _Recorder(self)  # weak: no feed <-> task cycle
        task.bind(self.items)

    # -- order -----------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.order.mode

    def _plan(self, epoch: int, rebase, world_size=None) -> list:
        return self.order.plan(epoch, rebase,
                               self.world_size if world_size is None else world_size)

    def rank_batches(self, plan) -> list:
        """This rank's batches of ``plan``, in step order."""
        return self.order.rank_batches(plan, self.rank, self.world_size)

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank): of the epoch in progress
        (or loaded), else of the next one. With a fixed batch size it is the same every epoch;
        with ``max_duration`` it can differ by a batch or two between epochs."""
        return self.order.steps(self._pos, self.world_size)

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
        self._pos = start_of(epoch)
        self._next_epoch = int(epoch)
        self._pending = False

    # -- resume (the rule: .order) -----------------------------------------------------------
    def items_fingerprint(self) -> str:
        """A hash of the item list, in order (:func:`.order.items_fingerprint`; computed
        once)."""
        return self.order.items_fingerprint()

    def state_dict(self) -> dict:
        """JSON-serializable position (:mod:`.order`: the resume rule)."""
        return self.order.state(self._pos, self.rank, self.world_size)

    def check_state(self, state) -> list:
        """The states of ``state`` checked to be ones this feed (a feed built with the same
        arguments over the same item list, at any rank and world size) can have written
        (:meth:`.order.EpochOrder.check_state`); a bad one raises
        :class:`~avpipe.errors.StateError`. Returns the states (a list of dicts)."""
        return self.order.check_state(state)

    def load_state_dict(self, state) -> None:
        """Resume at ``state``: one rank's state, or a list of ranks' states (lists of lists are
        flattened). With the saving feed's ``world_size`` it must hold this rank's state; with
        another ``world_size`` every saving rank's state (:mod:`.order`: the resume rule).
        A state this feed cannot have written or a list that misses a rank it needs raises
        :class:`~avpipe.errors.StateError` (a ``ValueError``) and leaves the feed as it was."""
        self._pos = self.order.resume(state, self.rank, self.world_size)
        self._pending = True

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self):
        if self._active is not None:
            it = self._active()
            if it is not None:
                it.close()
        if not self._pending:
            self._pos = start_of(self._next_epoch)
        self._pending = False
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead.take_over(self._pos):
            discard_ahead(self, ahead)
            ahead = None
        it = EpochIterator(self, dict(self._pos), ahead=ahead)
        self._active = weakref.ref(it)
        return it

    def _drop_ahead(self):
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            discard_ahead(self, ahead)

    def _advance(self, pos, finished):
        if finished:
            self._pos = start_of(pos["epoch"] + 1)
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
        LIVE[self._token] = self
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
