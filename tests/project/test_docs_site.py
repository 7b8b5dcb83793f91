"""The documentation site builds with ``mkdocs build --strict`` (a broken link, a missing page
in the nav, or an operator mkdocstrings cannot find fails it), and its reference pages hold the
API documented from the docstrings.

MkDocs, Material and mkdocstrings come with the ``dev`` extra (``docs``: the tools alone), so CI
builds the site; a machine without them fails here rather than skipping."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

from paths import REPO

ROOT = pathlib.Path(REPO)


def test_site_builds_strict(tmp_path):
    missing = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
               if importlib.util.find_spec(m.split(".")[0]) is None]
    assert not missing, f"install the docs tools: pip install '.[docs]' (missing {missing})"
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    # not -q: it hides the warnings from the count that --strict fails on
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ops = (site / "reference" / "ops" / "index.html").read_text()
    for name in ("avpipe.ops.audio.log_mel", "avpipe.ops.image.resize_crop_normalize",
                 "avpipe.ops.audio_augment.spec_augment"):
        assert f'id="{name}"' in ops, name
    recipes = (site / "reference" / "recipes" / "index.html").read_text()
    for name in ("avpipe.recipes.rnnt_feed", "avpipe.recipes.extract.run_extract",
                 "avpipe.pipeline.feed.Feed.state_dict"):
        assert f'id="{name}"' in recipes, name
    assert ":class:<code>" not in recipes + ops  # mkdocs_hooks.py renders the Sphinx roles
    pages = {p.relative_to(ROOT / "docs").with_suffix("") for p in (ROOT / "docs").rglob("*.md")}
    for page in pages:  # every page is built (a page missing from the nav fails --strict)
        built = site / page / "index.html" if page.name != "index" else site / "index.html"
        assert built.exists(), page
