"""An image-dataset source: a directory of class folders -> batches of images and labels.

::

    root/
      cat/  a.jpg  b.png ...
      dog/  c.jpg ...

Classes are the sub-folder names in sorted order (label = index), like torchvision's
``ImageFolder``. Files are found recursively under each class folder and kept when their
extension is an image format DALI decodes. Each batch is decoded in one
:func:`avpipe.decode_image_batch` call (DALI batch decode, on the GPU when usable).

Bad images follow ``on_error``: ``"skip"`` (default) leaves them out of the batch and records
them in :attr:`ImageFolder.errors` (path, typed error); ``"raise"`` raises the
:class:`~avpipe.DecodeError` naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._results import BatchResult
from .._validate import check_on_error, pos_int
from ..decoding.image import decode_image_batch, resolve_max_pixels
from ..device import resolve_device
from ..formats import IMAGE_EXTENSIONS
from .feed import EpochOrder
from .sources import read_folder

__all__ = ["ImageFolder", "ImageFolderBatch", "IMAGE_EXTENSIONS"]



@dataclass(frozen=True)
class ImageFolderBatch(BatchResult):
    """One batch: ``images`` (a stacked array when every transformed image has the same shape,
    else a list), ``labels`` (int64, on the images' device), ``paths`` of the good images, and
    ``errors`` — ``(index among the batch's drawn items, DecodeError)`` for each skipped one
    (the error names its file)."""

    images: Any
    labels: Any
    paths: tuple
    errors: tuple = field(default=(), repr=False)
    device: str = "cpu"


class ImageFolder:
    """Iterate a directory of class folders in batches.

    ``batch_size``: images per batch (the last one may be smaller unless ``drop_last``).
    ``shuffle``/``seed``: a new permutation each epoch, the feeds' epoch order
    (:class:`avpipe.pipeline.feed.EpochOrder`: a keyed permutation of ``(seed, epoch)``).
    ``device``: where images are decoded (None: the GPU when usable). ``transform``: a function
    applied to each decoded ``[H, W, 3]`` uint8 image (e.g. ``functools.partial(
    avpipe.ops.image.resize_crop_normalize, short_side=224, crop_size=224)``).
    ``on_error``: ``"skip"`` or ``"raise"``. ``extensions``: which files count as images
    (default :data:`avpipe.formats.IMAGE_EXTENSIONS`). ``max_pixels``: the pixel cap (see
    :func:`avpipe.decoding.image.decode_image_batch`; an image over it is a bad image).
    ``self.errors`` collects ``(path, DecodeError)`` for every image skipped so far.
    """

    def __init__(
        self,
        root,
        *,
        batch_size: int = 32,
        shuffle: bool = False,
        seed: int = 0,
        device=None,
        transform: Callable | None = None,
        on_error: str = "skip",
        drop_last: bool = False,
        extensions=IMAGE_EXTENSIONS,
        max_pixels: int | None = None,
    ):
        root = os.fspath(root)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"root: no such directory: {root!r}")
        batch_size = pos_int("batch_size", batch_size)
        check_on_error(on_error)
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable or None, got {type(transform).__name__}")
        self.root = root
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.device = resolve_device(device)
        self.transform = transform
        self.on_error = on_error
        self.drop_last = bool(drop_last)
        self.max_pixels = resolve_max_pixels(max_pixels) or 0
        self.classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        if not self.classes:
            raise ValueError(f"root {root!r} holds no class folders")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        # the one class-folder walk (pipeline.sources), the feeds' too
        self.samples = [(it.path, self.class_to_idx[it.label])
                        for it in read_folder(root, extensions=extensions)]
        self.errors: list = []
        self.order = EpochOrder(len(self.samples), batch_size=batch_size, seed=self.seed,
                                shuffle=self.shuffle)
        self.epoch = 0

    def __len__(self) -> int:
        n = len(self.samples)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[ImageFolderBatch]:
        order = self.order.permutation(self.epoch)
        self.epoch += 1
        for b in range(len(self)):
            idx = order[b * self.batch_size : (b + 1) * self.batch_size]
            yield self._load([self.samples[i] for i in idx])

    def _load(self, items) -> ImageFolderBatch:
        paths = [p for p, _ in items]
        res = decode_image_batch(paths, device=self.device, max_pixels=self.max_pixels)
        if res.errors and self.on_error == "raise":
            raise res.errors[0][1]
        self.errors.extend((paths[i], e) for i, e in res.errors)
        keep = [i for i, im in enumerate(res.images) if im is not None]
        imgs = [res.images[i] for i in keep]
        if self.transform is not None:
            imgs = [self.transform(im) for im in imgs]
        xp = self.device.xp
        with self.device.activate():
            labels = xp.asarray(np.array([items[i][1] for i in keep], np.int64))
            if imgs and all(tuple(im.shape) == tuple(imgs[0].shape) for im in imgs):
                if res.stacked is not None and self.transform is None:
                    images = res.stacked
                else:
                    images = xp.stack(imgs)
            else:
                images = imgs
        return ImageFolderBatch(
            images=images, labels=labels, paths=tuple(paths[i] for i in keep),
            errors=tuple(res.errors), device=str(self.device),
        )
