"""What to extract from: a folder, a glob, a file list, a manifest, or one media file.

Every form resolves to a list of :class:`Item` in a fixed order (the order that names the
shards): a folder or a glob is sorted by relative path; a file list and a manifest keep their
own order (a manifest may list one file several times, at different offsets).

* folder — walked recursively without following links; hidden entries and the output folder
  are skipped; media files are picked by extension. Manifests found in the folder
  (``*.jsonl`` / ``*.json`` NeMo manifests, ``*.csv`` with a ``path`` column) lend their
  fields (``text``, ``duration``, ``label``, ...) to the files they list; they are metadata,
  never counted as ignored files.
* glob — ``"data/**/*.flac"`` (``**`` recurses); sources are relative to the glob's fixed
  leading folder.
* file list — a ``.txt`` / ``.lst`` / ``.list`` file: one path a line (``#`` comments), paths
  relative to the list's folder.
* NeMo manifest — ``.json`` / ``.jsonl``: one JSON object a line with ``audio_filepath``
  (relative to the manifest's folder), ``duration``, ``text``, optional ``offset``; every field
  but the path is carried into the outputs (``offset`` / ``duration`` then select the span).
* CSV manifest — ``.csv`` with a header; the path column is ``path`` (or ``filepath``,
  ``file``, ``audio_filepath``, ``video_path``, ``image_path``), the other columns are carried
  (``label``, ...).
"""

from __future__ import annotations

import csv
import glob as _glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

LIST_EXTENSIONS = (".txt", ".lst", ".list")
JSON_MANIFEST_EXTENSIONS = (".json", ".jsonl")
CSV_EXTENSIONS = (".csv",)
# files that describe media rather than being media: never "ignored"
METADATA_EXTENSIONS = (
    *LIST_EXTENSIONS, *JSON_MANIFEST_EXTENSIONS, *CSV_EXTENSIONS, ".tsv", ".md", ".rst",
    ".py", ".toml", ".yaml", ".yml",
)
CSV_PATH_COLUMNS = ("path", "filepath", "file", "audio_filepath", "video_path", "image_path")


class EmptyInputError(ValueError):
    """No input matched; the message says what was looked for, and where."""


@dataclass(frozen=True)
class Item:
    """One input: ``index`` in the input list, ``source`` (as shown in outputs: relative to the
    input's root, posix), ``path`` (absolute), ``kind``, and the manifest's ``fields``."""

    index: int
    source: str
    path: str
    kind: str
    fields: dict[str, Any] = field(default_factory=dict)

    def to_task(self) -> tuple:
        return (self.index, self.source, self.path, self.kind, self.fields)

    @classmethod
    def from_task(cls, t) -> Item:
        return cls(int(t[0]), t[1], t[2], t[3], dict(t[4]))


@dataclass
class Inputs:
    """``root``: the folder sources are relative to; ``form``: "folder", "glob", "list",
    "manifest" or "file"; ``ignored``: files skipped for an unknown extension."""

    root: str
    form: str
    items: list[Item]
    ignored: int = 0
    spec: str = ""


def _is_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _rel(path: str, root: str) -> str:
    """``path`` as shown in outputs: relative to ``root`` (posix) when under it, else absolute.
    Absolute paths on a posix system by string (os.path.relpath, which this equals, took 27 µs
    an input: 1.8 s of a 65,536-file job's start, with the profiler on)."""
    if os.sep == "/" and path.startswith("/") and root.startswith("/"):
        path, root = os.path.normpath(path), os.path.normpath(root)
        if not path.startswith("//") and not root.startswith("//") and path != root:
            prefix = root if root.endswith("/") else root + "/"
            rel = path[len(prefix) :] if path.startswith(prefix) else path
            # relpath's result starting with ".." (a name like "..x" too) meant the absolute path
            return path if rel.startswith("..") else rel
    return _rel_any(path, root)


def _rel_any(path: str, root: str) -> str:
    try:
        rel = os.path.relpath(path, root)
    except ValueError:  # another drive
        return path.replace(os.sep, "/")
    if rel.startswith(".."):
        return os.path.abspath(path).replace(os.sep, "/")
    return rel.replace(os.sep, "/")


def _kind(path: str, extensions) -> str | None:
    return extensions.get(os.path.splitext(path)[1].lower())


def _describe(extensions) -> str:
    return " ".join(sorted(extensions))


def _read_json_manifest(path: str) -> list[dict]:
    with open(path, encoding="utf-8-sig") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):  # a JSON array of rows
        rows = json.loads(stripped)
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e.msg})") from None
    out = []
    for n, r in enumerate(rows, 1):
        if not isinstance(r, dict) or not isinstance(r.get("audio_filepath"), str):
            raise ValueError(f"{path}: row {n} has no 'audio_filepath' (a NeMo manifest needs it)")
        out.append(r)
    return out


def _read_csv_manifest(path: str) -> tuple[list[dict], str]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.DictReader(f))
        cols = [c.strip() for c in (rows[0].keys() if rows else [])]
    key = next((c for c in CSV_PATH_COLUMNS if c in cols), None)
    if key is None:
        raise ValueError(
            f"{path}: no path column (one of {', '.join(CSV_PATH_COLUMNS)}) in the header"
        )
    return [{k.strip(): v for k, v in r.items() if k is not None} for r in rows], key


def _manifest_rows(path: str) -> list[tuple[str, dict]]:
    """``[(media path as written, fields), ...]`` of a NeMo or CSV manifest."""
    ext = os.path.splitext(path)[1].lower()
    if ext in CSV_EXTENSIONS:
        rows, key = _read_csv_manifest(path)
        return [(r.pop(key), r) for r in rows]
    rows = _read_json_manifest(path)
    return [(r.pop("audio_filepath"), r) for r in rows]


def _folder_fields(folder_files: list[str], found: dict[str, int], items_fields: list[dict]):
    """Attach the fields of manifests lying in a walked folder to the files they list."""
    for mpath in folder_files:
        try:
            rows = _manifest_rows(mpath)
        except (ValueError, OSError, UnicodeDecodeError, csv.Error):
            continue  # not a manifest (any JSON / CSV file): nothing to lend
        base = os.path.dirname(mpath)
        for media, fields in rows:
            if not isinstance(media, str):
                continue
            full = os.path.normpath(os.path.join(base, media))
            i = found.get(full)
            if i is not None and "offset" not in fields:
                for k, v in fields.items():
                    items_fields[i].setdefault(k, v)


def _walk(path: str, extensions, exclude) -> Inputs:
    excl = os.path.realpath(exclude) if exclude is not None else None
    media, manifests, ignored = [], [], 0
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(
            d for d in dirnames
            if not d.startswith(".") and os.path.realpath(os.path.join(dirpath, d)) != excl
        )
        for f in sorted(filenames):
            if f.startswith("."):
                continue
            full = os.path.join(dirpath, f)
            if _kind(f, extensions) is not None:
                media.append(full)
            elif os.path.splitext(f)[1].lower() in (*JSON_MANIFEST_EXTENSIONS, *CSV_EXTENSIONS):
                manifests.append(full)
            elif os.path.splitext(f)[1].lower() not in METADATA_EXTENSIONS:
                ignored += 1
    rels = sorted((_rel(m, path), m) for m in media)
    fields: list[dict] = [{} for _ in rels]
    _folder_fields(manifests, {os.path.normpath(m): i for i, (_, m) in enumerate(rels)}, fields)
    items = [
        Item(i, rel, full, _kind(full, extensions), fields[i])
        for i, (rel, full) in enumerate(rels)
    ]
    return Inputs(path, "folder", items, ignored)


def resolve_inputs(input_path, extensions, *, exclude=None) -> Inputs:
    """Resolve INPUT (see the module docstring). Raises FileNotFoundError for a path that
    does not exist, :class:`EmptyInputError` when nothing usable was found."""
    spec = os.fspath(input_path)
    path = os.path.abspath(spec)
    looked_for = f"media files ({_describe(extensions)})"
    if not os.path.exists(path) and _is_glob(spec):
        hits = sorted(
            os.path.abspath(p) for p in _glob.glob(spec, recursive=True) if os.path.isfile(p)
        )
        fixed = []
        for part in spec.replace(os.sep, "/").split("/"):
            if _is_glob(part):
                break
            fixed.append(part)
        root = os.path.abspath("/".join(fixed) or ".")
        if spec.startswith("/") and not fixed[1:]:
            root = "/"
        media = [p for p in hits if _kind(p, extensions)]
        inp = Inputs(
            root, "glob",
            [Item(i, _rel(p, root), p, _kind(p, extensions)) for i, p in enumerate(media)],
            len(hits) - len(media), spec,
        )
        if not inp.items:
            raise EmptyInputError(
                f"no input: the glob {spec!r} matched {len(hits)} file(s), none of them "
                f"{looked_for}"
            )
        return inp
    if not os.path.exists(path):
        raise FileNotFoundError(f"input: no such file or folder: {spec!r}")
    if os.path.isdir(path):
        inp = _walk(path, extensions, exclude)
        inp.spec = spec
        if not inp.items:
            raise EmptyInputError(
                f"no input: found no {looked_for} under the folder {path!r} (searched "
                f"recursively, hidden entries skipped; {inp.ignored} other file(s) ignored)"
            )
        return inp
    ext = os.path.splitext(path)[1].lower()
    base = os.path.dirname(path)
    if ext in LIST_EXTENSIONS or ext in JSON_MANIFEST_EXTENSIONS or ext in CSV_EXTENSIONS:
        if ext in LIST_EXTENSIONS:
            form = "list"
            with open(path, encoding="utf-8-sig") as f:
                rows = [
                    (ln.strip(), {}) for ln in f
                    if ln.strip() and not ln.lstrip().startswith("#")
                ]
        else:
            form = "manifest"
            rows = _manifest_rows(path)
        items, ignored = [], 0
        for media, fields in rows:
            full = os.path.normpath(os.path.join(base, os.path.expanduser(str(media))))
            kind = _kind(full, extensions)
            if kind is None:
                ignored += 1
                continue
            items.append(Item(len(items), _rel(full, base), full, kind, dict(fields)))
        if not items:
            raise EmptyInputError(
                f"no input: the {form} {path!r} lists {len(rows)} path(s), none of them "
                f"{looked_for}"
            )
        return Inputs(base, form, items, ignored, spec)
    kind = _kind(path, extensions)
    if kind is None:
        raise EmptyInputError(
            f"no input: {path!r} is not one of the {looked_for}, nor a file list "
            f"({' '.join(LIST_EXTENSIONS)}) or a manifest (.json .jsonl .csv)"
        )
    return Inputs(base, "file", [Item(0, os.path.basename(path), path, kind)], 0, spec)
