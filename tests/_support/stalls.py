"""A read that never returns, for the audio loader's timeout tests: a named pipe, which the
loader refuses unless told otherwise (here, in the test process and its worker processes)."""

from __future__ import annotations

_READ_PIPES = """
import builtins, sys
_real_import = builtins.__import__

def _import(name, *a, **k):
    mod = _real_import(name, *a, **k)
    m = sys.modules.get("avpipe.pipeline.audio_loader")
    if m is not None and hasattr(m, "is_regular_file") and not getattr(m, "_pipes_read", 0):
        m._pipes_read = 1
        m.is_regular_file = lambda path: True
    return mod

builtins.__import__ = _import
"""


def let_loader_read_pipes(monkeypatch, tmp_path):
    """Let the loader open pipes, here and in its worker processes (fresh interpreters, which
    import a ``sitecustomize`` from the path they inherit), though it refuses them (a read may
    never return): a pipe is how these tests make a read that never returns."""
    from avpipe.pipeline import audio_loader

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_READ_PIPES)
    monkeypatch.syspath_prepend(str(hook))
    monkeypatch.setattr(audio_loader, "is_regular_file", lambda path: True)


# Every avpipe module's is_regular_file / is_special_file (bound at its import) sees a named
# pipe as a regular file, in this process and in the processes it spawns (they import this
# sitecustomize too): opening such a pipe with no writer blocks in the kernel, as a read of a
# stalled network mount does, in C code with the GIL released. Nothing else changes.
_PIPES_ARE_FILES = """
import builtins, os, stat, sys
_real_import = builtins.__import__
_seen = set()

def _fifo(path):
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except (OSError, ValueError, TypeError):
        return False

def _patch():
    for name, m in list(sys.modules.items()):
        if not name.startswith("avpipe") or m is None or name in _seen:
            continue
        reg = getattr(m, "is_regular_file", None)
        spec = getattr(m, "is_special_file", None)
        if reg is None and spec is None:
            continue
        _seen.add(name)
        if reg is not None:
            m.is_regular_file = lambda p, _r=reg: _r(p) or _fifo(p)
        if spec is not None:
            m.is_special_file = lambda p, _s=spec: _s(p) and not _fifo(p)

def _import(name, *a, **k):
    mod = _real_import(name, *a, **k)
    if "avpipe" in sys.modules:
        _patch()
    return mod

builtins.__import__ = _import
"""


def pipes_read_as_files(tmp_path) -> str:
    """A folder holding a ``sitecustomize`` (put it first on ``PYTHONPATH`` of a subprocess)
    under which avpipe takes named pipes for regular files: a pipe with no writer is then a
    "regular" file whose read never returns, without root, FUSE or NFS."""
    hook = tmp_path / "pipes_are_files"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_PIPES_ARE_FILES)
    return str(hook)


def treat_pipes_as_files() -> None:
    """In this process, from now on: avpipe takes named pipes for regular files (the
    ``sitecustomize`` of :func:`pipes_read_as_files`, applied here; later imports included)."""
    import avpipe.recipes  # noqa: F401 - the modules that bind the checks
    import avpipe.recipes.extract  # noqa: F401

    ns: dict = {}
    exec(_PIPES_ARE_FILES, ns)
    ns["_patch"]()
