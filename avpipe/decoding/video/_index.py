"""A persisted index of video scans: open a dataset's files without scanning them again.

:func:`build_index` scans many files (in a process pool) and writes one ``.npz`` file;
``VideoDecoder(path, index=...)`` then takes a file's scan from it instead of scanning, but only
when the file's size and modification time (ns) still match what the index recorded: a file
changed since is scanned again (never a stale entry).

Format: one uncompressed NumPy ``.npz`` archive (a zip of ``.npy`` arrays), loaded with
``allow_pickle=False``. A JSON header (a 0-d unicode array) holds a version, one record per file
(absolute path, size, mtime_ns, the scalar fields of its scan, where its rows start) and the
arrays hold every file's per-packet fields concatenated (pts, decode-order pts and dts, key
frames, disposable flags, byte positions and sizes, parameter sets). Why: a single file that is
quick to write and to load (the arrays are read as they are, no per-file objects until a file is
asked for), readable from any NumPy without avpipe, with no code execution on load (no pickle)
and a zip CRC on every member; scans of 1,000 files take a few MB.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from fractions import Fraction

import numpy as np

from ..._source import open_source
from ...errors import DecodeError
from ._scan import StreamScan, scan_stream

__all__ = ["VideoIndex", "build_index", "load_index"]

VERSION = 2  # 2: the scan's ``damaged`` is kept (version 1 dropped it)
_PKT_FIELDS = ("pts", "dts_sorted", "decode_pts", "disposable", "packet_pos", "packet_size")
_SCALARS = ("stream_index", "codec", "pix_fmt", "width", "height", "end_pts", "bit_depth",
            "color_space", "color_range", "rotation", "container", "nal_size", "damaged")


def _stat(path: str):
    st = os.stat(path)
    return int(st.st_size), int(st.st_mtime_ns)


def _scan_one(path: str):
    """(path, size, mtime_ns, scan fields) or (path, error text); run in a worker."""
    try:
        size, mtime = _stat(path)
        src = open_source(path)
        s = scan_stream(src, src.name)
        if _stat(path) != (size, mtime):
            return path, "the file changed while it was scanned"
    except (DecodeError, OSError, ValueError) as e:
        return path, f"{type(e).__name__}: {e}"
    rec = {k: getattr(s, k) for k in _SCALARS}
    rec["time_base"] = [s.time_base.numerator, s.time_base.denominator]
    sar = s.sample_aspect_ratio
    rec["sar"] = None if sar is None else [sar.numerator, sar.denominator]
    arrays = {k: getattr(s, k) for k in _PKT_FIELDS}
    arrays["keyframe_indices"] = s.keyframe_indices
    return path, size, mtime, rec, arrays, s.parameter_sets


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, disable=not enabled, unit="file", desc="index")


def build_index(paths, out, *, workers: int | None = None, progress: bool = True) -> dict:
    """Scan ``paths`` (video files) and write their scans to ``out`` (an ``.npz`` file).

    ``workers``: processes scanning in parallel (None: the CPU count; 0 or 1: this process).
    Files that cannot be scanned are left out and listed in the returned summary
    (``{"indexed": n, "failed": [(path, reason), ...], "seconds": t}``).
    """
    import time

    t0 = time.perf_counter()
    paths = [os.path.abspath(os.fspath(p)) for p in paths]
    paths = list(dict.fromkeys(paths))
    if workers is None:
        workers = os.cpu_count() or 1
    results, failed = [], []
    with _progress(len(paths), progress) as bar:
        if workers <= 1 or len(paths) < 2:
            it = map(_scan_one, paths)
            pool = None
        else:
            pool = ProcessPoolExecutor(max_workers=int(workers))
            it = pool.map(_scan_one, paths, chunksize=max(1, min(32, len(paths) // (4 * workers) or 1)))
        try:
            for r in it:
                (results if len(r) > 2 else failed).append(r)
                bar.update(1)
        finally:
            if pool is not None:
                pool.shutdown()
    _write(out, results)
    return {"indexed": len(results), "failed": failed, "seconds": time.perf_counter() - t0}


def _write(out, results) -> None:
    records = []
    cols: dict[str, list] = {k: [] for k in (*_PKT_FIELDS, "keyframe_indices")}
    params = []
    pkt_at = key_at = ps_at = 0
    for path, size, mtime, rec, arrays, ps in results:
        n = int(arrays["pts"].shape[0])
        rec = dict(rec, path=path, size=size, mtime_ns=mtime, n=n, pkt_at=pkt_at,
                   key_at=key_at, nkey=int(arrays["keyframe_indices"].shape[0]))
        has = {}
        for k in _PKT_FIELDS:
            a = arrays[k]
            has[k] = a is not None
            if a is None:
                a = np.zeros(n, bool if k == "disposable" else np.int64)
            if a.shape[0] != n:
                raise ValueError(f"{path}: field {k} has {a.shape[0]} rows for {n} packets")
            cols[k].append(a)
        rec["has"] = has
        cols["keyframe_indices"].append(arrays["keyframe_indices"])
        rec["ps_at"], rec["ps_len"] = ps_at, (-1 if ps is None else len(ps))
        if ps is not None:
            params.append(np.frombuffer(ps, np.uint8))
            ps_at += len(ps)
        pkt_at += n
        key_at += rec["nkey"]
        records.append(rec)
    data = {}
    for k, parts in cols.items():
        dt = bool if k == "disposable" else np.int64
        data[k] = np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt)
    data["parameter_sets"] = np.concatenate(params) if params else np.zeros(0, np.uint8)
    header = json.dumps({"format": "avpipe.video_index", "version": VERSION, "files": records})
    data["header"] = np.array(header)
    out = os.fspath(out)
    tmp = out + ".tmp.npz"
    np.savez(tmp, **data)
    os.replace(tmp, out)


class VideoIndex:
    """A loaded index: :meth:`lookup` returns a file's scan when the file is unchanged."""

    def __init__(self, path):
        self.path = os.path.abspath(os.fspath(path))
        with np.load(self.path, allow_pickle=False) as z:
            header = json.loads(str(z["header"]))
            if header.get("format") != "avpipe.video_index" or header.get("version") != VERSION:
                raise ValueError(f"{self.path}: not an avpipe video index of version {VERSION}")
            self._arrays = {k: z[k] for k in z.files if k != "header"}
        self._files = {r["path"]: r for r in header["files"]}

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, path) -> bool:
        return os.path.abspath(os.fspath(path)) in self._files

    def lookup(self, path, name: str | None = None, stream_index=None) -> StreamScan | None:
        """The recorded scan of ``path``, or None when it is not there, was recorded for
        another stream, or the file's size or mtime changed."""
        path = os.path.abspath(os.fspath(path))
        r = self._files.get(path)
        if r is None:
            return None
        if stream_index is not None and int(stream_index) != r["stream_index"]:
            return None
        try:
            if _stat(path) != (r["size"], r["mtime_ns"]):
                return None
        except OSError:
            return None
        a = self._arrays
        s0, s1 = r["pkt_at"], r["pkt_at"] + r["n"]

        def col(k):
            return a[k][s0:s1].copy() if r["has"][k] else None

        pts = a["pts"][s0:s1].copy()
        ps = None
        if r["ps_len"] >= 0:
            ps = a["parameter_sets"][r["ps_at"] : r["ps_at"] + r["ps_len"]].tobytes()
        return StreamScan(
            source_name=name if name is not None else path,
            stream_index=r["stream_index"],
            codec=r["codec"],
            pix_fmt=r["pix_fmt"],
            width=r["width"],
            height=r["height"],
            time_base=Fraction(*r["time_base"]),
            pts=pts,
            keyframe_indices=a["keyframe_indices"][r["key_at"] : r["key_at"] + r["nkey"]].copy(),
            end_pts=r["end_pts"],
            bit_depth=r["bit_depth"],
            color_space=r["color_space"],
            color_range=r["color_range"],
            rotation=r["rotation"],
            sample_aspect_ratio=None if r["sar"] is None else Fraction(*r["sar"]),
            container=r["container"],
            pts_to_index={int(p): i for i, p in enumerate(pts.tolist())},
            dts_sorted=col("dts_sorted"),
            decode_pts=col("decode_pts"),
            disposable=col("disposable"),
            packet_pos=col("packet_pos"),
            packet_size=col("packet_size"),
            nal_size=r["nal_size"],
            parameter_sets=ps,
            damaged=r["damaged"],
        )


_LOADED: dict = {}
_LOADED_LOCK = threading.Lock()


def load_index(index) -> VideoIndex:
    """A :class:`VideoIndex` from a path (loaded once per path and mtime) or the object itself."""
    if isinstance(index, VideoIndex):
        return index
    if not isinstance(index, (str, os.PathLike)):
        raise TypeError(f"index must be a path or a VideoIndex, got {type(index).__name__}")
    path = os.path.abspath(os.fspath(index))
    key = (path, _stat(path))
    with _LOADED_LOCK:
        got = _LOADED.get(key)
    if got is None:
        got = VideoIndex(path)
        with _LOADED_LOCK:
            _LOADED.clear()  # one index at a time is the common case; keep memory bounded
            _LOADED[key] = got
    return got
