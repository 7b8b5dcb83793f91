"""Tar shards for the tests: members written as given (mtime 0), in order."""

from __future__ import annotations

import io
import tarfile


def write_tar(path, members) -> None:
    """``members``: ``[(name, bytes), ...]`` -> a plain tar at ``path``."""
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
