"""Where things are, for tests in any folder of tests/ and for the scripts they start."""

from __future__ import annotations

import os

SUPPORT = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(SUPPORT)
REPO = os.path.dirname(TESTS)
SAMPLES = os.path.join(REPO, "samples")
