"""Batch feature extraction: the job behind ``avpipe extract``.

    avpipe extract INPUT --preset nemo --out DIR [--format tar|parquet|npy] [--shard-size 512]
                         [--devices cuda:0,cuda:1] [--engine local|ray] [--strict]

    from avpipe.recipes.extract import run_extract
    summary = run_extract("librispeech/train.jsonl", preset="nemo", out_dir="feats/")
    print(summary.format())

INPUT: a folder, a glob, a file list or a manifest (:mod:`._inputs`); presets: built-in names
or a TOML file (:mod:`._presets`); output layout, index and error report: :mod:`._writers`.

Work is cut into shards of ``shard_size`` consecutive inputs of the input list; a shard is
computed whole and written atomically (temporary name, fsync, rename), then its index part.
**Resume rule**: running again on the same DIR redoes exactly the shards whose part is missing
or incomplete (or whose outputs are gone); a shard's bytes depend only on its inputs and the
preset, so a run killed at any point and resumed leaves the same files, bytes and index as an
uninterrupted run. Inputs that failed stay recorded as failed (``--retry-errors`` redoes the
shards that hold them). Resuming with another preset, format, shard size or input list is
refused.

**Output to a URL**: ``out_dir`` (``--out``) may be ``s3://bucket/prefix``, ``gs://...`` or
``file://...`` (:mod:`avpipe.storage`; S3 configured as boto3 is, ``AWS_ENDPOINT_URL`` included).
The layout and bytes are those of a local folder; every output is staged in a local temporary
file and uploaded as one whole object, a shard's part after its data (:mod:`._writers`), so
the resume rule holds as it does locally: a run killed at any point and run again leaves the
same objects, byte for byte, and a finished job run again uploads nothing. A local folder is
locked (``DIR/.lock``) against a second run; a URL prefix is not: running one job at a time on
a prefix is the user's part. Two runs of the same command on one prefix write the same bytes
to the same names (each shard at most computed twice); runs that differ (preset, inputs) must
not share a prefix.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from ... import storage
from ..._validate import check_choice, pos_int
from ..._version import __version__
from ...device import gpu_count, resolve_device
from ...pipeline.samplers import uniform_indices
from ._inputs import EmptyInputError, Inputs, resolve_inputs
from ._presets import (
    BUILTIN,
    PresetError,
    describe_builtins,
    describe_operators,
    extensions_of,
    resolve_preset,
)
from ._writers import (
    ERRORS_NAME,
    FEATURES_DIR,
    FORMATS,
    INDEX_NAME,
    META_NAME,
    PARTS_DIR,
    SHARDS_DIR,
    clean_partials,
    is_remote,
    listing,
    make_shards,
    npy_name,
    printable,
    put,
    read_part,
    read_text,
    write_index,
)

__all__ = [
    "run_extract",
    "ExtractSummary",
    "PRESETS",
    "FORMATS",
    "EmptyInputError",
    "PresetError",
    "resolve_inputs",
    "resolve_preset",
    "describe_builtins",
    "describe_operators",
    "parse_devices",
    "uniform_indices",
    "INDEX_NAME",
    "ERRORS_NAME",
    "META_NAME",
    "FEATURES_DIR",
    "SHARDS_DIR",
    "PARTS_DIR",
]

PRESETS = BUILTIN

DEFAULT_SHARD_SIZE = 512
ENGINES = ("local", "ray")


@dataclass
class ExtractSummary:
    """What a run did. ``written``: ok outputs written this run, per kind; ``skipped``: ok
    inputs done by an earlier run; ``errors``: inputs that failed this run; ``total_errors``:
    failed inputs in the whole folder; ``failures``: workers that stopped (not inputs)."""

    input_path: str
    out_dir: str
    preset: str
    devices: list[str]
    engine: str = "local"
    output_format: str = "tar"
    inputs: int = 0
    written: dict[str, int] = field(default_factory=dict)
    skipped: int = 0
    errors: int = 0
    total_errors: int = 0
    earlier_errors: int = 0
    ignored: int = 0
    ignored_names: list[str] = field(default_factory=list)
    shards_done: int = 0
    shards_total: int = 0
    audio_seconds: float = 0.0
    frames: float = 0.0
    elapsed_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def total_written(self) -> int:
        return sum(self.written.values())

    @property
    def complete(self) -> bool:
        return not self.failures and self.shards_done == self.shards_total

    @property
    def device(self) -> str:
        return ",".join(self.devices)

    def format(self) -> str:  # noqa: A003
        """The report printed at the end of ``avpipe extract``."""
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.written.items()) if n) or "nothing new"
        t = max(self.elapsed_s, 1e-9)
        rate = [f"{self.total_written / t:.1f} files/s"]
        if self.audio_seconds:
            rate.append(f"{self.audio_seconds / t:.0f} audio-s/s "
                        f"({self.audio_seconds / 3600:.2f} audio-h)")
        if self.frames:
            rate.append(f"{self.frames / t:.1f} frames/s")
        lines = [
            f"{self.preset} on {self.device} ({self.engine}, {self.output_format}): wrote {kinds}; "
            f"{self.skipped} already done; {self.errors} error(s); {self.elapsed_s:.1f} s; "
            + ", ".join(rate)
        ]
        if self.earlier_errors:
            lines.append(f"{self.earlier_errors} input(s) failed in an earlier run "
                         "(--retry-errors redoes them)")
        if self.ignored:
            names = ", ".join(printable(n) for n in self.ignored_names)
            more = ", ..." if self.ignored > len(self.ignored_names) else ""
            lines.append(f"{self.ignored} file(s) ignored (not {self.preset} inputs)"
                         + (f": {names}{more}" if names else ""))
        if self.total_errors:
            lines.append(f"bad inputs are listed in {os.path.join(self.out_dir, ERRORS_NAME)}")
        for f in self.failures:
            lines.append(f"worker failed: {f}")
        if not self.complete:
            if all(_rerun_helps(f) for f in self.failures):
                lines.append(f"incomplete: {self.shards_done} of {self.shards_total} shards "
                             "done; run the same command again to resume")
            else:
                lines.append(f"incomplete: {self.shards_done} of {self.shards_total} shards "
                             "done; a rerun stops the same way until the failure above is "
                             "fixed (the shards done are kept)")
        if self.total_written:
            lines.append(f"features written to {self.out_dir}")
        elif self.skipped:
            lines.append(f"features in {self.out_dir} (nothing new written)")
        else:
            lines.append(f"no features written to {self.out_dir}")
        return "\n".join(lines)


# failures a rerun may not meet again: the machine's (files, memory, a killed process), not
# the program's or the input's
_TRANSIENT = ("OSError", "IOError", "BlockingIOError", "TimeoutError", "ConnectionError",
              "BrokenPipeError", "ConnectionResetError", "InterruptedError", "MemoryError",
              "KeyboardInterrupt", "SystemExit", "EOFError")


def _rerun_helps(failure: str) -> bool:
    """Whether running the same command again can get past ``failure`` (a worker's failure
    line, "DEVICE: why"): a killed worker or a system error may not come back; a shard that
    ended every worker tried on it, or an exception of the program, comes back every time."""
    why = failure.split(": ", 1)[-1]
    if " workers (last: " in why:  # a shard given up after its crashes: they repeat
        return False
    if why.startswith(("signal", "worker ended without finishing")):
        return True
    if failure.startswith("ray: "):
        return True
    name = why.split(":", 1)[0].strip()
    return name in _TRANSIENT or name.endswith(("OSError", "Interrupt", "Timeout"))


def parse_devices(devices) -> list[str]:
    """``None`` (every GPU, else the CPU), ``"cpu"``, ``"cuda"`` (every GPU), ``"cuda:0,cuda:1"``
    or a list; one entry may repeat (two workers on it). Returns canonical names."""
    if devices is None:
        n = gpu_count()
        return [f"cuda:{i}" for i in range(n)] if n else ["cpu"]
    if isinstance(devices, str):
        devices = [d for d in devices.replace(" ", "").split(",") if d]
    out = []
    for d in devices:
        if str(d) == "cuda":
            n = gpu_count()
            if n == 0:
                raise RuntimeError("devices='cuda': no usable CUDA GPU (is cupy installed?)")
            out.extend(f"cuda:{i}" for i in range(n))
        else:
            out.append(str(resolve_device(d, param="devices")))
    if not out:
        raise ValueError("devices: give at least one device (cpu, cuda, cuda:N)")
    return out


def job_devices(device=None, devices=None) -> list[str]:
    """The workers' devices of :func:`run_extract`: ``device`` (one, resolved by
    :func:`avpipe.device.resolve_device`: "cuda" is cuda:0), else ``devices``
    (:func:`parse_devices`; None: every GPU, else the CPU)."""
    if device is not None and devices is not None:
        raise ValueError(f"give device or devices, not both (device={device!r}, "
                         f"devices={devices!r})")
    if device is not None:
        if isinstance(device, (list, tuple)) or (isinstance(device, str) and "," in device):
            raise ValueError(f"device is one device, got {device!r}; give a list as devices=")
        return [str(resolve_device(device, param="device"))]
    return parse_devices(devices)


def _fingerprint(inp: Inputs) -> str:
    """sha256 over one JSON line ``[source, kind, fields]`` (sorted keys) per input; an input
    without fields is written by hand, the same bytes json.dumps gives, several times faster."""
    enc = json.encoder.encode_basestring_ascii
    lines = [f"[{enc(it.source)}, {enc(it.kind)}, {{}}]" if not it.fields and it.kind else
             json.dumps([it.source, it.kind, it.fields] + ([list(it.error)] if it.error else []),
                        sort_keys=True) for it in inp.items]
    lines.append("")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _check_meta(out_dir: str, meta: dict) -> None:
    text = read_text(out_dir, META_NAME)
    if text is not None:
        try:
            old = json.loads(text)
        except json.JSONDecodeError:
            old = None
        if isinstance(old, dict):
            def same(key, a, b):
                if key == "preset" and isinstance(a, dict):  # the description may change
                    a = {k: v for k, v in a.items() if k != "description"}
                    b = {k: v for k, v in b.items() if k != "description"}
                return a == b

            for key, what in (("preset", "preset"), ("format", "format"),
                              ("shard_size", "shard size"), ("input", "input")):
                if not same(key, old.get(key), meta[key]):
                    name = lambda v: v.get("name") if isinstance(v, dict) and "name" in v else (  # noqa: E731
                        v.get("root") if isinstance(v, dict) else v)
                    was, now = name(old.get(key)), name(meta[key])
                    if key == "input" and was == now:  # the same root: its files differ
                        a, b = old.get(key) or {}, meta[key]
                        detail = (f"{a.get('count')} files then, {b.get('count')} now"
                                  if a.get("count") != b.get("count") else
                                  "the same number of files, other names")
                        raise ValueError(
                            f"{out_dir!r} was extracted from {now!r} when it listed other files "
                            f"({detail}); outputs are numbered by input position, so a changed "
                            "input needs another --out"
                        )
                    raise ValueError(
                        f"{out_dir!r} was extracted with another {what} "
                        f"({was!r}, now {now!r}); resume with the "
                        "same command, or use another --out"
                    )
            return
    text = json.dumps(meta, indent=1, sort_keys=True) + "\n"
    put(out_dir, META_NAME, lambda f: f.write(text.encode()))


class _Lock:
    """One run at a time per output folder (``DIR/.lock``, flock)."""

    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, ".lock")
        self.f = None

    def __enter__(self):
        self.f = open(self.path, "a")
        try:
            fcntl.flock(self.f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.f.close()
            raise RuntimeError(f"another avpipe extract is writing to {os.path.dirname(self.path)!r}") from None
        return self

    def __exit__(self, *exc):
        try:
            os.remove(self.path)
        except OSError:
            pass
        self.f.close()


class _Progress:
    """The progress bar (tqdm, on stderr), in the unit that fits the inputs to do: audio hours
    when they are all audio (total: their manifest durations, the rest estimated from the mean
    duration of the files done so far, so the ETA is in audio), frames when they are all video
    and the preset samples a fixed number of frames per video, else files. Fed ``(files,
    errors, audio seconds, video frames)`` payloads."""

    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt}{unit} [{elapsed}<{remaining}{postfix}]"

    def __init__(self, items, cfg: dict, enabled, file=None):
        from tqdm import tqdm

        disable = (not sys.stderr.isatty()) if enabled is None else not enabled
        kinds = {it.kind for it in items if it.error is None}
        self.files_total = len(items)
        self.frames_per_file = None
        self.known_seconds = 0.0  # audio: manifest durations of the inputs to do
        self.unknown_files = 0  # ... and how many have none
        if kinds == {"audio"}:
            self.unit = "audio-h"
            for it in items:
                if it.error is not None:  # refused: no audio
                    continue
                d = _duration_of(it)
                if d is None:
                    self.unknown_files += 1
                else:
                    self.known_seconds += d
            total = self.known_seconds / 3600 if not self.unknown_files else None
        elif kinds == {"video"} and _frames_per_video(cfg["video"]) is not None:
            self.unit = "frame"
            self.frames_per_file = _frames_per_video(cfg["video"])
            total = self.files_total * self.frames_per_file
        else:
            self.unit = "file"
            total = self.files_total
        self.total = total
        # the rate is always written per second, in the postfix (tqdm's own turns into
        # "10.1s/ audio-h" below one unit a second)
        self.bar = tqdm(total=total, file=file or sys.stderr, disable=disable, unit=" " + self.unit,
                        unit_scale=self.unit != "file", desc="extract", dynamic_ncols=True,
                        smoothing=0.1, bar_format=self.BAR_FORMAT)
        self.t0 = time.perf_counter()
        self.files = self.errors = 0
        self.seconds = self.frames = 0.0
        self._last = 0.0

    def __call__(self, p):
        files, errors, seconds, frames = p
        self.files += files
        self.errors += errors
        self.seconds += seconds
        self.frames += frames
        if self.unit == "audio-h":
            if self.unknown_files and self.files > self.errors:
                # the files without a known duration: as long as the mean of those done
                mean = self.seconds / (self.files - self.errors)
                self.total = (self.known_seconds + self.unknown_files * mean) / 3600
                self.bar.total = self.total
            n = self.bar.n + seconds / 3600
            if self.bar.total is not None and n > self.bar.total:
                self.bar.total = n  # the manifest's durations fell a little short
            self.bar.update(seconds / 3600)
        elif self.unit == "frame":  # a failed video counts its frames too: the bar ends full
            self.bar.update(files * self.frames_per_file)
        else:
            self.bar.update(files)
        now = time.perf_counter()
        if now - self._last > 0.5:
            self._last = now
            dt = max(now - self.t0, 1e-9)
            parts = [f"{self.files / dt:.1f} files/s"]
            if self.seconds:
                parts.append(f"{self.seconds / dt:.0f} audio-s/s")
            if self.frames:
                parts.append(f"{self.frames / dt:.1f} frames/s")
            if self.errors:
                parts.append(f"{self.errors} err")
            self.bar.set_postfix_str(", ".join(parts), refresh=False)

    def close(self):
        self.bar.close()


def _duration_of(item) -> float | None:
    """An input's duration in seconds from its manifest fields, or None."""
    d = item.fields.get("duration")
    try:
        d = float(d)
    except (TypeError, ValueError):
        return None
    return d if d >= 0 and d == d and d != float("inf") else None


def _frames_per_video(vcfg: dict) -> int | None:
    """The frames the video sampler takes from every video, or None (``fps``: it depends on
    the video's duration)."""
    if vcfg["sampler"] == "uniform":
        return int(vcfg["num_frames"])
    if vcfg["sampler"] == "clips":
        return int(vcfg["num_clips"]) * int(vcfg["clip_length"])
    return None


def run_extract(
    input_path,
    *,
    preset="quickstart",
    out_dir,
    device=None,
    devices=None,
    format: str = "tar",  # noqa: A002
    shard_size: int = DEFAULT_SHARD_SIZE,
    workers: int | None = None,
    fps: float | None = None,
    dtype: str | None = None,
    batch_size: int | None = None,
    engine: str = "local",
    retry_errors: bool = False,
    progress: bool | None = None,
    ray_address: str | None = None,
    root=None,
    on_damage: str = "error",
    storage_options=None,
) -> ExtractSummary:
    """Extract features from every input of ``input_path`` into ``out_dir`` (see the module
    docstring). Returns an :class:`ExtractSummary`; bad inputs never raise (they are counted
    and listed).
    ``device``: one device, named as everywhere in avpipe ("cpu", "cuda" = cuda:0, "cuda:N");
    ``devices``: the list, one worker each (``--devices``: "cuda:0,cuda:1", "cuda" = every
    GPU; an entry may repeat). With both None the job runs on every GPU of the machine, else
    on the CPU; giving both is a ValueError.
    ``dtype``: the audio features' type, "float32" (the preset's, by default) or "float16"
    (half the bytes; computed in float32, then rounded). ``root``: a folder every input must
    lie under (``..`` and links resolved); the others are recorded as errors
    (``OutsideRootError`` in errors.jsonl), as are manifest lines that break the manifest rule
    and listed files not of the preset's kinds: every row of a list or manifest ends in
    index.jsonl, ok or failed.
    ``on_damage``: audio that decodes though damaged (fewer samples than its header, or more
    than 0.1 s fewer than its manifest ``duration``, declares) fails, listed in errors.jsonl
    ("error", the default), or is kept with ``info.damaged`` in its index row ("warn",
    ``--allow-damaged``; recorded in the preset's config, so a resume must give it too).
    ``input_path`` may also be WebDataset shards (a path or URL of ``.tar`` files with brace
    ranges, or a list): each sample's first member of the preset's kinds is an input, named
    ``URL#KEY``, read by one ranged read; ``storage_options`` goes to fsspec for URLs."""
    t0 = time.perf_counter()
    check_choice("format", format, FORMATS)
    check_choice("engine", engine, ENGINES)
    pos_int("shard_size", shard_size)
    if format == "parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise RuntimeError("--format parquet needs pyarrow: pip install 'avpipe[parquet]'") \
                from None
    check_choice("on_damage", on_damage, ("error", "warn"))
    cfg = resolve_preset(preset, fps=fps, dtype=dtype)
    if on_damage == "warn" and cfg.get("audio") is not None:
        cfg["audio"]["on_damage"] = "warn"
    standby = None
    if engine == "local":  # its start and imports overlap the work below (see Standby)
        from ._engine_local import Standby

        maybe_gpu = device != "cpu" and (devices is None or "cuda" in str(devices))
        standby = Standby(audio=maybe_gpu and cfg.get("audio") is not None,
                          cpu=not maybe_gpu)
    try:
        return _run_extract(input_path, cfg, out_dir, device, devices, format, shard_size,
                            workers, batch_size, engine, retry_errors, progress, ray_address, t0,
                            standby, root, storage_options)
    finally:
        if standby is not None:
            standby.stop()


def _run_extract(input_path, cfg, out_dir, device, devices, format, shard_size,  # noqa: A002
                 workers, batch_size, engine, retry_errors, progress, ray_address, t0,
                 standby, root=None, storage_options=None) -> ExtractSummary:
    if batch_size is not None:
        cfg["batch_size"] = pos_int("batch_size", batch_size)
    devs = job_devices(device, devices)
    if workers is None:
        workers = max(1, (os.cpu_count() or 1) // len(devs))
    out_dir = os.fspath(out_dir)
    if storage.is_url(out_dir) and storage.is_local(out_dir):  # file://: a local folder
        out_dir = storage.local_path(out_dir)
    remote = is_remote(out_dir)
    if not remote and os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise NotADirectoryError(f"out_dir: not a folder: {out_dir!r}")
    inp = resolve_inputs(input_path, extensions_of(cfg), exclude=None if remote else out_dir,
                         root=root, storage_options=storage_options)
    if not remote:
        os.makedirs(out_dir, exist_ok=True)
    total = len(inp.items)
    run_cfg = {k: v for k, v in cfg.items() if k != "batch_size"}
    run_cfg["batch_size"] = cfg["batch_size"]  # batching changes float rounding: part of it
    meta = {
        "preset": run_cfg,
        "format": format,
        "shard_size": shard_size,
        "input": {"root": inp.root, "form": inp.form, "count": total,
                  "sha256": _fingerprint(inp)},
    }
    meta["avpipe"] = __version__  # recorded, not compared
    # a URL prefix takes no lock (module docstring)
    with contextlib.nullcontext() if remote else _Lock(out_dir):
        _check_meta(out_dir, meta)
        clean_partials(out_dir)
        shards = make_shards(total, shard_size)
        done_ok = done_err = 0
        todo = []
        present = listing(out_dir)
        for s in shards:
            rows = read_part(out_dir, s, total, present)
            redo = rows is None or (retry_errors and any(r.get("status") != "ok" for r in rows))
            if redo:
                todo.append(s)
            else:
                done_ok += sum(r.get("status") == "ok" for r in rows)
                done_err += sum(r.get("status") != "ok" for r in rows)
        # inputs whose npy outputs would share a name (one file listed twice, or "/x/a.wav"
        # and "x/a.wav") get the input's key in the name
        clash = {s for s, n in Counter(npy_name(it.source) for it in inp.items).items() if n > 1}
        duplicated = frozenset(it.source for it in inp.items if npy_name(it.source) in clash)
        bar = _Progress([inp.items[i] for s in todo for i in range(s.start, s.end)], cfg,
                        progress)
        written: dict[str, int] = {}

        try:
            if todo:
                if engine == "ray":
                    from ._engine_ray import run_ray

                    failures = run_ray(devs, todo, inp.items, cfg, out_dir, format, total,
                                       workers, duplicated, bar, address=ray_address)
                else:
                    from ._engine_local import run_local

                    failures = run_local(devs, todo, inp.items, cfg, out_dir, format, total,
                                         workers, duplicated, bar, standby)
            else:
                failures = []
        finally:
            bar.close()
        # what this run wrote, from the parts (also right for the worker processes' shards)
        n_err = 0
        shards_done = 0
        present = listing(out_dir)
        parts = [read_part(out_dir, s, total, present) for s in shards]
        redone = set(todo)
        for s, rows in zip(shards, parts):
            if rows is None:
                continue
            shards_done += 1
            if s not in redone:
                continue
            for r in rows:
                if r.get("status") == "ok":
                    written[r["kind"]] = written.get(r["kind"], 0) + 1
                else:
                    n_err += 1
        _, _, total_errors = write_index(out_dir, shards, total, parts)
    return ExtractSummary(
        input_path=os.fspath(input_path), out_dir=out_dir, preset=cfg["name"], devices=devs,
        engine=engine, output_format=format, inputs=total, written=written, skipped=done_ok,
        errors=n_err, total_errors=total_errors, earlier_errors=0 if retry_errors else done_err,
        ignored=inp.ignored, ignored_names=inp.ignored_names, shards_done=shards_done, shards_total=len(shards),
        audio_seconds=bar.seconds, frames=bar.frames, elapsed_s=time.perf_counter() - t0,
        failures=failures,
    )

