"""The torch face of a feed: ``FeedDataset``, an ``IterableDataset`` for torch's DataLoader.

Across processes: a batch made in a DataLoader worker carries its ``errors``; unpickled in the
main process it records them into the feed ``torch_dataset`` was called on (the same feed also
gets the errors of the dataset's replica iterated in the main process, ``num_workers=0``).
"""

from __future__ import annotations

import os

from .order import flat_states, state_check

__all__ = ["dataset_class"]


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

    def __init__(self, feed):
        self.feed = feed
        self._epoch = None
        self._state = None
        self._changes = 0  # counts set_epoch / load_state_dict calls
        # this process's replica: ((pid, worker id, workers), the _changes it applied, feed)
        self._replica = None

    def _workers(self):
        import torch.utils.data as tud

        info = tud.get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def set_epoch(self, epoch: int):
        st = flat_states(self._state)[0] if self._state is not None else None
        if st is not None and int(st.get("epoch", -1)) == int(epoch):
            return  # a loaded state in that epoch: kept (Feed.set_epoch)
        self._epoch = int(epoch)
        self._state = None
        self._changes += 1

    def load_state_dict(self, state):
        """Resume from a feed state (checked here: :meth:`Feed.check_state`; a bad one raises
        :class:`~avpipe.errors.StateError` before any worker starts)."""
        self.feed.check_state(state)
        self._state = state
        self._changes += 1

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
        if rep[1] != self._changes:  # a set_epoch / load_state_dict not applied here yet
            if self._epoch is not None:
                f.set_epoch(self._epoch)
            if self._state is not None:
                f.load_state_dict(self._state)
        self._replica = (me, self._changes, f)
        return iter(f)



_DATASET_CLASS: list = []


def dataset_class():
    """``FeedDataset``: :class:`_FeedDataset` on torch's ``IterableDataset``, made on first use
    so that importing avpipe does not import torch."""
    if not _DATASET_CLASS:
        base = _iterable_dataset_base()
        bases = (_FeedDataset,) if base is object else (_FeedDataset, base)
        _DATASET_CLASS.append(
            # the package's name: FeedDataset pickles as avpipe.pipeline.feed.FeedDataset
            type("FeedDataset", bases, {"__doc__": _FeedDataset.__doc__,
                                        "__module__": "avpipe.pipeline.feed"})
        )
    return _DATASET_CLASS[0]
