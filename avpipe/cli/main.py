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


@cli.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(exists=True))
@click.option("--preset", required=True, help="What to extract (see `avpipe extract --help`).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Output folder; running again on the same folder resumes.")
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: the GPU if usable).")
def extract(input_path: str, preset: str, out_dir: str, device: str | None) -> None:
    """Extract features from every media file under INPUT into OUT.

    Presets: quickstart (audio -> NeMo log-mel, video -> 8 uniform frames at 224x224,
    images -> 224x224 thumbnails). Bad inputs are skipped and listed in OUT/errors.jsonl;
    the exit status stays 0.
    """
    from avpipe.recipes.extract import PRESETS, run_extract

    if preset not in PRESETS:
        raise click.BadParameter(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}",
                                 param_hint="--preset")
    try:
        summary = run_extract(input_path, preset=preset, out_dir=out_dir, device=device)
    except (ValueError, RuntimeError, OSError) as e:  # bad --out / --device / preset mismatch
        raise click.ClickException(str(e)) from e
    click.echo(summary.format())


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
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
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
        cli.main(args=argv, prog_name="avpipe", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
