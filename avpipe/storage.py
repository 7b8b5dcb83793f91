"""Where the bytes live: local paths, ``file://``, ``http(s)://``, ``s3://`` and ``gs://``.

Every reader of sharded data goes through this module, so that one set of rules holds everywhere:

* **URLs** are resolved through `fsspec <https://filesystem-spec.readthedocs.io>`_ (``s3fs`` and
  ``gcsfs`` are optional extras: ``pip install "avpipe[s3]"`` / ``"avpipe[gcs]"``).
  ``storage_options=`` is handed to fsspec as is; S3 is configured as boto3 is (``AWS_PROFILE``,
  ``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``~/.aws/config``), because s3fs builds a botocore
  client that reads them. Local paths and ``file://`` are read with ``os.pread``: no fsspec layer.
* **Reads are ranges** (:func:`read_range`): a reader asks for the bytes it needs, never a whole
  shard, so memory stays bounded by the largest sample.
* **Transient failures are retried** with exponential backoff and jitter: HTTP 5xx, 408 and
  429, connection resets, timeouts, truncated bodies. Anything else (403, 404, a bad URL) fails at
  once. A read that still fails raises :class:`StorageError` (an ``OSError``) naming the URL.
* **Writes are whole objects** (:func:`write_object` from bytes, :func:`put_file` from a local
  file, which an object store receives in parts when it is large): a local file is written
  beside its final name, fsync'ed and renamed; an object store's PUT (or multipart upload) is
  atomic by itself. A reader never sees half an object. Writes are retried as reads are.

Names: :func:`expand` turns a spec (bash-style braces ``{000000..000127}`` and ``{a,b}``, NeMo's
``_OP_`` / ``_CL_`` spelling of braces, or a list of them) into a list of URLs.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import threading
import time
from dataclasses import dataclass

from . import settings

__all__ = [
    "StorageError",
    "ObjectInfo",
    "is_url",
    "is_local",
    "local_path",
    "expand",
    "join",
    "stat",
    "read_range",
    "read_object",
    "write_object",
    "put_file",
    "exists",
    "remove",
    "listdir",
    "list_tree",
    "fingerprint",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


class StorageError(OSError):
    """A read or write of ``url`` failed (after the retries, where the failure was transient).
    ``.url`` names the object, ``.cause`` says why, ``.transient`` whether retrying could help."""

    def __init__(self, url: str, cause: str, *, transient: bool = False):
        self.url = url
        self.cause = cause
        self.transient = transient
        super().__init__(f"{url}: {cause}")

    def __reduce__(self):  # picklable across processes
        return (_make_storage_error, (self.url, self.cause, self.transient))


def _make_storage_error(url, cause, transient):
    return StorageError(url, cause, transient=transient)


@dataclass(frozen=True)
class ObjectInfo:
    """``size`` in bytes and ``version``: what changes when the object changes (an ETag or a
    generation on object stores, size and mtime in nanoseconds on a disk)."""

    url: str
    size: int
    version: str


def is_url(spec) -> bool:
    """True for ``scheme://...`` strings (``file://`` included)."""
    return isinstance(spec, str) and _SCHEME.match(spec) is not None


def is_local(url) -> bool:
    """A local path or a ``file://`` URL."""
    if isinstance(url, os.PathLike):
        return True
    m = _SCHEME.match(url)
    return m is None or m.group(1).lower() in ("file", "local")


def local_path(url) -> str:
    """The filesystem path of a local path or ``file://`` URL."""
    url = os.fspath(url)
    m = _SCHEME.match(url)
    if m is None:
        return url
    if m.group(1).lower() not in ("file", "local"):
        raise ValueError(f"not a local path: {url!r}")
    from urllib.parse import unquote

    rest = url[m.end():]
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    return unquote(rest)


def join(base: str, name: str) -> str:
    """``base/name`` for a local folder or a URL prefix."""
    base = os.fspath(base)
    if is_url(base) and not is_local(base):
        return base.rstrip("/") + "/" + name
    return os.path.join(local_path(base), name)


# -- names ----------------------------------------------------------------------------------------

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def _expand_one(spec: str) -> list:
    m = _BRACE.search(spec)
    if m is None:
        return [spec]
    head, body, tail = spec[: m.start()], m.group(1), spec[m.end():]
    r = _RANGE.match(body)
    if r is not None:
        a, b = r.group(1), r.group(2)
        lo, hi = int(a), int(b)
        width = max(len(a.lstrip("-")), len(b.lstrip("-"))) if (
            a.lstrip("-").startswith("0") or b.lstrip("-").startswith("0")) else 0
        step = 1 if hi >= lo else -1
        if abs(hi - lo) > 10_000_000:
            raise ValueError(f"a brace range of {abs(hi - lo) + 1} names: {spec!r}")
        parts = [str(v).zfill(width) if v >= 0 else "-" + str(-v).zfill(width)
                 for v in range(lo, hi + step, step)]
    elif "," in body:
        parts = body.split(",")
    else:  # a literal {x}, as bash leaves it
        return [head + "{" + body + "}" + t for t in _expand_one(tail)]
    return [head + p + t for p in parts for t in _expand_one(tail)]


def expand(spec) -> list:
    """A list of URLs / paths from a spec: one string with bash-style braces
    (``train-{000000..000127}.tar``: zero-padded as written; ``{a,b}``), NeMo's spelling of
    braces (``audio__OP_0..127_CL_.tar``), or a list or tuple of such strings (each expanded,
    order kept). ``os.PathLike`` values are taken as they are."""
    if isinstance(spec, os.PathLike):
        return [os.fspath(spec)]
    if isinstance(spec, (list, tuple)):
        out = []
        for s in spec:
            out.extend(expand(s))
        return out
    if not isinstance(spec, str):
        raise TypeError(f"a shard spec is a string, a path or a list of them, got {spec!r}")
    spec = spec.replace("_OP_", "{").replace("_CL_", "}")
    return _expand_one(spec)


# -- retries --------------------------------------------------------------------------------------

_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


def _status_of(e) -> int | None:
    for attr in ("status", "status_code", "code"):
        v = getattr(e, attr, None)
        if isinstance(v, int) and 100 <= v < 600:
            return v
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):  # botocore ClientError
        try:
            return int(resp["ResponseMetadata"]["HTTPStatusCode"])
        except (KeyError, TypeError, ValueError):
            pass
    m = re.search(r"\b([45]\d\d)\b", str(e)[:200])
    if m and any(w in str(e) for w in ("HTTP", "status", "Status", "Error")):
        return int(m.group(1))
    return None


_TRANSIENT_TYPES = {
    "ClientConnectionError", "ClientPayloadError", "ServerDisconnectedError",
    "ServerTimeoutError", "ClientOSError", "IncompleteRead", "ReadTimeoutError",
    "ConnectTimeoutError", "EndpointConnectionError", "ConnectionClosedError",
    "ResponseStreamingError", "ProtocolError", "FSTimeoutError", "IncompleteReadError",
    "ContentLengthError",
}


def _transient(e: BaseException) -> bool:
    """Whether a failed read is worth retrying: a connection reset or cut body, a timeout, or a
    status of 408, 429 or 5xx."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                      ValueError, TypeError)):
        return False
    if {c.__name__ for c in type(e).__mro__} & _TRANSIENT_TYPES:
        return True
    if isinstance(e, (ConnectionError, TimeoutError, EOFError)):
        return True
    status = _status_of(e)
    return status is not None and (status in _TRANSIENT_STATUS or status >= 500)


def _with_retries(url: str, what: str, fn):
    """``fn()``, retried on transient failures with exponential backoff and full jitter (base
    0.1 s, cap 4 s), ``settings.storage_retries()`` times at most."""
    attempts = settings.storage_retries() + 1
    delay = 0.1
    for k in range(attempts):
        try:
            return fn()
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001 - classified below, re-raised typed
            transient = _transient(e)
            if isinstance(e, FileNotFoundError):
                raise FileNotFoundError(f"{url}: no such object") from e
            if not transient or k == attempts - 1:
                tries = f" after {k + 1} attempts" if k else ""
                raise StorageError(url, f"{what} failed{tries}: {type(e).__name__}: {e}",
                                   transient=transient) from e
        time.sleep(random.uniform(0, delay))
        delay = min(4.0, delay * 2)
    raise AssertionError("unreachable")


# -- filesystems ----------------------------------------------------------------------------------

_FS_LOCK = threading.Lock()
_FS: dict = {}


def _options_key(options) -> str:
    return repr(sorted((options or {}).items(), key=lambda kv: kv[0]))


def _filesystem(url: str, storage_options):
    """(fsspec filesystem, path within it), one filesystem per (protocol, options) and process."""
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - fsspec is a dependency
        raise ImportError("reading URLs needs fsspec: pip install fsspec") from e
    protocol = _SCHEME.match(url).group(1).lower()
    opts = dict(storage_options or {})
    if protocol in ("http", "https"):
        opts.setdefault("client_kwargs", {})
        if "timeout" not in opts["client_kwargs"]:
            import aiohttp

            t = settings.storage_timeout()
            opts["client_kwargs"] = {**opts["client_kwargs"],
                                     "timeout": aiohttp.ClientTimeout(total=t, sock_read=t)}
    elif protocol in ("s3", "s3a"):
        opts.setdefault("config_kwargs", {})
        ck = dict(opts["config_kwargs"])
        t = settings.storage_timeout()
        ck.setdefault("connect_timeout", t)
        ck.setdefault("read_timeout", t)
        opts["config_kwargs"] = ck
        # boto3 reads AWS_ENDPOINT_URL itself; older botocore releases do not, so pass it on
        ep = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if ep and "endpoint_url" not in opts and "endpoint_url" not in opts.get(
                "client_kwargs", {}):
            opts["endpoint_url"] = ep
    key = (protocol, _options_key(opts), os.getpid())
    with _FS_LOCK:
        fs = _FS.get(key)
        if fs is None:
            try:
                cls = fsspec.get_filesystem_class(protocol)
            except (ImportError, ValueError) as e:
                extra = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}.get(protocol)
                hint = f" (pip install {extra})" if extra else ""
                raise ImportError(f"{url}: no filesystem for {protocol}://{hint}: {e}") from e
            fs = cls(**opts)
            _FS[key] = fs
    return fs, fs._strip_protocol(url) if protocol not in ("http", "https") else url


# -- reads ----------------------------------------------------------------------------------------


def stat(url, *, storage_options=None) -> ObjectInfo:
    """Size and version of an object (raises FileNotFoundError for a missing one)."""
    url = os.fspath(url)
    if is_local(url):
        st = os.stat(local_path(url))
        return ObjectInfo(url, int(st.st_size), f"{st.st_size}-{st.st_mtime_ns}")
    fs, path = _filesystem(url, storage_options)

    def info():
        return fs.info(path)

    d = _with_retries(url, "stat", info)
    size = d.get("size")
    if size is None:
        raise StorageError(url, "the server does not say the object's size")
    version = None
    for k in ("ETag", "etag", "VersionId", "generation", "md5Hash", "Content-MD5",
              "LastModified", "Last-Modified", "mtime", "last_modified", "updated"):
        if d.get(k) not in (None, ""):
            version = str(d[k]).strip('"')
            break
    return ObjectInfo(url, int(size), f"{int(size)}-{version}")


def read_range(url, start: int, length: int, *, storage_options=None) -> bytes:
    """``length`` bytes from ``start`` (fewer at the end of the object), retried on transient
    failures. A range that the object does not hold whole raises :class:`StorageError`."""
    url = os.fspath(url)
    start, length = int(start), int(length)
    if start < 0 or length < 0:
        raise ValueError(f"read_range: start={start}, length={length} must be >= 0")
    if length == 0:
        return b""
    if is_local(url):
        p = local_path(url)
        fd = os.open(p, os.O_RDONLY)
        try:
            out = bytearray()
            while len(out) < length:
                b = os.pread(fd, length - len(out), start + len(out))
                if not b:
                    break
                out += b
            return bytes(out)
        finally:
            os.close(fd)
    fs, path = _filesystem(url, storage_options)

    def get():
        b = fs.cat_file(path, start=start, end=start + length)
        if len(b) > length:  # a server that ignored the range sent the whole object
            b = b[start:start + length]
        return b

    return _with_retries(url, f"read of bytes {start}..{start + length}", get)


def read_object(url, *, storage_options=None) -> bytes:
    """A whole (small) object: an index, a manifest, a done mark."""
    url = os.fspath(url)
    if is_local(url):
        with open(local_path(url), "rb") as f:
            return f.read()
    fs, path = _filesystem(url, storage_options)

    def cat():
        # fsspec answers a missing name from a cached listing of its folder: an object another
        # process wrote after that listing would read as missing
        fs.invalidate_cache(path)
        return fs.cat_file(path)

    return _with_retries(url, "read", cat)


def exists(url, *, storage_options=None) -> bool:
    url = os.fspath(url)
    if is_local(url):
        return os.path.exists(local_path(url))
    fs, path = _filesystem(url, storage_options)

    def check():
        fs.invalidate_cache(path)  # as in read_object: not from a listing cached earlier
        return fs.exists(path)

    return bool(_with_retries(url, "exists", check))


def listdir(url, *, storage_options=None) -> list:
    """Names (not paths) directly under a folder or prefix, sorted; [] where there is none."""
    url = os.fspath(url)
    if is_local(url):
        p = local_path(url)
        return sorted(os.listdir(p)) if os.path.isdir(p) else []
    fs, path = _filesystem(url, storage_options)

    def ls():
        fs.invalidate_cache(path)  # another process may have written since (fsspec caches lists)
        try:
            return fs.ls(path, detail=False)
        except FileNotFoundError:
            return []

    return sorted(x.rstrip("/").rsplit("/", 1)[-1] for x in _with_retries(url, "list", ls))


def list_tree(url, *, storage_options=None) -> list:
    """Paths (relative to ``url``, ``/``-separated) of every file or object under a folder or
    prefix, at any depth, sorted; [] where there is none."""
    url = os.fspath(url)
    if is_local(url):
        top = local_path(url)
        out = []
        for dirpath, _, files in os.walk(top):
            rel = os.path.relpath(dirpath, top)
            for f in files:
                out.append(f if rel == "." else f"{rel}/{f}".replace(os.sep, "/"))
        return sorted(out)
    fs, path = _filesystem(url, storage_options)
    base = path.rstrip("/") + "/"

    def find():
        fs.invalidate_cache(path)
        try:
            return fs.find(base)
        except FileNotFoundError:
            return []

    return sorted(x[len(base):] for x in _with_retries(url, "list", find)
                  if x.startswith(base))


# -- writes ---------------------------------------------------------------------------------------


def write_object(url, data: bytes, *, storage_options=None) -> None:
    """Write a whole object so that no reader ever sees part of it: locally into a temporary
    file beside it, fsync'ed, renamed over the name (and the folder fsync'ed); on an object
    store by one PUT, which stores the whole object or nothing."""
    url = os.fspath(url)
    if is_local(url):
        _replace_locally(local_path(url), lambda f: f.write(data))
        return
    fs, path = _filesystem(url, storage_options)
    _with_retries(url, "write", lambda: fs.pipe_file(path, bytes(data)))


def _replace_locally(p: str, write) -> None:
    """``write(f)`` into a temporary file beside ``p``, fsync'ed, renamed over ``p``, and the
    folder fsync'ed: ``p`` is the old file or the whole new one, never a part."""
    d = os.path.dirname(os.path.abspath(p))
    os.makedirs(d, exist_ok=True)
    tmp = f"{p}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def put_file(local, url, *, storage_options=None, part_size: int | None = None) -> None:
    """Upload the local file ``local`` as the whole object ``url`` (s3fs sends a file of two
    parts or more, ``part_size`` bytes each, 50 MiB by default, as a multipart upload, which the
    store makes visible only once complete), retried on transient failures; a local ``url`` is
    copied beside its name, fsync'ed and renamed (as :func:`write_object`)."""
    url = os.fspath(url)
    local = os.fspath(local)
    if is_local(url):
        import shutil

        def copy(f):
            with open(local, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)

        _replace_locally(local_path(url), copy)
        return
    fs, path = _filesystem(url, storage_options)
    kw = {"chunksize": int(part_size)} if part_size else {}
    _with_retries(url, "upload", lambda: fs.put_file(local, path, **kw))


def remove(url, *, storage_options=None) -> None:
    """Remove an object; a missing one is no error."""
    url = os.fspath(url)
    if is_local(url):
        try:
            os.remove(local_path(url))
        except FileNotFoundError:
            pass
        return
    fs, path = _filesystem(url, storage_options)

    def rm():
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass

    _with_retries(url, "remove", rm)


def fingerprint(*parts) -> str:
    """A short stable hash of strings (cache keys)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(str(p).encode("utf-8", "surrogateescape"))
        h.update(b"\0")
    return h.hexdigest()[:32]
