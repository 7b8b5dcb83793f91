"""Shard files, the per-shard index parts, and the merged index / error report.

Layout of an output folder (``--format tar``, the default)::

    DIR/extract.json                      the preset (full config), format, shard size, input
    DIR/shards/shard-000000-000511.tar    inputs 0..511 of the input list (WebDataset style:
                                          KEY.npy + KEY.json per ok input, KEY = 9-digit index)
    DIR/parts/shard-000000-000511.jsonl   that shard's index lines (written last: the shard's
                                          "done" mark)
    DIR/index.jsonl                       every part, in input order (rebuilt at the end of a run)
    DIR/errors.jsonl                      the inputs that failed: source, path, error, message

``--format parquet``: ``shards/shard-….parquet`` (one row per ok input: key, index, source,
kind, shape, dtype, data (the array's C-order bytes), meta (the KEY.json text)).
``--format npy``: ``features/<source>.npy`` per ok input (today's layout); the parts still
record the shard ranges (the unit of resume).

Every file is written to ``NAME.<pid>.partial``, flushed, fsync'ed and renamed into place; tar
members have mtime 0, uid/gid 0, mode 0644 and empty owner names, JSON is written with sorted
keys: a shard's bytes depend only on its inputs and the preset.

DIR may be a URL (``s3://bucket/prefix``, ``gs://...``; :mod:`avpipe.storage`; ``file://`` is
a local folder). Every output is then one whole object: written first to a local temporary
file (``avpipe-extract-<pid>-*.partial`` in the temporary folder, ``TMPDIR``, removed once
uploaded, and by a later run where a killed process left them; a tar shard streams
there as it does to a local folder, never held whole in memory) and uploaded by one PUT, or a
multipart upload for a large file (:func:`avpipe.storage.put_file`), which the store makes
visible only once complete; the temporary file is removed after. A shard's part is uploaded
only after its data objects, so a part names only objects that exist; resume lists the prefix
once (:func:`listing`) and reads the parts it holds. Nothing half-written is ever visible
remotely, so a killed run leaves no temporary objects to clean. ``index.jsonl`` and
``errors.jsonl`` are uploaded only when their bytes differ from the objects there (a finished
job run again writes nothing).

JSON is strict: a non-finite number is written as ``null`` (``NaN`` is not JSON), and a name
holding bytes that are not UTF-8 (a file name read with ``surrogateescape``) is written with
each such byte as ``\\xNN`` (Python's ``backslashreplace``); the index row and ``KEY.json``
of such an input also hold ``source_bytes``, the name's exact bytes in base64.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import tarfile
import tempfile

import numpy as np

from ... import settings, storage
from ._process import Result, Shard

FORMATS = ("tar", "parquet", "npy")
SHARDS_DIR = "shards"
PARTS_DIR = "parts"
FEATURES_DIR = "features"
INDEX_NAME = "index.jsonl"
ERRORS_NAME = "errors.jsonl"
META_NAME = "extract.json"
PARTIAL = ".partial"
STAGING = "avpipe-extract-"  # a URL output's local temporary files: STAGING<pid>-*.partial


def dumps(obj) -> str:
    """Compact JSON with sorted keys, always valid and encodable as UTF-8 (module docstring:
    non-finite numbers become null, undecodable bytes of names ``\\xNN``)."""
    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
        text.encode("utf-8")
        return text
    except (ValueError, UnicodeEncodeError):  # NaN / inf, or a lone surrogate
        return json.dumps(_json_safe(obj), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False, allow_nan=False)


def printable(s: str) -> str:
    """``s`` with the bytes ``surrogateescape`` kept (an undecodable file name's) as ``\\xNN``."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _json_safe(obj):
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {printable(str(k)): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        return _json_safe(obj.item())
    return obj


def _source_bytes(row: dict, source: str) -> None:
    """``row["source_bytes"]``: the exact bytes of a name that is not UTF-8 (base64)."""
    if printable(source) is not source:
        row["source_bytes"] = base64.b64encode(
            source.encode("utf-8", "surrogateescape")).decode("ascii")


def shard_name(shard: Shard, total: int) -> str:
    w = max(6, len(str(max(total - 1, 0))))
    return f"shard-{shard.start:0{w}d}-{shard.end - 1:0{w}d}"


def key_of(index: int) -> str:
    return f"{index:09d}"


def make_shards(total: int, size: int) -> list[Shard]:
    return [Shard(a, min(a + size, total)) for a in range(0, total, size)]


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write, *, binary: bool = True, stream: bool = False) -> None:
    """``write(f)`` into ``path.<pid>.partial``, fsync, rename to ``path``. (The pid keeps a
    worker of a killed run that is still dying from writing into the same temporary file.)
    ``stream``: a large file written in many pieces (a tar shard): its bytes are handed to the
    disk while it is written (:class:`_Writeback`), and dropped from the page cache once
    fsync'ed."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}{PARTIAL}"
    every = settings.extract_writeback_mb() << 20 if stream and binary else 0
    with open(tmp, "wb" if binary else "w", buffering=1 << 20,
              **({} if binary else {"encoding": "utf-8"})) as f:
        write(_Writeback(f, every) if every else f)
        f.flush()
        os.fsync(f.fileno())
        if every:
            _drop_cached(f.fileno())
    os.replace(tmp, path)


def is_remote(out_dir) -> bool:
    """Whether ``out_dir`` is an object store URL (not a local path or ``file://``)."""
    return storage.is_url(out_dir) and not storage.is_local(out_dir)


def out_path(out_dir: str, rel: str) -> str:
    """The path or URL of ``rel`` (``/``-separated) in the output folder."""
    return storage.join(out_dir, rel) if is_remote(out_dir) else os.path.join(out_dir, rel)


def put(out_dir: str, rel: str, write, *, stream: bool = False) -> None:
    """``write(f)`` (a binary file) as the whole file or object ``rel`` of ``out_dir``: locally
    :func:`atomic_write`; for a URL into a local temporary file, uploaded once complete
    (:func:`avpipe.storage.put_file`), then removed."""
    if not is_remote(out_dir):
        atomic_write(os.path.join(out_dir, rel), write, stream=stream)
        return
    fd, tmp = tempfile.mkstemp(prefix=f"{STAGING}{os.getpid()}-", suffix=PARTIAL)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            write(f)
        storage.put_file(tmp, storage.join(out_dir, rel))
    finally:
        try:
            os.remove(tmp)
        except OSError:
            pass


def read_text(out_dir: str, rel: str) -> str | None:
    """The text of ``rel`` in the output folder, or None where it is missing or unreadable
    (a transient failure of an object store that outlasts the retries raises)."""
    if not is_remote(out_dir):
        try:
            with open(os.path.join(out_dir, rel), encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError):
            return None
    try:
        return storage.read_object(storage.join(out_dir, rel)).decode("utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        return None


def listing(out_dir: str) -> frozenset | None:
    """Every object under a URL ``out_dir`` (relative names), listed once, for :func:`read_part`;
    None for a local folder (checked file by file)."""
    if not is_remote(out_dir):
        return None
    return frozenset(storage.list_tree(out_dir))


def _libc_sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn
    except Exception:  # noqa: BLE001 - no such libc call here (not Linux): fsync alone
        return None


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; wait for nothing


class _Writeback:
    """A binary file whose bytes are handed to the disk every ``every`` bytes written:
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` starts their writeback and returns. Without it
    a shard's tens of megabytes sit in the page cache until the fsync at its end, the disk idles
    while shards are filled and then every writer waits on it at once. The fsync that follows
    still makes the file durable; this changes when the disk works, not what is written."""

    __slots__ = ("f", "every", "pos", "done")

    def __init__(self, f, every: int):
        self.f, self.every, self.pos, self.done = f, int(every), 0, 0

    def write(self, b) -> int:
        n = self.f.write(b)
        self.pos += n
        if self.pos - self.done >= self.every and _SYNC_FILE_RANGE is not None:
            self.f.flush()
            _SYNC_FILE_RANGE(self.f.fileno(), self.done, self.pos - self.done,
                             _SYNC_FILE_RANGE_WRITE)
            self.done = self.pos
        return n


def _drop_cached(fd: int) -> None:
    """Drop a written, fsync'ed file's pages from the page cache (the features are not read
    back by this run; the cache is better left to its inputs)."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass


def npy_header(arr: np.ndarray) -> bytes:
    """The ``.npy`` header ``np.save`` writes for ``arr`` (format 1.0)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, np.lib.format.header_data_from_array_1_0(arr))
    return buf.getvalue()


def npy_parts(arr: np.ndarray) -> tuple[bytes, memoryview]:
    """``(header, payload)`` of ``arr`` as ``.npy`` (the bytes of ``np.save``, without copying
    a C-contiguous array's data)."""
    arr = np.ascontiguousarray(arr)
    if arr.size == 0:  # memoryview cannot cast a view with a zero in its shape
        return npy_header(arr), memoryview(b"")
    return npy_header(arr), memoryview(arr).cast("B")


def npy_bytes(arr: np.ndarray) -> bytes:
    h, data = npy_parts(arr)
    return h + data.tobytes()


def sample_meta(r: Result, preset_name: str) -> dict:
    """The KEY.json of a sample: the manifest's fields, where it came from, what it is."""
    m = dict(r.item.fields)
    m.update(source=r.item.source, kind=r.item.kind, index=r.item.index, preset=preset_name,
             shape=list(r.array.shape), dtype=str(r.array.dtype), info=r.info)
    _source_bytes(m, r.item.source)
    return m


def index_row(r: Result, cfg: dict, shard_rel: str | None, out_rel: str | None) -> dict:
    it = r.item
    row = {"index": it.index, "source": it.source, "kind": it.kind}
    if it.fields:
        row["fields"] = it.fields
    if r.ok:
        row.update(status="ok", shard=shard_rel, key=key_of(it.index),
                   shape=list(r.array.shape), dtype=str(r.array.dtype),
                   params={"preset": cfg["name"], **cfg[it.kind]}, info=r.info)
        if out_rel is not None:
            row["output"] = out_rel
    else:
        row.update(status="error", path=it.path, error=r.error, message=r.message)
    _source_bytes(row, it.source)
    return row


def _tar_header_slow(name: str, size: int) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = 0
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


# A ustar header is a template here: name (0..100), size (124..136) and the checksum (148..156)
# change; the rest is what tarfile writes for mode 0644, uid/gid 0, mtime 0, empty owner names
# (one shard holds two members per input: tarfile's Python-level header building was most of a
# writer thread's own time, under the GIL the worker's main thread needs)
_USTAR = bytearray(_tar_header_slow("", 0))
_USTAR[148:156] = b" " * 8
_USTAR_SUM = sum(_USTAR) - sum(_USTAR[124:136])  # the size field is filled per member


def _tar_header(name: str, size: int) -> bytes:
    """tarfile's ustar header for a regular member ``name`` of ``size`` bytes (mode 0644, uid
    and gid 0, mtime 0, no owner names), byte for byte."""
    raw = name.encode("utf-8")
    if len(raw) >= 100 or not raw.isascii() or size >= 8 ** 11:
        return _tar_header_slow(name, size)
    field = b"%011o\0" % size
    h = bytearray(_USTAR)
    h[: len(raw)] = raw
    h[124:136] = field
    h[148:156] = b"%06o\0 " % (_USTAR_SUM + sum(raw) + sum(field))
    return bytes(h)


def _tar_member(f, name: str, parts) -> None:
    """One tar member from byte strings / buffers, written straight to ``f`` (no copies)."""
    size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    f.write(_tar_header(name, size))
    for p in parts:
        f.write(p)
    pad = -size % tarfile.BLOCKSIZE
    if pad:
        f.write(b"\0" * pad)


def _write_tar(f, ok: list[Result], cfg: dict) -> None:
    """A POSIX ustar archive: ``KEY.npy``, ``KEY.json`` per sample, then two zero blocks and
    padding to tarfile's record size (what ``tarfile`` writes for the same members)."""
    written = 0
    for r in ok:
        k = key_of(r.item.index)
        header, data = npy_parts(r.array)
        meta = dumps(sample_meta(r, cfg["name"])).encode()
        for name, parts in ((f"{k}.npy", (header, data)), (f"{k}.json", (meta,))):
            _tar_member(f, name, parts)
            size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
            written += tarfile.BLOCKSIZE + size + (-size % tarfile.BLOCKSIZE)
    end = written + 2 * tarfile.BLOCKSIZE
    f.write(b"\0" * (2 * tarfile.BLOCKSIZE + (-end % tarfile.RECORDSIZE)))


def _write_parquet(f, ok: list[Result], cfg: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "key": pa.array([key_of(r.item.index) for r in ok], pa.string()),
        "index": pa.array([r.item.index for r in ok], pa.int64()),
        "source": pa.array([printable(r.item.source) for r in ok], pa.string()),
        "kind": pa.array([r.item.kind for r in ok], pa.string()),
        "shape": pa.array([list(r.array.shape) for r in ok], pa.list_(pa.int64())),
        "dtype": pa.array([str(r.array.dtype) for r in ok], pa.string()),
        "data": pa.array([np.ascontiguousarray(r.array).tobytes() for r in ok], pa.binary()),
        "meta": pa.array([dumps(sample_meta(r, cfg["name"])) for r in ok], pa.string()),
    })
    pq.write_table(table, f, compression="zstd")


def npy_name(source: str) -> str:
    """The name under ``features/`` an input's npy output takes (before any key): a name that
    is not UTF-8 takes its printable form (:func:`printable`), the one the index holds."""
    return printable(source).lstrip("/")


def npy_output(r: Result, duplicated: bool) -> str:
    src = npy_name(r.item.source)
    if duplicated:  # one file listed twice (offsets), or names that clash: one output each
        return f"{FEATURES_DIR}/{src}.{key_of(r.item.index)}.npy"
    return f"{FEATURES_DIR}/{src}.npy"


def write_shard(out_dir: str, shard: Shard, results: list[Result], cfg: dict, fmt: str,
                total: int, duplicated: frozenset = frozenset()) -> list[dict]:
    """Write one shard's outputs, then its part (the shard's done mark). Returns its rows.

    A shard being redone (``--retry-errors``) loses its old part first, on disk: killed
    between its new outputs and its new part, the run finds no part and does the shard again
    (the old part would have been taken as done, its rows naming outputs no longer there)."""
    name = shard_name(shard, total)
    part_rel = f"{PARTS_DIR}/{name}.jsonl"
    remote = is_remote(out_dir)
    if remote:
        part = storage.join(out_dir, part_rel)
        if storage.exists(part):  # a DELETE of nothing is still a write (a delete marker)
            storage.remove(part)
    else:
        part = os.path.join(out_dir, PARTS_DIR, f"{name}.jsonl")
        if os.path.lexists(part):
            os.remove(part)
            _fsync_dir(os.path.dirname(part))
    ok = [r for r in results if r.ok]
    rows = []
    if fmt == "npy":
        for r in results:
            out_rel = None
            if r.ok:
                out_rel = npy_output(r, r.item.source in duplicated)
                data = npy_bytes(r.array)
                put(out_dir, out_rel, lambda f, d=data: f.write(d))
            rows.append(index_row(r, cfg, None, out_rel))
    else:
        shard_rel = f"{SHARDS_DIR}/{name}.{fmt}"
        writer = _write_tar if fmt == "tar" else _write_parquet
        put(out_dir, shard_rel, lambda f: writer(f, ok, cfg), stream=fmt == "tar")
        rows = [index_row(r, cfg, shard_rel if r.ok else None, None) for r in results]
    text = "".join(dumps(row) + "\n" for row in rows)
    put(out_dir, part_rel, lambda f: f.write(text.encode("utf-8")))
    return rows


def read_part(out_dir: str, shard: Shard, total: int,
              present: frozenset | None = None) -> list[dict] | None:
    """The shard's rows when it is complete (its part is whole and its outputs exist).
    ``present``: for a URL ``out_dir``, its :func:`listing` (listed here when not given)."""
    part_rel = f"{PARTS_DIR}/{shard_name(shard, total)}.jsonl"
    if is_remote(out_dir):
        if present is None:
            present = listing(out_dir)
        if part_rel not in present:
            return None
        exists = present.__contains__
    else:
        def exists(rel):
            return os.path.isfile(os.path.join(out_dir, rel))
    text = read_text(out_dir, part_rel)
    if text is None:
        return None
    try:
        rows = [json.loads(x) for x in text.splitlines() if x.strip()]
    except json.JSONDecodeError:
        return None
    if [r.get("index") for r in rows] != list(range(shard.start, shard.end)):
        return None
    seen = set()  # a tar / parquet shard holds every ok row of its part: checked once
    for r in rows:
        if r.get("status") != "ok":
            continue
        rel = r.get("shard") or r.get("output")
        if rel in seen:
            continue
        if not rel or not exists(rel):
            return None
        seen.add(rel)
    return rows


def clean_partials(out_dir: str) -> None:
    """Remove what a killed run left half-written (``*.partial``; ``.lock`` keeps two runs
    from doing this at once). A URL holds none: its outputs are staged locally, and the
    temporary files a killed process left there (its pid no longer running) are removed."""
    if is_remote(out_dir):
        _clean_staging()
        return
    for sub in (SHARDS_DIR, PARTS_DIR, FEATURES_DIR, ""):
        top = os.path.join(out_dir, sub)
        if not os.path.isdir(top):
            continue
        walker = os.walk(top) if sub == FEATURES_DIR else [(top, [], os.listdir(top))]
        for dirpath, _, files in walker:
            for f in files:
                if f.endswith(PARTIAL):
                    try:
                        os.remove(os.path.join(dirpath, f))
                    except OSError:
                        pass


def _clean_staging() -> None:
    top = tempfile.gettempdir()
    try:
        names = os.listdir(top)
    except OSError:
        return
    for f in names:
        if not (f.startswith(STAGING) and f.endswith(PARTIAL)):
            continue
        pid = f[len(STAGING):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # running (possibly another run's upload)
        except ProcessLookupError:
            pass
        except OSError:  # another user's process
            continue
        try:
            os.remove(os.path.join(top, f))
        except OSError:
            pass


def write_index(out_dir: str, shards: list[Shard], total: int,
                parts: list | None = None) -> tuple[int, int, int]:
    """Merge the parts of complete shards into index.jsonl and errors.jsonl (input order).
    ``parts``: each shard's :func:`read_part`, when the caller has just read them. Returns
    (rows, ok, errors)."""
    n = ok = bad = 0
    idx_lines, err_lines = [], []
    if parts is None:
        present = listing(out_dir)
        parts = [read_part(out_dir, s, total, present) for s in shards]
    for rows in parts:
        if rows is None:
            continue
        for r in rows:
            idx_lines.append(dumps(r) + "\n")
            n += 1
            if r.get("status") == "ok":
                ok += 1
            else:
                bad += 1
                e = {"index": r["index"], "source": r["source"], "path": r.get("path"),
                     "kind": r["kind"], "error": r.get("error"), "message": r.get("message")}
                if "source_bytes" in r:
                    e["source_bytes"] = r["source_bytes"]
                err_lines.append(dumps(e) + "\n")
    if is_remote(out_dir):  # uploaded where they differ: a finished job run again writes nothing
        for rel, lines in ((INDEX_NAME, idx_lines), (ERRORS_NAME, err_lines)):
            data = "".join(lines).encode()
            try:
                same = storage.read_object(storage.join(out_dir, rel)) == data
            except FileNotFoundError:
                same = False
            if not same:
                put(out_dir, rel, lambda f, d=data: f.write(d))
        return n, ok, bad
    atomic_write(os.path.join(out_dir, INDEX_NAME), lambda f: f.write("".join(idx_lines).encode()))
    atomic_write(os.path.join(out_dir, ERRORS_NAME), lambda f: f.write("".join(err_lines).encode()))
    _fsync_dir(out_dir)
    return n, ok, bad
