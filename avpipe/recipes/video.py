"""Video classification feed: a CSV ``path,label`` -> batches of normalized clips.

::

    feed = avpipe.recipes.video_classification("train.csv", clip_length=16, stride=4,
                                               crop_size=224, batch_size=8, seed=0)
    for batch in feed:
        batch.clips   # [B, 16, 3, 224, 224] float16, ImageNet-normalized
        batch.labels  # [B] int64, indices into feed.classes

The contract, in both modes: ``clips [B, clip_length, 3, crop_size, crop_size]`` floating
point, normalized; ``labels [B]`` integer; ``paths [B]``; ``B <= batch_size``.

``train=True``: one clip per video at a random start (``clip_length`` frames, ``stride`` apart),
then :mod:`avpipe.ops.image_augment`'s draws for all its frames:
:func:`~avpipe.ops.image_augment.sample_resized_crop_params` (area ``scale``, aspect ``ratio``,
torchvision's rule with ten tries, then a centre crop), folded into the fused resize
(:func:`~avpipe.ops.image_augment.fused_resized_crop_normalize`), and
:func:`~avpipe.ops.image_augment.sample_flip_params` (p = 0.5). Optional extras (off by
default): ``color_jitter=dict(brightness=, contrast=, saturation=, hue=)``, ``grayscale_p``,
``temporal_jitter`` (each frame index moved by up to that many frames). Every draw is keyed by
``(seed, stream, epoch, item id)`` (:mod:`avpipe.ops.random`), so a resumed run crops and flips
identically, on the CPU and on a GPU.

``train=False``: the unit of a batch is a *view*. Each video has ``V = num_clips * num_crops``
views, in order ``view = clip * num_crops + crop`` (``num_clips`` clips spread evenly over the
video; short side resized to ``crop_size``, then ``num_crops`` crops: 1 the centre, 3 at the
start, centre and end of the long side, :func:`~avpipe.ops.image_augment.n_crop`). The feed's
items are the ``(video, view)`` pairs (video-major: ``len(file_list) * V`` items); a batch holds
``batch_size`` views, with ``video_index [B]`` (the video's row in the file list) and ``view
[B]`` besides ``clips``, ``labels`` and ``paths``. ``len(feed)`` counts these batches; sharding
and resume work on the expanded list as on any other (every (video, view) pair exactly once per
epoch across the ranks). Per-video scores: average the logits of the rows sharing a
``video_index`` (e.g. ``np.add.at(sums, batch.video_index, logits)``).

Decoding: :func:`avpipe.pipeline.clips.decode_clip` per item in a thread pool (the same clip
decoding as :class:`avpipe.pipeline.clips.ClipFeed`: a :class:`avpipe.VideoDecoder`, NVDEC on a
GPU, PyAV on the CPU, only the frames a clip needs; the transform on the thread's own CUDA
stream); a video shorter than a clip repeats its last frame.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..device import array_module, resolve_device
from ..ops import image_augment as _aug
from ..ops import random as _rnd
from ..ops.image import IMAGENET_MEAN, IMAGENET_STD, normalize, resize_crop_normalize
from ..pipeline.clips import ThreadStreams, decode_clip
from ..pipeline.feed import Feed, Task
from ..pipeline.sources import class_index, read_csv

__all__ = ["video_classification", "VideoTask", "eval_views"]


def video_classification(file_list, *, clip_length=16, stride=4, crop_size=224, batch_size=8,
                         train=True, seed=0, shuffle=None, rank=0, world_size=1, device=None,
                         framework=None, on_error="skip", num_clips=4, num_crops=3,
                         scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3), dtype="float16",
                         prefetch=2, deadline=None, threads=None, color_jitter=None,
                         grayscale_p=0.0, temporal_jitter=0):
    """A :class:`~avpipe.pipeline.feed.Feed` of video clips (module docstring).
    ``shuffle=None``: shuffle when training. ``feed.classes``: the sorted label names.
    ``threads``: decoding threads (None: 16 on a GPU, as NVDEC sessions per thread; else the
    CPU count, at most 8). ``color_jitter`` (a dict of brightness / contrast / saturation /
    hue), ``grayscale_p`` and ``temporal_jitter``: training extras, off by default."""
    spec = (video_classification, dict(
        file_list=file_list, clip_length=clip_length, stride=stride, crop_size=crop_size,
        batch_size=batch_size, train=train, seed=seed, shuffle=shuffle, rank=rank,
        world_size=world_size, device=device, framework=framework, on_error=on_error,
        num_clips=num_clips, num_crops=num_crops, scale=scale, ratio=ratio, dtype=dtype,
        prefetch=prefetch, deadline=deadline, threads=threads, color_jitter=color_jitter,
        grayscale_p=grayscale_p, temporal_jitter=temporal_jitter))  # fmt: skip
    videos = read_csv(file_list)
    classes, labels = class_index(videos)
    dev = resolve_device(device)
    if threads is None:
        import os

        threads = 16 if dev.is_cuda else min(8, os.cpu_count() or 1)
    task = VideoTask(labels=labels, clip_length=clip_length, stride=stride, crop_size=crop_size,
                     train=train, seed=seed, device=dev, num_clips=num_clips,
                     num_crops=num_crops, scale=scale, ratio=ratio, dtype=dtype,
                     deadline=deadline, threads=threads, color_jitter=color_jitter,
                     grayscale_p=grayscale_p, temporal_jitter=temporal_jitter)
    items = videos if train else eval_views(videos, task.views)
    return Feed(items, task, batch_size=batch_size, seed=seed,
                shuffle=bool(train) if shuffle is None else bool(shuffle), rank=rank,
                world_size=world_size, prefetch=prefetch, on_error=on_error, device=dev,
                framework=framework, classes=classes, spec=spec)


def eval_views(videos, views):
    """The eval items: each video's ``views`` views in order, video-major; item ``k`` is
    video ``k // views``, view ``k % views`` (``item.extra["video"]``, ``["view"]``)."""
    return [dataclasses.replace(it, extra={**it.extra, "video": v, "view": k})
            for v, it in enumerate(videos) for k in range(int(views))]


def _clip_indices(n, clip_length, stride, start):
    idx = np.asarray(start, np.int64)[..., None] + np.arange(clip_length, dtype=np.int64) * stride
    return np.minimum(idx, max(n - 1, 0))


class VideoTask(Task):
    array_fields = ("clips", "labels", "video_index", "view")

    def __init__(self, *, labels, clip_length, stride, crop_size, train, seed, device,
                 num_clips=4, num_crops=3, scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3),
                 dtype="float16", mean=IMAGENET_MEAN, std=IMAGENET_STD, deadline=None,
                 threads=8, color_jitter=None, grayscale_p=0.0, temporal_jitter=0):
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
        if color_jitter is not None:
            bad = set(color_jitter) - {"brightness", "contrast", "saturation", "hue"}
            if bad:
                raise ValueError(f"color_jitter takes brightness, contrast, saturation, hue; "
                                 f"got {sorted(bad)}")
        self.color_jitter = dict(color_jitter) if color_jitter else None
        self.grayscale_p = float(grayscale_p)
        self.temporal_jitter = int(temporal_jitter)
        self._streams = ThreadStreams(device)

    @property
    def views(self) -> int:
        return 1 if self.train else self.num_clips * self.num_crops

    # -- frame indices -------------------------------------------------------------------------
    def _indices(self, n, i, item, epoch):
        """The clip's frame indices [T] for a video of ``n`` frames."""
        span = (self.T - 1) * self.stride + 1
        if self.train:
            start = int(_rnd.integers(self.seed, "clip", epoch, [i],
                                      high=max(1, n - span + 1))[0, 0])
            idx = _clip_indices(n, self.T, self.stride, start)
            if self.temporal_jitter > 0:
                p = _aug.sample_temporal_jitter_params(self.seed, epoch, [i], self.T,
                                                       max_jitter=self.temporal_jitter)
                idx = _aug.apply_temporal_jitter(idx[None], n, p)[0]
            return idx
        clip = item.extra["view"] // self.num_crops
        starts = np.round(np.linspace(0, max(0, n - span), self.num_clips)).astype(int)
        return _clip_indices(n, self.T, self.stride, starts[clip])

    # -- transforms ----------------------------------------------------------------------------
    def _train_transform(self, frames, i, epoch):
        """[T, H, W, 3] uint8 -> [T, 3, S, S]: random resized crop folded into the fused resize
        + normalize, (colour jitter, grayscale,) flip."""
        xp = array_module(frames)
        T, H, W, _ = frames.shape
        crop = _aug.sample_resized_crop_params(self.seed, epoch, [i], H, W, scale=self.scale,
                                               ratio=self.ratio)
        x = frames[None]
        if self.color_jitter is None and self.grayscale_p <= 0:
            y = _aug.fused_resized_crop_normalize(x, crop, self.S, in_layout="BTHWC",
                                                  mean=self.mean, std=self.std,
                                                  dtype=self.dtype, layout="NCHW")
        else:  # the colour ops work on 0..255 values: normalize after them
            y = _aug.fused_resized_crop_normalize(x, crop, self.S, in_layout="BTHWC", mean=0.0,
                                                  std=1.0, scale=1.0, dtype="float32",
                                                  layout="NHWC")
            if self.color_jitter is not None:
                p = _aug.sample_color_jitter_params(self.seed, epoch, [i], **self.color_jitter)
                y = _aug.apply_color_jitter(y, p, bound=255.0, layout="BTHWC")
            if self.grayscale_p > 0:
                p = _aug.sample_grayscale_params(self.seed, epoch, [i], p=self.grayscale_p)
                y = _aug.apply_grayscale(y, p, layout="BTHWC")
            y = normalize(y, self.mean, self.std, scale=1.0 / 255.0, dtype=self.dtype,
                          layout="NHWC")
            y = xp.moveaxis(y, -1, 2)
        flip = _aug.sample_flip_params(self.seed, epoch, [i])
        if bool(flip["flip"][0]):
            y = y[..., ::-1]
        return xp.ascontiguousarray(y[0])

    def _eval_transform(self, frames, view):
        """[T, H, W, 3] uint8 -> the view's [T, 3, S, S]: short side to S, then its crop."""
        xp = array_module(frames)
        y = resize_crop_normalize(frames, short_side=self.S, crop_size=None, mean=self.mean,
                                  std=self.std, dtype=self.dtype, layout="NCHW")
        k = view % self.num_crops
        if self.num_crops == 1:
            c = _aug.center_crop_clips(y[None], self.S, layout="BTCHW")
        else:
            c = _aug.n_crop(y[None], self.S, n=3, layout="BTCHW")[:, k]
        return xp.ascontiguousarray(c[0])

    # -- decoding ------------------------------------------------------------------------------
    def decode_one(self, i, item):
        with self.device.activate():
            return self._decode_one(i, item)

    def _decode_one(self, i, item):
        epoch = self.epoch

        def select(dec):
            n = len(dec)
            uniq, inv = np.unique(self._indices(n, i, item, epoch), return_inverse=True)
            frames = dec.get_frames(uniq).data
            return frames, (None if len(uniq) == len(inv) else inv)

        def transform(frames, inv):
            if inv is not None:  # a short video: repeated frames
                frames = frames[array_module(frames).asarray(inv)]
            if self.train:
                return self._train_transform(frames, i, epoch)
            return self._eval_transform(frames, item.extra["view"])

        on_open = None
        if self.timings is not None:  # open + packet scan: the "read" stage of stats()
            def on_open(sec):
                self.timings("read", sec)
        out, _, _, _ = decode_clip(item.path, select, transform, device=self.device,
                                   stream=self._streams.get(), on_open=on_open)
        return out

    def collate(self, values, pairs, epoch, step):
        xp = self.device.xp
        items = [it for _, it in pairs]
        vids = [i if self.train else it.extra["video"] for i, it in pairs]
        if values:
            clips = xp.stack([xp.asarray(v) for v in values])
        else:
            clips = xp.zeros((0, self.T, 3, self.S, self.S), np.dtype(self.dtype))
        out = {"clips": clips,
               "labels": xp.asarray(np.array([self.labels[v] for v in vids], np.int64)),
               "paths": [it.path for it in items]}
        if not self.train:
            out["video_index"] = xp.asarray(np.array(vids, np.int64))
            out["view"] = xp.asarray(np.array([it.extra["view"] for it in items], np.int64))
        return out

