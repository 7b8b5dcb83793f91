"""Ready-made jobs built on avpipe's public API.

* :mod:`avpipe.recipes.extract` — ``avpipe extract INPUT --preset NAME --out DIR``: walk a folder
  of media, compute features per file, write one ``.npy`` each plus ``index.jsonl`` /
  ``errors.jsonl``; resumable.
"""

from __future__ import annotations

from . import extract

__all__ = ["extract"]
