"""What to extract from: a folder, a glob, a file list, a manifest, or one media file.

Every form resolves to a list of :class:`~avpipe.pipeline.sources.Item` (the feeds' items, with
extraction's ``index``, ``source`` and ``kind``) in a fixed order (the order that names the
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
  (``label``, ...; a ``label`` column may not be empty).

Manifest, CSV and list lines are read by the feeds' readers and made Items by their
:func:`~avpipe.pipeline.sources.record_item` (:mod:`avpipe.pipeline.sources`: one rule for a
valid line, for paths relative to the list's folder and for ``root``). **Every row of a list
or a manifest is an input**: a row that cannot be extracted — a line breaking the manifest
rule, a file that is not of the preset's kinds, a path outside ``root`` — keeps its place in
the list with the reason (``Item.error``) and ends in ``errors.jsonl`` and ``index.jsonl``
like an input that failed to decode. Under a preset that takes audio, a listed video file
(``.mp4``, ``.mkv``, ...) is an audio input: its audio track is decoded. ``root`` (folder,
glob, list or manifest): inputs whose path, ``..`` and links resolved, lies outside it are
refused the same way.
"""

from __future__ import annotations

import csv
import dataclasses
import glob as _glob
import os
from dataclasses import dataclass, field

from ...errors import ManifestError, OutsideRootError
from ...formats import VIDEO_EXTENSIONS, kind_of
from ...pipeline.sharded import is_shard_spec, read_webdataset
from ...pipeline.sources import (
    Item,
    check_root,
    csv_records,
    list_records,
    listed_path,
    manifest_records,
    record_item,
    resolve_root,
)

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


def refused(index: int, source: str, path: str, e: BaseException | tuple) -> Item:
    """A row kept in the input list as an error (see :attr:`Item.error`)."""
    why = e if isinstance(e, tuple) else (type(e).__name__, str(e))
    return Item(path=path, error=why, index=index, source=source)


def _input(index: int, source: str, item: Item, kind: str | None) -> Item:
    """``item`` (a reader's) as extraction's input ``index``, shown as ``source``."""
    return dataclasses.replace(item, kind=kind, index=index, source=source)


def _file(index: int, source: str, path: str, kind: str | None, fields=None) -> Item:
    """A file found by a walk or a glob (``fields``: lent by a manifest beside it)."""
    return Item(path=path, raw_path=source, fields={} if fields is None else fields, kind=kind,
                index=index, source=source)


@dataclass
class Inputs:
    """``root``: the folder sources are relative to; ``form``: "folder", "glob", "list",
    "manifest" or "file"; ``ignored``: files of a folder or glob skipped for an unknown
    extension (rows of a list or manifest are never skipped: see :attr:`Item.error`), the
    first :data:`IGNORED_NAMED` of them named in ``ignored_names``."""

    root: str
    form: str
    items: list[Item]
    ignored: int = 0
    spec: str = ""
    ignored_names: list[str] = field(default_factory=list)


IGNORED_NAMED = 5


def _is_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _rel(path: str, root: str) -> str:
    """``path`` as shown in outputs: relative to ``root`` (posix) when under it, else absolute.
    Absolute paths on a posix system by string (os.path.relpath, which this equals, costs tens
    of µs an input: seconds at the start of a job of tens of thousands of files)."""
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


def _manifest_rows(path: str) -> list:
    """The rows of a NeMo or CSV manifest: the :class:`ManifestRecord` of a valid one, the
    :class:`ManifestError` of one that breaks the rule (its place kept). Raises ManifestError
    for the whole file (bytes not UTF-8, no path column)."""
    ext = os.path.splitext(path)[1].lower()
    if ext in CSV_EXTENSIONS:
        _, records = csv_records(path, CSV_PATH_COLUMNS, keep_errors=True)
        label = "label"
        out = []
        for r in records:
            if not isinstance(r, ManifestError) and label in r.fields and \
                    not (r.fields[label] or "").strip():
                r = ManifestError(path, r.line, "no label", label, r.fields[label])
            out.append(r)
        return out
    return manifest_records(path, keep_errors=True)


def _folder_fields(folder_files: list[str], found: dict[str, int], items_fields: list[dict]):
    """Attach the fields of manifests lying in a walked folder to the files they list."""
    for mpath in folder_files:
        try:
            rows = _manifest_rows(mpath)
        except (ValueError, OSError, csv.Error):
            continue  # not a manifest (any JSON / CSV file): nothing to lend
        base = os.path.dirname(mpath)
        for row in rows:
            if isinstance(row, ManifestError):
                continue  # a line of a lending manifest that breaks the rule lends nothing
            full = os.path.normpath(os.path.join(base, row.path))
            i = found.get(full)
            if i is not None and "offset" not in row.fields:
                for k, v in row.fields.items():
                    items_fields[i].setdefault(k, v)


def _outside(top, i: int, rel: str, full: str) -> Item | None:
    """The refused item for a path outside ``top`` (:func:`resolve_root`), else None."""
    try:
        check_root(full, top)
    except OutsideRootError as e:
        return refused(i, rel, full, e)
    return None


def _walk(path: str, extensions, exclude, top=None) -> Inputs:
    excl = os.path.realpath(exclude) if exclude is not None else None
    media, manifests, ignored, ignored_names = [], [], 0, []
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
                if len(ignored_names) < IGNORED_NAMED:
                    ignored_names.append(_rel(full, path))
    rels = sorted((_rel(m, path), m) for m in media)
    fields: list[dict] = [{} for _ in rels]
    _folder_fields(manifests, {os.path.normpath(m): i for i, (_, m) in enumerate(rels)}, fields)
    items = [
        _outside(top, i, rel, full) or _file(i, rel, full, _kind(full, extensions), fields[i])
        for i, (rel, full) in enumerate(rels)
    ]
    return Inputs(path, "folder", items, ignored, ignored_names=ignored_names)


def _row_kind(path: str, extensions) -> str | None:
    """A listed file's kind: by extension; a video container is an audio input under a preset
    that takes audio and no video (its audio track is decoded)."""
    kind = _kind(path, extensions)
    if kind is None and os.path.splitext(path)[1].lower() in VIDEO_EXTENSIONS and \
            "audio" in extensions.values() and "video" not in extensions.values():
        return "audio"
    return kind


def _shard_inputs(spec, extensions, looked_for, storage_options) -> Inputs:
    """The samples of WebDataset shards: each sample's first member of the preset's kinds is
    its input (``source`` ``URL#KEY``; the sample's JSON / ``.cls`` fields travel into its
    outputs); damage found while indexing and samples with no such member are refused items,
    so that every sample is in index.jsonl."""
    got = read_webdataset(spec, extensions=extensions, storage_options=storage_options)
    items = []
    for it in got.items:
        # the sample's metadata, then the values the reader took out of it (the outputs' order)
        fields = dict(it.fields)
        for k, v in (("text", it.text), ("label", it.label), ("duration", it.duration)):
            if v is not None:
                fields[k] = v
        if it.offset:
            fields["offset"] = it.offset
        kind = kind_of("x." + it.locator.ext.rsplit(".", 1)[-1])
        items.append(_input(len(items), it.path, dataclasses.replace(it, fields=fields), kind))
    for name, why in got.errors:
        items.append(refused(len(items), name, name, ("CorruptDataError", f"{name}: {why}")))
    if not items:
        raise EmptyInputError(f"no input: the shards {spec!r} hold no sample with one of the "
                              f"{looked_for}")
    shown = spec if isinstance(spec, str) else f"{len(spec)} shard specs"
    return Inputs("", "shards", items, 0, shown)


def resolve_inputs(input_path, extensions, *, exclude=None, root=None,
                   storage_options=None) -> Inputs:
    """Resolve INPUT (see the module docstring). Raises FileNotFoundError for a path that
    does not exist, :class:`EmptyInputError` when nothing usable was found,
    :class:`~avpipe.errors.ManifestError` for a list or manifest unreadable as a whole (bytes
    not UTF-8, a CSV header without a path column). ``root``: a folder every input must lie
    under (others are refused items, see :attr:`Item.error`)."""
    looked_for = f"media files ({_describe(extensions)})"
    if is_shard_spec(input_path):
        return _shard_inputs(input_path, extensions, looked_for, storage_options)
    spec = os.fspath(input_path)
    path = os.path.abspath(spec)
    top = resolve_root(root)
    if not os.path.exists(path) and _is_glob(spec):
        hits = sorted(
            os.path.abspath(p) for p in _glob.glob(spec, recursive=True) if os.path.isfile(p)
        )
        fixed = []
        for part in spec.replace(os.sep, "/").split("/"):
            if _is_glob(part):
                break
            fixed.append(part)
        root_dir = os.path.abspath("/".join(fixed) or ".")
        if spec.startswith("/") and not fixed[1:]:
            root_dir = "/"
        media = [p for p in hits if _kind(p, extensions)]
        inp = Inputs(
            root_dir, "glob",
            [_outside(top, i, _rel(p, root_dir), p)
             or _file(i, _rel(p, root_dir), p, _kind(p, extensions))
             for i, p in enumerate(media)],
            len(hits) - len(media), spec,
            [_rel(p, root_dir) for p in hits if not _kind(p, extensions)][:IGNORED_NAMED],
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
        inp = _walk(path, extensions, exclude, top)
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
        form = "list" if ext in LIST_EXTENSIONS else "manifest"
        rows = list_records(path, keep_errors=True) if form == "list" else _manifest_rows(path)
        nemo = ext in JSON_MANIFEST_EXTENSIONS
        items = []
        for row in rows:
            i = len(items)
            if isinstance(row, ManifestError):
                # named by its file and line (its path, if any, may be what is wrong)
                items.append(refused(i, f"{os.path.basename(path)}:{row.line or '?'}", "", row))
                continue
            full = listed_path(row.path, path)
            rel = _rel(full, base)
            try:  # named with its file and line
                it = record_item(row, path, root=top, nemo=nemo)
            except OutsideRootError as e:
                items.append(refused(i, rel, full, e))
                continue
            kind = _row_kind(full, extensions)
            if kind is None:
                where = f"{path}:{row.line}" if row.line else path
                items.append(refused(i, rel, full, (
                    "UnsupportedFormatError",
                    f"{where}: {row.path!r} is not one of the preset's {looked_for}")))
                continue
            items.append(_input(i, rel, it, kind))
        if not items:
            raise EmptyInputError(f"no input: the {form} {path!r} lists no path")
        return Inputs(base, form, items, 0, spec)
    kind = _kind(path, extensions)
    if kind is None:
        raise EmptyInputError(
            f"no input: {path!r} is not one of the {looked_for}, nor a file list "
            f"({' '.join(LIST_EXTENSIONS)}) or a manifest (.json .jsonl .csv)"
        )
    bad = _outside(top, 0, os.path.basename(path), path)
    return Inputs(base, "file", [bad or _file(0, os.path.basename(path), path, kind)], 0, spec)
