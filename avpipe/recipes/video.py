"""Video classification feed: a CSV ``path,label`` -> batches of normalized clips.

::

    feed = avpipe.recipes.video_classification("train.csv", clip_length=16, stride=4,
                                               crop_size=224, batch_size=8, seed=0)
    for batch in feed:
        batch.clips   # [B, 16, 3, 224, 224] float16, ImageNet-normalized
        batch.labels  # [B] int64, indices into feed.classes

``train=True``: one clip per video at a random start (``clip_length`` frames, ``stride`` apart),
then one random resized crop (area ``scale``, aspect ``ratio``, torchvision's rule with ten
tries, then a centre crop) and one horizontal flip (p = 0.5) for all its frames. Every draw is
a counter-based draw of ``(seed, stream, epoch, item id)`` (:mod:`avpipe.ops.random`), so a
resumed run crops and flips identically. ``train=False``: ``num_clips`` clips spread evenly
over each video x ``num_crops`` crops (short side resized to ``crop_size``; crops at the start,
centre and end of the long side): ``V = num_clips * num_crops`` views per video, batch fields
``clips [B * V, T, 3, S, S]``, ``labels [B * V]`` and ``video_index [B * V]`` (the view's video
within the batch: average the logits over it).

Decoding: :class:`avpipe.VideoDecoder` per item in a thread pool (NVDEC on a GPU, PyAV on the
CPU), only the frames a clip needs; a video shorter than a clip repeats its last frame. The
crop / resize / normalize is :func:`avpipe.ops.image.resize_crop_normalize` (fused kernels on a
GPU), run in the decoding thread on its own CUDA stream.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from ..decoding.video import VideoDecoder
from ..device import array_module, resolve_device
from ..ops import random as _rnd
from ..ops.image import IMAGENET_MEAN, IMAGENET_STD, resize_crop_normalize
from ..pipeline.feed import Feed, Task
from ..pipeline.sources import class_index, read_csv

__all__ = ["video_classification", "VideoTask", "random_resized_box"]


def video_classification(file_list, *, clip_length=16, stride=4, crop_size=224, batch_size=8,
                         train=True, seed=0, shuffle=None, rank=0, world_size=1, device=None,
                         framework=None, on_error="skip", num_clips=4, num_crops=3,
                         scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3), dtype="float16",
                         prefetch=2, deadline=None, threads=None):
    """A :class:`~avpipe.pipeline.feed.Feed` of video clips (module docstring).
    ``shuffle=None``: shuffle when training. ``feed.classes``: the sorted label names.
    ``threads``: decoding threads (None: 16 on a GPU, as NVDEC sessions per thread; else the
    CPU count, at most 8)."""
    spec = (video_classification, dict(
        file_list=file_list, clip_length=clip_length, stride=stride, crop_size=crop_size,
        batch_size=batch_size, train=train, seed=seed, shuffle=shuffle, rank=rank,
        world_size=world_size, device=device, framework=framework, on_error=on_error,
        num_clips=num_clips, num_crops=num_crops, scale=scale, ratio=ratio, dtype=dtype,
        prefetch=prefetch, deadline=deadline, threads=threads))  # fmt: skip
    items = read_csv(file_list)
    classes, labels = class_index(items)
    dev = resolve_device(device)
    if threads is None:
        import os

        threads = 16 if dev.is_cuda else min(8, os.cpu_count() or 1)
    task = VideoTask(labels=labels, clip_length=clip_length, stride=stride, crop_size=crop_size,
                     train=train, seed=seed, device=dev, num_clips=num_clips,
                     num_crops=num_crops, scale=scale, ratio=ratio, dtype=dtype,
                     deadline=deadline, threads=threads)
    return Feed(items, task, batch_size=batch_size, seed=seed,
                shuffle=bool(train) if shuffle is None else bool(shuffle), rank=rank,
                world_size=world_size, prefetch=prefetch, on_error=on_error, device=dev,
                framework=framework, classes=classes, spec=spec)


def random_resized_box(h, w, u, *, scale, ratio):
    """torchvision's RandomResizedCrop box ``(top, left, height, width)`` from 40 uniform
    draws ``u`` (ten tries of area / log-aspect / top / left, then a centre crop)."""
    area = h * w
    lr0, lr1 = math.log(ratio[0]), math.log(ratio[1])
    for k in range(10):
        a = area * (scale[0] + (scale[1] - scale[0]) * u[4 * k])
        r = math.exp(lr0 + (lr1 - lr0) * u[4 * k + 1])
        cw = int(round(math.sqrt(a * r)))
        ch = int(round(math.sqrt(a / r)))
        if 0 < cw <= w and 0 < ch <= h:
            top = int(u[4 * k + 2] * (h - ch + 1))
            left = int(u[4 * k + 3] * (w - cw + 1))
            return top, left, ch, cw
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def _clip_indices(n, clip_length, stride, start):
    idx = start + np.arange(clip_length, dtype=np.int64) * stride
    return np.minimum(idx, max(n - 1, 0))


class VideoTask(Task):
    array_fields = ("clips", "labels", "video_index")

    def __init__(self, *, labels, clip_length, stride, crop_size, train, seed, device,
                 num_clips=4, num_crops=3, scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3),
                 dtype="float16", mean=IMAGENET_MEAN, std=IMAGENET_STD, deadline=None,
                 threads=8):
        super().__init__()
        self.labels = list(labels)
        self.T, self.stride, self.S = int(clip_length), int(stride), int(crop_size)
        self.train, self.seed, self.device = bool(train), int(seed), device
        self.num_clips, self.num_crops = int(num_clips), int(num_crops)
        if self.num_crops not in (1, 3):
            raise ValueError(f"num_crops must be 1 or 3, got {num_crops!r}")
        self.scale, self.ratio = tuple(scale), tuple(ratio)
        self.dtype, self.mean, self.std = dtype, mean, std
        self.deadline, self.threads = deadline, int(threads)
        self._local = threading.local()

    def _stream(self):
        s = getattr(self._local, "stream", None)
        if s is None and self.device.is_cuda:
            import cupy

            with cupy.cuda.Device(self.device.index):
                s = self._local.stream = cupy.cuda.Stream(non_blocking=True)
        return s

    def _transform(self, frames, i, epoch):
        """[T, H, W, 3] uint8 -> [T, 3, S, S] (train: random resized crop + flip)."""
        T, H, W, _ = frames.shape
        if self.train:
            u = _rnd.uniform(self.seed, "crop", epoch, [i], 40)[0]
            top, left, ch, cw = random_resized_box(H, W, u, scale=self.scale, ratio=self.ratio)
            x = frames[:, top : top + ch, left : left + cw]
            y = resize_crop_normalize(x, short_side=None, size=(self.S, self.S), crop_size=None,
                                      mean=self.mean, std=self.std, dtype=self.dtype,
                                      layout="NCHW")
            if bool(_rnd.bernoulli(self.seed, "flip", epoch, [i], p=0.5)[0, 0]):
                y = array_module(y).ascontiguousarray(y[..., ::-1])
            return y[None]
        y = resize_crop_normalize(frames, short_side=self.S, crop_size=None, mean=self.mean,
                                  std=self.std, dtype=self.dtype, layout="NCHW")
        h, w = y.shape[-2:]
        if self.num_crops == 1:
            offs = [((h - self.S) // 2, (w - self.S) // 2)]
        elif w >= h:
            offs = [(0 + (h - self.S) // 2, x0) for x0 in (0, (w - self.S) // 2, w - self.S)]
        else:
            offs = [(y0, (w - self.S) // 2) for y0 in (0, (h - self.S) // 2, h - self.S)]
        return offs, y

    def decode_one(self, i, item):
        with self.device.activate():
            return self._decode_one(i, item)

    def _decode_one(self, i, item):
        import time

        epoch = self.epoch
        stream = self._stream()
        t0 = time.perf_counter()
        dec = VideoDecoder(item.path, device=self.device)
        if self.timings is not None:  # open + packet scan: the "read" stage of stats()
            self.timings("read", time.perf_counter() - t0)
        with dec:
            n = len(dec)
            span = (self.T - 1) * self.stride + 1
            if self.train:
                start = int(_rnd.integers(self.seed, "clip", epoch, [i],
                                          high=max(1, n - span + 1))[0, 0])
                idx = _clip_indices(n, self.T, self.stride, start)[None]
            else:
                starts = np.round(np.linspace(0, max(0, n - span), self.num_clips)).astype(int)
                idx = np.stack([_clip_indices(n, self.T, self.stride, s) for s in starts])
            uniq, inv = np.unique(idx.reshape(-1), return_inverse=True)
            frames = dec.get_frames(uniq).data
        if stream is not None:
            with stream:
                out = self._views(frames, inv.reshape(idx.shape), i, epoch)
            stream.synchronize()  # ready for the producer's stream
            return out
        return self._views(frames, inv.reshape(idx.shape), i, epoch)

    def _views(self, frames, inv, i, epoch):
        xp = array_module(frames)
        if self.train:
            return self._transform(frames[xp.asarray(inv[0])], i, epoch)
        views = []
        for c in range(inv.shape[0]):
            offs, y = self._transform(frames[xp.asarray(inv[c])], i, epoch)
            for y0, x0 in offs:
                views.append(y[:, :, y0 : y0 + self.S, x0 : x0 + self.S])
        return xp.ascontiguousarray(xp.stack(views))

    def collate(self, values, pairs, epoch, step):
        xp = self.device.xp
        ids = [i for i, _ in pairs]
        V = 1 if self.train else self.num_clips * self.num_crops
        if values:
            clips = xp.concatenate([xp.asarray(v) for v in values])
        else:
            clips = xp.zeros((0, self.T, 3, self.S, self.S), np.dtype(self.dtype))
        labels = np.repeat(np.array([self.labels[i] for i in ids], np.int64), V)
        vidx = np.repeat(np.arange(len(ids), dtype=np.int64), V)
        return {"clips": clips, "labels": xp.asarray(labels), "video_index": xp.asarray(vidx),
                "paths": [it.path for _, it in pairs], "views": V}
