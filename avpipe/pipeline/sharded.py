"""Items from sharded datasets: WebDataset tar shards, NeMo tarred audio and lhotse Shar.

Each reader indexes the shards once (:mod:`avpipe.pipeline.shards`: member offsets, cached per
shard version) and returns a :class:`Listing`: the items, in shard order, each carrying a
:class:`ShardMember` that reads its media by one ranged read, and the errors found on the way
(damaged tar headers, cut members, samples without media, metadata that does not parse), each
``(name, message)``. An item's ``path`` names the shard and the key: ``URL#KEY``.

* :func:`read_webdataset` — WebDataset shards: one sample = the members sharing a key. Audio
  ``KEY.flac|wav|ogg|...`` with ``KEY.json`` (``text``, ``duration``, ``offset``; every other
  field travels in ``item.fields``); video ``KEY.mp4|mkv|webm|...`` and images
  ``KEY.jpg|png|tif|jp2|...`` with a label from ``KEY.cls`` (an integer as text) or
  ``KEY.json`` (``label``).
* :func:`read_nemo_tarred` — NeMo tarred audio: a manifest whose lines name the member
  (``audio_filepath``) and its ``shard_id``, and the shards' pattern
  (``tarred_audio_filepaths``: braces or NeMo's ``_OP_`` / ``_CL_``).
* :func:`read_shar` — lhotse Shar: ``cuts.NNNNNN.jsonl.gz`` beside ``recording.NNNNNN.tar``
  (the i-th cut's audio is the i-th sample of the tar of the same number).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .. import settings, storage
from ..formats import AUDIO_EXTENSIONS, IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from . import shards
from .sources import Item

__all__ = ["ShardMember", "Listing", "is_shard_spec", "is_shar_spec", "read_webdataset",
           "read_nemo_tarred", "read_shar", "sharded_listing", "shard_groups", "is_mix_spec",
           "mix_listing", "MEDIA_EXTENSIONS", "read_ahead", "forget_reads"]

MEDIA_EXTENSIONS = {
    "audio": tuple(e.lstrip(".") for e in AUDIO_EXTENSIONS),
    "video": tuple(e.lstrip(".") for e in VIDEO_EXTENSIONS),
    "image": tuple(e.lstrip(".") for e in IMAGE_EXTENSIONS),
}


@dataclass(frozen=True)
class ShardMember:
    """Where an item's media lives: member ``ext`` of ``sample`` in the shard at ``url``."""

    url: str
    sample: shards.Sample
    ext: str
    storage_options: Any = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return shards.sample_name(self.url, self.sample.key)

    @property
    def size(self) -> int:
        return next(n for x, _, n in self.sample.members if x == self.ext)

    @property
    def span(self) -> tuple:
        """``(offset, size)`` of the member's data in the shard."""
        for x, off, n in self.sample.members:
            if x == self.ext:
                return off, n
        raise KeyError(self.ext)

    def read(self) -> bytes:
        """The member's bytes: from a read planned ahead (:func:`read_ahead`, which reads
        members lying close together in a shard by one ranged read) where there is one, else
        by one ranged read of the member alone. A planned read that failed or came back short
        leaves the member to its own read (retried as every read is), so an error names the
        member whose bytes are bad, not its neighbours."""
        off, n = self.span
        b = _READ_AHEAD.take(self, off, n)
        if b is None:
            b = storage.read_range(self.url, off, n, storage_options=self.storage_options)
        if len(b) != n:
            raise storage.StorageError(
                self.url, f"{self.name}.{self.ext}: read {len(b)} of {n} bytes (did "
                          "the shard change since it was indexed?)")
        return b


# -- read-ahead -----------------------------------------------------------------------------------

# Reads of remote members about to be decoded, planned by the feed (read_ahead) and issued on a
# few threads of their own before the decoding threads ask for the bytes. Members of one shard
# that lie close together become one ranged read (a "run"), sliced per member: an object
# store's request costs far more than the bytes between two members (docs/how-it-works.md,
# "Measured trade-offs"). The runs' bytes held at once are
# bounded (READ_AHEAD_BYTES); a run is dropped once each of its members was taken, or
# READ_AHEAD_TTL seconds after it was planned (a feed stopped early leaves no bytes behind).
COALESCE_GAP = 4 << 20  # the most bytes between two members read by one request
COALESCE_SPAN = 32 << 20  # the most bytes one request reads
READ_AHEAD_BYTES = 64 << 20  # the most bytes of planned runs held (in flight or read) at once
READ_AHEAD_THREADS = 4
READ_AHEAD_TTL = 120.0


class _Run:
    __slots__ = ("url", "start", "end", "opts", "fut", "left", "born", "owner")

    def __init__(self, url, start, end, opts, owner):
        self.url, self.start, self.end, self.opts, self.owner = url, start, end, opts, owner
        self.fut, self.left, self.born = None, 0, time.monotonic()


class _ReadAhead:
    """The process's planned reads: ``(url, offset, size)`` -> ``[run, takes left]``."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pid = None
        self.pool = None
        self.planned: dict = {}
        self.runs: set = set()
        self.held = 0
        self.requests = 0  # ranged reads issued for runs (tests count them)

    def _fresh(self):
        # after a fork: the parent's threads and futures are not this process's
        if self.pid != os.getpid():
            self.pid = os.getpid()
            self.pool = None
            self.planned, self.runs, self.held = {}, set(), 0

    def _drop(self, run):
        if run in self.runs:
            self.runs.discard(run)
            self.held -= run.end - run.start
            if run.fut is not None and run.left > 0:
                run.fut.cancel()

    def _forget(self, gone):
        for run in gone:
            self._drop(run)
        if gone:
            self.planned = {k: v for k, v in self.planned.items() if v[0] in self.runs}

    def forget(self, owner) -> None:
        """Drop the runs ``owner`` planned (a feed closing: its items read ahead for an epoch
        it will not decode hold no bytes)."""
        with self.lock:
            if self.pid == os.getpid():
                self._forget([r for r in self.runs if r.owner == id(owner)])

    def plan(self, members, owner=None) -> int:
        """Plan reads of ``members`` (:class:`ShardMember`, in the order they will be read)
        for ``owner`` (:meth:`forget`); returns the number of runs issued."""
        todo = []
        with self.lock:
            self._fresh()
            now = time.monotonic()
            self._forget([r for r in self.runs if now - r.born > READ_AHEAD_TTL])
            by_shard: dict = {}
            for m in members:
                off, n = m.span
                key = (m.url, off, n)
                ent = self.planned.get(key)
                if ent is not None and ent[0] in self.runs:
                    ent[1] += 1  # read again (a repeat): one more take of the same bytes
                    ent[0].left += 1
                    continue
                by_shard.setdefault((m.url, id(m.storage_options)), [m.storage_options, {}])[
                    1].setdefault(key, [off, n, 0])[2] += 1
            for (url, _), (opts, spans) in by_shard.items():
                run, group = None, []
                for off, n, takes in sorted(spans.values()):
                    if run is not None and off - run.end <= COALESCE_GAP and \
                            off + n - run.start <= COALESCE_SPAN:
                        run.end = max(run.end, off + n)
                    else:
                        if run is not None:
                            todo.append((run, group))
                        run, group = _Run(url, off, off + n, opts, id(owner)), []
                    group.append((off, n, takes))
                if run is not None:
                    todo.append((run, group))
            issued = []
            for run, group in todo:
                if self.held + (run.end - run.start) > READ_AHEAD_BYTES:
                    continue  # over the bound: these members are read when they are decoded
                self.held += run.end - run.start
                self.runs.add(run)
                for off, n, takes in group:
                    self.planned[(run.url, off, n)] = [run, takes]
                    run.left += takes
                issued.append(run)
            if issued and self.pool is None:
                self.pool = ThreadPoolExecutor(max_workers=READ_AHEAD_THREADS,
                                               thread_name_prefix="avpipe-read-ahead")
            for run in issued:
                self.requests += 1
                run.fut = self.pool.submit(storage.read_range, run.url, run.start,
                                           run.end - run.start, storage_options=run.opts)
        return len(issued)

    def take(self, member, off, n):
        """The member's bytes from its planned run, or None (not planned, or the run failed
        or came back short: the caller reads the member itself)."""
        with self.lock:
            if self.pid != os.getpid():
                return None
            key = (member.url, off, n)
            ent = self.planned.get(key)
            if ent is None:
                return None
            run = ent[0]
            ent[1] -= 1
            if ent[1] <= 0:
                del self.planned[key]
            run.left -= 1
            if run.left <= 0:
                self._drop(run)
        try:
            blob = run.fut.result(timeout=settings.storage_timeout() * (
                settings.storage_retries() + 1) + 1.0)
        except Exception:  # noqa: BLE001 - the member's own read retries and names it
            return None
        b = blob[off - run.start: off - run.start + n]
        return b if len(b) == n else None


_READ_AHEAD = _ReadAhead()
if hasattr(os, "register_at_fork"):  # a forked child starts with no plans and a free lock
    os.register_at_fork(after_in_child=lambda: _READ_AHEAD.__init__())


def read_ahead(items, owner=None) -> int:
    """Plan the reads of ``items`` (in the order they will be decoded): their remote shard
    members are read ahead on threads of their own, members of one shard close together by
    one ranged read (see ``COALESCE_GAP`` / ``COALESCE_SPAN``), the bytes held bounded by
    ``READ_AHEAD_BYTES``, dropped by ``forget_reads(owner)``. Items of loose files and of
    local shards are left alone (a local read costs no request). Returns the number of ranged
    reads issued."""
    members = [it.locator for it in items if isinstance(getattr(it, "locator", None),
                                                        ShardMember)
               and not storage.is_local(it.locator.url)]
    return _READ_AHEAD.plan(members, owner) if members else 0


def forget_reads(owner) -> None:
    """Drop the reads planned ahead for ``owner`` (its bytes are not held any longer)."""
    _READ_AHEAD.forget(owner)


@dataclass
class Listing:
    """What a reader found: ``items`` and ``errors`` (``(name, message)``)."""

    items: list
    errors: list


def _spec_names(spec) -> list | None:
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if isinstance(spec, str):
        return storage.expand(spec)
    if isinstance(spec, (list, tuple)) and spec and all(
            isinstance(s, (str, os.PathLike)) for s in spec):
        return storage.expand(list(spec))
    return None


def is_shard_spec(spec) -> bool:
    """A tar path or URL (braces allowed) or a list of them."""
    names = _spec_names(spec)
    return bool(names) and all(n.lower().endswith(".tar") for n in names)


def is_shar_spec(spec, *, storage_options=None) -> bool:
    """A folder or URL prefix holding ``cuts.*.jsonl.gz`` (lhotse Shar), or a dict of fields
    ``{"cuts": [...], "recording": [...]}``."""
    if isinstance(spec, dict):
        return "cuts" in spec
    if not isinstance(spec, (str, os.PathLike)):
        return False
    spec = os.fspath(spec)
    if storage.is_local(spec) and not os.path.isdir(storage.local_path(spec)):
        return False
    if not storage.is_local(spec) and spec.lower().endswith((".tar", ".json", ".jsonl",
                                                               ".csv", ".txt")):
        return False
    try:
        names = storage.listdir(spec, storage_options=storage_options)
    except (OSError, ImportError):
        return False
    return any(n.startswith("cuts.") and n.endswith(".jsonl.gz") for n in names)


def _kind_ext(sample: shards.Sample, kind: str, extensions=None) -> str | None:
    want = MEDIA_EXTENSIONS[kind] if extensions is None else tuple(
        e.lower().lstrip(".") for e in extensions)
    for ext in sample.exts():
        if ext.rsplit(".", 1)[-1].lower() in want:
            return ext
    return None


def _meta(url: str, sample: shards.Sample, blobs: dict) -> dict:
    """The sample's metadata: ``KEY.json`` (an object) and ``KEY.cls`` (an integer)."""
    out = {}
    for ext, data in blobs.items():
        low = ext.lower()
        if low == "json" or low.endswith(".json"):
            d = json.loads(data.decode("utf-8"))
            if not isinstance(d, dict):
                raise ValueError(f"{ext}: a JSON object is expected, got {type(d).__name__}")
            out.update(d)
        elif low == "cls" or low.endswith(".cls"):
            text = data.decode("utf-8").strip()
            try:
                out["label"] = int(text)
            except ValueError:
                raise ValueError(f"{ext}: an integer label is expected, got {text[:40]!r}") \
                    from None
        elif low == "txt" and "text" not in out:
            out["text"] = data.decode("utf-8").strip()
    return out


def _meta_blobs(url, sample, storage_options) -> dict:
    """The small metadata members of a sample (json, cls, txt), by ranged reads."""
    out = {}
    for ext, off, n in sample.members:
        low = ext.lower()
        if low in ("json", "cls", "txt") or low.endswith((".json", ".cls")):
            if n > (16 << 20):
                raise ValueError(f"{ext}: {n} bytes of metadata")
            out[ext] = storage.read_range(url, off, n, storage_options=storage_options)
    return out


def _seconds(v, what):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= float(v) < 1e12):
        raise ValueError(f"{what} must be a number of seconds >= 0, got {v!r}")
    return float(v)


def read_webdataset(spec, *, kind: str | None = None, extensions=None, storage_options=None,
                    threads: int = 16) -> Listing:
    """Items of WebDataset shards (see the module's doc). ``kind``: ``"audio"``, ``"video"``
    or ``"image"``: which member is the item's media; or ``extensions`` (``[".flac", ...]``):
    the first member with one of them."""
    if extensions is None and kind not in MEDIA_EXTENSIONS:
        raise ValueError(f"kind must be one of {sorted(MEDIA_EXTENSIONS)}, got {kind!r}")
    what = kind if extensions is None else "media"
    urls = _spec_names(spec)
    if not urls:
        raise ValueError(f"no shards in {spec!r}")
    indexes = shards.index_shards(urls, storage_options=storage_options, threads=threads)
    items, errors = [], []
    for url, idx in zip(urls, indexes):
        errors.extend(idx.errors)
        metas = _read_metas(url, idx.samples, storage_options, threads)
        for sample, meta in zip(idx.samples, metas):
            name = shards.sample_name(url, sample.key)
            if isinstance(meta, Exception):
                errors.append((name, f"metadata: {meta}"))
                continue
            ext = _kind_ext(sample, kind, extensions)
            if ext is None:
                want = list(MEDIA_EXTENSIONS[kind] if extensions is None else extensions)
                errors.append((name, f"no {what} member ({', '.join(want[:6])}, ...) among "
                                     f"its members {sample.exts()}"))
                continue
            try:
                offset = _seconds(meta.pop("offset", None), "offset") or 0.0
                duration = _seconds(meta.pop("duration", None), "duration")
                text = meta.pop("text", None)
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"text must be a string, got {type(text).__name__}")
            except ValueError as e:
                errors.append((name, f"metadata: {e}"))
                continue
            label = meta.pop("label", None)
            items.append(Item(path=name, raw_path=name, label=label, text=text, offset=offset,
                              duration=duration, fields=meta,
                              locator=ShardMember(url, sample, ext, storage_options)))
    return Listing(items, errors)


def _read_metas(url, samples, storage_options, threads) -> list:
    """Each sample's metadata dict, or the exception that parsing it raised."""

    def one(s):
        try:
            return _meta(url, s, _meta_blobs(url, s, storage_options))
        except (ValueError, UnicodeDecodeError) as e:
            return e

    if storage.is_local(url) or len(samples) < 2:
        return [one(s) for s in samples]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, threads)) as ex:
        return list(ex.map(one, samples))


def read_nemo_tarred(manifest, tarred_audio_filepaths, *, storage_options=None,
                     threads: int = 16) -> Listing:
    """NeMo tarred audio: each manifest line's ``audio_filepath`` names a member of shard
    ``shard_id`` of ``tarred_audio_filepaths`` (expanded in order). A member is found by its
    name in the tar, or else by its base name (NeMo's tarring script stores base names)."""
    from .sources import manifest_records

    urls = _spec_names(tarred_audio_filepaths)
    if not urls:
        raise ValueError(f"tarred_audio_filepaths names no shards: {tarred_audio_filepaths!r}")
    records = manifest_records(manifest)  # a line that breaks the manifest rule raises
    errors = []
    want = {}
    for rec in records:
        sid = rec.fields.get("shard_id")
        if isinstance(sid, bool) or not isinstance(sid, int) or not 0 <= sid < len(urls):
            errors.append((f"{os.fspath(manifest)}:{rec.line}",
                           f"shard_id must be an integer in [0, {len(urls)}), got {sid!r}"))
            continue
        want.setdefault(sid, []).append(rec)
    used = sorted(want)
    indexes = shards.index_shards([urls[s] for s in used], storage_options=storage_options,
                                  threads=threads)
    by_shard = {}
    for sid, idx in zip(used, indexes):
        errors.extend(idx.errors)
        names = {}
        for s in idx.samples:
            for ext in s.exts():
                full = f"{s.key}.{ext}"
                names.setdefault(full, (s, ext))
                names.setdefault(os.path.basename(full), (s, ext))
        by_shard[sid] = names
    items = []
    for rec in records:
        sid = rec.fields.get("shard_id")
        if sid not in by_shard:
            continue
        url = urls[sid]
        hit = by_shard[sid].get(rec.path) or by_shard[sid].get(os.path.basename(rec.path))
        name = f"{url}#{rec.path}"
        if hit is None:
            errors.append((name, f"no member {rec.path!r} in shard {sid} ({url})"))
            continue
        sample, ext = hit
        f = dict(rec.fields)
        f.pop("shard_id", None)
        text = f.pop("text", None)
        offset = f.pop("offset", None) or 0.0
        duration = f.pop("duration", None)
        items.append(Item(path=shards.sample_name(url, sample.key), raw_path=rec.path,
                          text=text if text is not None else "", offset=offset,
                          duration=duration, fields=f,
                          locator=ShardMember(url, sample, ext, storage_options)))
    return Listing(items, errors)


def _shar_fields(spec, storage_options) -> dict:
    if isinstance(spec, dict):
        return {k: _spec_names(v) or [] for k, v in spec.items()}
    spec = os.fspath(spec)
    names = storage.listdir(spec, storage_options=storage_options)
    fields = {}
    for n in names:
        parts = n.split(".")
        if len(parts) >= 3 and parts[1].isdigit():
            fields.setdefault(parts[0], []).append(storage.join(spec, n))
    return {k: sorted(v) for k, v in fields.items()}


def read_shar(spec, *, storage_options=None, threads: int = 16) -> Listing:
    """lhotse Shar (see the module's doc): items with the cut's transcript (its supervisions'
    texts joined by spaces), its ``start`` / ``duration`` as offset and duration, and its id,
    supervisions and recording fields in ``item.fields``."""
    fields = _shar_fields(spec, storage_options)
    cuts_files = fields.get("cuts") or []
    recs = fields.get("recording") or []
    if not cuts_files:
        raise ValueError(f"no cuts.NNNNNN.jsonl.gz in the Shar at {spec!r}")
    if len(recs) != len(cuts_files):
        raise ValueError(f"the Shar at {spec!r} has {len(cuts_files)} cut files and "
                         f"{len(recs)} recording tars: they must pair up")
    indexes = shards.index_shards(recs, storage_options=storage_options, threads=threads)
    items, errors = [], []
    for cf, url, idx in zip(cuts_files, recs, indexes):
        errors.extend(idx.errors)
        raw = storage.read_object(cf, storage_options=storage_options)
        try:
            lines = gzip.decompress(raw).decode("utf-8").splitlines()
        except (OSError, EOFError, UnicodeDecodeError) as e:
            errors.append((cf, f"not a gzip'ed JSON-lines file: {e}"))
            continue
        cuts = []
        for ln, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                c = json.loads(line)
                if not isinstance(c, dict) or not isinstance(c.get("id"), str):
                    raise ValueError("a cut is a JSON object with a string id")
            except ValueError as e:
                errors.append((f"{cf}:{ln}", f"not a cut: {e}"))
                cuts.append(None)
                continue
            cuts.append(c)
        # the i-th cut's audio is the i-th sample of the tar (lhotse writes them in step)
        samples = list(idx.samples)
        by_key = {s.key: s for s in samples}
        for k, c in enumerate(cuts):
            if c is None:
                continue
            cid = c["id"]
            s = samples[k] if k < len(samples) and _shar_match(samples[k], cid) else None
            if s is None:
                s = by_key.get(cid.split(".", 1)[0])
                if s is not None and not _shar_match(s, cid):
                    s = None
            name = shards.sample_name(url, cid)
            if s is None:
                errors.append((name, "the cut's recording is not in the tar"))
                continue
            ext = _kind_ext(s, "audio")
            if ext is None:
                errors.append((name, f"no audio member among {s.exts()}"))
                continue
            sups = c.get("supervisions") or []
            text = " ".join(str(x.get("text") or "") for x in sups
                            if isinstance(x, dict)).strip()
            try:
                start = _seconds(c.get("start", 0.0), "start") or 0.0
                duration = _seconds(c.get("duration"), "duration")
            except ValueError as e:
                errors.append((name, str(e)))
                continue
            extra = {k2: v for k2, v in c.items() if k2 not in ("start", "duration")}
            items.append(Item(path=name, raw_path=cid, text=text, offset=start,
                              duration=duration, fields=extra,
                              locator=ShardMember(url, s, ext, storage_options)))
    return Listing(items, errors)


def _shar_match(sample: shards.Sample, cut_id: str) -> bool:
    return any(f"{sample.key}.{ext}".startswith(cut_id + ".") for ext in sample.exts())


def sharded_listing(spec, *, kind: str, storage_options=None, tarred_audio_filepaths=None):
    """The :class:`Listing` of a sharded source, or None where ``spec`` is none (a manifest,
    CSV, list or folder of loose files, which the recipes read as before): NeMo tarred audio
    when ``tarred_audio_filepaths`` is given (``spec``: its manifest), WebDataset shards, or a
    lhotse Shar (audio)."""
    if tarred_audio_filepaths is not None:
        if kind != "audio":
            raise ValueError("tarred_audio_filepaths is for audio feeds")
        return read_nemo_tarred(spec, tarred_audio_filepaths, storage_options=storage_options)
    if is_shard_spec(spec):
        return read_webdataset(spec, kind=kind, storage_options=storage_options)
    if kind == "audio" and is_shar_spec(spec, storage_options=storage_options):
        return read_shar(spec, storage_options=storage_options)
    return None


def shard_groups(items) -> list:
    """A group id per item: the number of its shard, in the order shards first appear (for
    :class:`avpipe.pipeline.feed.Feed`'s ``groups``). Every item must come from a shard."""
    ids: dict = {}
    out = []
    for it in items:
        loc = it.locator
        if loc is None or not hasattr(loc, "url"):
            raise ValueError(f"shard_order=True takes sharded sources only; {it.path!r} is a "
                             "loose file")
        out.append(ids.setdefault(loc.url, len(ids)))
    return out


def is_mix_spec(spec) -> bool:
    """A list of sources with weights (NeMo's ``input_cfg``): dicts holding ``weight``."""
    return isinstance(spec, (list, tuple)) and bool(spec) and all(
        isinstance(s, dict) for s in spec)


def mix_listing(spec, *, read, seed: int) -> Listing:
    """Sources mixed by weight, as NeMo's ``input_cfg`` and lhotse's ``mux`` mix them.

    ``spec``: a list of dicts, each ``{"source": ..., "weight": w}`` (``manifest_filepath``
    is taken for ``source``, with ``tarred_audio_filepaths`` where given, as in NeMo's
    ``input_cfg``); ``read(source, tarred_audio_filepaths) -> Listing`` reads one. With ``N``
    the items of all sources together, source ``i`` gives ``round(N * w_i / sum(w))`` items:
    drawn from a permutation of its own items seeded by ``(seed, i)``, taken in turn and
    repeated where the weight asks for more items than it has. The mix is a function of the
    sources and ``seed`` alone: every rank, resume and epoch sees the same item list (the feed
    shuffles it per epoch)."""
    from .feed.plans import permutation

    parts, total = [], 0
    for k, s in enumerate(spec):
        src = s.get("source", s.get("manifest_filepath"))
        if src is None:
            raise ValueError(f"mix source {k}: needs 'source' (or 'manifest_filepath'), got "
                             f"{sorted(s)}")
        w = s.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0 or w == float(
                "inf"):
            raise ValueError(f"mix source {k}: weight must be a number > 0, got {w!r}")
        got = read(src, s.get("tarred_audio_filepaths"))
        parts.append((float(w), got))
        total += len(got.items)
    wsum = sum(w for w, _ in parts)
    items, errors = [], []
    for k, (w, got) in enumerate(parts):
        errors.extend(got.errors)
        n = len(got.items)
        want = int(round(total * w / wsum))
        if n == 0 or want == 0:
            continue
        order = permutation(n, seed=seed, epoch=0, stream=f"mix.{k}")
        picks = [int(order[j % n]) for j in range(want)]
        items.extend(got.items[j] for j in picks)
    return Listing(items, errors)
