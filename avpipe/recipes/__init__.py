"""Ready-made jobs built on avpipe's public API.

* :mod:`avpipe.recipes.extract` — ``avpipe extract INPUT --preset NAME --out DIR``: walk a folder
  of media, compute features per file, write one ``.npy`` each plus ``index.jsonl`` /
  ``errors.jsonl``; resumable.
* Training feeds (:class:`avpipe.pipeline.feed.Feed`: sharded, resumable, prefetched):
  :func:`rnnt_feed` (NeMo manifest -> log-mel batches, :mod:`avpipe.recipes.rnnt`),
  :func:`video_classification` (CSV ``path,label`` -> normalized clips,
  :mod:`avpipe.recipes.video`), :func:`image_classification` (class folders / CSV / list ->
  normalized images, :mod:`avpipe.recipes.image`).
"""

from __future__ import annotations

import importlib

_SUBMODULES = ("extract", "rnnt", "video", "image")
_LAZY = {
    "rnnt_feed": "rnnt",
    "video_classification": "video",
    "image_classification": "image",
}

__all__ = [*_SUBMODULES, *_LAZY]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"avpipe.recipes.{name}")
    if name in _LAZY:
        value = getattr(importlib.import_module(f"avpipe.recipes.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'avpipe.recipes' has no attribute {name!r}")
