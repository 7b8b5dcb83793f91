"""The generic training feed: order, shards, prefetch, errors, resume, stats, torch / JAX faces.

A :class:`Feed` is an iterable of batches: each ``iter(feed)`` runs one epoch (a new shuffle),
the next ``iter`` the next epoch. A recipe (:mod:`avpipe.recipes`) supplies a :class:`Task`
(how items are decoded and how decoded items become a batch); the feed does the rest.

* :mod:`.task` — :class:`Task`, the hooks a recipe implements (``submit`` / ``collect``,
  ``decode_one``, ``collate``), its decoding threads and the deadline; :class:`Batch`.
* :mod:`.order` — :class:`EpochOrder`: each epoch's order, each rank's share, the re-cut on a
  world size change, and the resume state (``state_dict`` / ``load_state_dict``).
* :mod:`.producer` — the producer thread (prefetch, errors and replacements, the CUDA stream
  handover) and the consumer's iterator.
* :mod:`.dataset` — the torch ``IterableDataset`` (``FeedDataset``) for DataLoader workers.
* :mod:`.core` — :class:`Feed`, which puts them together.
"""

from .core import Feed
from .dataset import dataset_class
from .order import STATE_VERSION, EpochOrder, items_fingerprint
from .task import Batch, Task, Work, collect_works, map_with_deadline, resolve_deadline

__all__ = ["Feed", "Task", "Batch", "EpochOrder", "Work", "collect_works", "dataset_class",
           "map_with_deadline", "resolve_deadline", "items_fingerprint",
           "STATE_VERSION"]  # + FeedDataset (lazy)


def __getattr__(name: str):
    if name == "FeedDataset":
        return dataset_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
