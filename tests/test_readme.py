"""The README's job examples (the three jobs, images beside video) run as written (on the CPU,
from a folder holding the repository's ``samples/``: what they write stays out of the
checkout, where ``./dev demo`` writes its own output)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _job_blocks():
    text = (ROOT / "README.md").read_text()
    jobs = text[text.index("## Three jobs") : text.index("\n## ", text.index("## Three jobs") + 3)]
    return re.findall(r"```python\n(.*?)```", jobs, re.S)


@pytest.mark.parametrize("i", range(4))
def test_readme_job_examples_run(i, tmp_path):
    blocks = _job_blocks()
    assert len(blocks) == 4
    (tmp_path / "samples").symlink_to(ROOT / "samples", target_is_directory=True)
    env = dict(os.environ, AVPIPE_DISABLE_GPU="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", blocks[i]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()
    # a print whose comment shows a value (a shape, a list of classes) prints that value
    shown = re.findall(r"print\(.*\)\s*#\s*(\[[^\]]*\])", blocks[i])
    printed = out.stdout.replace("(", "[").replace(")", "]")
    for value in shown:
        assert value in printed, (value, out.stdout[-2000:])


def test_readme_extract_example_and_demo_write_apart():
    """``./dev demo`` (quickstart-out/, the CLI's shard size) and the README's extraction example
    (its own folder, 4 files a shard) do not share an output folder: either one run first made
    the other refuse it (an output folder keeps its shard size)."""
    dev = (ROOT / "dev").read_text()
    demo_out = re.search(r"--out (\S+)", dev[dev.index("extract samples"):]).group(1)
    (example,) = [b for b in _job_blocks() if "run_extract" in b]
    assert f'out_dir="{demo_out}"' not in example and 'out_dir="' in example


def test_readme_data_at_scale_examples_run_as_written(tmp_path):
    """The "Data at scale" section's examples, in order, each as a script in one folder (the
    second reads the shards the first made); a printed value its comment shows is checked."""
    import ast

    text = (ROOT / "README.md").read_text()
    start = text.index("## Data at scale")
    section = text[start: text.index("\n## ", start + 3)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    (tmp_path / "samples").symlink_to(ROOT / "samples", target_is_directory=True)
    env = dict(os.environ, AVPIPE_DISABLE_GPU="1", PYTHONPATH=str(ROOT),
               AVPIPE_CACHE_DIR=str(tmp_path / "cache"))
    outs = []
    for i, block in enumerate(blocks):
        script = tmp_path / f"example{i}.py"
        script.write_text(block)
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip()
        printed = out.stdout.replace("(", "[").replace(")", "]")
        for value in re.findall(r"print\(.*\)\s*#\s*(\[[^\]]*\])", block):
            try:
                ast.literal_eval(value)
            except ValueError:
                continue  # a shape with a name in it ([2, 80, T]): not a printed literal
            assert value in printed, (value, out.stdout[-2000:])
        outs.append(out.stdout)
    assert outs[0].splitlines()[0] == "3 []"  # 3 batches, no error
    assert outs[0].count("utt0") == 3
    assert outs[1].count("(3, 80,") == 2  # two batches of three stored features
