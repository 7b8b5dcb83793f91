"""The SpecAugment kernel (``avpipe/ops/_spec_augment.cu``), compiled as plain C++ and run here
on the CPU, equals its numpy reference (``apply_spec_augment`` on numpy) exactly; the same
source compiles for the GPU with nvcc where it is installed. The GPU test
(test_augment_audio.py) runs it through NVRTC."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cpp_kernels import ELEMENTWISE_PRELUDE, build, ptx

from avpipe.ops import audio_augment as A

PRELUDE = ELEMENTWISE_PRELUDE

LAUNCHER = r"""
extern "C" void run(long long total, const float* x, float* out, const long long* p, int kf,
        int kt, long long F, long long T, float value) {
    blockDim.x = 1; threadIdx.x = 0;
    for (long long t = 0; t < total; ++t) { blockIdx.x = (unsigned)t;
        avpipe_spec_augment(x, out, p, kf, kt, F, T, total, value); }
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    with open(A.SPEC_AUGMENT_KERNEL) as f:
        return build(PRELUDE + f.read() + LAUNCHER, tmp_path_factory.mktemp("spec_kernel"))


def _p(a):
    return ctypes.c_void_p(a.ctypes.data)


@pytest.mark.parametrize("adaptive", [None, 0.05])
@pytest.mark.parametrize("value", [0.0, -3.5])
def test_kernel_equals_reference(lib, adaptive, value):
    rng = np.random.default_rng(7)
    B, F, T = 6, 40, 130
    x = rng.standard_normal((B, F, T)).astype(np.float32)
    lens = np.array([130, 97, 12, 1, 0, 64])
    p = A.sample_spec_augment_params(3, 2, np.arange(B), lens, F, freq_masks=2, freq_width=12,
                                     time_masks=5, time_width=0.2,
                                     adaptive_time_masks=adaptive)  # fmt: skip
    ref = A.apply_spec_augment(x, lens, p, mask_value=value)
    table = A.spec_augment_table(lens, p)
    assert table.shape == (B, 1 + 2 * 2 + 2 * 5) and table.dtype == np.int64
    out = np.full_like(x, np.nan)
    lib.run(ctypes.c_longlong(x.size), _p(x), _p(out), _p(table), ctypes.c_int(2),
            ctypes.c_int(5), ctypes.c_longlong(F), ctypes.c_longlong(T), ctypes.c_float(value))
    np.testing.assert_array_equal(out, ref)
    assert (out != x).any()  # some cells were masked
    np.testing.assert_array_equal(out[4], x[4])  # an empty item is untouched


def test_kernel_compiles_for_the_gpu(tmp_path):
    with open(A.SPEC_AUGMENT_KERNEL) as f:
        text = ptx(f.read(), tmp_path)
    assert "avpipe_spec_augment" in text
