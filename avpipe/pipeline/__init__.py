"""Everything that iterates: samplers, prefetching streams, batch loaders and training feeds.

* :mod:`avpipe.pipeline.samplers` — seeded frame and clip samplers over a ``VideoDecoder``.
* :mod:`avpipe.pipeline.clips` — :class:`ClipFeed`: batches of transformed video clips.
* :mod:`avpipe.pipeline.audio_loader` — :class:`AudioBatchLoader`: padded audio batches
  (FLAC decoded on the GPU in windows of files, else worker processes into a shared ring).
* :mod:`avpipe.pipeline.image_stream` — :func:`decode_image_stream`: prefetched image batches.
* :mod:`avpipe.pipeline.image_folder` — :class:`ImageFolder`: class folders -> image batches.
* :mod:`avpipe.pipeline.banks` — noise and impulse-response banks from files for the
  augmentations.
* :class:`Feed` — the training feed machinery (:mod:`avpipe.pipeline.feed`): epoch order,
  shards, bounded prefetch, skipped items, exact resume, stats, torch / JAX faces; the recipes
  in :mod:`avpipe.recipes` build feeds.
* :mod:`avpipe.pipeline.sources` — NeMo manifests, CSV, class folders, lists -> items.
"""

from __future__ import annotations

from . import samplers
from ._threads import AbandonablePool
from .audio_loader import AudioBatch, AudioBatchLoader
from .clips import Clip, ClipBatch, ClipFeed
from .feed import Batch, Feed, Task
from .image_folder import IMAGE_EXTENSIONS, ImageFolder, ImageFolderBatch
from .image_stream import decode_image_stream
from .sources import Item, read_csv, read_folder, read_list, read_manifest

__all__ = [
    "samplers",
    "AbandonablePool",
    "AudioBatchLoader",
    "AudioBatch",
    "ClipFeed",
    "Clip",
    "ClipBatch",
    "decode_image_stream",
    "ImageFolder",
    "ImageFolderBatch",
    "IMAGE_EXTENSIONS",
    "Feed",
    "Batch",
    "Task",
    "Item",
    "read_manifest",
    "read_csv",
    "read_folder",
    "read_list",
]


def __getattr__(name: str):
    if name == "FeedDataset":  # torch's IterableDataset underneath: made on first use
        from .feed import dataset_class

        return dataset_class()
    raise AttributeError(f"module 'avpipe.pipeline' has no attribute {name!r}")
