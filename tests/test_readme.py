"""The README's job examples (the three jobs, images beside video) run as written (on the CPU, from the repository's root)."""

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
def test_readme_job_examples_run(i):
    blocks = _job_blocks()
    assert len(blocks) == 4
    env = dict(os.environ, AVPIPE_DISABLE_GPU="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", blocks[i]], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()
