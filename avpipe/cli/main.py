"""``avpipe info`` and ``avpipe extract``."""

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
