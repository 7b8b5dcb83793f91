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


def test_planes_launch_arguments(monkeypatch):
    """nv12_planes_to_rgb's launch: the kernel's C types and values, frame after frame (the
    per-stream constants are built once and reused)."""
    import types

    calls = []
    monkeypatch.setattr(C, "_kernel", lambda dev: lambda grid, block, args: calls.append(
        (dev, grid, block, args)))  # fmt: skip
    out = types.SimpleNamespace(device=types.SimpleNamespace(id=1))
    coeffs = C.yuv_coefficients("bt709", None, "yuv420p")
    for luma, chw in ((1 << 40, False), ((1 << 40) + 4096, True), (2**64 - 1 - 768 * 400, False)):
        C.nv12_planes_to_rgb(luma, luma + 768 * 361, 768, 361, 641, coeffs, out, chw=chw)
        dev, grid, block, args = calls.pop()
        want = (np.uint64(luma), np.uint64(luma + 768 * 361), np.int64(768), np.int32(361),
                np.int32(641), out, np.int32(1 if chw else 0)) + tuple(
                    np.float32(c) for c in coeffs)  # fmt: skip
        assert dev == 1 and grid == (21, 46, 1) and block == (32, 8, 1)
        assert len(args) == len(want) == 13
        for got, exp in zip(args, want):
            assert type(got) is type(exp) and (got is exp or got == exp)
    with pytest.raises(ValueError):
        C.nv12_planes_to_rgb(0, 768, 768, 2, 2, coeffs[:5], out)
