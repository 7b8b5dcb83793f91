"""Shared fixtures. Media is made on the fly (PyAV encoders, soundfile), never downloaded.

Tests marked ``gpu`` run only where a CUDA GPU is usable (CuPy imports and the driver reports a
device); elsewhere they are skipped with a reason.
"""

from __future__ import annotations

import os
import sys

import pytest

# the helpers (servers, video_media, ...) live in tests/_support and are imported by their names
# from tests in every folder
_SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_support")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)

from avpipe.device import gpu_available  # noqa: E402


def pytest_collection_modifyitems(config, items):
    # the fuzz-corpus runs last: the long runs cannot keep the rest of a (time-limited) session
    # from running
    items.sort(key=lambda item: item.get_closest_marker("fuzz") is not None)
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no usable CUDA GPU (cupy + driver)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(1234)
