"""Image classification feed: a folder of classes, a CSV ``path,label`` or a list -> batches.

::

    feed = avpipe.recipes.image_classification("train/", batch_size=256, seed=0)
    for batch in feed:
        batch.images  # [B, 3, 224, 224] float16, ImageNet-normalized
        batch.labels  # [B] int64, indices into feed.classes

Decoding: :func:`avpipe.decoding.image.decode_image_stream` over the epoch's batches (DALI:
nvJPEG / nvImageCodec on a GPU, the CPU decoders otherwise; it reads and decodes ahead while
the producer collates), replacements with :func:`avpipe.decoding.image.decode_image_batch`. ``train=True``:
per image one random resized crop (area ``scale``, aspect ``ratio``;
:func:`avpipe.ops.image_augment.sample_resized_crop_params`, counter-based draws of ``(seed,
epoch, id)``) resized to ``crop_size`` (the crop folded into the fused resize, as
:func:`~avpipe.ops.image_augment.fused_resized_crop_normalize`) and a horizontal flip (p = 0.5,
:func:`~avpipe.ops.image_augment.sample_flip_params`);
``train=False``: short side resized to ``resize_size``, centre crop ``crop_size``. Both through
:func:`avpipe.ops.image.resize_crop_normalize` (fused kernels on a GPU).
"""

from __future__ import annotations

import os

import numpy as np

from ..decoding.image import decode_image_batch, resolve_max_pixels
from ..device import array_module, resolve_device, upload_many
from ..errors import DecodeError, renamed
from ..formats import IMAGE_EXTENSIONS
from ..ops import image_augment as _aug
from ..ops.image import IMAGENET_MEAN, IMAGENET_STD, resize_crop_normalize
from ..pipeline.feed import Feed, Task
from ..pipeline.image_stream import decode_image_stream
from ..pipeline.sharded import sharded_listing
from ..pipeline.sources import class_index, read_csv, read_folder, read_list

__all__ = ["image_classification", "ImageTask"]


def image_classification(source, *, crop_size=224, resize_size=256, batch_size=32, train=True,
                         seed=0, shuffle=None, rank=0, world_size=1, device=None,
                         framework=None, on_error="skip", scale=(0.08, 1.0),
                         ratio=(3 / 4, 4 / 3), dtype="float16", prefetch=2, deadline="auto",
                         root=None, max_pixels=None, storage_options=None):
    """A :class:`~avpipe.pipeline.feed.Feed` of images. ``source``: a folder of class folders,
    a ``.csv`` file (``path,label``), a text file of paths, or a list of ``(path, label)``.
    Batch fields: ``images [B, 3, crop_size, crop_size]``, ``labels [B]``, ``paths``.
    ``root``: a folder every listed image must lie under (links resolved); a CSV row without a
    path or label, or a path outside ``root``, raises :class:`~avpipe.errors.ManifestError` /
    :class:`~avpipe.errors.OutsideRootError`.
    ``max_pixels``: the pixel cap (see :func:`avpipe.decoding.image.decode_image_batch`): an
    image whose header declares more pixels is a bad item (``on_error``).
    ``source`` may also be WebDataset shards (a path or URL with brace ranges, or a list:
    ``KEY.jpg|png|tif|jp2|...`` with ``KEY.cls``, an integer that is the class index, or
    ``KEY.json`` ``{"label": ...}``), read through fsspec with ``storage_options``."""
    spec = (image_classification, dict(
        source=source, crop_size=crop_size, resize_size=resize_size, batch_size=batch_size,
        train=train, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size,
        device=device, framework=framework, on_error=on_error, scale=scale, ratio=ratio,
        dtype=dtype, prefetch=prefetch, deadline=deadline, root=root,
        max_pixels=max_pixels, storage_options=storage_options))  # fmt: skip
    listing = sharded_listing(source, kind="image", storage_options=storage_options)
    errors = [] if listing is None else list(listing.errors)
    if listing is not None:
        items = listing.items
    elif isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        items = read_folder(source, extensions=IMAGE_EXTENSIONS, check=root)
    elif isinstance(source, (str, os.PathLike)) and os.fspath(source).lower().endswith(".csv"):
        items = read_csv(source, root=root)
    else:
        items = read_list(source, root=root)
    classes, labels = class_index(items, integers_are_indices=listing is not None)
    dev = resolve_device(device)
    task = ImageTask(labels=labels, crop_size=crop_size, resize_size=resize_size, train=train,
                     seed=seed, device=dev, scale=scale, ratio=ratio, dtype=dtype,
                     deadline=deadline, max_pixels=resolve_max_pixels(max_pixels) or 0)
    return Feed(items, task, batch_size=batch_size, seed=seed,
                shuffle=bool(train) if shuffle is None else bool(shuffle), rank=rank,
                world_size=world_size, prefetch=prefetch, on_error=on_error, device=dev,
                framework=framework, classes=classes, spec=spec, initial_errors=errors,
                pad="repeat" if train else "empty")


class ImageTask(Task):
    array_fields = ("images", "labels")

    def __init__(self, *, labels, crop_size, resize_size, train, seed, device,
                 scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), dtype="float16",
                 mean=IMAGENET_MEAN, std=IMAGENET_STD, deadline="auto", max_pixels=None):
        super().__init__()
        self.labels = list(labels)
        self.S, self.R = int(crop_size), int(resize_size)
        self.train, self.seed, self.device = bool(train), int(seed), device
        self.scale, self.ratio = tuple(scale), tuple(ratio)
        self.dtype, self.mean, self.std = dtype, mean, std
        self.deadline = deadline
        self.max_pixels = max_pixels  # None: the setting's cap, read at each decode

    def decode_items(self, pairs):
        """One batch decode (DALI is driven from the producer thread only). A shard's member
        is read here (one ranged read), and its errors name the item, not ``<bytes>``."""
        out = [None] * len(pairs)
        todo, srcs = [], []
        for k, (_, it) in enumerate(pairs):
            if it.locator is not None:
                try:
                    srcs.append(it.locator.read())
                except OSError as e:
                    out[k] = e
                    continue
                todo.append(k)
            elif os.path.exists(it.path):
                todo.append(k)
                srcs.append(it.path)
            else:
                out[k] = FileNotFoundError(f"no such file: {it.path}")
        if todo:
            res = decode_image_batch(srcs, device=self.device, max_pixels=self.max_pixels)
            for j, e in res.errors:
                it = pairs[todo[j]][1]
                if it.locator is not None and isinstance(e, DecodeError):
                    e = renamed(e, it.path)
                out[todo[j]] = e
            for j, im in enumerate(res.images):
                if im is not None:
                    out[todo[j]] = im
        return out

    def decode_groups(self, groups):
        """The epoch's groups through one :func:`decode_image_stream` (DALI reads and decodes
        the next batches while the producer collates this one). The groups are taken all at
        once: items later used as replacements are decoded here too and dropped by the feed
        (a group's live items are always a prefix of it)."""
        import time

        if any(it.locator is not None for it in self._all_items):
            # shards: each group's members read and decoded when it comes (a stream over the
            # whole epoch would hold every member's bytes at once)
            for g in groups:
                t0 = time.perf_counter()
                values = self.decode_items(list(g))
                if self.timings is not None:
                    self.timings("decode", time.perf_counter() - t0)
                yield values
            return
        groups = [list(g) for g in groups]
        if not groups:
            return
        results = [[None] * len(g) for g in groups]
        where = []  # (group, row) of each streamed source
        for gi, g in enumerate(groups):
            for k, (_, it) in enumerate(g):
                if os.path.exists(it.path):
                    where.append((gi, k))
                else:
                    results[gi][k] = FileNotFoundError(f"no such file: {it.path}")
        chunk = max(1, max(len(g) for g in groups))
        stream = decode_image_stream([groups[gi][k][1].path for gi, k in where],
                                     batch_size=chunk, device=self.device,
                                     max_pixels=self.max_pixels) if where else iter(())
        xp = self.device.xp
        got = 0  # streamed sources received so far
        try:
            for gi in range(len(groups)):
                t0 = time.perf_counter()
                # this group's last streamed source
                need = sum(1 for w in where if w[0] <= gi)
                while got < need:
                    b = next(stream)
                    bad = dict(b.errors)
                    for j in range(len(b.images)):
                        wg, wk = where[got + j]
                        if j in bad:
                            results[wg][wk] = bad[j]
                        elif b.images[j] is None:
                            results[wg][wk] = RuntimeError("not decoded")
                        else:  # copy: the stream's arrays are DALI's buffers
                            results[wg][wk] = xp.array(b.images[j], copy=True)
                    got += len(b.images)
                if self.timings is not None:
                    self.timings("decode", time.perf_counter() - t0)
                yield results[gi]
                results[gi] = None
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    def _one(self, im, i, epoch):
        if self.train:
            h, w = im.shape[:2]
            crop = _aug.sample_resized_crop_params(self.seed, epoch, [i], h, w, scale=self.scale,
                                                   ratio=self.ratio)
            box = tuple(int(crop[k][0]) for k in ("top", "left", "height", "width"))
            flip = bool(_aug.sample_flip_params(self.seed, epoch, [i])["flip"][0])
            return resize_crop_normalize(im, box=box, size=(self.S, self.S), short_side=None,
                                         crop_size=None, mean=self.mean, std=self.std,
                                         dtype=self.dtype, layout="CHW", flip=flip)
        return resize_crop_normalize(im, short_side=self.R, crop_size=self.S, mean=self.mean,
                                     std=self.std, dtype=self.dtype, layout="CHW")

    def collate(self, values, pairs, epoch, step):
        xp = self.device.xp
        ids = [i for i, _ in pairs]
        if values:
            ims = [self._one(xp.asarray(v) if array_module(v) is not xp else v, i, epoch)
                   for v, i in zip(values, ids)]
            images = xp.ascontiguousarray(xp.stack(ims))
        else:
            images = xp.zeros((0, 3, self.S, self.S), np.dtype(self.dtype))
        # (page-locked: a pageable copy would wait for the producer stream's stack above)
        (labels,) = upload_many(xp, [np.array([self.labels[i] for i in ids], np.int64)])
        return {"images": images, "labels": labels, "paths": [it.path for _, it in pairs]}
