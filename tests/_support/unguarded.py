"""Run a script without an ``if __name__ == "__main__":`` guard, as a user might write one,
and count how many processes ran its top level (avpipe's worker processes must not)."""

from __future__ import annotations

import os
import subprocess
import sys

from paths import REPO as ROOT


def top_level_runs(tmp_path, body: str) -> int:
    """Run ``body`` (which ends by printing ``ok``) as an unguarded script; the number of
    processes that executed its top level (1 when no worker imported it again)."""
    marks = tmp_path / "marks"
    script = tmp_path / "unguarded.py"
    script.write_text("import os\n"
                      f"open({str(marks)!r}, 'a').write(f'{{os.getpid()}}\\n')\n" + body)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    return len(marks.read_text().split())
