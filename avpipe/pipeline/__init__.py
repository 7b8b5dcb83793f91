"""Pipeline sources, samplers and batching.

* :class:`ImageFolder` — a directory of class folders -> batches of images and labels
  (:mod:`avpipe.pipeline.image_folder`).
"""

from __future__ import annotations

from .image_folder import IMAGE_EXTENSIONS, ImageFolder, ImageFolderBatch

__all__ = ["ImageFolder", "ImageFolderBatch", "IMAGE_EXTENSIONS"]
