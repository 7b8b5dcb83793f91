"""Video classification feed: a CSV ``path,label`` -> batches of normalized clips.

::

    feed = avpipe.recipes.video_classification("train.csv", clip_length=16, stride=4,
                                               crop_size=224, batch_size=8, seed=0)
    for batch in feed:
        batch.clips   # [B, 16, 3, 224, 224] float16, ImageNet-normalized
        batch.labels  # [B] int64, indices into feed.classes

The contract, in both modes: ``clips [B, clip_length, 3, crop_size, crop_size]`` floating
point, normalized; ``labels [B]`` integer; ``paths [B]``; ``B <= batch_size``.
``layout="CTHW"`` gives ``clips [B, 3, clip_length, crop_size, crop_size]`` instead, the layout
torchvision's and PyTorchVideo's video models take (``layout="TCHW"``, the default, is the
one above); the clips are made as above and transposed once per batch (a contiguous copy).

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
epoch across the ranks; a video that fails is skipped with all its views and listed once in
``feed.errors``; the batches its views would have filled come out short or, at the end of the
epoch, empty: ``clips [0, ...]`` with the other axes kept). Per-video scores: average the
logits of the rows sharing a ``video_index`` (e.g. ``np.add.at(sums, batch.video_index,
logits)``).

Decoding: :func:`avpipe.pipeline.clips.decode_clip` per item in a thread pool (in eval, per
video of a batch: its views there share one open file and each clip is decoded once) (the same clip
decoding as :class:`avpipe.pipeline.clips.ClipFeed`: a :class:`avpipe.VideoDecoder`, NVDEC on a
GPU, PyAV on the CPU, only the frames a clip needs; the transform on the thread's own CUDA
stream); a video shorter than a clip repeats its last frame. On a GPU, a training clip whose
decoded frames take at most ``VideoTask.DEFER_BYTES`` (32 MiB: 16 frames up to about 540p) is
cropped and resized with the rest of its batch when the batch is collated: every such clip's
box in one launch (:func:`~avpipe.ops.image_augment.fused_resized_crop_normalize` on a list of
clips) instead of a call per clip, at the cost of holding those decoded frames until then (the
batches being decoded ahead: about two). Larger clips, and clips with colour jitter or
grayscale, are transformed on their thread as they come. The draws and the values are the same
either way.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time

import numpy as np

from .. import settings
from .._validate import check_choice
from ..decoding import load_index
from ..device import array_module, keep_until_done, resolve_device, upload_many
from ..errors import naming
from ..ops import image_augment as _aug
from ..ops import random as _rnd
from ..ops.image import IMAGENET_MEAN, IMAGENET_STD, resize_crop_normalize
from ..pipeline.clips import ThreadStreams, decode_clip
from ..pipeline.feed import Feed, Task
from ..pipeline.samplers import clip_indices_at, clip_indices_regular
from ..pipeline.scan_ahead import SCAN_DEPTH, ScanAhead, lookahead
from ..pipeline.sharded import sharded_listing
from ..pipeline.sources import class_index, read_csv

__all__ = ["video_classification", "VideoTask", "eval_views", "clips_in_layout", "LAYOUTS"]


def video_classification(file_list, *, clip_length=16, stride=4, crop_size=224, batch_size=8,
                         train=True, seed=0, shuffle=None, rank=0, world_size=1, device=None,
                         framework=None, on_error="skip", num_clips=4, num_crops=3,
                         scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3), dtype="float16",
                         prefetch=2, deadline="auto", threads=None, color_jitter=None,
                         grayscale_p=0.0, temporal_jitter=0, index=None, root=None,
                         layout="TCHW", storage_options=None):
    """A :class:`~avpipe.pipeline.feed.Feed` of video clips (module docstring).
    ``shuffle=None``: shuffle when training. ``feed.classes``: the sorted label names.
    ``threads``: decoding threads (None: 16 on a GPU, as NVDEC sessions per thread; else the
    CPU count, at most 8). ``color_jitter`` (a dict of brightness / contrast / saturation /
    hue), ``grayscale_p`` and ``temporal_jitter``: training extras, off by default.
    ``index``: a persisted video index (``avpipe index``'s file, :func:`avpipe.decoding.build_index`):
    files it holds, unchanged since, open without a scan. Files it lacks are scanned as they
    come; MP4 / MOV ones by ``AVPIPE_VIDEO_SCAN_AHEAD`` processes a few batches before their
    decoding (see ``avpipe.pipeline.scan_ahead``). ``root``: a folder every listed video must
    lie under; a CSV row without a path or label, or outside ``root``, raises
    :class:`~avpipe.errors.ManifestError` / :class:`~avpipe.errors.OutsideRootError`.
    ``layout``: ``"TCHW"`` (clips ``[B, T, 3, S, S]``) or ``"CTHW"`` (``[B, 3, T, S, S]``,
    torchvision's / PyTorchVideo's). ``file_list`` may also be WebDataset shards (a path or URL
    with brace ranges, or a list: ``KEY.mp4|mkv|webm|...`` with ``KEY.cls``, an integer that is
    the class index, or ``KEY.json`` ``{"label": ...}``), read through fsspec with
    ``storage_options``; a video is read by one ranged read of its member."""
    check_choice("layout", layout, LAYOUTS)
    spec = (video_classification, dict(
        file_list=file_list, clip_length=clip_length, stride=stride, crop_size=crop_size,
        batch_size=batch_size, train=train, seed=seed, shuffle=shuffle, rank=rank,
        world_size=world_size, device=device, framework=framework, on_error=on_error,
        num_clips=num_clips, num_crops=num_crops, scale=scale, ratio=ratio, dtype=dtype,
        prefetch=prefetch, deadline=deadline, threads=threads, color_jitter=color_jitter,
        grayscale_p=grayscale_p, temporal_jitter=temporal_jitter, index=index, root=root,
        layout=layout, storage_options=storage_options))  # fmt: skip
    listing = sharded_listing(file_list, kind="video", storage_options=storage_options)
    if listing is None:
        videos, errors = read_csv(file_list, root=root), []
    else:
        videos, errors = listing.items, list(listing.errors)
    classes, labels = class_index(videos, integers_are_indices=listing is not None)
    dev = resolve_device(device)
    if threads is None:
        import os

        threads = 16 if dev.is_cuda else min(8, os.cpu_count() or 1)
    task = VideoTask(labels=labels, clip_length=clip_length, stride=stride, crop_size=crop_size,
                     train=train, seed=seed, device=dev, num_clips=num_clips,
                     num_crops=num_crops, scale=scale, ratio=ratio, dtype=dtype,
                     deadline=deadline, threads=threads, color_jitter=color_jitter,
                     grayscale_p=grayscale_p, temporal_jitter=temporal_jitter, index=index,
                     layout=layout)
    items = videos if train else eval_views(videos, task.views)
    return Feed(items, task, batch_size=batch_size, seed=seed,
                shuffle=bool(train) if shuffle is None else bool(shuffle), rank=rank,
                world_size=world_size, prefetch=prefetch, on_error=on_error, device=dev,
                framework=framework, classes=classes, spec=spec, initial_errors=errors,
                pad="repeat" if train else "empty")


LAYOUTS = ("TCHW", "CTHW")


def clips_in_layout(clips, layout: str):
    """A batch of clips ``[B, T, 3, S, S]`` (numpy or cupy) in ``layout``: as is for
    ``"TCHW"``, ``[B, 3, T, S, S]`` (contiguous) for ``"CTHW"``."""
    check_choice("layout", layout, LAYOUTS)
    if layout == "TCHW":
        return clips
    xp = array_module(clips)
    return xp.ascontiguousarray(clips.transpose(0, 2, 1, 3, 4))


def eval_views(videos, views):
    """The eval items: each video's ``views`` views in order, video-major; item ``k`` is
    video ``k // views``, view ``k % views`` (``item.fields["video"]``, ``["view"]``)."""
    return [dataclasses.replace(it, fields={**it.fields, "video": v, "view": k})
            for v, it in enumerate(videos) for k in range(int(views))]


@dataclasses.dataclass
class _Deferred:
    """A training clip's decoded frames, left for its batch's collate (``VideoTask``)."""

    frames: object  # [T, H, W, 3] uint8 on the device
    draws: object = None  # the batch's Task.ahead table its thread drew from, if any


class VideoTask(Task):
    array_fields = ("clips", "labels", "video_index", "view")
    DEFER_BYTES = 32 << 20  # a clip's decoded frames at most this: resized in the collate
    # the words a clip's random resized crop and flip draw (their samplers' streams and counts)
    _CROP_DRAWS = (("random_resized_crop", 40), ("flip", 1))

    def __init__(self, *, labels, clip_length, stride, crop_size, train, seed, device,
                 num_clips=4, num_crops=3, scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3),
                 dtype="float16", mean=IMAGENET_MEAN, std=IMAGENET_STD, deadline="auto",
                 threads=8, color_jitter=None, grayscale_p=0.0, temporal_jitter=0,
                 index=None, layout="TCHW"):
        super().__init__()
        self.layout = check_choice("layout", layout, LAYOUTS)
        self.labels = list(labels)
        self.clip_length, self.stride = int(clip_length), int(stride)
        self.crop_size = int(crop_size)
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
        self._made = threading.local()  # drawn_in_groups' tables, per producer thread
        self.index = None if index is None else load_index(index)
        self._scan_ahead = None  # started by the first decode_groups
        # on a GPU, small training clips are cropped, resized (and colour-jittered) a batch
        # at a time (the collate)
        self._defer = self.train and device.is_cuda

    @property
    def views(self) -> int:
        return 1 if self.train else self.num_clips * self.num_crops

    # -- draws ---------------------------------------------------------------------------------
    DRAW_GROUPS = 8  # training batches whose draws are made in one Philox pass

    def ahead(self, pairs):
        """Task.ahead: a training batch's draws (clip start, crop box, flip and the extras') in
        one Philox pass on the producer, read by the decoding threads; made with the next
        batches' where :meth:`drawn_in_groups` saw them coming."""
        if not self.train:
            return None
        ids = [i for i, _ in pairs]
        made = getattr(self._made, "tables", None)
        if made:
            table = made.pop((self.epoch, tuple(ids)), None)
            if table is not None:
                return table
        return _rnd.draw_ahead(self.seed, self.epoch, ids, self._ahead_requests())

    def _ahead_requests(self):
        reqs = [("clip", 1), *self._transform_draws()]
        if self.temporal_jitter > 0:
            reqs.append(("temporal_jitter", 1 + self.clip_length))
        return reqs

    def drawn_in_groups(self, groups):
        """``groups`` (of ``(id, item)`` pairs) unchanged and in order; in training, each
        ``DRAW_GROUPS`` of them first drawn in one pass (:func:`avpipe.ops.random.
        draw_ahead_groups`, the words :meth:`ahead` hands each batch: the same words as one
        pass a batch). Run on the thread that then calls :meth:`ahead` (the producer's)."""
        if not self.train:
            yield from groups
            return
        it = iter(groups)
        while True:
            chunk = list(itertools.islice(it, self.DRAW_GROUPS))
            if not chunk:
                return
            ids = [[i for i, _ in g] for g in chunk]
            tables = _rnd.draw_ahead_groups(self.seed, self.epoch, ids, self._ahead_requests())
            # (this thread's: another producer, a next epoch's, keeps its own)
            self._made.tables = {(self.epoch, tuple(k)): t for k, t in zip(ids, tables)}
            yield from chunk

    def _transform_draws(self):
        """The words a clip's training transform draws: its samplers' streams and counts (the
        crop and flip, the colour jitter and grayscale where on)."""
        reqs = list(self._CROP_DRAWS)
        if self.color_jitter is not None:
            reqs.append(("color_jitter", 8))
        if self.grayscale_p > 0:
            reqs.append(("grayscale", 1))
        return reqs

    # -- frame indices -------------------------------------------------------------------------
    def _train_indices(self, n, i, epoch):
        """The training clip's frame indices [T] for a video of ``n`` frames."""
        span = (self.clip_length - 1) * self.stride + 1
        start = int(_rnd.integers(self.seed, "clip", epoch, [i], high=max(1, n - span + 1))[0, 0])
        idx = clip_indices_at(n, start, clip_length=self.clip_length, stride=self.stride)
        if self.temporal_jitter > 0:
            p = _aug.sample_temporal_jitter_params(self.seed, epoch, [i], self.clip_length,
                                                   max_jitter=self.temporal_jitter)
            idx = _aug.apply_temporal_jitter(idx[None], n, p)[0]
        return idx

    def _eval_indices(self, n, clips):
        """[len(clips), T] frame indices of eval clips ``clips`` (spread evenly)."""
        idx = clip_indices_regular(n, clip_length=self.clip_length, stride=self.stride,
                                   num_clips=self.num_clips, short_video="repeat_last")
        return idx[np.asarray(clips, np.int64)]

    # -- transforms ----------------------------------------------------------------------------
    def _train_transform(self, frames, i, epoch):
        """[T, H, W, 3] uint8 -> [T, 3, S, S]: the random resized crop's box read in place by
        the fused resize + normalize (``resize_crop_normalize(box=...)``; on a GPU one launch
        for the clip) with the flip folded into the resize, (then colour jitter, grayscale)."""
        T, H, W, _ = frames.shape
        p = _aug.sample_resized_crop_params(self.seed, epoch, [i], H, W, scale=self.scale,
                                            ratio=self.ratio)
        box = tuple(int(p[k][0]) for k in ("top", "left", "height", "width"))
        size = (self.crop_size, self.crop_size)
        # the flip commutes with the pixel-wise colour ops and the contrast's frame mean (with
        # the flip folded in, that mean sums the pixels mirrored: float rounding may move a
        # value by a float16 step)
        flip = bool(_aug.sample_flip_params(self.seed, epoch, [i])["flip"][0])
        if self.color_jitter is None and self.grayscale_p <= 0:
            return resize_crop_normalize(frames, box=box, size=size, short_side=None,
                                         crop_size=None, mean=self.mean, std=self.std,
                                         dtype=self.dtype, layout="NCHW", flip=flip)  # fmt: skip
        # the colour ops work on 0..255 values: normalize after them
        y = resize_crop_normalize(frames, box=box, size=size, short_side=None, crop_size=None,
                                  mean=0.0, std=1.0, scale=1.0, dtype="float32", layout="NHWC",
                                  flip=flip)[None]  # fmt: skip
        return self._colour.apply(y, [*self._colour_draws([i], epoch), {}])[0]

    def _resize_deferred(self, values, ids, epoch):
        """The collate's part of the training transform: the deferred clips (``_Deferred``)
        of ``values`` cropped and resized in one call, with their draws (the same as
        ``_train_transform``'s, made for them at once). Returns the batch ``[B, T, 3, S, S]``
        when every clip was deferred, else ``values`` with the deferred ones replaced."""
        k = [j for j, v in enumerate(values) if isinstance(v, _Deferred)]
        if not k:
            return values
        frames = [values[j].frames for j in k]
        kid = [ids[j] for j in k]
        hw = np.array([f.shape[1:3] for f in frames], np.int64)
        tables = {id(values[j].draws): values[j].draws for j in k}
        (table,) = tables.values() if len(tables) == 1 else (None,)
        # the words of Task.ahead's table (one batch's: one table), else one pass for them
        with (_rnd.drawn_from(table) if table is not None else
              _rnd.drawn_together(self.seed, epoch, kid, self._transform_draws())):
            p = _aug.sample_resized_crop_params(self.seed, epoch, kid, hw[:, 0], hw[:, 1],
                                                scale=self.scale, ratio=self.ratio)
            p["flip"] = _aug.sample_flip_params(self.seed, epoch, kid)["flip"]
            colour = self._colour_draws(kid, epoch)
        try:
            if not colour:
                y = _aug.fused_resized_crop_normalize(frames, p, self.crop_size, mean=self.mean,
                                                      std=self.std, dtype=self.dtype,
                                                      layout="NCHW")  # fmt: skip
            elif self.grayscale_p <= 0:  # the jitter between the crop and the normalize
                y = _aug.fused_resized_crop_normalize(frames, p, self.crop_size, color_jitter=colour[0],
                                                      bound=255.0, mean=self.mean, std=self.std,
                                                      scale=1.0 / 255.0, dtype=self.dtype,
                                                      layout="NCHW")  # fmt: skip
            else:  # 0..255 floats, then the colour ops and the normalize over the batch
                y = _aug.fused_resized_crop_normalize(frames, p, self.crop_size, mean=0.0, std=1.0,
                                                      scale=1.0, dtype="float32",
                                                      layout="NHWC")  # fmt: skip
                y = self._colour.apply(y, [*colour, {}])
        except Exception as e:
            if type(e).__name__ != "OutOfMemoryError":  # (cupy's)
                raise
            # the batch's output did not fit: each clip alone, as its thread would have
            y = [self._train_transform(f, i, epoch) for f, i in zip(frames, kid)]
        if len(k) == len(values):
            return y
        out = list(values)
        for r, j in enumerate(k):
            out[j] = y[r]
        return out

    def _colour_draws(self, ids, epoch):
        """The colour jitter's and grayscale's params of clips ``ids`` (those on), in
        :meth:`_colour_chain`'s order."""
        out = []
        if self.color_jitter is not None:
            out.append(_aug.sample_color_jitter_params(self.seed, epoch, ids,
                                                       **self.color_jitter))  # fmt: skip
        if self.grayscale_p > 0:
            out.append(_aug.sample_grayscale_params(self.seed, epoch, ids, p=self.grayscale_p))
        return out

    @functools.cached_property
    def _colour(self):
        return self._colour_chain()

    def _colour_chain(self):
        """Colour jitter, grayscale (those on) and the normalize of ``[B, T, S, S, 3]`` 0..255
        floats to ``[B, T, 3, S, S]``: on a GPU the jitter and the normalize in one pass
        where no grayscale comes between them. The transform's steps, for a batch (made once:
        ``_colour``)."""
        ops = []
        if self.color_jitter is not None:
            ops.append(_aug.ColorJitter(**self.color_jitter, bound=255.0, layout="BTHWC"))
        if self.grayscale_p > 0:
            ops.append(_aug.RandomGrayscale(self.grayscale_p, layout="BTHWC"))
        ops.append(_aug.Normalize(self.mean, self.std, scale=1.0 / 255.0, dtype=self.dtype,
                                  out_layout="NCHW", layout="BTHWC"))  # fmt: skip
        return _aug.Chain(ops)

    def _eval_views(self, frames):
        """[T, H, W, 3] uint8 -> [num_crops, T, 3, S, S]: short side to S, then the crops."""
        if self.num_crops == 1:  # the centre crop folded into the resize
            return resize_crop_normalize(frames, short_side=self.crop_size, crop_size=self.crop_size,
                                         mean=self.mean, std=self.std, dtype=self.dtype,
                                         layout="NCHW")[None]  # fmt: skip
        y = resize_crop_normalize(frames, short_side=self.crop_size, crop_size=None, mean=self.mean,
                                  std=self.std, dtype=self.dtype, layout="NCHW")
        return _aug.n_crop(y[None], self.crop_size, n=3, layout="BTCHW")[0]

    # -- decoding ------------------------------------------------------------------------------
    def decode_groups(self, groups):
        """Task.decode_groups, with the files of the next ``SCAN_DEPTH`` groups scanned ahead
        in other processes (``AVPIPE_VIDEO_SCAN_AHEAD``; the module docstring) and the training
        draws of ``DRAW_GROUPS`` groups made at once (:meth:`drawn_in_groups`)."""
        if self._scan_ahead is None:
            self._scan_ahead = ScanAhead(settings.video_scan_ahead())
        ahead = self._scan_ahead
        if ahead.active:
            index = self.index

            def seen(group):
                ahead.submit(it.path for _, it in group if it.locator is None
                             and (index is None or it.path not in index))

            groups = lookahead(groups, SCAN_DEPTH, seen)
        # (after the lookahead: a chunk's tables are all handed out before the next is drawn)
        return super().decode_groups(self.drawn_in_groups(groups))

    def _on_open(self, path):
        """Take ``path``'s scan if it was read ahead; the ``on_open`` for decode_clip (the
        wait for that scan plus the open: the "read" stage of stats())."""
        t0 = time.perf_counter()
        ahead = self._scan_ahead  # (close() on another thread may clear it)
        if ahead is not None:
            ahead.take(path)
        waited = time.perf_counter() - t0
        if self.timings is None:
            return None

        def on_open(sec):
            self.timings("read", sec + waited)

        return on_open

    def close(self):
        super().close()
        if self._scan_ahead is not None:
            self._scan_ahead.close()
            self._scan_ahead = None

    def decode_one(self, i, item):
        if not self.train:
            return self.decode_views([(i, item)])[0]
        with self.device.activate():
            epoch = self.epoch

            def select(dec):
                uniq, inv = np.unique(self._train_indices(len(dec), i, epoch),
                                      return_inverse=True)
                return dec.get_frames(uniq).data, (None if len(uniq) == len(inv) else inv)

            def transform(frames, inv):
                if inv is not None:  # a short video: repeated frames
                    frames = frames[array_module(frames).asarray(inv)]
                if self._defer and frames.nbytes <= self.DEFER_BYTES:
                    return _Deferred(frames, _rnd.drawn_table())
                return self._train_transform(frames, i, epoch)

            src, index = self._source(item)
            with naming(item.path, src):
                out, _, _, _ = decode_clip(src, select, transform, device=self.device,
                                           stream=self._streams.get(),
                                           on_open=self._on_open(item.path), index=index)
            return out

    def _source(self, item):
        """``(source, index)`` to open: a shard member's bytes (no persisted index applies to
        them), else the path and the feed's index."""
        return item.media(), (None if item.locator is not None else self.index)

    def decode_views(self, pairs):
        """Eval: views of one video (``pairs`` of ``(id, item)``, all the same video), its file
        opened once and each clip decoded and resized once; one ``[T, 3, S, S]`` per pair."""
        views = [int(it.fields["view"]) for _, it in pairs]
        clips = sorted({v // self.num_crops for v in views})
        with self.device.activate():
            def select(dec):
                idx = self._eval_indices(len(dec), clips)  # [C, T]
                uniq, inv = np.unique(idx.reshape(-1), return_inverse=True)
                return dec.get_frames(uniq).data, inv.reshape(idx.shape)

            def transform(frames, inv):
                xp = array_module(frames)
                per_clip = {}
                for c, row in zip(clips, inv):
                    per_clip[c] = self._eval_views(frames[xp.asarray(row)])
                return [xp.ascontiguousarray(per_clip[v // self.num_crops][v % self.num_crops])
                        for v in views]

            item = pairs[0][1]
            src, index = self._source(item)
            with naming(item.path, src):
                out, _, _, _ = decode_clip(src, select, transform, device=self.device,
                                           stream=self._streams.get(),
                                           on_open=self._on_open(item.path), index=index)
            return out

    def submit(self, pairs):
        """Eval: one job per video of the group (its views decoded together)."""
        if self.train:
            return super().submit(pairs)
        rows = {}
        for k, (_, it) in enumerate(pairs):
            rows.setdefault(it.fields["video"], []).append(k)
        jobs = list(rows.values())
        futs = [self.start(self.decode_views, ([pairs[k] for k in ks],), pairs[ks[0]])
                for ks in jobs]

        def result():
            got = self.collect(futs)
            out = [None] * len(pairs)
            for ks, g in zip(jobs, got):
                for j, k in enumerate(ks):
                    out[k] = g if isinstance(g, BaseException) else g[j]
            return out

        return result

    def collate(self, values, pairs, epoch, step):
        xp = self.device.xp
        items = [it for _, it in pairs]
        vids = [i if self.train else it.fields["video"] for i, it in pairs]
        if values:
            made = [v.frames if isinstance(v, _Deferred) else v for v in values]
            values = self._resize_deferred(values, [i for i, _ in pairs], epoch)
            clips = values if not isinstance(values, list) else xp.stack(
                [xp.asarray(v) for v in values])
            if self.device.is_cuda:  # the threads made these on their own streams' memory:
                import cupy  # held until this stream's kernels that read them are done

                done = cupy.cuda.Event()
                done.record()
                keep_until_done(done, made)
        else:
            clips = xp.zeros((0, self.clip_length, 3, self.crop_size, self.crop_size), np.dtype(self.dtype))
        clips = clips_in_layout(clips, self.layout)
        # the small arrays in one copy from page-locked memory (a copy from pageable memory
        # would first wait for the producer stream's work: the stack above)
        host = [np.array([self.labels[v] for v in vids], np.int64)]
        if not self.train:
            host += [np.array(vids, np.int64),
                     np.array([it.fields["view"] for it in items], np.int64)]
        small = upload_many(xp, host)
        out = {"clips": clips, "labels": small[0], "paths": [it.path for it in items]}
        if not self.train:
            out["video_index"], out["view"] = small[1], small[2]
        return out

