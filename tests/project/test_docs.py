"""Every fenced ``python`` and ``bash`` block of README.md and docs/*.md runs, as written.

The blocks are read from the pages themselves (no copies in this file). The conventions the
pages follow:

* A ```python or ```bash block runs. Blocks of any other language (``text``, ``toml``, ...)
  do not run themselves.
* A page's blocks run in order, each as its own script (``python block.py``, ``bash -e
  block.sh``), in one temporary folder per page. That folder stands for a checkout: it holds
  ``samples/`` (the repository's), ``dev`` and ``pyproject.toml``, and a set-up ``.venv`` whose
  ``bin/avpipe`` and ``bin/python`` run this checkout; ``avpipe`` and ``python`` on the PATH
  are the same. What a block writes stays there for the page's later blocks. CPU only
  (``AVPIPE_DISABLE_GPU=1``), no network.
* Printed output: a ```text block right after a runnable block (only blank lines between) is
  what that block prints. Its lines must equal the printed lines (stdout), where ``...`` inside
  a line matches any text, and a line that is ``...`` alone matches any number of lines.
* ``<!-- file: NAME -->`` on the line before a block (a TOML preset, say) writes the block to
  NAME in the page's folder, for later blocks to use.
* ``<!-- not run: REASON -->`` on the line before a block leaves it out: a GPU, the network, or
  this very test suite. Such blocks are counted here and must stay few.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from docblocks import PAGES, ROOT, RUNNABLE, blocks_of, matches

MAX_NOT_RUN = 5  # blocks the pages may leave out, all pages together


def _checkout(tmp: pathlib.Path) -> dict:
    """A folder that stands for a set-up checkout, and the environment the blocks run in."""
    (tmp / "samples").symlink_to(ROOT / "samples", target_is_directory=True)
    (tmp / "pyproject.toml").symlink_to(ROOT / "pyproject.toml")
    (tmp / "dev").symlink_to(ROOT / "dev")
    venv_bin = tmp / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    shims = {"avpipe": f'exec "{sys.executable}" -m avpipe "$@"',
             "python": f'exec "{sys.executable}" "$@"',
             "python3": f'exec "{sys.executable}" "$@"'}
    for name, body in shims.items():
        p = venv_bin / name
        p.write_text(f"#!/bin/sh\n{body}\n")
        p.chmod(0o755)
    (tmp / ".venv" / "bin" / "activate").write_text(f'PATH="{venv_bin}:$PATH"\n')
    (tmp / ".venv" / ".avpipe-installed").touch()  # ./dev sees it set up: no pip install
    return dict(os.environ, AVPIPE_DISABLE_GPU="1", PYTHONPATH=str(ROOT),
                PATH=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
                AVPIPE_CACHE_DIR=str(tmp / "cache"), HOME=str(tmp))


def _pages_with_blocks():
    return [p for p in PAGES if any(b.lang in RUNNABLE or b.file for b in blocks_of(p))]


@pytest.mark.parametrize("page", _pages_with_blocks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_blocks_run_as_written(page, tmp_path):
    env = _checkout(tmp_path)
    ran = 0
    for i, b in enumerate(blocks_of(page)):
        where = f"{b.page}:{b.line}"
        if b.not_run:
            continue
        if b.file:
            (tmp_path / b.file).write_text(b.code)
            continue
        if b.lang not in RUNNABLE:
            continue
        script = tmp_path / f".block{i}.{'py' if b.lang == 'python' else 'sh'}"
        script.write_text(b.code)
        cmd = [sys.executable, str(script)] if b.lang == "python" else ["bash", "-e", str(script)]
        out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, f"{where} exited {out.returncode}:\n{out.stderr[-3000:]}"
        if b.output is not None:
            assert matches(b.output, out.stdout), (
                f"{where} printed:\n{out.stdout}\nthe page shows:\n{b.output}")
        ran += 1
    assert ran


def test_left_out_blocks_are_few_and_say_why():
    left = [(b.page, b.line, b.not_run) for p in PAGES for b in blocks_of(p) if b.not_run]
    assert len(left) <= MAX_NOT_RUN, left
    assert all(reason and reason != "(no reason given)" for *_, reason in left), left


def test_every_code_block_is_runnable_or_named():
    """A block's language is given, so that none escapes the runner unnoticed: python and bash
    run; text, toml and the like do not (a ```text block right after a runnable one is its
    printed output)."""
    for p in PAGES:
        fences = [line for line in p.read_text().split("\n") if line.startswith("```")]
        assert len(fences) % 2 == 0, f"{p.name}: a fence without its pair"
        for b in blocks_of(p):
            assert b.lang, f"{b.page}:{b.line}: a code block needs a language"


def test_output_matching(tmp_path):
    assert matches("a\n...\nc", "a\nb1\nb2\nc\n")
    assert matches("x (2, ...)", "x (2, 80, 311)")
    assert not matches("a\nc", "a\nb\nc")
    assert not matches("(2, 80, ...)", "(3, 80, 5)")
    text = "```python\nprint(1)\n```\n\n```text\n1\n```\n<!-- not run: a GPU -->\n```bash\nx\n```\n"
    page = tmp_path / "page.md"
    page.write_text(text)
    a, b = blocks_of(page)
    assert (a.lang, a.output, a.not_run) == ("python", "1\n", None)
    assert (b.lang, b.not_run) == ("bash", "a GPU")
