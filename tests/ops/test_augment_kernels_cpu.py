"""The clip augmentation kernels (avpipe.ops._image_augment_kernels), compiled as plain C++ and run
here on the CPU, against the numpy reference of avpipe.ops.image_augment; and the CUDA source
compile-checked with nvcc (the GPU tests in test_augment_image.py run it through NVRTC).

The emulation runs the kernels' grid-stride loops with several blocks of one thread (the gray
mean reduction's tree is then trivial). Tolerances: flip and normalize exact; colour jitter
within 1e-4 of the value range (float32 arithmetic as numpy's, the frame mean summed in float64
here vs numpy's float32 pairwise sum) and 1 level on uint8; resized crop within 1e-3 of the
range (float32, another summation order than the GEMMs) and 1 level on uint8.

The cupy dispatch of image_augment runs here too, against a fake cupy (``dev``) whose kernels
are these compiled ones, each launch's arguments checked against its CUDA signature: the tests
count what a batch costs (launches, host -> device copies, device -> host syncs, other device
work) and compare its results with the numpy path and with the kernels launched directly.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cpp_kernels import TablesOn, build, ptx

from avpipe import device as D
from avpipe.device import cuda_modules as CM
from avpipe.ops import _image_augment_kernels as K
from avpipe.ops import _resize_kernels as IK
from avpipe.ops import image as IM
from avpipe.ops import image_augment as I

PRELUDE = r"""
#include <math.h>
#define __global__
#define __launch_bounds__(n)
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads()
#define __fmul_rn(a, b) ((a) * (b))
#define __fadd_rn(a, b) ((a) + (b))
#define AVP_F2H_DEFINED
#include <string.h>
static inline unsigned short avp_f2h(float v) {  // the GPU's cvt.rn.f16.f32
    _Float16 h = (_Float16)v;
    unsigned short u;
    memcpy(&u, &h, 2);
    return u;
}
struct Dim3 { unsigned x, y; };
static Dim3 threadIdx, blockIdx, blockDim, gridDim;
extern "C" void avp_cpu_block2(unsigned b, unsigned nblocks, unsigned by, unsigned nby) {
    blockDim.x = 1; threadIdx.x = 0; blockIdx.x = b; gridDim.x = nblocks;
    blockDim.y = 1; threadIdx.y = 0; blockIdx.y = by; gridDim.y = nby;
}
extern "C" void avp_cpu_block(unsigned b, unsigned nblocks) { avp_cpu_block2(b, nblocks, 0, 1); }
"""

P, LL, I32, F32 = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_float


class Tab(ctypes.Structure):
    """device.py's AvpTable: a launch's own table, passed by value."""

    _fields_ = [("w", ctypes.c_longlong * (D.TABLE_BYTES // 8))]


SRC = [P, LL, LL, LL, LL, LL]
ARGTYPES = {
    "avp_gray_mean": SRC + [I32] * 4 + [P] * 5 + [F32, P, Tab, I32],
    "avp_pixels": SRC + [I32] * 4 + [P] * 7 + [I32, F32, I32, P, P, I32, I32, P, Tab, I32],
    "avp_crop_hpass": SRC + [I32] * 5 + [P] * 4 + [I32, P],
    "avp_crop_vpass": [P] + [I32] * 6 + [P, P, I32, I32, P],
}
NBLOCKS = 5


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build(PRELUDE + K.KERNELS.source, tmp_path_factory.mktemp("augment_kernels"),
                 flags=("-std=c++14", "-Wno-unused-function", "-Wno-unknown-pragmas"))


def _p(a):
    return None if a is None else ctypes.c_void_p(a.ctypes.data)


def _launch(lib, name, *args, rows=1):
    f = getattr(lib, name)
    f.argtypes = ARGTYPES[name.rsplit("_", 1)[0] if name != "avp_crop_vpass" else name]
    f.restype = None
    for by in range(rows):  # gridDim.y: the gray mean's parts of each frame
        for b in range(NBLOCKS):  # grid-stride loops over several blocks of one thread
            lib.avp_cpu_block2(b, NBLOCKS, by, rows)
            f(*args)


def _src(x5):
    kind = "u8" if x5.dtype == np.uint8 else "f32"
    return kind, [_p(x5)] + [s // x5.dtype.itemsize for s in x5.strides]


def pixels_cpu(lib, x5, *, flip=None, jitter=None, bound=255.0, round_u8=False, affine=None,
               nchw=False, mode=K.MODE_F32, parts=3, inl=False):  # fmt: skip
    """:func:`avpipe.ops._image_augment_kernels.pixels`, its launches run here (``parts``: each
    frame's gray sum in that many parts, the gray-mean launch's ``gridDim.y``; ``inl``: the
    flips and the jitter's parameters in the launches' own table, as a GPU takes host ones)."""
    B, T, H, W, _ = x5.shape
    kind, src = _src(x5)
    out = np.empty((B, T, 3, H, W) if nchw else (B, T, H, W, 3), K._OUT_DTYPE[mode])
    fl = None if flip is None else np.ascontiguousarray(flip, bool).view(np.uint8)
    keep = [fl]
    tab = Tab()
    if jitter is not None:
        order = np.ascontiguousarray(jitter["order"], np.int64)
        fac = [np.ascontiguousarray(jitter[n], np.float64)
               for n in ("brightness", "contrast", "saturation", "hue")]  # fmt: skip
        keep += [order, fac]
    if inl:  # each array at a byte offset of the table, the pointers carrying the offsets
        arrays = ([] if fl is None else [fl]) + ([] if jitter is None else [order, *fac])
        table, offs = D.launch_table(TablesOn, arrays)
        tab = Tab.from_buffer_copy(table.tobytes())
        ptrs = iter(ctypes.c_void_p(int(o)) for o in offs)
        pfl = None if fl is None else next(ptrs)
        porder, pfac = (None, [None] * 4) if jitter is None else (next(ptrs), list(ptrs))
    else:
        pfl = _p(fl)
        porder, pfac = (None, [None] * 4) if jitter is None else (_p(order), list(map(_p, fac)))
    if jitter is not None:
        mean = np.full(B * T * parts, np.nan, np.float64)
        _launch(lib, f"avp_gray_mean_{kind}", *src, B, T, H, W, porder, *pfac, bound, _p(mean),
                tab, int(inl), rows=parts)  # fmt: skip
        keep += [mean]
    else:
        mean = None
        parts = 0
    a, b = (None, None) if affine is None else (np.asarray(affine[0], np.float32),
                                                np.asarray(affine[1], np.float32))  # fmt: skip
    _launch(lib, f"avp_pixels_{kind}", *src, B, T, H, W, pfl, porder, *pfac,
            _p(mean), parts, bound, int(round_u8), _p(a), _p(b), int(nchw), mode,
            _p(out), tab, int(inl), rows=2)  # fmt: skip  (frames in steps of gridDim.y)
    return out



def plan_tables(top, left, height, width, oh, ow, interpolation="bilinear", antialias=True):
    """The batch's crop tables built from whole 2-D :func:`avpipe.ops._resize_kernels.plan`s
    (what ``crop_tables`` did per item before its per-axis cache): the reference layout."""
    from avpipe.ops import _resize_kernels as IK

    plans = [IK.plan(int(h), int(w), oh, ow, (0, oh), (0, ow), interpolation, bool(antialias))
             for h, w in zip(height, width)]  # fmt: skip
    B = len(plans)
    xt, yt = max(q.x.taps for q in plans), max(q.y.taps for q in plans)
    row0 = np.array([int(t) + q.row0 for t, q in zip(top, plans)], np.int32)
    rows = np.array([q.rows for q in plans], np.int32)
    xtab = np.stack([q.x.table for q in plans]).astype(np.int32)
    xtab[:, :, 0] += np.asarray(left, np.int32)[:, None]
    ytab = np.stack([q.y.table for q in plans]).astype(np.int32)
    xw = np.zeros((B, ow, xt), np.float32)
    yw = np.zeros((B, oh, yt), np.float32)
    for b, q in enumerate(plans):
        xw[b, :, : q.x.taps] = q.x.weights
        yw[b, :, : q.y.taps] = q.y.weights
    return (row0, rows, xtab, ytab, xw, yw), (max(q.rows for q in plans), xt, yt)


def resized_crop_cpu(lib, x5, p, oh, ow, interpolation="bilinear", antialias=True,
                     mode=K.MODE_F32):  # fmt: skip
    """:func:`avpipe.ops._image_augment_kernels.resized_crop` (tables from whole plans) run here."""
    B, T, H, W, C = x5.shape
    tables, (maxrows, xt, yt) = plan_tables(p["top"], p["left"], p["height"], p["width"], oh,
                                            ow, interpolation, antialias)  # fmt: skip
    row0, rows, xtab, ytab, xw, yw = (np.ascontiguousarray(a) for a in tables)
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
    text = ptx(K.KERNELS.source, tmp_path)
    assert all(name in text for name in K.KERNELS.names)
    # the launch's table is read where the parameters are, never copied to each thread's
    # memory: on sm_90 and on sm_75, the oldest GPU a CUDA 13 nvcc builds for
    assert ".local" not in text
    assert ".local" not in ptx(K.KERNELS.source, tmp_path, arch="sm_75")


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


def test_gray_mean_in_parts(lib):
    """Each frame's gray sum split into any number of parts (the gray-mean launch's
    ``gridDim.y``) gives the contrast the same frame mean: the jittered values agree to float
    rounding whatever the split. ``mean_parts`` depends on the frame's size alone (a clip
    alone and in its batch get the same split, the same sums)."""
    cj = I.sample_color_jitter_params(2, 3, np.arange(5), brightness=0.4, contrast=0.4,
                                      saturation=0.4, hue=0.1)  # fmt: skip
    xf = _clips(dtype=np.float32)
    one = pixels_cpu(lib, xf, jitter=cj, bound=1.0, parts=1)
    for parts in (2, 7):
        np.testing.assert_allclose(pixels_cpu(lib, xf, jitter=cj, bound=1.0, parts=parts), one,
                                   atol=1e-6, rtol=0)  # fmt: skip
    assert K.mean_parts(224 * 224) == 7 and K.mean_parts(100) == 1 and K.mean_parts(10**9) == 64


def test_float16_output_is_the_float32_rounded(lib):
    """Mode float16 writes each float32 result rounded to nearest even (numpy's astype), bit
    for bit: the normalize to float16 without a second pass over the output."""
    x = _clips()
    cj = I.sample_color_jitter_params(2, 0, np.arange(5), brightness=0.4, contrast=0.4,
                                      saturation=0.4, hue=0.1)  # fmt: skip
    s = np.asarray(IM.IMAGENET_STD)
    ab = ((1 / 255 / s).astype(np.float32), (-np.asarray(IM.IMAGENET_MEAN) / s).astype(np.float32))
    for nchw in (False, True):
        kw = dict(jitter=cj, round_u8=True, affine=ab, nchw=nchw)
        f32 = pixels_cpu(lib, x, mode=K.MODE_F32, **kw)
        f16 = pixels_cpu(lib, x, mode=K.MODE_F16, **kw)
        assert f16.dtype == np.float16 and f16.shape == f32.shape
        np.testing.assert_array_equal(f16.view(np.uint16), f32.astype(np.float16).view(np.uint16))
    # halfway cases and the ends of float16's range round as numpy does
    v = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65519.0, 65520.0, 1e-8, -2.5e-5, 6.1e-5],
                 np.float32)  # fmt: skip
    xs = np.zeros((1, 1, 1, v.size, 3), np.float32)
    xs[..., 0] = v
    got = pixels_cpu(lib, xs, affine=(np.ones(3, np.float32), np.zeros(3, np.float32)),
                     mode=K.MODE_F16)  # fmt: skip
    with np.errstate(over="ignore"):  # 65520 rounds to inf, as on the GPU
        ref = v.astype(np.float16)
    np.testing.assert_array_equal(got[..., 0].view(np.uint16), ref.view(np.uint16)[None, None, None])


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


def test_parameters_in_the_launch_table_give_the_same_pixels(lib):
    """The flips and the jitter's parameters read from the launches' own table (byte offsets
    in the pointer arguments) give the values of the same parameters read from memory, bit
    for bit, with and without a jitter."""
    x = _clips()
    ids = np.arange(5)
    f = I.sample_flip_params(3, 1, ids)["flip"]
    cj = I.sample_color_jitter_params(3, 1, ids, brightness=0.4, contrast=0.4, saturation=0.4,
                                      hue=0.1)  # fmt: skip
    assert f.any() and not f.all()
    for kw in (dict(flip=f, jitter=cj, round_u8=True, affine=_norm_consts(), nchw=True),
               dict(jitter=cj, mode=K.MODE_U8), dict(flip=f, mode=K.MODE_U8)):
        want = pixels_cpu(lib, x, **kw)
        np.testing.assert_array_equal(pixels_cpu(lib, x, inl=True, **kw), want)
    # the table really is read: other parameters in it give other pixels
    cj2 = {**cj, "brightness": cj["brightness"] * 0.5}
    assert not np.array_equal(pixels_cpu(lib, x, jitter=cj2, mode=K.MODE_U8, inl=True),
                              pixels_cpu(lib, x, jitter=cj, mode=K.MODE_U8))  # fmt: skip


def test_launch_table_packs_at_aligned_offsets_and_refuses_what_does_not_fit():
    a = np.arange(3, dtype=np.uint8)
    b = np.array([1.5, -2.0])
    table, offs = D.launch_table(TablesOn, [a, b])  # (offset 0 never: null stays "none")
    assert [int(o) for o in offs] == [8, 16] and all(isinstance(o, np.uint64) for o in offs)
    raw = table.tobytes()
    assert len(raw) == D.TABLE_BYTES and raw[8:11] == a.tobytes() and raw[16:32] == b.tobytes()
    assert not any(raw[:8]) and not any(raw[11:16]) and not any(raw[32:])
    rows = np.zeros((64, 7), np.int64)  # a batch of 64 resampling rows fits
    assert D.launch_table(TablesOn, [rows]) is not None
    assert D.launch_table(TablesOn, [rows, a]) is None
    assert D.launch_table(np, [a]) is None  # numpy: no launches

    class Old(TablesOn):
        class cuda:
            class Device(TablesOn.cuda.Device):
                compute_capability = "61"  # no __grid_constant__: copies as before

    assert D.launch_table(Old, [a]) is None


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


def test_crop_tables_equal_whole_plans():
    """The per-axis cached taps give the tables the whole 2-D plans gave, bit for bit."""
    # (the last two: antialias=False reads from a row0 > 0 when it shrinks an axis 2x or more)
    for H, W, oh, ow in ((360, 640, 224, 224), (40, 70, 24, 50), (9, 5, 16, 16), (360, 640, 16, 16),
                         (120, 90, 7, 5)):
        p = I.sample_resized_crop_params(3, 1, np.arange(40), H, W)
        for interp, aa in (("bilinear", True), ("bicubic", True), ("bilinear", False),
                           ("bicubic", False)):  # fmt: skip
            args = (p["top"], p["left"], p["height"], p["width"], oh, ow, interp, aa)
            got, meta = K.crop_tables(*args)
            want, want_meta = plan_tables(*args)
            assert meta == want_meta
            if not aa and H > 4 * oh:
                assert np.any(got[0] > p["top"])  # some item's first row read is below its top
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)


# --- the cupy dispatch with a fake cupy: launches, copies and syncs counted ---------------------

# each kernel's parameters as its CUDA signature declares them: "i64" long long, "i32" int,
# "f32" float, "p:<dtype>" a device pointer ("?": may be null, passed as 0; "T": the
# kernel's input type; "out": uint8 or float32 by the mode), "tab" the launch's own table (its
# last argument, "inl", set: the per-item parameters' pointers are byte offsets into it)
_SRC = ["p:T", "i64", "i64", "i64", "i64", "i64"]
SIGNATURES = {
    "avp_gray_mean": _SRC + ["i32"] * 4 + ["p:int64"] + ["p:float64"] * 4
    + ["f32", "p:float64", "tab", "i32"],
    "avp_pixels": _SRC + ["i32"] * 4 + ["p:uint8?", "p:int64?"] + ["p:float64?"] * 4
    + ["p:float64?", "i32", "f32", "i32", "p:float32?", "p:float32?", "i32", "i32", "p:out",
       "tab", "i32"],
    "avp_crop_hpass": _SRC + ["i32"] * 5 + ["p:int32", "p:int32", "p:int32", "p:float32", "i32",
                                            "p:float32"],
    "avp_crop_vpass": ["p:float32"] + ["i32"] * 6 + ["p:int32", "p:float32", "i32", "i32",
                                                     "p:out"],
}  # fmt: skip
_CTYPE = {"i64": (np.int64, LL), "i32": (np.int32, I32), "f32": (np.float32, F32)}


class Log:
    """What the fake device did: kernel launches (names), other device work (cupy operations:
    each a launch on a GPU), host -> device copies and device -> host syncs."""

    def __init__(self):
        self.launches, self.ops, self.copies, self.syncs = [], [], [], []

    def clear(self):
        self.__init__()


LOG = Log()


class _Pointer:
    """cupy's MemoryPointer: an address into an array's memory (``+`` an offset in bytes)."""

    def __init__(self, ptr, base, off=0):
        self.ptr, self.base, self.off = ptr, base, off

    def __add__(self, o):
        return _Pointer(self.ptr + o, self.base, self.off + o)


class DevArray:
    """A device array: numpy memory behind just the cupy interface the dispatch uses; views
    are free, anything that computes is logged as device work, reading values on the host is
    logged as a sync (and numpy conversion refused, as cupy does)."""

    __module__ = "cupy"  # what avpipe.device takes for a cupy array
    device = type("Device", (), {"id": 0})()

    def __init__(self, a, dtype=None, memptr=None):
        if memptr is not None:  # cupy.ndarray(shape, dtype, memptr=...): over that memory
            n = int(np.prod(a, dtype=np.int64))
            a = np.frombuffer(memptr.base, dtype, n, memptr.off).reshape(a)
        self.a = a

    shape = property(lambda self: self.a.shape)
    ndim = property(lambda self: self.a.ndim)
    dtype = property(lambda self: self.a.dtype)
    strides = property(lambda self: self.a.strides)
    size = property(lambda self: self.a.size)
    nbytes = property(lambda self: self.a.nbytes)
    flags = property(lambda self: self.a.flags)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.a.ctypes.data, False),
                "version": 3}  # fmt: skip

    def __len__(self):
        return len(self.a)

    @property
    def data(self):  # cupy's .data.ptr: the first element's address
        return _Pointer(self.a.ctypes.data, self.a)

    def _view(self, v, what):
        if not np.shares_memory(v, self.a):
            LOG.ops.append(what)
        return DevArray(v)

    def __getitem__(self, k):
        return self._view(self.a[k], "gather")

    def view(self, dtype):
        return DevArray(self.a.view(dtype))

    def reshape(self, *shape):
        return self._view(self.a.reshape(*shape), "reshape copy")

    def astype(self, dtype, copy=True):
        LOG.ops.append("astype")
        return DevArray(self.a.astype(dtype))

    def set(self, arr, stream=None):
        LOG.copies.append(np.asarray(arr).nbytes)
        self.a[...] = arr

    def get(self, stream=None):
        LOG.syncs.append("get")
        return self.a.copy()

    def __array__(self, *a, **k):
        raise TypeError("implicit conversion of a device array to numpy")

    def _sync(self, f):
        LOG.syncs.append(f.__name__)
        return f(self.a)

    __bool__ = lambda self: self._sync(bool)  # noqa: E731
    __int__ = lambda self: self._sync(int)  # noqa: E731
    __float__ = lambda self: self._sync(float)  # noqa: E731
    tolist = lambda self: self._sync(np.ndarray.tolist)  # noqa: E731
    item = lambda self: self._sync(np.ndarray.item)  # noqa: E731


class _Stream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def record(self):
        return type("Event", (), {"done": True})()

    def synchronize(self):
        LOG.syncs.append("stream.synchronize")


class FakeCupy:
    """Just enough of cupy for the augmentation dispatch; ``RawModule``'s functions run the
    kernels' source compiled for the CPU (``lib``) after checking every launch argument against
    the CUDA signature (type, dtype, contiguity, sizes)."""

    ndarray = DevArray
    uint8, int32, int64, float16, float32, float64 = (np.uint8, np.int32, np.int64, np.float16,
                                                     np.float32, np.float64)  # fmt: skip
    lib = None

    class cuda:
        alloc_pinned_memory = staticmethod(bytearray)
        get_current_stream = staticmethod(_Stream)
        Stream = staticmethod(lambda non_blocking=True: _Stream())

        class Device:
            def __init__(self, i=0):
                assert int(i) == 0
                self.id = 0

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

    @staticmethod
    def empty(shape, dtype):
        dt = np.dtype(dtype)
        return DevArray(np.full(shape, np.nan if dt.kind == "f" else 0xAB, dt))

    @staticmethod
    def asarray(a, dtype=None):
        if isinstance(a, DevArray):
            return a if dtype is None or a.dtype == dtype else a.astype(dtype)
        LOG.copies.append("asarray")
        return DevArray(np.array(a, dtype=dtype))

    @staticmethod
    def ascontiguousarray(a, dtype=None):
        a = FakeCupy.asarray(a, dtype)
        if a.flags.c_contiguous:
            return a
        LOG.ops.append("copy")
        return DevArray(np.ascontiguousarray(a.a))

    @staticmethod
    def moveaxis(a, src, dst):
        return DevArray(np.moveaxis(a.a, src, dst))

    class RawModule:
        def __init__(self, code, options=()):
            assert code is K.KERNELS.source or code is IK._KERNELS.source
            self.image = code is IK._KERNELS.source

        def get_function(self, name):
            if self.image:  # the image kernels' launches: their numpy emulation, where the
                return _image_launch(name)  # tests of those kernels keep it
            return lambda grid, block, args: _fake_launch(name, grid, block, args)


def _image_launch(name):
    """The one-pass items kernel of ``_resize_kernels`` as ``test_ops_image_kernels`` emulates
    it (its arguments checked there), on the fake device's arrays; logged as a launch."""
    from test_ops_image_kernels import _fake_direct_items

    if not name.startswith("avp_direct_items_"):
        return None
    emulated = _fake_direct_items(np.uint8 if name.endswith("_u8") else np.float32)

    def launch(grid, block, args):
        LOG.launches.append(name)
        emulated(grid, block, [a.a if isinstance(a, DevArray) else a for a in args])

    return launch


def _fake_launch(name, grid, block, args):
    base, kind = (name, None) if name == "avp_crop_vpass" else tuple(name.rsplit("_", 1))
    sig = SIGNATURES[base]
    assert len(args) == len(sig), (name, len(args))
    assert len(grid) == len(block) == 3 and grid[0] >= 1
    assert block[0] == (K._MEAN_THREADS if base == "avp_gray_mean" else 256)
    conv, arrays = [], []
    inl = "tab" in sig and int(args[-1]) == 1
    for a, t in zip(args, sig):
        if t == "tab":
            assert isinstance(a, np.void) and a.dtype == CM._TABLE, (name, type(a))
            conv.append(Tab.from_buffer_copy(a.tobytes()))
            arrays.append(None)
            continue
        if inl and isinstance(a, np.uint64):  # an offset into the launch's table
            assert t.startswith("p:") and int(a) % 8 == 0 and int(a) < D.TABLE_BYTES, (name, t)
            conv.append(ctypes.c_void_p(int(a)))
            arrays.append(None)
            continue
        if t in _CTYPE:
            assert type(a) is _CTYPE[t][0], (name, t, type(a))
            conv.append(_CTYPE[t][1](a))
            arrays.append(None)
            continue
        want = t[2:].rstrip("?")
        if isinstance(a, int) and not isinstance(a, DevArray):
            assert t.endswith("?") and a == 0, (name, t, a)
            conv.append(None)
            arrays.append(None)
            continue
        assert isinstance(a, DevArray), (name, t, type(a))
        if want == "T":
            assert a.dtype == {"u8": np.uint8, "f32": np.float32}[kind], (name, a.dtype)
        else:
            assert a.flags.c_contiguous, (name, t)
            if want != "out":
                assert a.dtype == np.dtype(want), (name, t, a.dtype)
        conv.append(ctypes.c_void_p(a.a.ctypes.data))
        arrays.append(a)
    _check_sizes(base, args)
    f = getattr(FakeCupy.lib, name)
    f.argtypes = [P if t.startswith("p:") else Tab if t == "tab" else _CTYPE[t][1] for t in sig]
    f.restype = None
    for by in range(int(grid[1])):
        for b in range(NBLOCKS):
            FakeCupy.lib.avp_cpu_block2(b, NBLOCKS, by, int(grid[1]))
            f(*conv)
    LOG.launches.append(name)


def _check_sizes(base, args):
    """The arrays a launch reads and writes hold what its scalars say (no read out of bounds)."""
    def size(a, want=1):  # (an offset into the launch's table: its size unknown, taken as want)
        return 0 if isinstance(a, int) else want if isinstance(a, np.uint64) else a.size

    if base in ("avp_gray_mean", "avp_pixels", "avp_crop_hpass"):
        src, strides = args[0], args[1:6]
        assert tuple(int(s) for s in strides) == tuple(s // src.dtype.itemsize for s in src.strides)
        nb, nt = int(args[6]), int(args[7])
        assert src.shape[:2] == (nb, nt)
    if base in ("avp_gray_mean", "avp_pixels"):
        h, w = int(args[8]), int(args[9])
        assert args[0].shape[2:] == (h, w, 3)
        k = 10 if base == "avp_gray_mean" else 11
        if base == "avp_pixels":
            assert size(args[10], nb) in (0, nb)
        assert size(args[k], nb * 4) in (0, nb * 4)
        assert all(size(f, nb) in (0, nb) for f in args[k + 1 : k + 5])
        if base == "avp_gray_mean":
            assert args[16].size % (nb * nt) == 0 and args[16].size // (nb * nt) >= 1
        else:
            parts = int(args[17])
            assert size(args[16]) in (0, nb * nt * parts) and (parts > 0) == (size(args[16]) > 0)
            assert (size(args[16]) == 0) == (size(args[11]) == 0)
            assert size(args[20]) in (0, 3) and size(args[21]) in (0, 3)
            nchw, mode, out = int(args[22]), int(args[23]), args[24]
            assert out.dtype == K._OUT_DTYPE[mode]
            assert out.shape == ((nb, nt, 3, h, w) if nchw else (nb, nt, h, w, 3))
    if base == "avp_crop_hpass":
        maxrows, ow, c, taps = int(args[8]), int(args[9]), int(args[10]), int(args[15])
        assert args[0].shape[-1] == c and args[11].size == args[12].size == nb
        assert args[13].size == nb * ow * 2 and args[14].size == nb * ow * taps
        assert args[16].size == nb * nt * maxrows * ow * c
        assert int(np.max(args[12].a, initial=0)) <= maxrows
    if base == "avp_crop_vpass":
        nb, nt, maxrows, ow, c, oh = (int(v) for v in args[1:7])
        taps = int(args[9])
        assert args[0].size == nb * nt * maxrows * ow * c
        assert args[7].size == nb * oh * 2 and args[8].size == nb * oh * taps
        out, mode = args[11], int(args[10])
        assert out.shape == (nb, nt, oh, ow, c)
        assert out.dtype == (np.uint8 if mode == K.MODE_U8 else np.float32)


@pytest.fixture
def dev(lib, monkeypatch):
    """The fake cupy in place of cupy (the kernels compiled here), its log cleared."""
    import sys

    monkeypatch.setitem(sys.modules, "cupy", FakeCupy)
    monkeypatch.setattr(FakeCupy, "lib", lib)
    monkeypatch.setattr(K, "_VECS", {})
    monkeypatch.delenv("AVPIPE_IMAGE_KERNELS", raising=False)
    CM.clear_cache()
    LOG.clear()
    yield FakeCupy
    CM.clear_cache()


def _up(x):
    """A host array put on the fake device (not logged)."""
    return DevArray(np.array(x))


def _norm_consts():
    s = np.asarray(IM.IMAGENET_STD)
    return (1 / 255 / s).astype(np.float32), (-np.asarray(IM.IMAGENET_MEAN) / s).astype(np.float32)


@pytest.fixture(params=["direct", "two_pass"])
def crop_path(request, monkeypatch):
    """The resized crop's launches on each path: the one-pass items kernel of
    ``_resize_kernels`` (emulated in numpy), or the two passes with host tables that it leaves
    large downscales to (forced by allowing the one-pass kernel no taps)."""
    if request.param == "two_pass":
        monkeypatch.setattr(IK, "_DIRECT_WORK", 0)
        return {"u8": ["avp_crop_hpass_u8", "avp_crop_vpass"],
                "f32": ["avp_crop_hpass_f32", "avp_crop_vpass"], "two_pass": True}  # fmt: skip
    return {"u8": ["avp_direct_items_u8"], "f32": ["avp_direct_items_f32"], "two_pass": False}


def _crop_reference(x5, p, oh, ow, flip, two_pass, mode=K.MODE_U8):
    """The resized crop as the chain's path launches it, run here: the two passes from whole
    plans (:func:`resized_crop_cpu`), or the one-pass kernel's emulation per item (``flip``
    folded in)."""
    if two_pass:
        return resized_crop_cpu(lib=FakeCupy.lib, x5=x5, p=p, oh=oh, ow=ow, mode=mode)
    from test_ops_image_kernels import _emulate_direct

    ab = np.array([1, 1, 1, 1, 0, 0, 0, 0], np.float32)
    return np.stack([_emulate_direct(x5[b], p["height"][b], oh, 0, p["top"][b], oh,
                                     p["width"][b], ow, 0, p["left"][b], ow, bool(flip[b]), 0,
                                     1, 0, ab, mode) for b in range(x5.shape[0])])  # fmt: skip


@pytest.mark.parametrize("layout", [None, "BTCHW", "images"])
def test_video_chain_batch_costs_few_launches_no_sync(dev, crop_path, layout):
    """video_train_chain on the device: the resized crop (1 launch, with the flip folded in;
    2 for boxes past the one-pass kernel), the gray means and the fused (flip +) jitter +
    normalize (1 each); the batch's parameters and the crop's tables (the one-pass kernel's
    table of items, or the two passes' taps) in one host -> device copy; no device -> host
    sync; the same parameters as the numpy path, the result within its tolerances and equal to
    the kernels launched directly on those params."""
    x = _clips(shape=(4, 3, 36, 64, 3))
    if layout == "BTCHW":
        x = np.ascontiguousarray(np.moveaxis(x, -1, 2))
    elif layout == "images":
        x, layout = x[:, 0], None
    chain = I.video_train_chain(16, layout=layout)
    assert chain._runs() == [(0, 4)]  # one run: the crop leads it
    ref, ps = chain(x, seed=2, epoch=1, return_params=True)  # numpy
    xd = _up(x)
    chain(xd, seed=2, epoch=0)  # warm: the normalize constants go up once per device
    LOG.clear()
    got, psd = chain(xd, seed=2, epoch=1, return_params=True)
    assert LOG.launches == crop_path["u8"] + ["avp_gray_mean_u8", "avp_pixels_u8"]
    assert len(LOG.copies) == 1 and LOG.ops == [] and LOG.syncs == []
    assert isinstance(got, DevArray)
    for a, b in zip(ps, psd):  # the same draws, on the device
        assert a.keys() == b.keys()
        for k in a:
            assert isinstance(b[k], DevArray) and b[k].dtype == a[k].dtype
            np.testing.assert_array_equal(b[k].a, a[k])
    g = got.a
    assert g.shape == ref.shape and g.dtype == ref.dtype == np.float32
    d = np.abs(g - ref)
    assert d.max() < 4 / 255 / 0.224 and np.mean(d > 1e-3) < 1e-2
    # exactly the kernels launched directly on these parameters (tables from whole plans)
    x5 = x if x.ndim == 5 and layout is None else (np.moveaxis(x, 2, -1) if layout else x[:, None])
    two = crop_path["two_pass"]
    y5 = _crop_reference(x5, ps[0], 16, 16, ps[1]["flip"], two)
    want = pixels_cpu(FakeCupy.lib, y5, flip=ps[1]["flip"] if two else None, jitter=ps[2],
                      round_u8=True, affine=_norm_consts(), nchw=True)  # fmt: skip
    np.testing.assert_array_equal(g, want[:, 0] if x.ndim == 4 else want)
    # replay with the device params: nothing copied; with host params: their one copy per
    # kernel group (tables, pixel params); on other data: the crop's table of items again
    n = len(LOG.launches)
    LOG.clear()
    np.testing.assert_array_equal(chain.apply(xd, psd).a, g)
    assert len(LOG.launches) == n and LOG.copies == [] and LOG.syncs == [] and LOG.ops == []
    LOG.clear()
    np.testing.assert_array_equal(chain.apply(_up(x), psd).a, g)
    assert len(LOG.copies) == (0 if two else 1) and LOG.syncs == [] and LOG.ops == []
    LOG.clear()
    np.testing.assert_array_equal(chain.apply(xd, ps).a, g)
    assert len(LOG.launches) == n and len(LOG.copies) == 2 and LOG.syncs == [] and LOG.ops == []


def test_changed_device_params_are_read_again(dev):
    """A value replaced in a device params dict is what gets applied (read back once), not the
    host copy or the tables that went up with the dict."""
    x = _clips(shape=(3, 2, 30, 40, 3))
    chain = I.video_train_chain(12)
    _, psd = chain(_up(x), seed=5, return_params=True)
    host_p = [{k: v.a.copy() for k, v in q.items()} for q in psd]
    host_p[0]["top"] = host_p[0]["top"] // 2
    host_p[1]["flip"] = ~host_p[1]["flip"]
    psd[0]["top"] = _up(host_p[0]["top"])
    psd[1]["flip"] = _up(host_p[1]["flip"])
    LOG.clear()
    got = chain.apply(_up(x), psd).a
    assert LOG.syncs == ["get"]  # the new crop tops (the flip is used on the device)
    np.testing.assert_array_equal(got, chain.apply(_up(x), host_p).a)
    d = np.abs(got - chain.apply(x, host_p))
    assert d.max() < 4 / 255 / 0.224 and np.mean(d > 1e-3) < 1e-2


def test_single_ops_and_module_functions_on_the_device(dev, crop_path):
    """Each op alone: its params (and a crop's tables) in one copy, its launches, no sync;
    results as numpy's."""
    x = _clips(shape=(5, 3, 23, 31, 3))
    xd = _up(x)
    I.Normalize().apply(xd, {})  # warm the constants
    crop = crop_path["u8"]
    cases = [
        (I.RandomFlip(0.5), ["avp_pixels_u8"], 0),
        (I.ColorJitter(0.4, 0.4, 0.4, 0.1, p=0.7), ["avp_gray_mean_u8", "avp_pixels_u8"], 1),
        (I.RandomResizedCrop(16), crop, 1),
        (I.RandomResizedCrop(16, dtype="float32", interpolation="bicubic"), crop, 0.255),
        (I.RandomResizedCrop(5, antialias=False), crop, 1),
    ]  # fmt: skip
    for op, launches, tol in cases:
        LOG.clear()
        y, p = op(xd, seed=3, epoch=2, return_params=True)
        assert LOG.launches == launches and len(LOG.copies) == 1, (op, LOG.copies)
        assert LOG.syncs == [] and LOG.ops == []
        ref, pr = op(x, seed=3, epoch=2, return_params=True)
        assert p.keys() == pr.keys() and all(np.array_equal(p[k].a, pr[k]) for k in p)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        assert np.abs(y.a.astype(np.float32) - ref).max() <= tol
    LOG.clear()
    y = I.Normalize().apply(xd, {})
    assert LOG.launches == ["avp_pixels_u8"] and LOG.copies == LOG.syncs == LOG.ops == []
    np.testing.assert_array_equal(y.a, I.Normalize().apply(x, {}))
    # module functions: the sampler's one copy; the crop's tables in one more
    LOG.clear()
    p = I.sample_resized_crop_params(1, 0, np.arange(5), 23, 31, xp=FakeCupy)
    assert len(LOG.copies) == 1 and all(isinstance(v, DevArray) for v in p.values())
    y = I.apply_resized_crop(xd, p, 12)
    assert len(LOG.copies) == 2 and LOG.launches == crop and LOG.syncs == []
    ref = I.apply_resized_crop(x, {k: v.a for k, v in p.items()}, 12)
    assert np.abs(y.a.astype(int) - ref).max() <= 1
    LOG.clear()
    f = I.sample_flip_params(0, 0, np.arange(5))  # host params: one copy at apply
    np.testing.assert_array_equal(I.apply_flip(xd, f).a, I.apply_flip(x, f))
    assert len(LOG.copies) == 1 and LOG.launches == ["avp_pixels_u8"] and LOG.syncs == []


def test_float_input_and_nhwc_float16_out(dev, crop_path):
    xf = _clips(shape=(3, 2, 20, 28, 3), dtype=np.float32)
    chain = I.Chain([I.RandomResizedCrop(10), I.RandomFlip(), I.ColorJitter(0.3, 0.3, 0.3, 0.05),
                     I.Normalize(dtype="float16", out_layout="NHWC", scale=1.0)])  # fmt: skip
    ref = chain(xf, seed=1)
    chain(_up(xf), seed=0)  # warm the normalize constants
    LOG.clear()
    got = chain(_up(xf), seed=1)
    assert LOG.launches == crop_path["f32"] + ["avp_gray_mean_f32", "avp_pixels_f32"]
    # the kernel writes float16 itself: no astype pass after it
    assert LOG.ops == [] and len(LOG.copies) == 1 and LOG.syncs == []
    assert got.shape == ref.shape and got.dtype == ref.dtype == np.float16
    np.testing.assert_allclose(got.a.astype(np.float32), ref.astype(np.float32), atol=2e-3 * 5)


@pytest.mark.parametrize("jitter", [True, False])
def test_recipe_batch_sends_its_tables_in_the_launches(dev, monkeypatch, jitter):
    """The recipe's folded path (``fused_resized_crop_normalize``) on a device that reads
    launch tables: the crops' items and the jitter's parameters travel in the launches'
    parameters, no host -> device copy at all; the same values as with the copies."""
    x = _clips(shape=(4, 3, 36, 64, 3))
    ids = np.arange(4)
    p = I.sample_resized_crop_params(6, 2, ids, 36, 64, scale=(0.25, 1.0))
    p["flip"] = I.sample_flip_params(6, 2, ids)["flip"]
    cj = I.sample_color_jitter_params(6, 2, ids, brightness=0.4, contrast=0.4, saturation=0.4,
                                      hue=0.1) if jitter else None  # fmt: skip
    kw = dict(color_jitter=cj, bound=255.0, mean=IM.IMAGENET_MEAN, std=IM.IMAGENET_STD,
              scale=1 / 255, dtype="float16", layout="NCHW")  # fmt: skip
    clips = [_up(c) for c in x]
    I.fused_resized_crop_normalize(clips, p, 16, **kw)  # warm the normalize constants
    LOG.clear()
    want = I.fused_resized_crop_normalize(clips, p, 16, **kw).a
    copies = len(LOG.copies)
    assert copies == (2 if jitter else 1)  # the items' table (and the jitter's parameters)
    monkeypatch.setattr(FakeCupy.cuda.Device, "compute_capability", "90", raising=False)
    CM._tables_ok.cache_clear()
    try:
        LOG.clear()
        got = I.fused_resized_crop_normalize(clips, p, 16, **kw).a
        assert LOG.copies == [] and LOG.syncs == [] and LOG.ops == []
        assert LOG.launches == ["avp_direct_items_u8"] + (
            ["avp_gray_mean_f32", "avp_pixels_f32"] if jitter else [])
        np.testing.assert_array_equal(got, want)
        ref = I.fused_resized_crop_normalize(list(x), p, 16, **kw)  # numpy
        d = np.abs(got.astype(np.float32) - ref.astype(np.float32))
        assert d.max() < 4 / 255 / 0.224 and np.mean(d > 1e-2) < 1e-2
    finally:
        CM._tables_ok.cache_clear()


def test_cached_constants_wait_for_their_copy_and_are_never_dropped(dev):
    """Normalize's constants are cached for every stream: their copy is waited for (the
    recipe's decoding threads read them from their own streams). A full cache keeps what it
    holds (a kernel queued on another stream may still read it) and copies a new vector for
    the call alone, on its stream."""
    a = K._vec(dev, [1.0, 2.0, 3.0], 0)
    assert LOG.syncs == ["stream.synchronize"] and len(LOG.copies) == 1
    LOG.clear()
    assert K._vec(dev, [1.0, 2.0, 3.0], 0) is a and LOG.copies == [] and LOG.syncs == []
    for k in range(255):
        K._VECS[(np.float32([k, k, k]).tobytes(), 0)] = object()
    full = dict(K._VECS)
    LOG.clear()
    b = K._vec(dev, [7.5, 8.0, 9.0], 0)
    assert b.a.tolist() == [7.5, 8.0, 9.0] and LOG.syncs == [] and len(LOG.copies) == 1
    assert K._VECS == full and all(K._VECS[k] is v for k, v in full.items())
