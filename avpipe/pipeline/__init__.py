"""Pipeline sources, samplers and batching.

* :class:`ImageFolder` — a directory of class folders -> batches of images and labels
  (:mod:`avpipe.pipeline.image_folder`).
* :class:`Feed` — the training feed machinery (:mod:`avpipe.pipeline.feed`): epoch order,
  shards, bounded prefetch, skipped items, exact resume, stats, torch / JAX faces; the recipes
  in :mod:`avpipe.recipes` build feeds.
* :mod:`avpipe.pipeline.sources` — NeMo manifests, CSV, class folders, lists -> items.
"""

from __future__ import annotations

from .feed import Batch, Feed, FeedDataset, Task
from .image_folder import IMAGE_EXTENSIONS, ImageFolder, ImageFolderBatch
from .sources import Item, read_csv, read_folder, read_list, read_manifest

__all__ = [
    "ImageFolder", "ImageFolderBatch", "IMAGE_EXTENSIONS",
    "Feed", "FeedDataset", "Batch", "Task",
    "Item", "read_manifest", "read_csv", "read_folder", "read_list",
]
