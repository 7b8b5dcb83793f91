"""Training from stored features: an ``avpipe extract`` output folder (or URL) as a feed.

::

    # avpipe extract train.jsonl --preset nemo --out s3://bucket/feats/
    feed = avpipe.recipes.feature_feed("s3://bucket/feats/", batch_size=32, seed=0)
    for batch in feed:
        batch.features         # [B, 80, T] (the stored dtype), padded with zeros
        batch.feature_lengths  # [B] frames (the last axis)
        batch.transcripts, batch.labels, batch.paths

The items are the ``ok`` rows of the output's ``index.jsonl``; its failed rows are listed in
``feed.errors`` from the start. A tar output's arrays are read by ranged reads of their shard
(the shard's member offsets are indexed once and cached, :mod:`avpipe.pipeline.shards`); an
``npy`` output's by one read of each file. Order, ranks, ``len(feed)``, resume (also across a
world size change) and errors are the feed's (:class:`avpipe.pipeline.feed.Feed`), as for the
other recipes.

A batch stacks its arrays along a new first axis, each padded with zeros to the batch's largest
size on every axis. ``feature_lengths``: each item's size on the last axis (audio features'
frames); ``shapes [B, ndim]``: each item's shape; ``transcripts``: the rows' ``text`` field
(``""`` where none); ``labels``: their ``label`` field (None where none); ``paths``: the inputs
as extraction named them; ``keys``: their keys in the output.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import storage
from ..device import resolve_device
from ..errors import CorruptDataError
from ..pipeline import shards
from ..pipeline.feed import Feed, Task
from ..pipeline.sharded import ShardMember
from ..pipeline.sources import Item, within_max_duration

__all__ = ["feature_feed", "FeatureTask", "read_feature_index"]

INDEX_NAME = "index.jsonl"


@dataclass(frozen=True)
class _Object:
    """A whole object (an ``npy`` output's file) as an item's bytes."""

    url: str
    storage_options: Any = field(default=None, compare=False, repr=False)

    def read(self) -> bytes:
        return storage.read_object(self.url, storage_options=self.storage_options)


def read_feature_index(source, *, storage_options=None):
    """``(items, errors)`` of an extraction output: ``source`` is its folder / URL prefix, or
    its ``index.jsonl``."""
    src = str(source)
    if src.endswith(".jsonl"):
        index_url, base = src, src.rsplit("/", 1)[0] if "/" in src else "."
    else:
        index_url, base = storage.join(src, INDEX_NAME), src
    try:
        raw = storage.read_object(index_url, storage_options=storage_options)
    except FileNotFoundError:
        raise FileNotFoundError(f"{index_url}: no index.jsonl: not an avpipe extract output "
                                "(or the run has not finished: its index is written at the end)")\
            from None
    rows = []
    for ln, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise CorruptDataError(f"{index_url}:{ln}", f"not an index line ({e})") from None
    errors = [(str(r.get("source")), f"{r.get('error') or r.get('status')}: "
                                     f"{r.get('message') or ''}".strip())
              for r in rows if r.get("status") != "ok"]
    ok = [r for r in rows if r.get("status") == "ok"]
    tars = sorted({r["shard"] for r in ok if str(r.get("shard", "")).endswith(".tar")})
    if any(str(r.get("shard", "")).endswith(".parquet") for r in ok):
        raise ValueError(f"{src}: a parquet output; feature_feed reads tar and npy outputs "
                         "(avpipe extract --format tar, the default)")
    urls = {t: storage.join(base, t) for t in tars}
    idx = shards.index_shards([urls[t] for t in tars], storage_options=storage_options)
    samples = {t: {s.key: s for s in ix.samples} for t, ix in zip(tars, idx)}
    items = []
    for r in ok:
        fields = dict(r.get("fields") or {})
        info = r.get("info") or {}
        dur = fields.get("duration", info.get("seconds"))
        key = str(r["key"])
        if r.get("shard"):
            s = samples.get(r["shard"], {}).get(key)
            if s is None or "npy" not in s.exts():
                errors.append((str(r.get("source")), f"no {key}.npy in {r['shard']}"))
                continue
            loc = ShardMember(urls[r["shard"]], s, "npy", storage_options)
        elif r.get("output"):
            loc = _Object(storage.join(base, r["output"]), storage_options)
        else:
            errors.append((str(r.get("source")), "the index row names no output"))
            continue
        items.append(Item(
            path=str(r.get("source")), raw_path=key, label=fields.get("label"),
            text=fields.get("text"), duration=None if dur is None else float(dur),
            fields={"key": key, "shape": r.get("shape"), "dtype": r.get("dtype")},
            locator=loc))
    return items, errors


class FeatureTask(Task):
    """Reads stored arrays and pads them into batches."""

    array_fields = ("features", "feature_lengths", "shapes")

    def __init__(self, *, device, threads=8, deadline=None):
        super().__init__()
        self.device = device
        self.threads = int(threads)
        self.deadline = deadline

    def decode_one(self, i, item):
        data = item.media()
        try:
            a = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise CorruptDataError(item.path, f"stored array {item.raw_path}.npy: {e}") from None
        want = item.fields.get("shape")
        if want is not None and list(a.shape) != list(want):
            raise CorruptDataError(item.path, f"stored array {item.raw_path}.npy has shape "
                                              f"{list(a.shape)}, the index says {want}")
        return a

    def collate(self, values, pairs, epoch, step):
        items = [it for _, it in pairs]
        xp = self.device.xp
        if values:
            nd = max(v.ndim for v in values)
            shapes = np.array([(1,) * (nd - v.ndim) + v.shape for v in values], np.int64)
            big = shapes.max(axis=0)
            dtype = np.result_type(*[v.dtype for v in values])
            host = np.zeros((len(values), *big), dtype)
            for r, v in enumerate(values):
                host[(r, *[slice(0, n) for n in shapes[r]])] = v.reshape(shapes[r])
            lens = shapes[:, -1].copy()
        else:
            host = np.zeros((0, 0), np.float32)
            shapes = np.zeros((0, 0), np.int64)
            lens = np.zeros(0, np.int64)
        return {
            "features": xp.asarray(host),
            "feature_lengths": xp.asarray(lens),
            "shapes": xp.asarray(shapes),
            "transcripts": [it.text or "" for it in items],
            "labels": [it.label for it in items],
            "paths": [it.path for it in items],
            "keys": [it.raw_path for it in items],
            "durations": [it.duration for it in items],
        }


def feature_feed(source, *, batch_size=None, max_duration=None, seed=0, shuffle=True, rank=0,
                 world_size=1, training=True, device=None, framework=None, on_error="skip",
                 prefetch=2, threads=8, deadline=None, bucket_window=100,
                 storage_options=None):
    """A :class:`~avpipe.pipeline.feed.Feed` over an ``avpipe extract`` output (module doc).
    ``batch_size`` items per batch, or ``max_duration`` seconds per batch (the rows' ``duration``
    field, else the decoded seconds extraction recorded). ``training``: where too few items are
    left for every rank, repeat the epoch's first ones (True) or give empty batches (False:
    every item exactly once). ``storage_options``: passed to fsspec for a URL."""
    spec = (feature_feed, dict(
        source=source, batch_size=batch_size, max_duration=max_duration, seed=seed,
        shuffle=shuffle, rank=rank, world_size=world_size, training=training, device=device,
        framework=framework, on_error=on_error, prefetch=prefetch, threads=threads,
        deadline=deadline, bucket_window=bucket_window, storage_options=storage_options))
    items, errors = read_feature_index(source, storage_options=storage_options)
    items, left_out = within_max_duration(items, max_duration)
    errors += left_out
    dev = resolve_device(device)
    task = FeatureTask(device=dev, threads=threads, deadline=deadline)
    return Feed(items, task, batch_size=batch_size, max_duration=max_duration,
                durations=[it.duration or 0.0 for it in items], seed=seed, shuffle=shuffle,
                rank=rank, world_size=world_size, prefetch=prefetch, on_error=on_error,
                device=dev, framework=framework, bucket_window=bucket_window,
                initial_errors=errors, spec=spec, pad="repeat" if training else "empty")
