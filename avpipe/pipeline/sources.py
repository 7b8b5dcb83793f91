"""Item lists for the training feeds: NeMo manifests, CSV files, folders of classes, plain lists.

Each reader returns a list of :class:`Item` (path made absolute: a relative path in a manifest
or list is relative to that file's folder), in the file's own order; the feed shuffles.

* :func:`read_manifest` — NeMo JSON lines: ``audio_filepath``, ``duration``, ``text`` and an
  optional ``offset`` (seconds); the item's span is ``[offset, offset + duration)``.
* :func:`read_csv` — a CSV file with a header row holding ``path`` and ``label`` columns.
* :func:`read_folder` — ``root/<class>/**/file`` (classes: the sorted folder names).
* :func:`read_list` — a text file of paths (one per line; ``#`` comments) or a Python sequence
  of paths / ``(path, label)`` pairs.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Item", "read_manifest", "read_csv", "read_folder", "read_list", "class_index"]


@dataclass(frozen=True)
class Item:
    """One training item. ``path``: absolute; ``raw_path``: as the source wrote it; ``label``:
    the label name (CSV / folders) or None; ``text``: the transcript (manifests); ``offset`` /
    ``duration``: seconds (None: from the start / to the end); ``extra``: other fields;
    ``locator``: where the bytes are when ``path`` names a shard's sample (``URL#KEY``): an
    object whose ``read()`` returns them (:class:`avpipe.pipeline.sharded.ShardMember`)."""

    path: str
    raw_path: str
    label: Any = None
    text: str | None = None
    offset: float = 0.0
    duration: float | None = None
    extra: dict = field(default_factory=dict, repr=False, compare=False)
    # where the bytes are when not at ``path`` (a shard's member: .read() -> bytes; None: a file)
    locator: Any = field(default=None, repr=False, compare=False)


def _resolve(p: str, base: str) -> str:
    p = os.path.expanduser(p)
    return os.path.normpath(p if os.path.isabs(p) else os.path.join(base, p))


def read_manifest(path) -> list:
    """A NeMo JSON-lines manifest -> items (blank lines ignored; a line without
    ``audio_filepath`` raises ValueError naming the file and line)."""
    path = os.fspath(path)
    base = os.path.dirname(os.path.abspath(path))
    items = []
    with open(path, encoding="utf-8-sig") as f:
        for ln, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
                raw = d["audio_filepath"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{ln}: not a manifest line ({e})") from None
            dur = d.get("duration")
            extra = {k: v for k, v in d.items()
                     if k not in ("audio_filepath", "duration", "text", "offset")}
            items.append(Item(
                path=_resolve(raw, base), raw_path=raw, text=d.get("text", ""),
                offset=float(d.get("offset") or 0.0),
                duration=None if dur is None else float(dur), extra=extra,
            ))  # fmt: skip
    return items


def read_csv(path, *, path_column: str = "path", label_column: str = "label") -> list:
    """A CSV file with a header row holding ``path_column`` and ``label_column``."""
    path = os.fspath(path)
    base = os.path.dirname(os.path.abspath(path))
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
        header = rows[0].keys() if rows else []
    if rows and (path_column not in header or label_column not in header):
        raise ValueError(
            f"{path}: the header must hold the columns {path_column!r} and {label_column!r}, "
            f"got {list(header)}"
        )
    items = []
    for r in rows:
        raw = (r[path_column] or "").strip()
        if not raw:
            continue
        extra = {k: v for k, v in r.items() if k not in (path_column, label_column)}
        items.append(Item(path=_resolve(raw, base), raw_path=raw,
                          label=(r[label_column] or "").strip(), extra=extra))
    return items


def read_folder(root, *, extensions=None) -> list:
    """``root/<class>/...`` -> items labelled by class folder name (recursive, sorted)."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"no such directory: {root!r}")
    exts = None if extensions is None else tuple(e.lower() for e in extensions)
    items = []
    for c in sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, c)):
            dirnames.sort()
            for fn in sorted(filenames):
                if exts is None or fn.lower().endswith(exts):
                    p = os.path.join(dirpath, fn)
                    items.append(Item(path=os.path.abspath(p),
                                      raw_path=os.path.relpath(p, root), label=c))
    return items


def read_list(source, *, labels=None) -> list:
    """A text file of paths (relative to its folder) or a sequence of paths or
    ``(path, label)`` pairs (relative to the working directory)."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        base = os.path.dirname(os.path.abspath(path))
        with open(path, encoding="utf-8-sig") as f:
            entries = [ln.strip() for ln in f]
        entries = [e for e in entries if e and not e.startswith("#")]
    else:
        base = os.getcwd()
        entries = list(source)
    items = []
    for i, e in enumerate(entries):
        lab = None if labels is None else labels[i]
        if isinstance(e, (tuple, list)):
            e, lab = e[0], e[1]
        raw = os.fspath(e)
        items.append(Item(path=_resolve(raw, base), raw_path=raw, label=lab))
    return items


def class_index(items) -> tuple[list, list]:
    """``(classes, labels)``: the sorted label names and each item's index into them."""
    classes = sorted({str(it.label) for it in items})
    pos = {c: i for i, c in enumerate(classes)}
    return classes, [pos[str(it.label)] for it in items]
