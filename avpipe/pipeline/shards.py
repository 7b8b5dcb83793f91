"""WebDataset-style tar shards: an index of each shard's samples, and reads of one sample.

A shard is a POSIX tar. Its members are grouped into samples by key, as WebDataset groups them:
the key is the member's name up to the first dot of its base name (``a/b/utt1.flac`` and
``a/b/utt1.json`` are sample ``a/b/utt1``, members ``flac`` and ``json``); the members of one
sample stand next to each other.

:func:`index_shard` walks the tar's headers once (a local file by seeks; a remote object by
ranged reads of 1 MiB windows, skipping the data of larger members) and keeps, for every
sample, its members' byte ranges. The index is cached in ``AVPIPE_CACHE_DIR/shards/``, keyed by
the URL and the object's version (size and ETag, generation or mtime), so a changed shard is
indexed again. :func:`read_sample` then reads one sample by one ranged read: a shard is never held
in memory whole, and any sample can be read in any order.

Damage is recorded, never silent: a header whose checksum fails is reported with its byte offset
and the walk resynchronises at the next valid header; a member cut short by the end of the
object loses its sample, which is reported by name. ``ShardIndex.errors`` lists these as
``(name, message)``; the feeds add them to ``feed.errors``.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .. import settings, storage

__all__ = ["Sample", "ShardIndex", "split_key", "index_shard", "index_shards", "read_sample",
           "sample_name"]

BLOCK = 512
WINDOW = 1 << 20  # bytes per ranged read while indexing a remote shard
INDEX_FORMAT = 1
_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


@dataclass(frozen=True)
class Sample:
    """One sample of a shard: ``key``; ``start`` / ``end``: the byte span from its first
    member's header to its last member's data; ``members``: ``(ext, offset, size)`` of each
    member's data, in shard order (``ext`` as written, after the key's dot: ``flac``,
    ``seg.json``)."""

    key: str
    start: int
    end: int
    members: tuple

    def exts(self) -> list:
        return [m[0] for m in self.members]


@dataclass(frozen=True)
class ShardIndex:
    """A shard's samples in shard order; ``errors``: ``(name, message)`` for damage found;
    ``version``: the object's version the index was built from."""

    url: str
    size: int
    version: str
    samples: tuple
    errors: tuple = ()

    def __len__(self):
        return len(self.samples)


def split_key(name: str):
    """``(key, ext)`` of a member name, or None for a name without an extension."""
    m = _KEY.match(name)
    return None if m is None else (m.group(1), m.group(2))


def sample_name(url: str, key: str) -> str:
    """How a shard's sample is named in ``batch.paths`` and ``feed.errors``: ``URL#KEY``."""
    return f"{url}#{key}"


class _Windows:
    """Bytes of an object at absolute offsets, read in windows (one request per window)."""

    def __init__(self, url, size, storage_options):
        self.url, self.size, self.opts = url, size, storage_options
        self.local = storage.is_local(url)
        self.fd = os.open(storage.local_path(url), os.O_RDONLY) if self.local else None
        self.base, self.buf = 0, b""

    def read(self, at: int, n: int) -> bytes:
        if self.local:
            return os.pread(self.fd, n, at)
        if not (self.base <= at and at + n <= self.base + len(self.buf)):
            want = min(max(WINDOW, n), max(0, self.size - at))
            self.base, self.buf = at, storage.read_range(self.url, at, want,
                                                         storage_options=self.opts)
        return self.buf[at - self.base: at - self.base + n]

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _pax_fields(data: bytes) -> dict:
    out, pos = {}, 0
    while pos < len(data):
        sp = data.find(b" ", pos)
        if sp < 0:
            break
        try:
            n = int(data[pos:sp])
        except ValueError:
            break
        if n <= 0:
            break
        rec = data[sp + 1: pos + n - 1]
        k, _, v = rec.partition(b"=")
        out[k.decode("utf-8", "replace")] = v.decode("utf-8", "surrogateescape")
        pos += n
    return out


def _walk(url: str, size: int, storage_options) -> tuple:
    """(members, errors): ``(name, header_offset, data_offset, size)`` per regular member."""
    r = _Windows(url, size, storage_options)
    members, errors = [], []
    pos, long_name, pax = 0, None, {}
    damaged_at = None
    try:
        while pos + BLOCK <= size:
            hdr = r.read(pos, BLOCK)
            if len(hdr) < BLOCK:
                break
            if hdr == b"\0" * BLOCK:
                if damaged_at is None:
                    # the end-of-archive blocks (or padding): what follows must be zeros too
                    nxt = r.read(pos + BLOCK, BLOCK)
                    if not nxt or nxt == b"\0" * len(nxt):
                        break
                pos += BLOCK
                continue
            try:
                ti = tarfile.TarInfo.frombuf(hdr, "utf-8", "surrogateescape")
            except tarfile.HeaderError:
                if damaged_at is None:
                    damaged_at = pos
                    errors.append((f"{url}@{pos}", f"damaged tar header at byte {pos}: the "
                                   "member there is lost; reading on from the next valid header"))
                pos += BLOCK  # resynchronise: the next block with a valid header
                continue
            if damaged_at is not None and hdr[257:262] != b"ustar":
                pos += BLOCK  # a checksum that holds by chance inside data: not a header
                continue
            damaged_at = None
            data_at = pos + BLOCK
            n = int(ti.size)
            padded = (n + BLOCK - 1) // BLOCK * BLOCK
            if ti.type in (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE, tarfile.XGLTYPE,
                           tarfile.GNUTYPE_LONGLINK):
                body = r.read(data_at, n) if n <= (1 << 20) else b""
                if ti.type == tarfile.GNUTYPE_LONGNAME:
                    long_name = body.rstrip(b"\0").decode("utf-8", "surrogateescape")
                elif ti.type == tarfile.XHDTYPE:
                    pax = _pax_fields(body)
                pos = data_at + padded
                continue
            name = pax.get("path") or long_name or ti.name
            if "size" in pax:
                try:
                    n = int(pax["size"])
                    padded = (n + BLOCK - 1) // BLOCK * BLOCK
                except ValueError:
                    pass
            long_name, pax = None, {}
            if ti.type in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE):
                if data_at + n > size:
                    errors.append((name, f"member {name!r} is cut short by the end of the shard "
                                         f"({size - data_at} of {n} bytes)"))
                    break
                members.append((name, pos, data_at, n))
            pos = data_at + padded
        else:
            if 0 < size - pos < BLOCK:
                errors.append((f"{url}@{pos}", f"the shard ends inside a tar header at byte "
                                               f"{pos}"))
    finally:
        r.close()
    return members, errors


def _group(url, members, errors) -> tuple:
    """Samples from consecutive members sharing a key; a sample whose member was cut short by
    the end of the shard (the last error, named by the member) is left out and named."""
    groups = []
    for name, hdr_at, data_at, n in members:
        kx = split_key(name)
        if kx is None:
            continue  # a member without an extension (a folder, a stray file): no sample
        key, ext = kx
        if groups and groups[-1][0] == key:
            groups[-1][2] = data_at + n
            groups[-1][3].append((ext, data_at, n))
        else:
            groups.append([key, hdr_at, data_at + n, [(ext, data_at, n)]])
    errs = []
    for name, msg in errors:
        kx = None if name.startswith(url + "@") else split_key(name)
        if kx is None:
            errs.append((name, msg))
            continue
        if groups and groups[-1][0] == kx[0]:
            groups.pop()  # its other members came before the cut: the sample is incomplete
        errs.append((sample_name(url, kx[0]), msg))
    out, seen = [], set()
    for key, start, end, mem in groups:
        if key in seen:
            errs.append((sample_name(url, key), "the key appears twice in the shard (its "
                                                "members are not next to each other): the "
                                                "later sample is left out"))
            continue
        seen.add(key)
        out.append(Sample(key, start, end, tuple(mem)))
    return tuple(out), tuple(errs)


def _cache_path(url: str, version: str) -> str:
    return os.path.join(settings.cache_dir(), "shards",
                        storage.fingerprint(INDEX_FORMAT, url, version) + ".json")


def _load_cached(path, url, version):
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    if d.get("format") != INDEX_FORMAT or d.get("url") != url or d.get("version") != version:
        return None
    try:
        samples = tuple(Sample(k, int(s), int(e), tuple((x, int(o), int(n)) for x, o, n in m))
                        for k, s, e, m in d["samples"])
        errors = tuple((a, b) for a, b in d["errors"])
        return ShardIndex(url, int(d["size"]), version, samples, errors)
    except (KeyError, TypeError, ValueError):
        return None


def index_shard(url, *, storage_options=None, cache: bool = True) -> ShardIndex:
    """The index of one shard (cached per shard version unless ``cache=False``). A missing
    shard raises FileNotFoundError; one that cannot be read, :class:`avpipe.storage.StorageError`."""
    url = os.fspath(url)
    info = storage.stat(url, storage_options=storage_options)
    path = _cache_path(url, info.version)
    if cache:
        hit = _load_cached(path, url, info.version)
        if hit is not None:
            return hit
    members, errors = _walk(url, info.size, storage_options)
    samples, errors = _group(url, members, errors)
    idx = ShardIndex(url, info.size, info.version, samples, errors)
    if cache:
        d = {"format": INDEX_FORMAT, "url": url, "size": info.size, "version": info.version,
             "samples": [[s.key, s.start, s.end, [list(m) for m in s.members]]
                         for s in samples],
             "errors": [list(e) for e in errors]}
        try:
            storage.write_object(path, json.dumps(d, separators=(",", ":")).encode())
        except OSError:
            pass  # a read-only cache costs a rebuild next time, nothing else
    return idx


def index_shards(urls, *, storage_options=None, cache: bool = True, threads: int = 16) -> list:
    """The indexes of many shards, built concurrently, in the order given."""
    urls = list(urls)
    if len(urls) <= 1:
        return [index_shard(u, storage_options=storage_options, cache=cache) for u in urls]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(urls)))) as ex:
        return list(ex.map(lambda u: index_shard(u, storage_options=storage_options,
                                                 cache=cache), urls))


def read_sample(url, sample: Sample, *, storage_options=None) -> dict:
    """``{ext: bytes}`` of one sample, by one ranged read of its span."""
    blob = storage.read_range(url, sample.start, sample.end - sample.start,
                              storage_options=storage_options)
    if len(blob) < sample.end - sample.start:
        raise storage.StorageError(
            url, f"sample {sample.key!r}: the shard holds {len(blob)} of its "
                 f"{sample.end - sample.start} bytes (did it change since it was indexed?)")
    return {ext: blob[off - sample.start: off - sample.start + n]
            for ext, off, n in sample.members}
