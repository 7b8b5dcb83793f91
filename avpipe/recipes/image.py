"""Image classification feed: a folder of classes, a CSV ``path,label`` or a list -> batches.

::

    feed = avpipe.recipes.image_classification("train/", batch_size=256, seed=0)
    for batch in feed:
        batch.images  # [B, 3, 224, 224] float16, ImageNet-normalized
        batch.labels  # [B] int64, indices into feed.classes

Reading and decoding: each batch's files are read on the feed's decoding threads, a few batches
ahead (a read that never returns costs its item, a :class:`~avpipe.errors.DecodeTimeoutError`
past the feed's ``deadline``, and nothing waits for its thread); DALI decodes the bytes as one
stream over the epoch's batches (:func:`avpipe.pipeline.image_stream.stream_loaded`: nvJPEG /
nvImageCodec on a GPU, the CPU decoders otherwise; it decodes ahead while the producer
collates), replacements with :func:`avpipe.decoding.image.decode_image_batch`. ``train=True``:
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

from .._source import Source, open_source
from ..decoding.image import decode_image_batch, resolve_max_pixels
from ..device import array_module, resolve_device, upload_many
from ..errors import DecodeError, renamed
from ..formats import IMAGE_EXTENSIONS
from ..ops import image_augment as _aug
from ..ops.image import IMAGENET_MEAN, IMAGENET_STD, resize_crop_normalize
from ..pipeline.feed import Feed, Task
from ..pipeline.image_stream import LoadedChunks, needs_batch_path, stream_loaded
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


def _read_image(path, check, cap):
    """An image file's bytes and whether the stream must leave it to the per-batch path
    (:func:`avpipe.pipeline.image_stream.needs_batch_path`), read on a decoding thread."""
    try:
        data = open_source(path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"no such file: {path}") from None
    return data, check and needs_batch_path(Source(name=path, data=data), cap)



class ImageTask(Task):
    array_fields = ("images", "labels")

    def __init__(self, *, labels, crop_size, resize_size, train, seed, device,
                 scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), dtype="float16",
                 mean=IMAGENET_MEAN, std=IMAGENET_STD, deadline="auto", max_pixels=None):
        super().__init__()
        self.labels = list(labels)
        self.crop_size, self.resize_size = int(crop_size), int(resize_size)
        self.train, self.seed, self.device = bool(train), int(seed), device
        self.scale, self.ratio = tuple(scale), tuple(ratio)
        self.dtype, self.mean, self.std = dtype, mean, std
        self.deadline = deadline
        self.max_pixels = max_pixels  # None: the setting's cap, read at each decode

    def decode_items(self, pairs):
        """One batch decode (DALI is driven from the producer thread only). A shard's member
        is read here (one ranged read), and its errors name the item, not ``<bytes>``; a
        file is read on the decoding threads (with the deadline, as in :meth:`decode_groups`)."""
        out = [None] * len(pairs)
        todo, srcs = [], []
        files = [k for k, (_, it) in enumerate(pairs) if it.locator is None]
        got = dict(zip(files, self._read_group([pairs[k] for k in files], None,
                                                       check=False)())) if files else {}
        for k, (_, it) in enumerate(pairs):
            if k in got:
                if isinstance(got[k], BaseException):
                    out[k] = got[k]
                else:
                    todo.append(k)
                    srcs.append(Source(name=it.path, data=got[k][0]))
            elif it.locator is not None:
                try:
                    srcs.append(it.media())
                except OSError as e:
                    out[k] = e
                    continue
                todo.append(k)
        if todo:
            res = decode_image_batch(srcs, device=self.device, max_pixels=self.max_pixels)
            for j, e in res.errors:
                it = pairs[todo[j]][1]
                out[todo[j]] = renamed(e, it.path)
            for j, im in enumerate(res.images):
                if im is not None:
                    out[todo[j]] = im
        return out

    def decode_groups(self, groups):
        """The epoch's groups through one DALI stream of bytes (:func:`stream_loaded`: DALI
        decodes the next batches while the producer collates this one). Each group's files
        are read on the decoding threads :attr:`READ_AHEAD` groups ahead of the one DALI asks
        for, and collected with the deadline (:meth:`~avpipe.pipeline.feed.Task.collect`): a read
        that never returns is that item's :class:`~avpipe.errors.DecodeTimeoutError`. The
        groups are taken all at once (the pairs only): items later used as replacements are
        decoded here too and dropped by the feed (a group's live items are always a prefix of
        it)."""
        import time

        if any(it.locator is not None for it in self.feed_items):
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
        cap = resolve_max_pixels(self.max_pixels)
        reads = {}  # group -> its reads' result function, submitted READ_AHEAD groups ahead
        ready = {}  # group -> (values so far, its chunk of bytes sources, their rows)

        def read_upto(gi):
            for g in range(len(reads), min(gi + 1, len(groups))):
                reads[g] = self._read_group(groups[g], cap)

        def chunk(gi):
            if gi not in ready:
                read_upto(gi + self.READ_AHEAD)
                ready[gi] = self._admit(groups[gi], reads.pop(gi)())
            return ready[gi][1]

        read_upto(self.READ_AHEAD)
        stream = stream_loaded(LoadedChunks(len(groups), chunk),
                               batch_size=max(len(g) for g in groups), device=self.device,
                               max_pixels=self.max_pixels)
        xp = self.device.xp
        try:
            for gi in range(len(groups)):
                t0 = time.perf_counter()
                b = next(stream)
                values, srcs, rows = ready.pop(gi)
                bad = dict(b.errors)
                for j, k in enumerate(rows):
                    path = groups[gi][k][1].path
                    if j in bad:
                        values[k] = renamed(bad[j], path)
                    elif b.images[j] is None:
                        values[k] = DecodeError(path, "not decoded")
                    else:  # copy: the stream's arrays are DALI's buffers
                        values[k] = xp.array(b.images[j], copy=True)
                del srcs, b
                if self.timings is not None:
                    self.timings("decode", time.perf_counter() - t0)
                yield values
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    # groups whose files are read (on the decoding threads) ahead of the one DALI asks for:
    # DALI decodes two ahead of the one handed out, so about five groups' bytes are held
    READ_AHEAD = 3

    def _read_group(self, group, cap, check=True):
        """Start reading ``group``'s files on the decoding threads (a read that never returns
        costs its item after the deadline, and nothing waits for its thread); returns a
        function giving per item ``(bytes, whether the per-batch path must decode it)`` or an
        exception."""
        works = [self.start(_read_image, (it.path, check, cap), (i, it)) for i, it in group]
        return lambda: self.collect(works, timed=False)

    def _admit(self, group, got):
        """One group's read results -> (values: the exceptions so far, the bytes sources for
        the stream, their rows in the group). A source the stream must not decode (over the
        pixel cap, a JPEG 2000 cut short, one for the helper process) is decoded here by
        :func:`decode_image_batch`, which reports (or isolates) it."""
        values, srcs, rows, aside = [None] * len(group), [], [], []
        for k, ((_, it), r) in enumerate(zip(group, got)):
            if isinstance(r, BaseException):
                values[k] = r
            elif r[1]:
                aside.append(k)
            else:
                srcs.append(Source(name=it.path, data=r[0]))
                rows.append(k)
        if aside:
            res = decode_image_batch([Source(name=group[k][1].path, data=got[k][0])
                                      for k in aside], device=self.device,
                                     max_pixels=self.max_pixels)
            for j, e in res.errors:
                values[aside[j]] = renamed(e, group[aside[j]][1].path)
            for j, im in enumerate(res.images):
                if im is not None:
                    values[aside[j]] = im
        return values, srcs, rows

    def _one(self, im, i, epoch):
        if self.train:
            h, w = im.shape[:2]
            crop = _aug.sample_resized_crop_params(self.seed, epoch, [i], h, w, scale=self.scale,
                                                   ratio=self.ratio)
            box = tuple(int(crop[k][0]) for k in ("top", "left", "height", "width"))
            flip = bool(_aug.sample_flip_params(self.seed, epoch, [i])["flip"][0])
            return resize_crop_normalize(im, box=box, size=(self.crop_size, self.crop_size), short_side=None,
                                         crop_size=None, mean=self.mean, std=self.std,
                                         dtype=self.dtype, layout="CHW", flip=flip)
        return resize_crop_normalize(im, short_side=self.resize_size, crop_size=self.crop_size, mean=self.mean,
                                     std=self.std, dtype=self.dtype, layout="CHW")

    def collate(self, values, pairs, epoch, step):
        xp = self.device.xp
        ids = [i for i, _ in pairs]
        if values:
            ims = [self._one(xp.asarray(v) if array_module(v) is not xp else v, i, epoch)
                   for v, i in zip(values, ids)]
            images = xp.ascontiguousarray(xp.stack(ims))
        else:
            images = xp.zeros((0, 3, self.crop_size, self.crop_size), np.dtype(self.dtype))
        # (page-locked: a pageable copy would wait for the producer stream's stack above)
        (labels,) = upload_many(xp, [np.array([self.labels[i] for i in ids], np.int64)])
        return {"images": images, "labels": labels, "paths": [it.path for _, it in pairs]}
