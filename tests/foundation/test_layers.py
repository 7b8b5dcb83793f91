"""The package's layers depend one way, read from the source's imports (ast, nothing imported).

    foundation  <-  ops  <-  decoding  <-  pipeline  <-  recipes  <-  cli

A module may import from its own layer and the layers below it, never from a layer above.
Foundation modules (settings, errors, device, ...) sit below every layer and import only each
other at module level; the few that need a layer above do it inside a function, listed in
``LAZY_ALLOWED``. Heavy libraries load only inside functions.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
from paths import REPO

ROOT = pathlib.Path(REPO) / "avpipe"

LAYERS = {"foundation": 0, "ops": 1, "decoding": 2, "pipeline": 3, "recipes": 4, "cli": 5}

# top-level modules that are not foundation: the package facade and ``python -m avpipe``
TOP = {"avpipe": "cli", "avpipe.__main__": "cli"}

# (importing module, imported module prefix): foundation modules that import upwards, lazily
LAZY_ALLOWED = {
    ("avpipe._info", "avpipe.decoding"),  # avpipe.info() reports NVDEC codecs and DALI decoders
}

HEAVY = ("av", "cupy", "nvidia", "PyNvVideoCodec", "soundfile", "torch", "jax")


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    p = ROOT.parent.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def layer_of(module: str) -> str:
    if module in TOP:
        return TOP[module]
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS and parts[1] != "foundation":
        return parts[1]
    return "foundation"


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` in ``package`` names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: pathlib.Path):
    """(imported module, line, inside a function) for every import of an avpipe module."""
    name = _module_name(path)
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    func_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for inner in ast.walk(node):
                if inner is not node:
                    func_nodes.add(id(inner))
    for node in ast.walk(tree):
        lazy = id(node) in func_nodes
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno, lazy
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, package)
            for a in node.names:
                sub = f"{mod}.{a.name}"
                yield (sub if _is_module(sub) else mod), node.lineno, lazy
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant):
                yield str(node.args[0].value), node.lineno, lazy


FILES = sorted(ROOT.rglob("*.py"))


def test_layer_of_examples():
    assert layer_of("avpipe.settings") == "foundation"
    assert layer_of("avpipe.ops.color") == "ops"
    assert layer_of("avpipe.decoding.video._nvdec") == "decoding"
    assert layer_of("avpipe.pipeline.feed") == "pipeline"
    assert layer_of("avpipe.recipes.rnnt") == "recipes"
    assert layer_of("avpipe.cli.main") == "cli"


def test_imports_point_down_the_layers():
    bad = []
    for path in FILES:
        me = _module_name(path)
        mine = LAYERS[layer_of(me)]
        for target, line, lazy in _imports(path):
            if target != "avpipe" and not target.startswith("avpipe."):
                continue
            if target == "avpipe":  # ``import avpipe`` for its public API: the facade
                theirs = LAYERS["cli"]
            else:
                theirs = LAYERS[layer_of(target)]
            if theirs <= mine:
                continue
            if lazy and any(
                me == m and (target == p or target.startswith(p + ".")) for m, p in LAZY_ALLOWED
            ):
                continue
            bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {me} ({layer_of(me)}) "
                       f"imports {target}")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_module_imports_itself_through_others():
    """No circle of imports between modules and packages (a package is its ``__init__``),
    counting imports at module level and inside functions alike: a circle means two modules
    are one idea split in two, or one imports the other only for a side effect, and an import
    moved into a function to dodge one hides it rather than removing it."""
    graph: dict[str, set] = {}
    for path in FILES:
        me = _module_name(path)
        graph[me] = {t for t, _line, _lazy in _imports(path)
                     if (t == "avpipe" or t.startswith("avpipe.")) and t != me
                     and _is_module(t)}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path_: list[str] = []
    circles = []

    def visit(m):
        state[m] = 1
        path_.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                circles.append(" -> ".join(path_[path_.index(t):] + [t]))
            elif t not in state:
                visit(t)
        path_.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_heavy_libraries_load_inside_functions_only():
    bad = []
    for path in FILES:
        for target, line, lazy in _imports(path):
            if not lazy and target.split(".")[0] in HEAVY:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {target}")
    assert not bad, "heavy imports at module level:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "modules",
    [
        "avpipe",
        "avpipe.decoding.video, avpipe.decoding.audio, avpipe.decoding.image, avpipe.ops.audio, "
        "avpipe.ops.image, avpipe.ops.color, avpipe.pipeline.samplers, avpipe.pipeline.clips, "
        "avpipe.pipeline.audio_loader, avpipe.pipeline.image_stream, avpipe.recipes.extract",
    ],
)
def test_import_loads_no_heavy_library(modules):
    code = (
        f"import sys, {modules}\n"
        f"heavy = {HEAVY!r}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _names_imported(path: pathlib.Path):
    """(module, name, line) for every ``from avpipe... import name`` (the names as imported)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _from_module(node, package)
            for a in node.names:
                yield mod, a.name, node.lineno


def _private_owner(module: str) -> str | None:
    """The package that owns the first private part of ``module`` (``avpipe.pipeline._order``
    -> ``avpipe.pipeline``), or None when every part is public."""
    parts = module.split(".")
    for i, p in enumerate(parts):
        if p.startswith("_") and not p.startswith("__"):
            return ".".join(parts[:i])
    return None


def _within(package: str, owner: str) -> bool:
    return package == owner or package.startswith(owner + ".")


def privacy_violations():
    """Imports of another package's private module (``_x``) or private name (``_name``): a
    module may use the private parts of its own package and of the packages above it, never
    those of a sibling or of a package below it."""
    bad = []
    for path in FILES:
        me = _module_name(path)
        mine = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for mod, name, line in _names_imported(path):
            if mod != "avpipe" and not mod.startswith("avpipe."):
                continue
            target = f"{mod}.{name}" if _is_module(f"{mod}.{name}") else mod
            owner = _private_owner(target)
            if owner is not None and not _within(mine, owner):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {me} imports the private "
                           f"module {target}")
                continue
            if name.startswith("_") and not name.startswith("__") and target == mod:
                owner = mod if (ROOT.parent.joinpath(*mod.split(".")) / "__init__.py").is_file() \
                    else mod.rpartition(".")[0]
                if not _within(mine, owner):
                    bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {me} imports the "
                               f"private name {name} of {mod}")
        for target, line, _lazy in _imports(path):
            if not target.startswith("avpipe."):
                continue
            owner = _private_owner(target)
            if owner is not None and not _within(mine, owner):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {me} imports the private "
                           f"module {target}")
    return list(dict.fromkeys(bad))  # a ``from`` import is seen by both loops


def test_no_module_uses_another_packages_private_parts():
    bad = privacy_violations()
    assert not bad, "private parts of another package imported:\n" + "\n".join(bad)


def test_the_privacy_rule_sees_a_private_import():
    assert _private_owner("avpipe.pipeline._order") == "avpipe.pipeline"
    assert _private_owner("avpipe.pipeline.feed") is None
    assert _within("avpipe.pipeline.feed", "avpipe.pipeline")
    assert not _within("avpipe.recipes", "avpipe.pipeline")
