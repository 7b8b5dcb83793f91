"""Ready-made jobs built on avpipe's public API.

* :mod:`avpipe.recipes.extract` — ``avpipe extract INPUT --preset NAME --out DIR``: walk a folder
  of media, compute features per file, write one ``.npy`` each plus ``index.jsonl`` /
  ``errors.jsonl``; resumable.
"""

from __future__ import annotations

import importlib

_SUBMODULES = ("extract",)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"avpipe.recipes.{name}")
    raise AttributeError(f"module 'avpipe.recipes' has no attribute {name!r}")
