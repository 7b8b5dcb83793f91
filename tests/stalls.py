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
