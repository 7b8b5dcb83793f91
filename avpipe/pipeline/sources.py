"""Item lists: NeMo manifests, CSV files, folders of classes, plain lists.

:class:`Item` is the one input model: the feeds, the sharded readers
(:mod:`avpipe.pipeline.sharded`) and the extraction job (``avpipe extract``) all hold their
inputs as Items and open an item's media by :meth:`Item.media`. Each reader returns a list of
Items (path made absolute: a relative path in a manifest or list is relative to that file's
folder), in the file's own order; the feed shuffles. A line of a list becomes its Item by
:func:`record_item`, for the feeds and extraction alike.

* :func:`read_manifest` — NeMo JSON lines: ``audio_filepath``, ``duration``, ``text`` and an
  optional ``offset`` (seconds); the item's span is ``[offset, offset + duration)``.
* :func:`read_csv` — a CSV file with a header row holding ``path`` and ``label`` columns.
* :func:`read_folder` — ``root/<class>/**/file`` (classes: the sorted folder names).
* :func:`read_list` — a text file of paths (one per line; ``#`` comments) or a Python sequence
  of paths / ``(path, label)`` pairs.

The lines of manifests and CSV files are read by :func:`manifest_records` and
:func:`csv_records`, which the extraction job (``avpipe extract``) uses too: one rule for what
a valid line is. A line that breaks it is a :class:`~avpipe.errors.ManifestError` naming the
file, the line, the field and the value: the feeds raise it when they are built (a training
set silently smaller than its manifest changes the experiment, and nothing has run yet);
extraction records it in ``errors.jsonl`` and goes on (a long batch job never dies of one
line). The rule for a NeMo line:

* a JSON object (bytes in UTF-8; ``NaN``, ``Infinity`` and numbers beyond float range are not
  JSON values and are refused, in any field);
* ``audio_filepath``: a non-empty string;
* ``duration`` / ``offset``: absent, null, or a finite number >= 0 (not a bool, not a string);
* ``text``: absent, null, or a string.

``root=`` (every reader): paths, after ``..`` and links are resolved, must lie under ``root``;
one outside raises :class:`~avpipe.errors.OutsideRootError` naming it.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError, OutsideRootError

__all__ = [
    "Item", "read_manifest", "read_csv", "read_folder", "read_list", "class_index",
    "ManifestRecord", "manifest_records", "csv_records", "check_manifest_record",
    "record_item", "list_records", "listed_path", "decode_text", "check_root",
    "resolve_root", "check_path_text", "within_max_duration", "text_lines",
]

MANIFEST_PATH_FIELD = "audio_filepath"


@dataclass(frozen=True)
class Item:
    """One input, for the feeds and for extraction (``avpipe extract``) alike.

    * ``path``: absolute (a shard's sample: ``URL#KEY``); ``raw_path``: as the source wrote it.
    * ``label``: the label (CSV / folders / ``KEY.cls``) or None; ``text``: the transcript
      (manifests); ``offset`` / ``duration``: seconds (0 / None: from the start / to the end).
    * ``fields``: the source's own fields for the item. A manifest line's or CSV row's: every
      field but the path, as written (checked), in the line's order, ``text`` / ``offset`` /
      ``duration`` / ``label`` included; a shard's sample: its metadata beside those four.
    * ``locator``: where the bytes are when not at ``path`` (a shard's member: ``read() ->
      bytes``, :class:`avpipe.pipeline.sharded.ShardMember`); None: a file. :meth:`media` is
      what a decoder opens.
    * ``kind``: "audio", "video" or "image" where the reader knows it (extraction, by
      extension), else None.
    * ``error``: ``(error type, message)`` for an input refused before decoding (a bad
      manifest line, a file not of the wanted kinds, a path outside ``root``): recorded,
      never decoded.
    * ``index`` / ``source``: extraction's place of the input in its list and its name as
      shown in outputs (relative to the input's root, posix); None in the feeds.
    """

    path: str
    raw_path: str | None = None
    label: Any = None
    text: str | None = None
    offset: float = 0.0
    duration: float | None = None
    fields: dict = field(default_factory=dict, repr=False, compare=False)
    locator: Any = field(default=None, repr=False, compare=False)
    kind: str | None = None
    error: tuple[str, str] | None = None
    index: int | None = None
    source: str | None = None

    def media(self):
        """What a decoder opens: a shard member's bytes (one ranged read), else the path."""
        return self.locator.read() if self.locator is not None else self.path

    def to_task(self) -> tuple:
        """What a worker process needs of an extraction input, as JSON-able values
        (``(index, source, path, kind, fields[, error[, locator]])``; :meth:`from_task`)."""
        t = (self.index, self.source, self.path, self.kind, self.fields)
        if self.locator is not None:
            return (*t, None if self.error is None else list(self.error), self.locator)
        return t if self.error is None else (*t, list(self.error))

    @classmethod
    def from_task(cls, t) -> Item:
        """The input a worker received (:meth:`to_task`): extraction reads an input's
        ``fields`` (they hold its span and transcript), so ``label`` / ``text`` / ``offset`` /
        ``duration`` stay at their defaults."""
        err = tuple(t[5]) if len(t) > 5 and t[5] is not None else None
        return cls(path=t[2], fields=dict(t[4]), locator=t[6] if len(t) > 6 else None,
                   kind=t[3], error=err, index=int(t[0]), source=t[1])


@dataclass(frozen=True)
class ManifestRecord:
    """One valid line of a manifest or CSV file: ``line`` (1-based), ``path`` (as written),
    ``fields`` (every other field, checked: ``offset`` / ``duration`` finite numbers >= 0 when
    present, ``text`` a string)."""

    line: int
    path: str
    fields: dict


def _resolve(p: str, base: str) -> str:
    p = os.path.expanduser(p)
    return os.path.normpath(p if os.path.isabs(p) else os.path.join(base, p))


def listed_path(raw: str, list_path) -> str:
    """A path as a list wrote it, made absolute: relative to the list's folder, ``~``
    expanded, normalised (links and ``..`` left to :func:`check_root`)."""
    return _resolve(raw, os.path.dirname(os.path.abspath(os.fspath(list_path))))


def resolve_root(root) -> str | None:
    """``root=`` as a resolved absolute folder (links followed), or None."""
    if root is None:
        return None
    return os.path.realpath(os.path.abspath(os.fspath(root)))


def check_root(path: str, root: str | None, *, raw=None, manifest=None, line=None) -> None:
    """Raise :class:`OutsideRootError` when ``path`` (absolute), with ``..`` and links resolved,
    is not under ``root`` (from :func:`resolve_root`; None: no check). ``raw``: the path as the
    list wrote it (named in the error)."""
    if root is None:
        return
    real = os.path.realpath(path)
    if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
        raise OutsideRootError(path if raw is None else raw, root, manifest, line)


def decode_text(data: bytes, path: str) -> str:
    """A list file's bytes as text (UTF-8, a leading BOM dropped); bytes that are not UTF-8
    raise :class:`ManifestError` naming the file and the line."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ManifestError(path, line, f"not UTF-8 text (byte 0x{data[e.start]:02x} at "
                                        f"column {col})") from None


def text_lines(text: str) -> list[str]:
    """The lines of a list file: split at ``\\n`` only (``str.splitlines`` also splits at
    U+2028 and other characters a JSON string may hold, and would miscount lines)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _refuse_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"the number {s[:40]} is beyond float range")
    return v


def loads_strict(text: str):
    """``json.loads`` refusing NaN, Infinity and numbers beyond float range (ValueError; so
    is nesting too deep for the parser)."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _seconds(d: dict, key: str, manifest: str, line) -> None:
    """``d[key]``, when present, checked as seconds (a finite number >= 0; null: absent) and
    stored as a float."""
    if key not in d:
        return
    v = d[key]
    if v is None:
        del d[key]
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ManifestError(manifest, line, f"seconds must be a number, got "
                                            f"{type(v).__name__}", key, v)
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f) or f < 0:
        raise ManifestError(manifest, line, "seconds must be a finite number >= 0", key, v)
    d[key] = f


def check_path_text(raw: str, manifest, line, field=None) -> None:
    """A listed path may not hold a NUL character (no file name can): ManifestError."""
    if "\x00" in raw:
        raise ManifestError(manifest, line, "a path cannot hold a NUL character", field, raw)


def check_manifest_record(d, manifest: str, line: int | None) -> ManifestRecord:
    """A decoded NeMo line (the module docstring's rule) -> :class:`ManifestRecord`; raises
    :class:`ManifestError` naming ``manifest``, ``line``, the field and its value."""
    if not isinstance(d, dict):
        raise ManifestError(manifest, line, f"a manifest line is a JSON object, got "
                                            f"{type(d).__name__}")
    if MANIFEST_PATH_FIELD not in d:
        raise ManifestError(manifest, line, f"no {MANIFEST_PATH_FIELD!r} field")
    raw = d[MANIFEST_PATH_FIELD]
    if not isinstance(raw, str) or not raw.strip():
        raise ManifestError(manifest, line, "the media path must be a non-empty string",
                            MANIFEST_PATH_FIELD, raw)
    check_path_text(raw, manifest, line, MANIFEST_PATH_FIELD)
    fields = {k: v for k, v in d.items() if k != MANIFEST_PATH_FIELD}
    _seconds(fields, "offset", manifest, line)
    _seconds(fields, "duration", manifest, line)
    if "text" in fields and fields["text"] is not None and not isinstance(fields["text"], str):
        raise ManifestError(manifest, line, "the transcript must be a string", "text",
                            fields["text"])
    return ManifestRecord(line if line is not None else 0, raw, fields)


def manifest_records(path, *, keep_errors: bool = False) -> list:
    """The lines of a NeMo manifest (JSON lines; blank lines skipped; a file holding one JSON
    array of objects is read too) as :class:`ManifestRecord`, in order. A line that breaks the
    rule raises :class:`ManifestError`; with ``keep_errors`` it takes its place in the list
    instead (bytes that are not UTF-8 and an unreadable array are errors of the whole file,
    raised either way)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        text = decode_text(f.read(), path)
    out: list = []

    stripped = text.lstrip()
    if stripped.startswith("["):  # one JSON array of rows: its rows have no line of their own
        try:
            rows = loads_strict(stripped)
        except ValueError as e:
            raise ManifestError(path, None, f"not a JSON array ({e})") from None
        if not isinstance(rows, list):
            raise ManifestError(path, None, "not a JSON array")
        for n, r in enumerate(rows, 1):
            try:
                out.append(check_manifest_record(r, path, None))
            except ManifestError as e:  # named by its place in the array
                e = ManifestError(path, None, f"row {n}: {e.reason}", e.field, e.value)
                if not keep_errors:
                    raise e from None
                out.append(e)
        return out
    for ln, line in enumerate(text_lines(text), 1):
        if not line.strip():
            continue
        try:
            try:
                d = loads_strict(line)
            except ValueError as e:  # JSONDecodeError, NaN, a number beyond float range
                raise ManifestError(path, ln, f"not a JSON line ({e})") from None
            out.append(check_manifest_record(d, path, ln))
        except ManifestError as e:
            if not keep_errors:
                raise
            out.append(e)
    return out


def csv_records(path, path_columns, *, label_column=None, keep_errors: bool = False):
    """``(path column, records)`` of a CSV file with a header row: the first of
    ``path_columns`` in the header is the path, every other column a field; ``line`` is the
    row's last line. A row with an empty path, or with an empty ``label_column`` (when given
    and in the header), raises :class:`ManifestError` (``keep_errors``: takes its place). A
    header without a path column (or without ``label_column``) raises one for the file."""
    path = os.fspath(path)
    if isinstance(path_columns, str):
        path_columns = (path_columns,)
    with open(path, "rb") as f:
        text = decode_text(f.read(), path)
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        header = [c.strip() for c in (reader.fieldnames or [])]
    except csv.Error as e:
        raise ManifestError(path, 1, f"not CSV ({e})") from None
    key = next((c for c in path_columns if c in header), None)
    if key is None or (label_column is not None and label_column not in header):
        need = [" or ".join(repr(c) for c in path_columns)]
        if label_column is not None:
            need.append(repr(label_column))
        raise ManifestError(path, 1, f"the header must hold the columns {' and '.join(need)}, "
                                     f"got {header}")
    out: list = []
    try:
        for r in reader:
            ln = reader.line_num
            row = {(k.strip() if k is not None else None): v for k, v in r.items()}
            try:
                extra = row.pop(None, None)
                if extra:
                    raise ManifestError(path, ln, f"{len(extra)} value(s) more than the header's "
                                                  "columns", None, extra)
                raw = (row.pop(key) or "").strip()
                if not raw:
                    raise ManifestError(path, ln, "no path", key, raw)
                check_path_text(raw, path, ln, key)
                if label_column is not None and not (row.get(label_column) or "").strip():
                    raise ManifestError(path, ln, "no label", label_column,
                                        row.get(label_column))
                if label_column is not None:
                    row[label_column] = row[label_column].strip()
                out.append(ManifestRecord(ln, raw, row))
            except ManifestError as e:
                if not keep_errors:
                    raise
                out.append(e)
    except csv.Error as e:
        raise ManifestError(path, reader.line_num, f"not CSV ({e})") from None
    return key, out


def record_item(rec: ManifestRecord, list_path: str, *, root=None, nemo: bool = True,
                label_column: str = "label") -> Item:
    """The item of one valid line of a list: its path resolved against the list's folder (a
    relative path is relative to ``list_path``'s folder; ``~`` expanded) and checked against
    ``root`` (from :func:`resolve_root`: :class:`~avpipe.errors.OutsideRootError` naming the
    file and the line); ``fields``: the line's. A NeMo line (``nemo``) gives ``text`` (``""``
    when absent), ``offset``, ``duration`` and ``label``; a CSV row (its values are text) or a
    list's line gives ``label`` from ``label_column`` alone."""
    list_path = os.fspath(list_path)
    full = listed_path(rec.path, list_path)
    check_root(full, root, raw=rec.path, manifest=list_path, line=rec.line or None)
    f = dict(rec.fields)
    if not nemo:
        return Item(path=full, raw_path=rec.path, label=f.get(label_column), fields=f)
    text = f.get("text")
    return Item(path=full, raw_path=rec.path, label=f.get("label"),
                text="" if text is None else text, offset=f.get("offset") or 0.0,
                duration=f.get("duration"), fields=f)


def read_manifest(path, *, root=None) -> list:
    """A NeMo JSON-lines manifest -> items (blank lines ignored). A line that breaks the rule of
    the module docstring raises :class:`~avpipe.errors.ManifestError` naming the file, the line,
    the field and the value; with ``root``, a path outside it raises
    :class:`~avpipe.errors.OutsideRootError`."""
    top = resolve_root(root)
    return [record_item(rec, path, root=top) for rec in manifest_records(path)]


def read_csv(path, *, path_column: str = "path", label_column: str = "label",
             root=None) -> list:
    """A CSV file with a header row holding ``path_column`` and ``label_column``. A row
    without a path or a label raises :class:`~avpipe.errors.ManifestError` naming the file
    and the line; with ``root``, a path outside it raises
    :class:`~avpipe.errors.OutsideRootError`."""
    top = resolve_root(root)
    _, records = csv_records(path, (path_column,), label_column=label_column)
    return [record_item(rec, path, root=top, nemo=False, label_column=label_column)
            for rec in records]


def list_records(path, *, keep_errors: bool = False) -> list:
    """The paths of a text list (one a line; blank lines and ``#`` comments skipped) as
    :class:`ManifestRecord` (no fields), in order. A path holding a NUL raises
    :class:`ManifestError` (``keep_errors``: takes its place); bytes that are not UTF-8 are an
    error of the whole file, raised either way."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        text = decode_text(f.read(), path)
    out: list = []
    for n, ln in enumerate(text_lines(text), 1):
        raw = ln.strip()
        if not raw or raw.startswith("#"):
            continue
        try:
            check_path_text(raw, path, n)
            out.append(ManifestRecord(n, raw, {}))
        except ManifestError as e:
            if not keep_errors:
                raise
            out.append(e)
    return out


def read_folder(root, *, extensions=None, check=None) -> list:
    """``root/<class>/...`` -> items labelled by class folder name (recursive, sorted). Files
    that are links resolving outside ``check`` (a folder; None: no check) raise
    :class:`~avpipe.errors.OutsideRootError`."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"no such directory: {root!r}")
    top = resolve_root(check)
    exts = None if extensions is None else tuple(e.lower() for e in extensions)
    items = []
    for c in sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, c)):
            dirnames.sort()
            for fn in sorted(filenames):
                if exts is None or fn.lower().endswith(exts):
                    p = os.path.join(dirpath, fn)
                    check_root(os.path.abspath(p), top)
                    items.append(Item(path=os.path.abspath(p),
                                      raw_path=os.path.relpath(p, root), label=c))
    return items


def read_list(source, *, labels=None, root=None) -> list:
    """A text file of paths (relative to its folder) or a sequence of paths or
    ``(path, label)`` pairs (relative to the working directory). With ``root``, a path outside
    it raises :class:`~avpipe.errors.OutsideRootError`."""
    top = resolve_root(root)
    if isinstance(source, (str, os.PathLike)):
        items = [record_item(rec, source, root=top, nemo=False) for rec in list_records(source)]
        if labels is not None:
            items = [dataclasses.replace(it, label=labels[i]) for i, it in enumerate(items)]
        return items
    base = os.getcwd()
    items = []
    for i, e in enumerate(source):
        lab = None if labels is None else labels[i]
        if isinstance(e, (tuple, list)):
            e, lab = e[0], e[1]
        raw = os.fspath(e)
        check_path_text(raw, None, None)
        full = _resolve(raw, base)
        check_root(full, top, raw=raw)
        items.append(Item(path=full, raw_path=raw, label=lab))
    return items


def within_max_duration(items, max_duration) -> tuple[list, list]:
    """``(kept, errors)``: the items of at most ``max_duration`` seconds (a duration bucketing
    feed's budget), and ``(path, message)`` for each left out (longer, or no duration)."""
    if max_duration is None:
        return list(items), []
    keep, errors = [], []
    for it in items:
        if it.duration is None:
            errors.append((it.path, "no duration known (max_duration needs it)"))
        elif it.duration > float(max_duration):
            errors.append((it.path, f"{it.duration:g} s, longer than max_duration="
                                    f"{float(max_duration):g} s: left out"))
        else:
            keep.append(it)
    return keep, errors


def class_index(items, *, integers_are_indices: bool = False) -> tuple[list, list]:
    """``(classes, labels)``: the sorted label names and each item's index into them. With
    ``integers_are_indices`` (WebDataset's ``KEY.cls``) labels that are all integers >= 0 are
    the indices themselves: classes ``0 .. max``."""
    if integers_are_indices and items and all(
            isinstance(it.label, int) and not isinstance(it.label, bool) and it.label >= 0
            for it in items):
        return list(range(max(it.label for it in items) + 1)), [it.label for it in items]
    classes = sorted({str(it.label) for it in items})
    pos = {c: i for i, c in enumerate(classes)}
    return classes, [pos[str(it.label)] for it in items]
