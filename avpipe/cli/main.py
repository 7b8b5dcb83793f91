"""``avpipe info``, ``avpipe extract`` and ``avpipe index``."""

from __future__ import annotations

import json
import logging
import sys

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name=None, message="avpipe %(version)s", version=None)
@click.option("-v", "--verbose", is_flag=True, help="Log what avpipe decides (device, fallbacks).")
def cli(verbose: bool) -> None:
    """avpipe: audio, video and images to training-ready tensors and stored features."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def info(as_json: bool) -> None:
    """Versions, GPU and driver, NVDEC codecs, DALI image decoders."""
    from avpipe._info import format_info
    from avpipe._info import info as _info

    d = _info()
    click.echo(json.dumps(d, indent=2) if as_json else format_info(d))


def _preset_help() -> str:
    from avpipe.recipes.extract import PRESETS as BUILTIN

    return "\n".join(f"  {n:<12} {p['description']}" for n, p in BUILTIN.items())


class _ExtractCommand(click.Command):
    """Lists the presets, one line each, under the options."""

    def format_epilog(self, ctx, formatter):
        formatter.write_paragraph()
        formatter.write_text("Presets (--preset NAME, or --preset FILE.toml for your own):")
        with formatter.indentation():
            for line in _preset_help().splitlines():
                formatter.write(" " * formatter.current_indent + line.strip() + "\n")
        from avpipe.recipes.extract import describe_operators

        formatter.write_paragraph()
        formatter.write_text("Operators of a preset's ops lists (avpipe.ops.registry):")
        with formatter.indentation():
            for line in describe_operators(76).splitlines():
                formatter.write(" " * formatter.current_indent + line + "\n")


@cli.command(cls=_ExtractCommand)
@click.argument("input_path", metavar="INPUT")
@click.option("--preset", required=True, metavar="NAME|FILE.toml",
              help="What to extract: a preset listed below, or a TOML file (decode settings "
                   "and a list of operators; the schema: docs/presets.md).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              metavar="DIR|URL",
              help="Output folder, or a URL (s3://bucket/prefix, gs://..., file://...); "
                   "running again on the same folder resumes.")
@click.option("--format", "fmt", type=click.Choice(["tar", "parquet", "npy"]), default="tar",
              show_default=True,
              help="tar: WebDataset shards (KEY.npy + KEY.json); parquet: one row per input; "
                   "npy: one file per input.")
@click.option("--shard-size", type=click.IntRange(min=1), default=512, show_default=True,
              help="Inputs per shard (the unit of writing and of resume).")
@click.option("--devices", default=None, metavar="LIST",
              help="Where to run, one worker process each: cpu, cuda (every GPU), "
                   "cuda:0,cuda:1; repeat one for two workers on it (cuda:0,cuda:0). "
                   "Default: every GPU, else the CPU.")
@click.option("--device", default=None, hidden=True,
              help="One device: cpu, cuda (cuda:0) or cuda:N.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Decoding processes / threads per device worker (default: CPUs / workers).")
@click.option("--fps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Frames per second for the frames preset (default 1).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Items per feature batch (default: the preset's, 64).")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default=None,
              help="Audio features' type (default: the preset's, float32); float16 halves "
                   "the bytes written.")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local",
              show_default=True,
              help="local: worker processes here; ray: a Ray cluster through Ray Data "
                   "(RAY_ADDRESS or --ray-address; a local one when neither).")
@click.option("--ray-address", default=None, help="The Ray cluster to join (--engine ray).")
@click.option("--strict", is_flag=True,
              help="Exit with status 3 when any input failed (default: 0, failures listed in "
                   "OUT/errors.jsonl).")
@click.option("--allow-damaged", is_flag=True,
              help="Keep audio that decodes though damaged (fewer samples than its header or "
                   "its manifest duration declares), noted as info.damaged in index.jsonl "
                   "(default: such inputs fail, listed in OUT/errors.jsonl).")
@click.option("--retry-errors", is_flag=True,
              help="Redo the shards holding inputs that failed in an earlier run.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr (default: when stderr is a terminal).")
@click.option("--root", default=None, type=click.Path(file_okay=False),
              help="A folder every input must lie under (.. and links resolved); the inputs "
                   "outside it are refused and listed in OUT/errors.jsonl.")
def extract(input_path, preset, out_dir, fmt, shard_size, devices, device, workers, fps,
            batch_size, dtype, engine, ray_address, strict, allow_damaged, retry_errors,
            progress, root) -> None:
    """Extract features from every input of INPUT into shards in OUT.

    INPUT is a folder (walked recursively), a glob ("data/**/*.flac"), a file list (.txt, one
    path a line) or a manifest (NeMo .json/.jsonl: audio_filepath, duration, text, offset;
    .csv with a path column): manifest fields (text, label, ...) go into the outputs. Paths in
    lists and manifests are relative to their folder.

    OUT gets shards/shard-AAAAAA-BBBBBB.tar (inputs AAAAAA..BBBBBB of the input list),
    index.jsonl (every input: shard, key, shape, dtype, status, parameters), errors.jsonl
    (inputs that failed) and extract.json (the preset's full config). Killed, it resumes
    where it stopped when run again with the same arguments. Every row of a list or manifest
    is in index.jsonl: a bad manifest line, a file not of the preset's kinds or outside
    --root is listed in errors.jsonl with the reason.
    """
    from avpipe.recipes.extract import EmptyInputError, PresetError, run_extract

    if devices is not None and device is not None:
        raise click.UsageError("give --devices or --device, not both")
    try:
        summary = run_extract(
            input_path, preset=preset, out_dir=out_dir, device=device, devices=devices,
            format=fmt, shard_size=shard_size, workers=workers, fps=fps, dtype=dtype,
            batch_size=batch_size, engine=engine, ray_address=ray_address,
            retry_errors=retry_errors, progress=progress, root=root,
            on_damage="warn" if allow_damaged else "error",
        )
    except KeyboardInterrupt:
        _end_children()
        click.echo("avpipe extract: interrupted; run the same command again to resume",
                   err=True)
        raise click.exceptions.Exit(130) from None
    except PresetError as e:
        raise click.BadParameter(str(e), param_hint="--preset") from e
    except EmptyInputError as e:
        raise click.ClickException(str(e)) from e
    except (ValueError, RuntimeError, OSError) as e:  # bad --out / --devices / resume mismatch
        raise click.ClickException(str(e)) from e
    click.echo(summary.format())
    if summary.failures or not summary.complete:
        raise click.exceptions.Exit(1)
    if strict and summary.total_errors:
        click.echo(f"--strict: {summary.total_errors} input(s) failed", err=True)
        raise click.exceptions.Exit(3)


def _end_children() -> None:
    """End the worker processes this process started (they ignore Ctrl-C; the interpreter's
    exit would wait for them)."""
    import multiprocessing as mp

    for p in mp.active_children():
        try:
            p.kill()
            p.join(timeout=5)
        except (OSError, ValueError, AssertionError):
            pass


@cli.command()
@click.argument("input_path", metavar="INPUT")
@click.option("--out", "out_file", required=True, type=click.Path(dir_okay=False),
              help="The index file to write (.npz).")
@click.option("--workers", type=int, default=None, help="Scanning processes (default: CPU count).")
def index(input_path: str, out_file: str, workers: int | None) -> None:
    """Scan every video under INPUT (a folder, a glob pattern or a text file listing paths) into
    one index file; `VideoDecoder(path, index=OUT)` then opens those files without scanning."""
    import glob
    import os

    from avpipe.decoding import build_index
    from avpipe.formats import VIDEO_EXTENSIONS

    if os.path.isdir(input_path):
        paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(input_path) for f in fs
                       if f.lower().endswith(VIDEO_EXTENSIONS))
    elif os.path.isfile(input_path) and not input_path.lower().endswith(VIDEO_EXTENSIONS):
        base = os.path.dirname(os.path.abspath(input_path))
        with open(input_path) as f:
            paths = [os.path.join(base, line.strip()) for line in f if line.strip()]
    else:
        paths = sorted(glob.glob(input_path, recursive=True))
    if not paths:
        raise click.ClickException(f"no video files found for {input_path!r}")
    summary = build_index(paths, out_file, workers=workers)
    click.echo(f"indexed {summary['indexed']} files in {summary['seconds']:.1f} s "
               f"({summary['indexed'] / max(summary['seconds'], 1e-9):.0f} files/s) -> {out_file}")
    for path, why in summary["failed"]:
        click.echo(f"  skipped {path}: {why}", err=True)


@cli.command()
@click.argument("kind", type=click.Choice(["video", "rnnt"]))
@click.argument("input_path", metavar="INPUT", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", "out_file", required=True, type=click.Path(dir_okay=False),
              help="The PNG contact sheet to write.")
@click.option("--items", type=int, default=4, show_default=True, help="Items shown (rows).")
@click.option("--frames", type=int, default=8, show_default=True,
              help="video: frames shown per clip.")
@click.option("--seed", type=int, default=0, show_default=True, help="The feed's seed.")
@click.option("--train/--eval", "train", default=True, show_default=True,
              help="Training augmentation (random crops, flips, SpecAugment) or eval.")
@click.option("--clip-length", type=int, default=16, show_default=True, help="video: frames per clip.")
@click.option("--stride", type=int, default=4, show_default=True, help="video: frame step.")
@click.option("--crop-size", type=int, default=224, show_default=True, help="video: crop side.")
@click.option("--device", default=None,
              help="cpu, cuda or cuda:N (default: the GPU when one is usable, else the CPU).")
def preview(kind, input_path, out_file, items, frames, seed, train, clip_length, stride,
            crop_size, device) -> None:
    """Draw a contact sheet of a feed's first items into OUT (PNG), to check a pipeline by eye.

    video INPUT (a CSV path,label): each clip's frames after augmentation, with label and path.
    rnnt INPUT (a NeMo manifest): log-mel spectrograms with SpecAugment's masked cells marked
    in cyan, with transcript and duration.
    """
    from avpipe.recipes.preview import preview_rnnt, preview_video

    try:
        if kind == "video":
            sheet = preview_video(input_path, out_file, items=items, frames=frames, seed=seed,
                                  train=train, clip_length=clip_length, stride=stride,
                                  crop_size=crop_size, device=device)
        else:
            sheet = preview_rnnt(input_path, out_file, items=items, seed=seed, train=train,
                                 device=device)
    except (ValueError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {sheet.path} ({sheet.size[0]}x{sheet.size[1]}, "
               f"{len(sheet.tiles)} items)")

def main(argv=None) -> int:
    try:
        rv = cli.main(args=argv, prog_name="avpipe", standalone_mode=False)
        if isinstance(rv, int):  # click returns an Exit's code when not standalone
            return rv
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Abort as e:
        if isinstance(e.__context__, KeyboardInterrupt):  # Ctrl-C: click's Abort wraps it
            _end_children()
            click.echo("avpipe: interrupted", err=True)
            return 130
        click.echo("aborted", err=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
