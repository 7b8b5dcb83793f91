"""Ready-made jobs built on avpipe's public API.

* :mod:`avpipe.recipes.extract` — ``avpipe extract INPUT --preset NAME --out DIR``: walk a folder
  of media, compute features per file, write one ``.npy`` each plus ``index.jsonl`` /
  ``errors.jsonl``; resumable.
* Training feeds (:class:`avpipe.pipeline.feed.Feed`: sharded, resumable, prefetched):
  :func:`rnnt_feed` (NeMo manifest -> log-mel batches, :mod:`avpipe.recipes.rnnt`),
  :func:`video_classification` (CSV ``path,label`` -> normalized clips,
  :mod:`avpipe.recipes.video`), :func:`image_classification` (class folders / CSV / list ->
  normalized images, :mod:`avpipe.recipes.image`), :func:`feature_feed` (an ``avpipe extract``
  output -> padded batches of its stored features, :mod:`avpipe.recipes.features`).
"""

from __future__ import annotations

from . import extract
from .features import feature_feed
from .image import image_classification
from .rnnt import rnnt_feed
from .video import video_classification

__all__ = ["extract", "rnnt_feed", "video_classification", "image_classification",
           "feature_feed"]
