"""README.md and docs/ speak to users of the project as it is: short, no dated runs or history,
the commands CI and ``./dev`` rely on still there. (Their code blocks run in test_docs.py.)"""

from __future__ import annotations

import pathlib
import re

from docblocks import PAGES, blocks_of
from paths import REPO

ROOT = pathlib.Path(REPO)
README = ROOT / "README.md"


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 300


def test_pages_hold_no_dates_sessions_or_machine_letters():
    """History belongs in git: no dated headings or runs, no sessions, no machine names."""
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(ROOT)
        assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), name
        assert not re.search(r"\b(\w+th|first|second|third|\d+(st|nd|rd)) session\b", text, re.I), name
        assert not re.search(r"\bmachines? [A-Z]{1,2}\d?\b", text), name


def test_readme_keeps_the_quick_start_and_ci_commands():
    """``.ci/run`` runs ``./dev test``; the README shows both quick-start commands."""
    assert "./dev test" in (ROOT / ".ci" / "run").read_text()
    code = [b.code for b in blocks_of(README) if b.lang == "bash"]
    assert any(c.lstrip().startswith("./dev demo") for c in code)
    assert any(c.lstrip().startswith("./dev test") for c in code)


def test_readme_extract_example_and_demo_write_apart():
    """``./dev demo`` (quickstart-out/, the CLI's shard size) and the README's extraction example
    (its own folder, 4 files a shard) do not share an output folder: either one run first would
    make the other refuse it (an output folder keeps its shard size)."""
    dev = (ROOT / "dev").read_text()
    demo_out = re.search(r"--out (\S+)", dev[dev.index("extract samples"):]).group(1)
    (example,) = [b.code for b in blocks_of(README) if "run_extract(" in b.code]
    assert f'out_dir="{demo_out}"' not in example and 'out_dir="' in example
    # extraction's workers never run the calling script again: the example needs no guard
    assert 'if __name__ == "__main__":' not in example


def test_readme_links_resolve():
    text = README.read_text()
    for target in re.findall(r"\]\(((?!https?:)[^)#]+)", text):
        assert (ROOT / target).exists(), target


def test_extract_help_points_at_the_presets_page():
    """``avpipe extract --help`` sends users to the TOML schema's page, not to a private module,
    and the built-in presets the page lists are the ones the code has."""
    from click.testing import CliRunner

    from avpipe.cli.main import cli
    from avpipe.recipes.extract._presets import BUILTIN

    out = CliRunner().invoke(cli, ["extract", "--help"], terminal_width=200).output
    assert "docs/presets.md" in " ".join(out.split()) and "_presets" not in out
    page = (ROOT / "docs" / "presets.md").read_text()
    builtin = page[page.index("## Built-in presets"): page.index("## The schema")]
    assert set(re.findall(r"^\| `(\w+)` \|", builtin, re.M)) == set(BUILTIN)
