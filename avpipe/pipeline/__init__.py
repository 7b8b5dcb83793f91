"""Everything that iterates: samplers, prefetching streams, batch loaders and training feeds.

* :mod:`avpipe.pipeline.samplers` — seeded frame and clip samplers over a ``VideoDecoder``.
* :mod:`avpipe.pipeline.clips` — :class:`ClipFeed`: batches of transformed video clips.
* :mod:`avpipe.pipeline.audio_loader` — :class:`AudioBatchLoader`: padded audio batches
  (FLAC decoded on the GPU in windows of files, else worker processes into a shared ring).
* :mod:`avpipe.pipeline.image_stream` — :func:`decode_image_stream`: prefetched image batches.
* :mod:`avpipe.pipeline.image_folder` — :class:`ImageFolder`: class folders -> image batches.
"""

from __future__ import annotations

from . import samplers
from .audio_loader import AudioBatch, AudioBatchLoader
from .clips import Clip, ClipBatch, ClipFeed
from .image_folder import IMAGE_EXTENSIONS, ImageFolder, ImageFolderBatch
from .image_stream import decode_image_stream

__all__ = [
    "samplers",
    "AudioBatchLoader",
    "AudioBatch",
    "ClipFeed",
    "Clip",
    "ClipBatch",
    "decode_image_stream",
    "ImageFolder",
    "ImageFolderBatch",
    "IMAGE_EXTENSIONS",
]
