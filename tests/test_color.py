"""avpipe.ops.color: one colour table, one rule for tags, two arithmetic forms that agree."""

from __future__ import annotations

import numpy as np
import pytest

from avpipe.ops import color as C


def test_unknown_tags_mean_bt601():
    for tag in (None, "", "unknown", "reserved", "unspecified", "ycgco", "bt2099"):
        assert C.matrix_for(tag) == "bt601"
        assert C.yuv_coefficients(tag, "tv") == C.yuv_coefficients("bt601", "tv")
    for tag in C.MATRICES:
        assert C.matrix_for(tag) == tag


def test_named_matrix_must_be_in_the_table():
    y = np.zeros((4, 4), np.uint8)
    uv = np.zeros((2, 2, 2), np.uint8)
    with pytest.raises(ValueError, match="matrix must be one of"):
        C.nv12_to_rgb(y, uv, matrix="unknown")


def test_ffmpeg_aliases_share_coefficients():
    assert C.yuv_coefficients("bt2020c", "tv") == C.yuv_coefficients("bt2020nc", "tv")
    assert C.yuv_coefficients("bt2020", "tv") == C.yuv_coefficients("bt2020nc", "tv")
    assert C.yuv_coefficients("smpte170m", "pc") == C.yuv_coefficients(None, "pc")


@pytest.mark.parametrize("matrix", sorted(C.MATRICES))
@pytest.mark.parametrize("full", [False, True])
def test_float_reference_within_three_levels_of_fixed_point(matrix, full):
    rng = np.random.default_rng(0)
    h, w = 34, 46
    nv12 = rng.integers(16, 236, (h + h // 2, w), dtype=np.uint8)
    ref = C.nv12_to_rgb_reference(nv12, h, w, C.yuv_coefficients(matrix, "pc" if full else "tv"))
    fixed = C.nv12_to_rgb(nv12[:h], nv12[h:], matrix=matrix, full_range=full)
    assert np.abs(ref.astype(int) - fixed.astype(int)).max() <= 3
