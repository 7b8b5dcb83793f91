"""Run a Python script in a process of its own, importing this checkout's avpipe: for what a
test must not do in the test process itself (fork it, start it from another directory)."""

from __future__ import annotations

import os
import subprocess
import sys

from paths import REPO


def run_script(tmp_path, source: str, *, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``source`` written to a file under ``tmp_path`` and run by this interpreter, this
    checkout first on its path, in ``cwd`` (default: ``tmp_path``); its completed process
    (text output)."""
    script = tmp_path / "script.py"
    script.write_text(source)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, str(script)], cwd=cwd or tmp_path,
                          env=dict(os.environ, PYTHONPATH=path), capture_output=True,
                          text=True, timeout=timeout)
