"""The clip augmentation kernels (avpipe.ops._augment_kernels), compiled as plain C++ and run
here on the CPU, against the numpy reference of avpipe.ops.image_augment; and the CUDA source
compile-checked with nvcc (the GPU tests in test_augment_image.py run it through NVRTC).

The emulation runs the kernels' grid-stride loops with several blocks of one thread (the gray
mean reduction's tree is then trivial). Tolerances: flip and normalize exact; colour jitter
within 1e-4 of the value range (float32 arithmetic as numpy's, the frame mean summed in float64
here vs numpy's float32 pairwise sum) and 1 level on uint8; resized crop within 1e-3 of the
range (float32, another summation order than the GEMMs) and 1 level on uint8.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cpp_kernels import build, ptx

from avpipe.ops import _augment_kernels as K
from avpipe.ops import image as IM
from avpipe.ops import image_augment as I

PRELUDE = r"""
#include <math.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads()
#define __fmul_rn(a, b) ((a) * (b))
#define __fadd_rn(a, b) ((a) + (b))
struct Dim3 { unsigned x; };
static Dim3 threadIdx, blockIdx, blockDim, gridDim;
extern "C" void avp_cpu_block(unsigned b, unsigned nblocks) {
    blockDim.x = 1; threadIdx.x = 0; blockIdx.x = b; gridDim.x = nblocks;
}
"""

P, LL, I32, F32 = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_float
SRC = [P, LL, LL, LL, LL, LL]
ARGTYPES = {
    "avp_gray_mean": SRC + [I32] * 4 + [P] * 5 + [F32, P],
    "avp_pixels": SRC + [I32] * 4 + [P] * 7 + [F32, I32, P, P, I32, I32, P],
    "avp_crop_hpass": SRC + [I32] * 5 + [P] * 4 + [I32, P],
    "avp_crop_vpass": [P] + [I32] * 6 + [P, P, I32, I32, P],
}
NBLOCKS = 5


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build(PRELUDE + K.SOURCE, tmp_path_factory.mktemp("augment_kernels"),
                 flags=("-std=c++14", "-Wno-unused-function"))


def _p(a):
    return None if a is None else ctypes.c_void_p(a.ctypes.data)


def _launch(lib, name, *args):
    f = getattr(lib, name)
    f.argtypes = ARGTYPES[name.rsplit("_", 1)[0] if name != "avp_crop_vpass" else name]
    f.restype = None
    for b in range(NBLOCKS):  # grid-stride loops over several blocks of one thread
        lib.avp_cpu_block(b, NBLOCKS)
        f(*args)


def _src(x5):
    kind = "u8" if x5.dtype == np.uint8 else "f32"
    return kind, [_p(x5)] + [s // x5.dtype.itemsize for s in x5.strides]


def pixels_cpu(lib, x5, *, flip=None, jitter=None, bound=255.0, round_u8=False, affine=None,
               nchw=False, mode=K.MODE_F32):  # fmt: skip
    """:func:`avpipe.ops._augment_kernels.pixels`, its launches run here."""
    B, T, H, W, _ = x5.shape
    kind, src = _src(x5)
    out = np.empty((B, T, 3, H, W) if nchw else (B, T, H, W, 3),
                   np.uint8 if mode == K.MODE_U8 else np.float32)  # fmt: skip
    fl = None if flip is None else np.ascontiguousarray(flip, bool).view(np.uint8)
    keep = [fl]
    if jitter is not None:
        order = np.ascontiguousarray(jitter["order"], np.int64)
        fac = [np.ascontiguousarray(jitter[n], np.float64)
               for n in ("brightness", "contrast", "saturation", "hue")]  # fmt: skip
        mean = np.full(B * T, np.nan, np.float32)
        _launch(lib, f"avp_gray_mean_{kind}", *src, B, T, H, W, _p(order), *map(_p, fac),
                bound, _p(mean))  # fmt: skip
        keep += [order, fac, mean]
    else:
        order = mean = None
        fac = [None] * 4
    a, b = (None, None) if affine is None else (np.asarray(affine[0], np.float32),
                                                np.asarray(affine[1], np.float32))  # fmt: skip
    _launch(lib, f"avp_pixels_{kind}", *src, B, T, H, W, _p(fl), _p(order), *map(_p, fac),
            _p(mean), bound, int(round_u8), _p(a), _p(b), int(nchw), mode, _p(out))  # fmt: skip
    return out


def resized_crop_cpu(lib, x5, p, oh, ow, interpolation="bilinear", antialias=True,
                     mode=K.MODE_F32):  # fmt: skip
    """:func:`avpipe.ops._augment_kernels.resized_crop` (the same packed tables) run here."""
    B, T, H, W, C = x5.shape
    ints, floats, (maxrows, xt, yt) = K.crop_tables(p["top"], p["left"], p["height"],
                                                    p["width"], oh, ow, interpolation,
                                                    antialias)  # fmt: skip
    row0, rows = ints[:B], ints[B : 2 * B]
    xtab = np.ascontiguousarray(ints[2 * B : 2 * B + B * ow * 2])
    ytab = np.ascontiguousarray(ints[2 * B + B * ow * 2 :])
    xw, yw = floats[: B * ow * xt], floats[B * ow * xt :]
    row0, rows, xw, yw = (np.ascontiguousarray(a) for a in (row0, rows, xw, yw))
    kind, src = _src(x5)
    tmp = np.full((B, T, maxrows, ow, C), np.nan, np.float32)
    _launch(lib, f"avp_crop_hpass_{kind}", *src, B, T, maxrows, ow, C, _p(row0), _p(rows),
            _p(xtab), _p(xw), xt, _p(tmp))  # fmt: skip
    out = np.empty((B, T, oh, ow, C), np.uint8 if mode == K.MODE_U8 else np.float32)
    _launch(lib, "avp_crop_vpass", _p(tmp), B, T, maxrows, ow, C, oh, _p(ytab), _p(yw), yt,
            mode, _p(out))  # fmt: skip
    return out


def _clips(shape=(5, 3, 23, 31, 3), dtype=np.uint8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, shape, dtype=np.uint8)
    x[0, :, :4] = 200  # flat patches (hue of gray pixels, equal channels)
    x[1, :, 5:9, :, 1] = x[1, :, 5:9, :, 0]  # ties between channels
    return x if dtype == np.uint8 else (x.astype(np.float32) / 255)


def test_cuda_source_compiles(tmp_path):
    text = ptx(K.SOURCE, tmp_path)
    assert all(name in text for name in K.KERNEL_NAMES)


def test_flip(lib):
    x = _clips()
    f = I.sample_flip_params(0, 0, np.arange(5))
    assert f["flip"].any() and not f["flip"].all()
    ref = I.apply_flip(x, f)
    np.testing.assert_array_equal(pixels_cpu(lib, x, flip=f["flip"], mode=K.MODE_U8), ref)
    xf = _clips(dtype=np.float32)
    np.testing.assert_array_equal(pixels_cpu(lib, xf, flip=f["flip"]), I.apply_flip(xf, f))
    # a channels-first view (any strides)
    xc = np.ascontiguousarray(np.moveaxis(x, -1, 2))
    np.testing.assert_array_equal(pixels_cpu(lib, np.moveaxis(xc, 2, -1), flip=f["flip"],
                                             mode=K.MODE_U8), ref)  # fmt: skip


@pytest.mark.parametrize("random_order", [True, False])
@pytest.mark.parametrize("p", [1.0, 0.6])
def test_color_jitter(lib, random_order, p):
    cj = I.sample_color_jitter_params(4, 1, np.arange(5), brightness=0.4, contrast=0.4,
                                      saturation=0.4, hue=0.1, random_order=random_order, p=p)  # fmt: skip
    xf = _clips(dtype=np.float32)
    np.testing.assert_allclose(pixels_cpu(lib, xf, jitter=cj, bound=1.0),
                               I.apply_color_jitter(xf, cj), atol=1e-4, rtol=0)  # fmt: skip
    x = _clips()
    d = pixels_cpu(lib, x, jitter=cj, mode=K.MODE_U8).astype(int) - I.apply_color_jitter(x, cj)
    assert np.abs(d).max() <= 1 and np.mean(d != 0) < 1e-3


def test_normalize_and_fused_run(lib):
    """Flip + jitter + normalize in one pass equal the ops one after another (uint8 input:
    the jitter's rounding kept)."""
    x = _clips()
    ids = np.arange(5)
    f = I.sample_flip_params(1, 0, ids)
    cj = I.sample_color_jitter_params(1, 0, ids, brightness=0.4, contrast=0.4, saturation=0.4,
                                      hue=0.1)  # fmt: skip
    s = np.asarray(IM.IMAGENET_STD)
    a = (1 / 255 / s).astype(np.float32)
    b = (-np.asarray(IM.IMAGENET_MEAN) / s).astype(np.float32)
    norm = I.Normalize()
    np.testing.assert_array_equal(pixels_cpu(lib, x, affine=(a, b), nchw=True),
                                  norm.apply(x, {}))  # fmt: skip
    ref = norm.apply(I.apply_color_jitter(I.apply_flip(x, f), cj), {})
    kw = dict(flip=f["flip"], jitter=cj, round_u8=True, affine=(a, b))
    got = pixels_cpu(lib, x, nchw=True, **kw)
    d = np.abs(got - ref)
    assert d.max() <= 1.01 / 255 / 0.224 and np.mean(d > 1e-6) < 1e-3
    nhwc = pixels_cpu(lib, x, **kw)
    np.testing.assert_array_equal(np.moveaxis(nhwc, -1, 2), got)


@pytest.mark.parametrize("interpolation,antialias", [("bilinear", True), ("bicubic", True),
                                                     ("bilinear", False)])  # fmt: skip
def test_resized_crop(lib, interpolation, antialias):
    x = _clips(shape=(6, 3, 40, 70, 3))
    p = I.sample_resized_crop_params(2, 0, np.arange(6), 40, 70)
    assert len(set(p["height"].tolist())) > 1
    for oh, ow in ((16, 16), (24, 50)):  # down- and upscaling
        ref = I.apply_resized_crop(x, p, (oh, ow), interpolation=interpolation,
                                   antialias=antialias, dtype="float32")  # fmt: skip
        got = resized_crop_cpu(lib, x, p, oh, ow, interpolation, antialias)
        np.testing.assert_allclose(got, ref, atol=0.255, rtol=0)
        ref8 = I.apply_resized_crop(x, p, (oh, ow), interpolation=interpolation,
                                    antialias=antialias)  # fmt: skip
        got8 = resized_crop_cpu(lib, x, p, oh, ow, interpolation, antialias, mode=K.MODE_U8)
        assert np.abs(got8.astype(int) - ref8).max() <= 1
    xf = _clips(shape=(6, 3, 40, 70, 3), dtype=np.float32)[:, :, ::-1]  # float, negative strides
    ref = I.apply_resized_crop(xf, p, 16, interpolation=interpolation, antialias=antialias)
    got = resized_crop_cpu(lib, xf, p, 16, 16, interpolation, antialias)
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=0)


def _patch_glue(lib, monkeypatch):
    """image_augment's cupy dispatch taken with numpy arrays, the kernels run here: exercises
    the host glue (tables, constants, rounding, dtypes, layouts, the chain's fused run)."""

    calls = []

    def crop(x5, top, left, height, width, oh, ow, interpolation, antialias, *, mode):
        calls.append("resized_crop")
        p = {"top": top, "left": left, "height": height, "width": width}
        return resized_crop_cpu(lib, x5, p, oh, ow, interpolation, antialias, mode)

    def pixels(x5, **kw):
        calls.append(tuple(sorted(k for k, v in kw.items() if v is not None and v is not False)))
        return pixels_cpu(lib, x5, **kw)

    monkeypatch.setattr(I, "_kernel_ok", lambda x5, channels=3: x5.dtype in (np.uint8, np.float32)
                        and channels in (0, x5.shape[-1]))  # fmt: skip
    monkeypatch.setattr(K, "pixels", pixels)
    monkeypatch.setattr(K, "resized_crop", crop)
    return calls


@pytest.mark.parametrize("layout", [None, "BTCHW", "images"])
def test_chain_through_the_kernel_glue(lib, monkeypatch, layout):
    x = _clips(shape=(4, 3, 36, 64, 3))
    if layout == "BTCHW":
        x = np.ascontiguousarray(np.moveaxis(x, -1, 2))
    elif layout == "images":
        x, layout = x[:, 0], None
    chain = I.video_train_chain(16, layout=layout)
    assert chain._runs() == [(0, 1), (1, 4)]  # flip + jitter + normalize: one run
    ref, ps = chain(x, seed=2, epoch=1, return_params=True)
    ops = [I.apply_resized_crop(x, ps[0], 16, layout=layout)]
    ops.append(I.apply_flip(ops[0], ps[1], layout=layout))
    ops.append(I.apply_color_jitter(ops[1], ps[2], layout=layout))
    ops.append(chain.ops[3].apply(ops[2], {}))
    calls = _patch_glue(lib, monkeypatch)
    got, ps2 = chain(x, seed=2, epoch=1, return_params=True)
    assert calls == ["resized_crop", ("affine", "bound", "flip", "jitter", "mode", "nchw",
                                      "round_u8")]  # fmt: skip
    for a, b in zip(ps, ps2):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    d = np.abs(got - ref)
    assert d.max() < 4 / 255 / 0.224 and np.mean(d > 1e-3) < 1e-2
    np.testing.assert_array_equal(chain.apply(x, ps), got)  # replay
    # the ops one by one through their kernels
    y = I.apply_resized_crop(x, ps[0], 16, layout=layout)
    assert y.shape == ops[0].shape and np.abs(y.astype(int) - ops[0]).max() <= 1
    y = ops[0]
    for k, fn in ((1, I.apply_flip), (2, I.apply_color_jitter)):
        z = fn(y, ps[k], layout=layout)
        assert z.shape == ops[k].shape and z.dtype == ops[k].dtype
        assert np.abs(z.astype(int) - ops[k]).max() <= 1
        y = ops[k]
    z = chain.ops[3].apply(ops[2], {})
    assert z.shape == ops[3].shape and z.dtype == ops[3].dtype
    np.testing.assert_array_equal(z, ops[3])
    # float16 out, channels-last out
    n = I.Normalize(dtype="float16", out_layout="NHWC", layout=layout)
    monkeypatch.undo()
    want = n.apply(ops[2], {})
    _patch_glue(lib, monkeypatch)
    got = n.apply(ops[2], {})
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
