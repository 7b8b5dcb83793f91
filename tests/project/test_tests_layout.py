"""tests/ mirrors the package: every test file sits in the folder of the package path it tests
(tests/ops for avpipe/ops, tests/decoding/video for avpipe/decoding/video, ...) or in one of the
few folders for what is not one package path; helpers sit in tests/_support only; test file
names are unique across folders (the test folders are not packages: pytest imports each file
by its name)."""

from __future__ import annotations

import collections
import pathlib

from paths import REPO, TESTS

PACKAGE = pathlib.Path(REPO) / "avpipe"
# folders that mirror no single package path: foundation modules (settings, errors, device/,
# storage, ...), repository-level checks, cross-cutting reliability runs
OTHER = {"foundation", "project", "reliability"}
# not test folders: the helpers, the fuzz package (python -m tests.fuzz.run)
NOT_TESTS = {"_support", "fuzz"}
ROOT_FILES = {"conftest.py"}


def _python_files(root: pathlib.Path):
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if "__pycache__" in rel.parts or rel.parts[0] in NOT_TESTS:
            continue
        yield rel


def layout_problems(root: pathlib.Path, package: pathlib.Path) -> list[str]:
    problems = []
    names = collections.defaultdict(list)
    for rel in _python_files(root):
        if len(rel.parts) == 1:
            if rel.name not in ROOT_FILES:
                problems.append(f"{rel}: at the top of tests/ (move it to the folder it tests, "
                                "or to _support/ if it is a helper)")
            continue
        folder = rel.parent
        if rel.name == "conftest.py":
            continue
        if not rel.name.startswith("test_"):
            problems.append(f"{rel}: a helper beside tests (helpers live in tests/_support/)")
            continue
        names[rel.name].append(str(rel))
        if folder.parts[0] in OTHER:
            if len(folder.parts) != 1:
                problems.append(f"{rel}: {folder.parts[0]}/ has no subfolders")
        elif not (package / folder).is_dir():
            problems.append(f"{rel}: avpipe/{folder} is no package path")
    for name, where in names.items():
        if len(where) > 1:
            problems.append(f"{name}: in more than one folder ({', '.join(where)})")
    return problems


def test_every_test_file_mirrors_a_package_path():
    assert layout_problems(pathlib.Path(TESTS), PACKAGE) == []


def test_helpers_only_in_support():
    support = pathlib.Path(TESTS) / "_support"
    assert not any(p.name.startswith("test_") for p in support.glob("*.py"))


def test_layout_problems_are_found(tmp_path):
    tests, package = tmp_path / "tests", tmp_path / "avpipe"
    (package / "ops").mkdir(parents=True)
    for rel in ("conftest.py", "ops/test_a.py", "test_flat.py", "ops/helper.py",
                "nowhere/test_b.py", "project/test_a.py", "project/deep/test_c.py"):
        (tests / rel).parent.mkdir(parents=True, exist_ok=True)
        (tests / rel).write_text("")
    got = "\n".join(layout_problems(tests, package))
    assert "test_flat.py: at the top" in got
    assert "ops/helper.py: a helper" in got
    assert "nowhere/test_b.py: avpipe/nowhere" in got
    assert "test_a.py: in more than one folder" in got
    assert "project/deep/test_c.py: project/ has no subfolders" in got
    assert "conftest.py" not in got
