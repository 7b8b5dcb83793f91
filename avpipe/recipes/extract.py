"""Feature extraction over a folder of media: the job behind ``avpipe extract``.

    avpipe extract INPUT --preset quickstart --out DIR

    from avpipe.recipes.extract import run_extract
    summary = run_extract("samples/", preset="quickstart", out_dir="feats/")
    print(summary.format())

INPUT is a media file or a folder, walked recursively in sorted order (hidden entries and the
output folder itself are skipped); a file is picked by its extension. For every input the
preset's extractor for that kind (``"audio"``, ``"video"``, ``"image"``) returns one array,
saved as ``DIR/features/<path relative to INPUT>.npy`` (e.g. ``features/speech/utt1.wav.npy``).

Bookkeeping in DIR:

* ``index.jsonl`` — one line per finished output: ``source`` (relative to INPUT), ``kind``,
  ``output`` (relative to DIR), ``shape``, ``dtype``.
* ``errors.jsonl`` — one line per input that failed in the latest run: ``source``, ``kind``,
  ``error`` (the exception's type name), ``message``. Bad inputs never stop the job.
* ``extract.json`` — the preset the folder was made with (resuming with another preset is
  refused rather than mixing features).

Crash safety and resume: an output is written to a temporary name and renamed into place
(``os.replace``), *then* its index line is appended and flushed. Running again on the same DIR
skips every input whose index line exists and whose output file is there; everything else
(never started, crashed half-way, deleted output, failed last time) is done again. Index lines
stay unique: at start the index is read, lines that are cut short, duplicated or whose output is
gone are dropped, and the file is rewritten (atomically) when anything was dropped.

Presets (:data:`PRESETS`):

* ``quickstart`` — files by extension (:mod:`avpipe.formats`): audio -> ``load_audio(sr=16000)``
  -> ``ops.log_mel(preset="nemo")`` -> ``[80, T]`` float32; video -> 8 uniformly spaced frames
  (``pipeline.samplers.uniform_indices``) -> resize short side 224 + center crop ->
  ``[8, 224, 224, 3]`` uint8; images -> ``decode_images`` -> resize short side 224 + center
  crop -> ``[224, 224, 3]`` uint8.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._version import __version__
from ..decoding.audio import load_audio
from ..decoding.image import decode_images
from ..decoding.video import VideoDecoder
from ..device import Device, resolve_device, to_numpy
from ..errors import EmptyMediaError
from ..formats import EXTENSIONS
from ..ops import image as im
from ..ops.audio import log_mel
from ..pipeline.samplers import uniform_indices

__all__ = [
    "Preset",
    "ExtractSummary",
    "PRESETS",
    "run_extract",
    "find_inputs",
    "uniform_indices",
    "INDEX_NAME",
    "ERRORS_NAME",
    "FEATURES_DIR",
]

INDEX_NAME = "index.jsonl"
ERRORS_NAME = "errors.jsonl"
META_NAME = "extract.json"
FEATURES_DIR = "features"

# an extractor: (path, device) -> one array (numpy or cupy)
Extractor = Callable[[str, Device], Any]


@dataclass(frozen=True)
class Preset:
    """What to extract: ``extensions`` maps a lower-case suffix (".wav") to a kind, and
    ``extractors`` maps each kind to a function ``(path, device) -> array``."""

    name: str
    description: str
    extensions: Mapping[str, str]
    extractors: Mapping[str, Extractor]


@dataclass(frozen=True)
class ExtractSummary:
    """What a run did. ``written``: outputs written this run, per kind; ``skipped``: inputs
    already done by an earlier run; ``errors``: inputs that failed this run."""

    input_path: str
    out_dir: str
    preset: str
    device: str
    written: Mapping[str, int] = field(default_factory=dict)
    skipped: int = 0
    errors: int = 0
    ignored: int = 0
    elapsed_s: float = 0.0

    @property
    def total_written(self) -> int:
        return sum(self.written.values())

    def format(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.written.items()) if n) or "nothing new"
        lines = [
            f"{self.preset} on {self.device}: wrote {kinds}; {self.skipped} already done; "
            f"{self.errors} error(s); {self.elapsed_s:.1f} s"
        ]
        if self.errors:
            lines.append(f"bad inputs are listed in {os.path.join(self.out_dir, ERRORS_NAME)}")
        lines.append(f"features written to {self.out_dir}")
        return "\n".join(lines)


# --- the quickstart preset's extractors ---------------------------------------------------------

QUICKSTART_SAMPLE_RATE = 16000
QUICKSTART_FRAMES = 8
QUICKSTART_SIZE = 224


def _resize_center_crop(x, size: int):
    return im.center_crop(im.resize(x, short_side=size), size)


def _audio_log_mel(path: str, device: Device):
    audio = load_audio(path, sample_rate=QUICKSTART_SAMPLE_RATE, device=str(device))
    x = audio.samples
    if x.shape[-1] == 0:
        raise EmptyMediaError(path, "no audio samples")
    feats, lengths = log_mel(x, preset="nemo")
    n = int(to_numpy(lengths).reshape(-1)[0])
    return feats[0, :, :n]


def _video_frames(path: str, device: Device):
    with VideoDecoder(path, device=str(device)) as dec:
        n = int(dec.metadata.num_frames)
        if n <= 0:
            raise EmptyMediaError(path, "no video frames")
        batch = dec.get_frames(uniform_indices(n, QUICKSTART_FRAMES).tolist())
        frames = batch.data
    return _resize_center_crop(frames, QUICKSTART_SIZE)


def _image_thumbnail(path: str, device: Device):
    (img,) = decode_images([path], device=str(device))
    return _resize_center_crop(img, QUICKSTART_SIZE)


QUICKSTART = Preset(
    name="quickstart",
    description=(
        "audio -> NeMo log-mel [80, T] float32 (16 kHz); video -> 8 uniform frames "
        "[8, 224, 224, 3] uint8; images -> [224, 224, 3] uint8 (short side 224, center crop)"
    ),
    extensions=dict(EXTENSIONS),
    extractors={"audio": _audio_log_mel, "video": _video_frames, "image": _image_thumbnail},
)

PRESETS: dict[str, Preset] = {QUICKSTART.name: QUICKSTART}


# --- walking the input --------------------------------------------------------------------------


def find_inputs(input_path, extensions: Mapping[str, str], *, exclude=None):
    """``(root, [(relative posix path, kind), ...], ignored)`` for a file or a folder.

    A folder is walked recursively in sorted order without following links; hidden entries and
    ``exclude`` (a folder, e.g. the output) are skipped; files whose suffix is not in
    ``extensions`` are counted in ``ignored``.
    """
    path = os.path.abspath(os.fspath(input_path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"input: no such file or folder: {os.fspath(input_path)!r}")
    if os.path.isfile(path):
        kind = extensions.get(os.path.splitext(path)[1].lower())
        root = os.path.dirname(path)
        name = os.path.basename(path)
        return root, ([(name, kind)] if kind else []), (0 if kind else 1)
    excl = os.path.realpath(exclude) if exclude is not None else None
    found, ignored = [], 0
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(
            d for d in dirnames
            if not d.startswith(".") and os.path.realpath(os.path.join(dirpath, d)) != excl
        )
        for f in sorted(filenames):
            if f.startswith("."):
                continue
            kind = extensions.get(os.path.splitext(f)[1].lower())
            if kind is None:
                ignored += 1
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), path).replace(os.sep, "/")
            found.append((rel, kind))
    return path, found, ignored


# --- bookkeeping --------------------------------------------------------------------------------


def _output_rel(source_rel: str) -> str:
    return f"{FEATURES_DIR}/{source_rel}.npy"


def _read_jsonl(path: str) -> tuple[list[dict], bool]:
    """Parsed lines and whether any line was bad (cut short by a crash, not an object)."""
    if not os.path.exists(path):
        return [], False
    rows, bad = [], False
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            if not line.endswith("\n"):  # the last line of a crashed run
                bad = True
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad = True
                continue
            if isinstance(row, dict) and isinstance(row.get("source"), str):
                rows.append(row)
            else:
                bad = True
    return rows, bad


def _write_jsonl_atomic(path: str, rows) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load_done(out_dir: str) -> dict[str, dict]:
    """Index entries whose output exists, one per source; rewrites the index if it had to drop
    anything (partial or duplicate lines, outputs that are gone)."""
    index_path = os.path.join(out_dir, INDEX_NAME)
    rows, bad = _read_jsonl(index_path)
    done: dict[str, dict] = {}
    dropped = bad
    for r in rows:
        out = r.get("output")
        full = os.path.join(out_dir, out) if isinstance(out, str) else None
        if full is None or not os.path.isfile(full) or os.path.getsize(full) == 0 \
                or r["source"] in done:
            dropped = True
            continue
        done[r["source"]] = r
    if dropped:
        _write_jsonl_atomic(index_path, done.values())
    return done


def _save_npy_atomic(path: str, arr: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
    os.replace(tmp, path)


def _check_meta(out_dir: str, preset: str, root: str) -> None:
    meta_path = os.path.join(out_dir, META_NAME)
    if os.path.exists(meta_path):
        try:
            with open(meta_path, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, json.JSONDecodeError):
            old = {}
        if isinstance(old, dict) and old.get("preset") not in (None, preset):
            raise ValueError(
                f"preset {preset!r} does not match the preset {old['preset']!r} that {out_dir!r} "
                "was extracted with; use the same --preset to resume, or another --out"
            )
        if isinstance(old, dict) and old.get("input") not in (None, root):
            raise ValueError(
                f"input {root!r} is not the input {old['input']!r} that {out_dir!r} was "
                "extracted from; resume with the same INPUT, or use another --out"
            )
        return
    tmp = meta_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"preset": preset, "input": root, "avpipe": __version__}, f, indent=1)
    os.replace(tmp, meta_path)


# --- the job ------------------------------------------------------------------------------------


def _resolve_preset(preset) -> Preset:
    if isinstance(preset, Preset):
        return preset
    if isinstance(preset, str) and preset in PRESETS:
        return PRESETS[preset]
    raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")


def _progress(total: int, enabled):
    from tqdm import tqdm

    disable = (not sys.stderr.isatty()) if enabled is None else not enabled
    return tqdm(total=total, file=sys.stderr, disable=disable, unit="file", desc="extract")


def run_extract(
    input_path,
    *,
    preset="quickstart",
    out_dir,
    device=None,
    extractors: Mapping[str, Extractor] | None = None,
    progress: bool | None = None,
) -> ExtractSummary:
    """Extract features from every media file under ``input_path`` into ``out_dir``.

    ``preset``: a name from :data:`PRESETS` or a :class:`Preset`. ``device``: ``None`` (the GPU
    when usable), ``"cpu"``, ``"cuda"``, ``"cuda:N"``. ``extractors``: per-kind overrides of the
    preset's functions ``(path, device) -> array`` (tests, custom jobs). ``progress``: a tqdm bar
    on stderr (None: only when stderr is a terminal).

    Resumes when run again on the same ``out_dir``; bad inputs are recorded in
    ``errors.jsonl`` and skipped. Returns an :class:`ExtractSummary`.
    """
    t0 = time.perf_counter()
    p = _resolve_preset(preset)
    fns = dict(p.extractors)
    if extractors:
        unknown = set(extractors) - set(p.extensions.values())
        if unknown:
            raise ValueError(f"extractors has kinds the preset does not know: {sorted(unknown)}")
        fns.update(extractors)
    dev = resolve_device(device)
    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise NotADirectoryError(f"out_dir: not a folder: {out_dir!r}")
    os.makedirs(out_dir, exist_ok=True)

    root, inputs, ignored = find_inputs(input_path, p.extensions, exclude=out_dir)
    _check_meta(out_dir, p.name, root)
    done = _load_done(out_dir)
    todo = [(rel, kind) for rel, kind in inputs if rel not in done]
    skipped = len(inputs) - len(todo)

    written: Counter = Counter()
    n_err = 0
    errors_path = os.path.join(out_dir, ERRORS_NAME)
    index_path = os.path.join(out_dir, INDEX_NAME)
    # errors.jsonl describes the latest run: every input that failed before is retried now
    with open(errors_path, "w", encoding="utf-8") as ferr, \
            open(index_path, "a", encoding="utf-8") as fidx, _progress(len(todo), progress) as bar:
        for rel, kind in todo:
            src = os.path.join(root, rel)
            try:
                with dev.activate():
                    arr = to_numpy(fns[kind](src, dev))
                arr = np.ascontiguousarray(arr)
                out_rel = _output_rel(rel)
                _save_npy_atomic(os.path.join(out_dir, out_rel), arr)
            except Exception as e:  # noqa: BLE001 - a bad input is recorded, never fatal
                n_err += 1
                ferr.write(json.dumps({"source": rel, "kind": kind, "error": type(e).__name__,
                                       "message": str(e)}) + "\n")
                ferr.flush()
            else:
                fidx.write(json.dumps({"source": rel, "kind": kind, "output": out_rel,
                                       "shape": list(arr.shape), "dtype": str(arr.dtype)}) + "\n")
                fidx.flush()
                written[kind] += 1
            bar.update(1)

    return ExtractSummary(
        input_path=os.fspath(input_path),
        out_dir=out_dir,
        preset=p.name,
        device=str(dev),
        written=dict(written),
        skipped=skipped,
        errors=n_err,
        ignored=ignored,
        elapsed_s=time.perf_counter() - t0,
    )
