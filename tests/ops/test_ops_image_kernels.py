"""The fused CUDA resize kernels (avpipe.ops._resize_kernels) against the numpy reference.

CPU tests: the host-side sparse tap tables, applied by a numpy emulation of exactly what each
kernel computes per output element (same taps, float32 accumulation in tap order, the same
normalize constants, cast, layout), equal the numpy ``resize_crop_normalize`` / ``resize``.
GPU tests (``-m gpu``): the kernels themselves against the numpy path. Tolerances: float32
output max abs error <= 1e-3; float16 output |gpu - cpu| <= 2e-3 * max(1, |cpu|) (one fp16 ulp
is at most 2^-10 relative); uint8 ``resize`` within 2 levels, mean < 0.01 (rounding flips).
"""

from __future__ import annotations

import numpy as np
import pytest

from avpipe import device as D
from avpipe.device import cuda_modules as CM
from avpipe.device.cuda_modules import CudaModule
from avpipe.ops import _image_resize as R
from avpipe.ops import _resize_kernels as K
from avpipe.ops import image as I


def _picture(n, h, w, c=3, seed=0):
    """Smooth gradients + hard edges + noise, uint8 [n, h, w, c]."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = 127 + 90 * np.sin(xx[..., None] / (3.0 + np.arange(c))) * np.cos(yy[..., None] / 7.0)
    base = base + 60 * ((xx // 9 + yy // 5) % 2)[..., None]
    img = base[None] + rng.normal(0, 25, (n, h, w, c))
    return np.clip(img, 0, 255).astype(np.uint8)


# --- numpy emulation of the two kernels ---------------------------------------------------------


def _emulate_hpass(x, p: K.Plan, round_mid=False):
    """avp_hpass: tmp[b, r, ox, ch] = sum_{k < count[ox]} w[ox, k] * x[b, row0 + r, start + k, ch]."""
    xs = x[:, p.row0 : p.row0 + p.rows].astype(np.float32)
    w_in = x.shape[2]
    acc = np.zeros(xs.shape[:2] + (p.x.table.shape[0], x.shape[3]), np.float32)
    for k in range(p.x.taps):
        live = k < p.x.count  # the kernel's loop bound
        col = np.clip(p.x.start + k, 0, w_in - 1)
        wk = np.where(live, p.x.weights[:, k], 0).astype(np.float32)
        acc += wk[None, None, :, None] * xs[:, :, col, :]
    if round_mid:
        acc = np.clip(np.floor(acc + np.float32(0.5)), 0, 255)
    return acc


def _emulate_vpass(tmp, p: K.Plan, mode, nchw, a=None, b=None):
    """avp_vpass: vertical taps, then v * a + b, cast, layout."""
    n, rows, ow, c = tmp.shape
    oh = p.y.table.shape[0]
    acc = np.zeros((n, oh, ow, c), np.float32)
    for k in range(p.y.taps):
        live = k < p.y.count
        row = np.clip(p.y.start + k, 0, rows - 1)
        wk = np.where(live, p.y.weights[:, k], 0).astype(np.float32)
        acc += wk[None, :, None, None] * tmp[:, row]
    if mode == K.MODE_U8:
        out = np.clip(np.floor(acc + np.float32(0.5)), 0, 255).astype(np.uint8)
    else:
        a = np.ones(c, np.float32) if a is None else a
        b = np.zeros(c, np.float32) if b is None else b
        v = acc * a + b
        out = v.astype(np.float16 if mode == K.MODE_F16 else np.float32)
    return np.ascontiguousarray(out.transpose(0, 3, 1, 2)) if nchw else out


def _emulate_rcn(x, *, short_side=None, size=None, crop_size=None, mean=I.IMAGENET_MEAN,
                 std=I.IMAGENET_STD, scale=1 / 255, interpolation="bilinear", antialias=True,
                 dtype="float32", layout="NCHW"):  # fmt: skip
    """resize_crop_normalize through the tap tables (the host logic of the kernel dispatch)."""
    single = x.ndim == 3
    xb = x[None] if single else x
    n, h, w, c = xb.shape
    if size is not None:
        oh, ow = (size, size) if isinstance(size, int) else size
    else:
        oh, ow = I.resize_short_side_size(h, w, short_side)
    if crop_size is None:
        rows, cols = (0, oh), (0, ow)
    else:
        ch, cw = (crop_size, crop_size) if isinstance(crop_size, int) else crop_size
        top, left = int(round((oh - ch) / 2.0)), int(round((ow - cw) / 2.0))
        rows, cols = (top, top + ch), (left, left + cw)
    p = K.plan(h, w, oh, ow, rows, cols, interpolation, antialias)
    s = np.broadcast_to(np.asarray(std, np.float64).reshape(-1), (c,))
    m = np.broadcast_to(np.asarray(mean, np.float64).reshape(-1), (c,))
    a = (scale / s).astype(np.float32)
    b = (-m / s).astype(np.float32)
    mode = K.MODE_F16 if dtype == "float16" else K.MODE_F32
    y = _emulate_vpass(_emulate_hpass(xb, p), p, mode, layout in ("NCHW", "CHW"), a, b)
    return y[0] if single else y


# --- CPU tests ----------------------------------------------------------------------------------

CASES = [
    # (shape, resize + normalize kwargs, crop_size)
    ((2, 375, 500, 3), dict(short_side=224), 224),  # the benchmark's downscale + center crop
    ((3, 37, 53, 3), dict(short_side=64), (60, 50)),  # upscaling, odd sizes, non-square crop
    ((2, 41, 29, 1), dict(size=(17, 23), short_side=None, mean=0.5, std=0.25), None),  # no crop
    (
        (33, 47, 4),
        dict(
            size=(50, 20),
            short_side=None,
            mean=(0.1, 0.2, 0.3, 0.4),
            std=(0.5, 0.6, 0.7, 0.8),
            scale=0.01,
        ),
        None,
    ),  # single image: up h, down w
    ((1, 30, 40, 3), dict(size=(30, 61), short_side=None), (30, 33)),  # identity vertical axis
]


@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_tap_tables_reproduce_resize_crop_normalize(case, interp, antialias):
    shape, kw, crop = CASES[case]
    x = _picture(*shape) if len(shape) == 4 else _picture(1, *shape, seed=case)[0]
    for dtype, layout in [("float32", "NCHW"), ("float32", "NHWC"), ("float16", "NCHW"),
                          ("float16", "HWC" if x.ndim == 3 else "NHWC")]:  # fmt: skip
        opts = dict(kw, crop_size=crop, interpolation=interp, antialias=antialias, dtype=dtype,
                    layout=layout)  # fmt: skip
        ref = I.resize_crop_normalize(x, **opts)
        got = _emulate_rcn(x, **opts)
        assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape)
        d = np.abs(got.astype(np.float32) - ref.astype(np.float32))
        if dtype == "float32":
            assert d.max() <= 1e-4, d.max()
        else:  # one fp16 rounding flip at most
            assert np.all(d <= 2e-3 * np.maximum(1.0, np.abs(ref.astype(np.float32)))), d.max()


@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [True, False])
def test_tap_tables_reproduce_resize_uint8_and_float(interp, antialias):
    x = _picture(2, 45, 61)
    for oh, ow in [(20, 33), (70, 40), (45, 30)]:
        p = K.plan(45, 61, oh, ow, (0, oh), (0, ow), interp, antialias)
        ref = I.resize(x, (oh, ow), interpolation=interp, antialias=antialias)
        got = _emulate_vpass(_emulate_hpass(x, p, round_mid=True), p, K.MODE_U8, False)
        assert got.shape == ref.shape and got.dtype == np.uint8
        d = np.abs(got.astype(int) - ref)
        assert d.max() <= 1 and d.mean() < 0.01  # rare rounding flips only
        xf = x.astype(np.float32)
        reff = I.resize(xf, (oh, ow), interpolation=interp, antialias=antialias)
        gotf = _emulate_vpass(_emulate_hpass(xf, p), p, K.MODE_F32, False)
        assert np.abs(gotf - reff).max() <= 1e-3


@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.parametrize("in_size,out_size,window", [(375, 224, (0, 224)), (500, 298, (37, 261)),
                                                     (7, 19, (0, 19)), (19, 7, (2, 6)),
                                                     (1, 5, (0, 5)), (64, 64, (0, 64))])  # fmt: skip
def test_sparse_taps_are_the_dense_map(in_size, out_size, window, interp, antialias):
    idx, w = R.axis_weights(in_size, out_size, interp, antialias, *window)
    t = K.sparse_taps(idx, w)
    dense = R._dense(idx, w, in_size)
    mine = np.zeros_like(dense)
    for i in range(dense.shape[0]):
        s, n = t.table[i]
        assert 0 <= s and s + n <= in_size and n <= t.taps
        mine[i, s : s + n] = t.weights[i, :n]
        assert np.all(t.weights[i, n:] == 0)
    np.testing.assert_allclose(mine, dense, atol=1e-7)
    if in_size == out_size:  # identity: one tap of weight exactly 1
        assert t.taps == 1 and np.all(t.weights == 1.0)
    assert t.table.dtype == np.int32 and t.weights.dtype == np.float32


def test_plan_restricts_rows_to_the_vertical_taps():
    p = K.plan(375, 500, 224, 298, (0, 224), (37, 261), "bilinear", True)
    assert p.x.table.shape == (224, 2) and p.y.table.shape == (224, 2)
    ys = p.y.start.astype(int) + p.row0
    assert p.row0 == ys.min() and p.row0 + p.rows == (ys + p.y.count).max()
    # a central crop of a tall image touches only the middle rows
    q = K.plan(600, 100, 224, 224, (0, 224), (0, 224), "bilinear", True)
    q2 = K.plan(600, 100, 1344, 224, (560, 784), (0, 224), "bilinear", True)
    assert q.rows == 600 and q2.row0 > 200 and q2.row0 + q2.rows < 400
    assert K.plan(375, 500, 224, 298, (0, 224), (37, 261), "bilinear", True) is p  # cached


def test_kernel_switch(monkeypatch):
    monkeypatch.delenv("AVPIPE_IMAGE_KERNELS", raising=False)
    assert K.enabled()
    monkeypatch.setenv("AVPIPE_IMAGE_KERNELS", "0")
    assert not K.enabled()


def test_kernel_source_is_complete():
    for name in K._KERNELS.names:
        assert f'extern "C" __global__ void {name}(' in K._KERNELS.source


class _Pointer:
    """cupy's MemoryPointer: an address into an array's memory (``+`` an offset in bytes)."""

    def __init__(self, ptr, base=None, off=0):
        self.ptr, self.base, self.off = ptr, base, off

    def __add__(self, o):
        return _Pointer(self.ptr + o, self.base, self.off + o)


class _FakeArr(np.ndarray):
    """A numpy array that answers ``.device.id`` and ``.set`` (a host-to-device copy) like a
    cupy array."""

    device = type("D", (), {"id": 0})()
    copies: list = []

    @property
    def data(self):  # cupy's .data.ptr: the first element's address
        return _Pointer(self.__array_interface__["data"][0], self)

    def set(self, arr, stream=None):
        _FakeArr.copies.append(np.asarray(arr).shape)
        self[...] = arr


class _FakeStream:
    def __init__(self, non_blocking=True):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def record(self):
        return type("E", (), {"done": True})()

    def synchronize(self):
        pass


class _FakeCupy:
    """Just enough of cupy for ``_resize_kernels.resample``: the "kernels" are numpy emulations
    that unpack the launch arguments exactly as the CUDA signatures declare them, so the host
    glue (argument order, element strides, tables, modes, layout) is checked on the CPU."""

    float32 = np.float32
    launches: list = []

    uint8 = np.uint8

    @staticmethod
    def ndarray(shape, dtype, memptr):  # an array over a buffer's memory (no copy)
        n = int(np.prod(shape, dtype=np.int64))
        v = np.frombuffer(memptr.base, dtype, n, memptr.off).reshape(shape)
        return v.view(_FakeArr)

    class cuda:
        Stream = _FakeStream
        alloc_pinned_memory = staticmethod(bytearray)  # host memory the copies read
        get_current_stream = staticmethod(_FakeStream)

        class Device:
            def __init__(self, i=0):
                self.id = i

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

    @staticmethod
    def _wrap(a):
        return np.asarray(a).view(_FakeArr)

    @classmethod
    def empty(cls, shape, dtype):
        return cls._wrap(np.full(shape, 77, dtype=dtype))

    @classmethod
    def asarray(cls, a):
        return cls._wrap(np.array(a))

    @classmethod
    def ascontiguousarray(cls, a):
        return cls._wrap(np.ascontiguousarray(a))

    class RawModule:
        def __init__(self, code, options=()):
            assert code is K._KERNELS.source

        def get_function(self, name):
            return {"avp_hpass_u8": _fake_hpass(np.uint8), "avp_hpass_f32": _fake_hpass(np.float32),
                    "avp_vpass": _fake_vpass, "avp_direct_u8": _fake_direct(np.uint8),
                    "avp_direct_f32": _fake_direct(np.float32),
                    "avp_direct_items_u8": _fake_direct_items(np.uint8),
                    "avp_direct_items_f32": _fake_direct_items(np.float32)}[name]  # fmt: skip


def _fake_hpass(src_dtype):
    def launch(grid, block, args):
        src, sn, sh, sw, sc, n, row0, rows, ow, c, xtab, xw, taps, round_mid, dst = args
        assert src.dtype == src_dtype and dst.dtype == np.float32 and dst.flags.c_contiguous
        assert all(isinstance(v, np.int64) for v in (sn, sh, sw, sc))
        assert all(isinstance(v, np.int32) for v in (n, row0, rows, ow, c, taps, round_mid))
        assert xtab.dtype == np.int32 and xw.dtype == np.float32 and xw.shape[1] == taps
        assert grid[0] * block[0] >= 1 and dst.shape == (n, rows, ow, c)
        it = src.itemsize
        x = np.lib.stride_tricks.as_strided(np.asarray(src), src.shape,
                                            (sn * it, sh * it, sw * it, sc * it))  # fmt: skip
        p = K.Plan(x=K.AxisTaps(np.asarray(xtab), np.asarray(xw)), y=None, row0=int(row0),
                   rows=int(rows), key=None)  # fmt: skip
        dst[...] = _emulate_hpass(x, p, round_mid=bool(round_mid))
        _FakeCupy.launches.append("h")

    return launch


def _fake_vpass(grid, block, args):
    tmp, n, rows, ow, c, oh, ytab, yw, taps, a, bb, nchw, mode, out = args
    assert all(isinstance(v, np.int32) for v in (n, rows, ow, c, oh, taps, nchw, mode))
    assert tmp.shape == (n, rows, ow, c) and yw.shape == (oh, taps) and out.flags.c_contiguous
    assert out.shape == ((n, c, oh, ow) if nchw else (n, oh, ow, c))
    assert a.dtype == bb.dtype == np.float32 and a.shape == bb.shape == (c,)
    p = K.Plan(x=None, y=K.AxisTaps(np.asarray(ytab), np.asarray(yw)), row0=0, rows=int(rows),
               key=None)  # fmt: skip
    out[...] = _emulate_vpass(np.asarray(tmp), p, int(mode), bool(nchw), np.asarray(a),
                              np.asarray(bb))  # fmt: skip
    _FakeCupy.launches.append("v")


def _direct_axis(size_in, size_out, lo, n, off, size, interp, aa, flip=False):
    """avp_taps + avp_at for output positions lo .. lo + n of an axis: the input indices and
    weights [n, K] (numpy's axis_weights: the kernel's weights bit for bit, the C++ test below
    checks), moved by ``off`` and clamped into the input's ``size``."""
    idx, w = R.axis_weights(size_in, size_out, interp, aa, lo, lo + n)
    idx = np.clip(np.asarray(idx) + off, 0, size - 1)
    return (idx[::-1], np.asarray(w)[::-1]) if flip else (idx, np.asarray(w))


def _emulate_direct(x, y_in, y_out, y_lo, y_off, oh, x_in, x_out, x_lo, x_off, ow, flip, cubic,
                    aa, round_mid, ab, mode):  # fmt: skip
    """avp_direct_impl on ``x`` [n, H, W, c]: each input row's horizontal sum, then the
    vertical taps, ``v * a + b``, the cast; ``[n, oh, ow, c]``."""
    n, _, _, c = x.shape
    interp = "bicubic" if cubic else "bilinear"
    yi, yw = _direct_axis(int(y_in), int(y_out), int(y_lo), int(oh), int(y_off), x.shape[1],
                          interp, bool(aa))  # fmt: skip
    xi, xw = _direct_axis(int(x_in), int(x_out), int(x_lo), int(ow), int(x_off), x.shape[2],
                          interp, bool(aa), bool(flip))  # fmt: skip
    xf = x.astype(np.float32)
    acc = np.zeros((n, oh, ow, c), np.float32)
    for ky in range(yi.shape[1]):  # each row's horizontal sum, then the vertical tap
        rows = xf[:, yi[:, ky]]  # [n, oh, W, c]
        h = np.zeros((n, oh, ow, c), np.float32)
        for kx in range(xi.shape[1]):
            h += xw[None, None, :, kx, None] * rows[:, :, xi[:, kx]]
        if round_mid:
            h = np.clip(np.floor(h + np.float32(0.5)), 0, 255)
        acc += yw[None, :, ky, None, None] * h
    if mode == K.MODE_U8:
        return np.clip(np.floor(acc + np.float32(0.5)), 0, 255).astype(np.uint8)
    a, b = np.array(ab[:4], np.float32)[:c], np.array(ab[4:], np.float32)[:c]
    return (acc * a + b).astype(np.float16 if mode == K.MODE_F16 else np.float32)


def _fake_direct(src_dtype):
    def launch(grid, block, args):
        (src, sn, sh, sw, sc, n, c, y_in, y_out, y_lo, y_off, y_size, oh, x_in, x_out, x_lo,
         x_off, x_size, ow, flip, cubic, aa, round_mid, *ab) = args[:31]  # fmt: skip
        nchw, mode, out, ob = args[31:]
        assert len(args) == 35 and src.dtype == src_dtype and out.flags.c_contiguous
        assert all(isinstance(v, np.int64) for v in (sn, sh, sw, sc, ob))
        assert all(isinstance(v, np.int32) for v in (n, c, y_in, y_out, y_lo, y_off, y_size, oh,
                                                     x_in, x_out, x_lo, x_off, x_size, ow, flip,
                                                     cubic, aa, round_mid, nchw, mode))  # fmt: skip
        assert all(isinstance(v, np.float32) for v in ab) and grid[0] * block[0] >= 1
        assert out.shape == ((n, c, oh, ow) if nchw else (n, oh, ow, c)) and ob == c * oh * ow
        assert (y_size, x_size) == src.shape[1:3]
        it = src.itemsize
        x = np.lib.stride_tricks.as_strided(np.asarray(src), src.shape,
                                            (sn * it, sh * it, sw * it, sc * it))  # fmt: skip
        y = _emulate_direct(x, y_in, y_out, y_lo, y_off, oh, x_in, x_out, x_lo, x_off, ow, flip,
                            cubic, aa, round_mid, ab, mode)  # fmt: skip
        out[...] = np.ascontiguousarray(y.transpose(0, 3, 1, 2)) if nchw else y
        _FakeCupy.launches.append("d")

    return launch


def _at_address(ptr, dtype, shape, strides):
    """A numpy view of memory at address ``ptr`` (a fake device pointer: host memory)."""
    import ctypes

    it = np.dtype(dtype).itemsize
    lo = sum(min(0, (d - 1) * s) for d, s in zip(shape, strides)) * it
    hi = (sum(max(0, (d - 1) * s) for d, s in zip(shape, strides)) + 1) * it
    buf = (ctypes.c_uint8 * (hi - lo)).from_address(ptr + lo)
    base = np.frombuffer(buf, np.uint8)
    return np.lib.stride_tricks.as_strided(base[-lo:].view(dtype) if lo else base.view(dtype),
                                           shape, tuple(s * it for s in strides))  # fmt: skip


def _fake_direct_items(src_dtype):
    def launch(grid, block, args):
        table, c, y_out, oh, x_out, ow, cubic, aa, round_mid, *rest = args
        ab, (nchw, mode, out, ob, tab, inl) = rest[:8], rest[8:]
        assert len(args) == 23 and isinstance(tab, np.void) and tab.dtype == CM._TABLE
        assert isinstance(inl, np.int32) and int(inl) in (0, 1)
        if inl:  # the items in the launch's own table, table its byte offset there
            assert isinstance(table, np.uint64) and int(table) % 8 == 0
            words = np.frombuffer(tab.tobytes(), np.int64)
            at = int(table) // 8
            table = words[at : at + 14 * int(grid[2])].reshape(-1, 14)
        else:
            assert tab.tobytes() == D.NO_TABLE.tobytes()
        assert table.dtype == np.int64 and table.shape[1] == 14
        assert all(isinstance(v, np.int32) for v in (c, y_out, oh, x_out, ow, cubic, aa,
                                                     round_mid, nchw, mode))  # fmt: skip
        assert all(isinstance(v, np.float32) for v in ab) and isinstance(ob, np.int64)
        assert grid[2] == table.shape[0] and out.flags.c_contiguous
        flat = np.asarray(out).reshape(-1).view(np.uint8)
        for ptr, sn, sh, sw, sc, n, y_in, y_off, y_size, x_in, x_off, x_size, flip, off in \
                np.asarray(table).tolist():  # fmt: skip
            x = _at_address(ptr, src_dtype, (n, y_size, x_size, int(c)), (sn, sh, sw, sc))
            y = _emulate_direct(x, y_in, y_out, 0, y_off, oh, x_in, x_out, 0, x_off, ow, flip,
                                cubic, aa, round_mid, ab, mode)  # fmt: skip
            y = np.ascontiguousarray(y.transpose(0, 3, 1, 2) if nchw else y)
            assert ob == y[0].size
            flat[off : off + y.nbytes] = y.view(np.uint8).reshape(-1)
        _FakeCupy.launches.append("items")

    return launch


@pytest.fixture(params=["direct", "two_pass"])
def kernel_path(request, monkeypatch):
    """Each test of the kernels' glue on both paths: the one-pass kernel (``"d"``) where it
    fits, and the two passes (``"h"``, ``"v"``) it leaves the large filters to."""
    if request.param == "two_pass":
        monkeypatch.setattr(K, "_DIRECT_WORK", 0)
        return ["h", "v"]
    return ["d"]


@pytest.fixture
def fake_cupy(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy)
    monkeypatch.setattr(K, "_TABLES", {})
    monkeypatch.setattr(K, "_VECS", {})
    CM.clear_cache()
    _FakeCupy.launches = []
    yield _FakeCupy
    CM.clear_cache()


@pytest.mark.parametrize("interp,antialias", [("bilinear", True), ("bicubic", False)])
def test_launch_glue_with_emulated_kernels(fake_cupy, kernel_path, interp, antialias):
    x = _picture(3, 61, 83, c=4, seed=5)
    views = [x, x[::2, 3:50, ::-1, 2::-1], np.ascontiguousarray(x.transpose(0, 2, 1, 3))
             .transpose(0, 2, 1, 3), x.astype(np.float32)[:, ::-1], x.astype(np.float64)]  # fmt: skip
    for v in views:
        c = v.shape[3]
        m, sd = np.linspace(0.3, 0.6, c), np.linspace(0.2, 0.3, c)
        for dtype, layout, crop in [("float32", "NCHW", (40, 30)), ("float16", "NHWC", None),
                                    ("float32", "NHWC", 32)]:  # fmt: skip
            opts = dict(short_side=48, crop_size=crop, mean=m, std=sd, interpolation=interp,
                        antialias=antialias, dtype=dtype, layout=layout)  # fmt: skip
            ref = I.resize_crop_normalize(v, **opts)
            fake_cupy.launches = []
            a = (1 / 255 / sd).astype(np.float32)
            b = (-m / sd).astype(np.float32)
            mode = K.MODE_F16 if dtype == "float16" else K.MODE_F32
            oh, ow = I.resize_short_side_size(v.shape[1], v.shape[2], 48)
            ch, cw = (oh, ow) if crop is None else ((crop, crop) if isinstance(crop, int) else crop)
            top, left = int(round((oh - ch) / 2.0)), int(round((ow - cw) / 2.0))
            got = K.resample(
                v.view(_FakeArr),
                oh,
                ow,
                (top, top + ch),
                (left, left + cw),
                interp,
                antialias,
                mode=mode,
                nchw=layout == "NCHW",
                a=a,
                b=b,
            )
            assert fake_cupy.launches == kernel_path
            assert got.shape == ref.shape and got.dtype == ref.dtype
            d = np.abs(np.asarray(got, np.float32) - ref.astype(np.float32))
            assert d.max() <= (1e-4 if dtype == "float32" else 2e-3 * 3), d.max()
    # uint8 resize mode (rounded between the passes, as the numpy path)
    got = K.resample(x.view(_FakeArr), 30, 40, (0, 30), (0, 40), interp, antialias,
                     mode=K.MODE_U8, nchw=False)  # fmt: skip
    ref = I.resize(x, (30, 40), interpolation=interp, antialias=antialias)
    assert got.dtype == np.uint8 and np.abs(np.asarray(got, int) - ref).max() <= 1


# --- GPU tests ----------------------------------------------------------------------------------


# --- a window of the image (a decode-time crop) --------------------------------------------------

WINDOW_CASES = [  # (n, h, w, short_side, crop)
    (2, 375, 500, 224, 224),  # the benchmark's landscape pictures
    (1, 500, 375, 224, 224),  # portrait
    (1, 90, 131, 40, (36, 40)),  # small, odd, non-square crop
]


def _square_window(h, w, margin=0.02):
    from avpipe.decoding.image import square_window

    return square_window(h, w, margin)


@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.parametrize("case", range(len(WINDOW_CASES)))
def test_window_of_the_image_gives_the_whole_images_result(case, interp, antialias, fake_cupy,
                                                           kernel_path):  # fmt: skip
    n, h, w, short, crop = WINDOW_CASES[case]
    x = _picture(n, h, w, seed=case)
    top, left, ch, cw = _square_window(h, w)
    assert (ch, cw) != (h, w)  # a real crop
    part = x[:, top : top + ch, left : left + cw]
    opts = dict(short_side=short, crop_size=crop, interpolation=interp, antialias=antialias,
                dtype="float32")  # fmt: skip
    want = I.resize_crop_normalize(x, **opts)
    got = I.resize_crop_normalize(part, window=(top, left, h, w), **opts)  # the numpy path
    np.testing.assert_allclose(got, want, atol=1e-5)
    # the kernels' host logic (emulated): the shifted taps read the window only
    oh, ow = I.resize_short_side_size(h, w, short)
    kh, kw = (crop, crop) if isinstance(crop, int) else crop
    t, lf = int(round((oh - kh) / 2.0)), int(round((ow - kw) / 2.0))
    args = (oh, ow, (t, t + kh), (lf, lf + kw), interp, antialias)
    full = K.resample(x.view(_FakeArr), *args, mode=K.MODE_F32, nchw=True)
    win = K.resample(np.ascontiguousarray(part).view(_FakeArr), *args, mode=K.MODE_F32,
                     nchw=True, window=(top, left, h, w))  # fmt: skip
    np.testing.assert_allclose(np.asarray(win), np.asarray(full), atol=1e-5)


def test_window_errors():
    x = _picture(1, 375, 500)
    sq = x[:, :, 62:437]  # the bare square: the resize reads a column or two either side
    with pytest.raises(ValueError, match=r"window=\(0, 62, 375, 500\) does not hold .* columns 6"):
        I.resize_crop_normalize(sq, short_side=224, crop_size=224, window=(0, 62, 375, 500))
    with pytest.raises(ValueError, match="does not hold"):
        K.plan(375, 375, 224, 298, (0, 224), (37, 261), "bilinear", True, (0, 62, 375, 500))
    # without a crop the resize reads the whole image
    top, left, ch, cw = _square_window(375, 500)
    with pytest.raises(ValueError, match="does not hold"):
        I.resize_crop_normalize(x[:, :, left : left + cw], short_side=224, crop_size=None,
                                window=(0, left, 375, 500))  # fmt: skip
    # one window per image: accepted when they agree, refused when they differ
    top, left, ch, cw = _square_window(375, 500)
    two = np.concatenate([x, x])[:, :, left : left + cw]
    win = (0, left, 375, 500)
    np.testing.assert_array_equal(
        I.resize_crop_normalize(two, short_side=224, crop_size=224, window=[win, win]),
        I.resize_crop_normalize(two, short_side=224, crop_size=224, window=win),
    )
    with pytest.raises(ValueError, match="different windows"):
        I.resize_crop_normalize(two, short_side=224, crop_size=224,
                                window=[win, (0, left + 10, 375, 520)])  # fmt: skip
    with pytest.raises(ValueError, match="1 windows for 2 images"):
        I.resize_crop_normalize(two, short_side=224, crop_size=224, window=[win])
    for bad in [(0, 0, 10, 10), (-1, 0, 375, 500), (0, 200, 375, 500), (0, 0, 375), "abc",
                (0.5, 0, 375, 500)]:  # fmt: skip
        with pytest.raises(ValueError, match="window"):
            I.resize_crop_normalize(sq, short_side=224, crop_size=224, window=bad)


def _check(g, c, dtype):
    import cupy

    assert isinstance(g, cupy.ndarray) and g.shape == c.shape and g.dtype == c.dtype
    assert g.flags.c_contiguous
    gf, cf = cupy.asnumpy(g).astype(np.float32), c.astype(np.float32)
    d = np.abs(gf - cf)
    if dtype == "float32":
        assert d.max() <= 1e-3, d.max()
    else:
        assert np.all(d <= 2e-3 * np.maximum(1.0, np.abs(cf))), d.max()


def _kernels_available():
    import cupy

    assert K._kernels(int(cupy.cuda.runtime.getDevice())) is not None, "kernels did not compile"


@pytest.mark.gpu
def test_gpu_flip_matches_numpy(monkeypatch):
    import cupy

    monkeypatch.delenv("AVPIPE_IMAGE_KERNELS", raising=False)
    _kernels_available()
    x = _picture(3, 97, 131, seed=9)
    for dtype, layout in (("float32", "NCHW"), ("float16", "NHWC")):
        for crop in (None, 40):
            opts = dict(short_side=56, crop_size=crop, dtype=dtype, layout=layout, flip=True)
            _check(I.resize_crop_normalize(cupy.asarray(x), **opts),
                   I.resize_crop_normalize(x, **opts), dtype)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gpu_kernels_match_numpy(case, interp, antialias, monkeypatch):
    import cupy

    monkeypatch.delenv("AVPIPE_IMAGE_KERNELS", raising=False)
    _kernels_available()
    shape, kw, crop = CASES[case]
    x = _picture(*shape) if len(shape) == 4 else _picture(1, *shape, seed=case)[0]
    gx = cupy.asarray(x)
    for dtype, layout in [("float32", "NCHW"), ("float32", "NHWC"), ("float16", "NCHW"),
                          ("float16", "NHWC")]:  # fmt: skip
        opts = dict(kw, crop_size=crop, interpolation=interp, antialias=antialias, dtype=dtype,
                    layout=layout)  # fmt: skip
        _check(I.resize_crop_normalize(gx, **opts), I.resize_crop_normalize(x, **opts), dtype)
        # float input takes the float32 kernel
        xf = x.astype(np.float32)
        _check(I.resize_crop_normalize(cupy.asarray(xf), **opts),
               I.resize_crop_normalize(xf, **opts), dtype)  # fmt: skip


@pytest.mark.gpu
def test_gpu_benchmark_batch_and_single_image(monkeypatch):
    import cupy

    monkeypatch.delenv("AVPIPE_IMAGE_KERNELS", raising=False)
    _kernels_available()
    x = _picture(128, 375, 500, seed=3)
    gx = cupy.asarray(x)
    for dtype in ("float16", "float32"):
        opts = dict(short_side=224, crop_size=224, dtype=dtype, layout="NCHW")
        g = I.resize_crop_normalize(gx, **opts)
        assert g.shape == (128, 3, 224, 224)
        _check(g, I.resize_crop_normalize(x, **opts), dtype)
    one = I.resize_crop_normalize(gx[5], dtype="float32")
    assert one.shape == (3, 224, 224)
    _check(one, I.resize_crop_normalize(x[5], dtype="float32"), "float32")
    # the kernels and the cuBLAS path agree too
    monkeypatch.setenv("AVPIPE_IMAGE_KERNELS", "0")
    old = I.resize_crop_normalize(gx[:8], dtype="float32")
    monkeypatch.setenv("AVPIPE_IMAGE_KERNELS", "1")
    new = I.resize_crop_normalize(gx[:8], dtype="float32")
    assert float(cupy.abs(old - new).max()) <= 1e-3


@pytest.mark.gpu
def test_gpu_non_contiguous_input(monkeypatch):
    import cupy

    monkeypatch.delenv("AVPIPE_IMAGE_KERNELS", raising=False)
    _kernels_available()
    big = _picture(4, 120, 170, c=4, seed=7)
    gbig = cupy.asarray(big)
    views = [
        (gbig[::2, 10:110, 5:160, :3], big[::2, 10:110, 5:160, :3]),  # strided batch, crop, RGBA->RGB
        (gbig[:, ::-1, ::2, 2::-1], big[:, ::-1, ::2, 2::-1]),  # negative and step-2 strides
        (cupy.asarray(np.ascontiguousarray(big[..., :3].transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3),
         big[..., :3]),  # channel-last but W-major memory
    ]  # fmt: skip
    for g, c in views:
        assert not g.flags.c_contiguous
        for dtype in ("float32", "float16"):
            opts = dict(short_side=64, crop_size=(60, 50), dtype=dtype, layout="NHWC",
                        interpolation="bicubic")  # fmt: skip
            _check(I.resize_crop_normalize(g, **opts), I.resize_crop_normalize(c, **opts), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [True, False])
def test_gpu_resize_kernels_match_numpy(interp, antialias, monkeypatch):
    import cupy

    monkeypatch.delenv("AVPIPE_IMAGE_KERNELS", raising=False)
    _kernels_available()
    x = _picture(3, 375, 500, seed=11)
    sizes = [dict(short_side=224), dict(size=(400, 333)), dict(size=(375, 250))]
    for kw in sizes:
        g = I.resize(cupy.asarray(x), interpolation=interp, antialias=antialias, **kw)
        c = I.resize(x, interpolation=interp, antialias=antialias, **kw)
        assert g.shape == c.shape and g.dtype == np.uint8 and g.flags.c_contiguous
        d = np.abs(cupy.asnumpy(g).astype(int) - c)
        assert d.max() <= 2 and d.mean() < 0.01
        gf = I.resize(cupy.asarray(x, dtype=cupy.float32), interpolation=interp,
                      antialias=antialias, **kw)  # fmt: skip
        cf = I.resize(x.astype(np.float32), interpolation=interp, antialias=antialias, **kw)
        assert gf.dtype == np.float32 and np.abs(cupy.asnumpy(gf) - cf).max() <= 1e-3
    single = I.resize(cupy.asarray(x[0]), (100, 130), interpolation=interp, antialias=antialias)
    assert single.shape == (100, 130, 3)


@pytest.mark.gpu
def test_gpu_compile_failure_falls_back(monkeypatch, caplog):
    import cupy

    x = _picture(2, 60, 80)
    broken = CudaModule(K.__file__, "_resize_kernels.cu", table=True, fallback="image resize",
                        names=K._KERNELS.names, prelude="#error deliberately broken\n")
    monkeypatch.setattr(K, "_KERNELS", broken)
    CM.clear_cache()
    try:
        with caplog.at_level("WARNING", logger="avpipe"):
            g = I.resize_crop_normalize(cupy.asarray(x), short_side=32, crop_size=32,
                                        dtype="float32")  # fmt: skip
        assert "failed to compile" in caplog.text
        _check(g, I.resize_crop_normalize(x, short_side=32, crop_size=32, dtype="float32"),
               "float32")  # fmt: skip
    finally:
        CM.clear_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("interp,antialias", [("bilinear", True), ("bicubic", False)])
def test_gpu_window_of_the_image_matches_numpy(interp, antialias, monkeypatch):
    import cupy

    monkeypatch.delenv("AVPIPE_IMAGE_KERNELS", raising=False)
    _kernels_available()
    for case, (n, h, w, short, crop) in enumerate(WINDOW_CASES):
        x = _picture(n, h, w, seed=case)
        top, left, ch, cw = _square_window(h, w)
        part = cupy.asarray(x[:, top : top + ch, left : left + cw])
        for dtype in ("float32", "float16"):
            opts = dict(short_side=short, crop_size=crop, interpolation=interp,
                        antialias=antialias, dtype=dtype)  # fmt: skip
            got = I.resize_crop_normalize(part, window=(top, left, h, w), **opts)
            _check(got, I.resize_crop_normalize(x, **opts), dtype)



def test_flip_is_the_mirrored_result():
    """numpy: ``flip=True`` is the unflipped result mirrored along its width, bit for bit."""
    x = _picture(2, 61, 83, seed=3)
    for layout, axis in (("NCHW", -1), ("NHWC", -2)):
        for crop in (None, (40, 30)):
            opts = dict(short_side=48, crop_size=crop, dtype="float32", layout=layout)
            ref = np.flip(I.resize_crop_normalize(x, **opts), axis=axis)
            got = I.resize_crop_normalize(x, flip=True, **opts)
            assert got.flags.c_contiguous and np.array_equal(got, ref)


@pytest.mark.parametrize("window", [None, (10, 20, 81, 123)])
def test_flip_folded_into_the_kernel_tables(fake_cupy, kernel_path, window):
    """The kernels' flip is the horizontal taps in reverse order: the emulated launches give
    the numpy ``flip=True`` result (no extra pass)."""
    x = _picture(2, 61, 83, seed=4)
    full_h, full_w = (61, 83) if window is None else window[2:]
    m, sd = np.array([0.4, 0.5, 0.45]), np.array([0.2, 0.25, 0.3])
    for layout, crop in (("NCHW", (30, 26)), ("NHWC", None if window is None else 30)):
        opts = dict(short_side=48, crop_size=crop, mean=m, std=sd, dtype="float32",
                    layout=layout, window=window)  # fmt: skip
        ref = I.resize_crop_normalize(x, flip=True, **opts)
        oh, ow = I.resize_short_side_size(full_h, full_w, 48)
        ch, cw = (oh, ow) if crop is None else I._hw(crop, "crop_size")
        top, left = int(round((oh - ch) / 2.0)), int(round((ow - cw) / 2.0))
        fake_cupy.launches = []
        got = K.resample(x.view(_FakeArr), oh, ow, (top, top + ch), (left, left + cw),
                         "bilinear", True, mode=K.MODE_F32, nchw=layout == "NCHW",
                         a=(1 / 255 / sd).astype(np.float32), b=(-m / sd).astype(np.float32),
                         window=window, flip=True)  # fmt: skip
        assert fake_cupy.launches == kernel_path
        assert got.shape == ref.shape
        assert np.abs(np.asarray(got, np.float32) - ref).max() <= 1e-4
        unflipped = I.resize_crop_normalize(x, **opts)
        assert np.abs(np.asarray(got, np.float32) - unflipped).max() > 0.1  # it did mirror
    p = K.plan(61, 83, 10, 20, (0, 10), (3, 17), "bilinear", True, None, True)
    q = K.plan(61, 83, 10, 20, (0, 10), (3, 17), "bilinear", True)
    assert np.array_equal(p.x.table, q.x.table[::-1])
    assert np.array_equal(p.x.weights, q.x.weights[::-1]) and p.y == q.y


def test_a_plans_tables_go_up_in_one_copy(fake_cupy, monkeypatch):
    """A new plan (a random resized crop makes one per clip) costs one host->device copy: the
    four tables are views of one buffer, equal to the host tables."""
    copies = _FakeArr.copies
    for h, w, interp, aa in ((300, 520, "bilinear", True), (91, 67, "bicubic", False)):
        p = K.plan(h, w, 224, 224, (0, 224), (0, 224), interp, aa)
        copies.clear()
        tabs = K._device_tables(_FakeCupy, p, 0)
        assert len(copies) == 1 and len(copies[0]) == 1  # one flat buffer
        host = (p.x.table, p.x.weights, p.y.table, p.y.weights)
        for d, ref in zip(tabs, host):
            assert d.dtype == ref.dtype and d.shape == ref.shape and d.flags.c_contiguous
            assert np.asarray(d).tobytes() == ref.tobytes()
        again = K._device_tables(_FakeCupy, p, 0)  # cached: the same arrays, no copy
        assert all(a is b for a, b in zip(again, tabs)) and len(copies) == 1


def test_device_tables_are_cached_per_axis(fake_cupy):
    """A new crop size along one axis copies only that axis's tables up (a random resized crop
    makes a new 2-D plan per clip, but the sizes along each axis repeat)."""
    copies = _FakeArr.copies
    p = K.plan(200, 300, 224, 224, (0, 224), (0, 224), "bilinear", True)
    tabs = K._device_tables(_FakeCupy, p, 0)
    q = K.plan(150, 300, 224, 224, (0, 224), (0, 224), "bilinear", True)  # same width
    copies.clear()
    got = K._device_tables(_FakeCupy, q, 0)
    assert got[0] is tabs[0] and got[1] is tabs[1]  # the x axis as cached
    assert got[2] is not tabs[2] and len(copies) == 1
    assert np.asarray(got[2]).tobytes() == q.y.table.tobytes()
    assert np.asarray(got[3]).tobytes() == q.y.weights.tobytes()


def test_device_tables_of_a_square_crop_keep_each_axis_role(fake_cupy):
    """Both axes of a square crop have the same taps, but the vertical table's starts are
    relative to its first row: each axis gets its own table from the cache."""
    p = K.plan(64, 64, 32, 32, (10, 20), (10, 20), "bilinear", True)
    assert p.y.table[0, 0] == 0 and p.x.table[0, 0] > 0 and p.row0 == p.x.table[0, 0]
    for _ in range(2):  # cold, then cached
        xt, xw, yt, yw = K._device_tables(_FakeCupy, p, 0)
        assert np.array_equal(np.asarray(xt), p.x.table)
        assert np.array_equal(np.asarray(yt), p.y.table)


# --- the one-pass kernel's taps, compiled as C++ ------------------------------------------------

_TAPS_PRELUDE = r"""
#include <math.h>
#define __device__
#define __forceinline__ inline
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
"""

_TAPS_LAUNCHER = r"""
extern "C" int taps(int in_size, int out_size, int i, int cubic, int aa, int* first, float* w) {
    return avp_taps(in_size, out_size, i, cubic, aa, first, w);
}
extern "C" int tap_index(int first, int j, int n, int in_size) {
    return avp_tap_index(first, j, n, in_size);
}
"""


@pytest.fixture(scope="module")
def taps_lib(tmp_path_factory):
    from cpp_kernels import build

    src = K._KERNELS.source
    body = src[src.index("#define AVP_MAXTAP") : src.index("// The input row / column of a tap")]
    return build(_TAPS_PRELUDE + body + _TAPS_LAUNCHER, tmp_path_factory.mktemp("image_taps"),
                 flags=("-ffp-contract=off",))  # fmt: skip


@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [True, False])
def test_direct_kernel_taps_are_numpys(taps_lib, interp, antialias):
    """avp_taps (the one-pass kernel's weights, computed per output pixel) gives
    ``axis_weights``' taps bit for bit: the same indices (clamped as torch's filters clamp) and
    float32 weights, numpy's zero-weight padding aside. Sizes from 1 to 1000, up and down,
    including downscales whose taps reach 16 (PIL's sums of 8 and more, pairwise)."""
    import ctypes

    sizes = [(1, 1), (1, 7), (7, 1), (5, 224), (224, 224), (360, 224), (640, 224), (225, 224),
             (1000, 224), (900, 130), (37, 53), (53, 37), (1000, 999), (3, 1000)]  # fmt: skip
    first = ctypes.c_int()
    w = (ctypes.c_float * K.MAX_DIRECT_TAPS)()
    checked = 0
    for size_in, size_out in sizes:
        if K.axis_taps_bound(size_in, size_out, interp, antialias) > K.MAX_DIRECT_TAPS:
            continue
        idx, ref = R.axis_weights(size_in, size_out, interp, antialias)
        for i in range(size_out):
            n = taps_lib.taps(size_in, size_out, i, interp == "bicubic", antialias,
                              ctypes.byref(first), w)  # fmt: skip
            k = abs(n)
            got_idx = [taps_lib.tap_index(first.value, j, n, size_in) for j in range(k)]
            got_w = np.array(w[:k], np.float32)
            assert got_idx == list(idx[i, :k]), (size_in, size_out, i)
            np.testing.assert_array_equal(got_w, ref[i, :k])  # bit for bit
            assert not np.any(ref[i, k:])  # numpy's padding: zero weights
            assert k <= K.axis_taps_bound(size_in, size_out, interp, antialias)
            checked += 1
    assert checked > 2000


def test_box_is_the_crop_resized(fake_cupy, kernel_path):
    """``resize_crop_normalize(box=...)`` is ``crop`` then the resize (numpy, bit for bit), and
    the kernels read the box in place (the emulated launches: no view, the same values)."""
    x = _picture(2, 61, 83, seed=6)
    m, sd = np.array([0.4, 0.5, 0.45]), np.array([0.2, 0.25, 0.3])
    for box, flip in (((3, 5, 40, 70), False), ((0, 0, 61, 83), True), ((20, 60, 9, 23), True)):
        opts = dict(size=(40, 48), short_side=None, crop_size=None, mean=m, std=sd,
                    dtype="float32", flip=flip)  # fmt: skip
        ref = I.resize_crop_normalize(I.crop(x, *box), **opts)
        assert np.array_equal(I.resize_crop_normalize(x, box=box, **opts), ref)
        fake_cupy.launches = []
        got = K.resample(x.view(_FakeArr), 40, 48, (0, 40), (0, 48), "bilinear", True,
                         mode=K.MODE_F32, nchw=True, a=(1 / 255 / sd).astype(np.float32),
                         b=(-m / sd).astype(np.float32), box=box, flip=flip)  # fmt: skip
        assert fake_cupy.launches == kernel_path
        assert np.abs(np.asarray(got, np.float32) - ref).max() <= 1e-4
    for bad in [(0, 0, 62, 10), (-1, 0, 5, 5), (0, 80, 5, 5), (0, 0, 0, 5), (0, 0, 5), "abc",
                (0.5, 0, 5, 5)]:  # fmt: skip
        with pytest.raises(ValueError, match="box|crop"):
            I.resize_crop_normalize(x, box=bad, size=8, short_side=None, crop_size=None)
    with pytest.raises(ValueError, match="not both"):
        I.resize_crop_normalize(x, box=(0, 0, 5, 5), window=(0, 0, 61, 83), short_side=8)


def test_direct_kernel_takes_small_filters_only():
    """The one-pass kernel reads every row's taps for each pixel: it takes resizes with few
    taps per pixel (a clip's crop to 224), and leaves large downscales to the two passes."""
    assert K.direct_fits(360, 224, 640, 224, "bilinear", True, 3)
    assert K.direct_fits(1080, 224, 1920, 398, "bilinear", False, 3)  # torch's: 2 taps
    assert not K.direct_fits(1080, 224, 1920, 398, "bilinear", True, 3)  # 11 x 11 taps
    assert not K.direct_fits(360, 224, 640, 224, "bilinear", True, 5)  # 5 channels
    # torch's 2 taps, but a tile's 16 rows read rows 67 apart: more than its shared memory
    assert not K.direct_fits(1080, 16, 100, 100, "bilinear", False, 3)
    assert K.direct_fits(1080, 120, 100, 100, "bilinear", False, 3)
    assert not K.direct_fits(0, 224, 640, 224, "bilinear", True, 3)  # an empty axis
    assert K.axis_taps_bound(640, 224, "bilinear", True) == 7
    assert K.axis_taps_bound(640, 224, "bicubic", True) == 13


@pytest.mark.gpu
@pytest.mark.parametrize("interp,antialias", [("bilinear", True), ("bicubic", True),
                                               ("bilinear", False), ("bicubic", False)])  # fmt: skip
def test_gpu_direct_kernel_matches_two_passes_and_numpy(interp, antialias, monkeypatch):
    """The one-pass kernel against the numpy path and the two passes on the same input: a
    clip's random crops (box, flip) to 224 in float16 / float32, and a uint8 resize."""
    import cupy

    monkeypatch.delenv("AVPIPE_IMAGE_KERNELS", raising=False)
    _kernels_available()
    x = _picture(4, 360, 640, seed=12)
    gx = cupy.asarray(x)
    cases = [dict(box=(10, 30, 300, 400), flip=False), dict(box=(0, 0, 360, 640), flip=True),
             dict(box=(200, 500, 60, 90), flip=True)]  # fmt: skip
    monkeypatch.setattr(K, "_DIRECT_WORK", K.MAX_DIRECT_TAPS**2)  # bicubic's 13 x 9 taps too
    for kw in cases:
        assert K.direct_fits(kw["box"][2], 224, kw["box"][3], 224, interp, antialias, 3)
        for dtype in ("float16", "float32"):
            opts = dict(kw, size=(224, 224), short_side=None, crop_size=None, dtype=dtype,
                        interpolation=interp, antialias=antialias)  # fmt: skip
            one = I.resize_crop_normalize(gx, **opts)
            _check(one, I.resize_crop_normalize(x, **opts), dtype)
            work, K._DIRECT_WORK = K._DIRECT_WORK, 0  # the two passes
            try:
                two = I.resize_crop_normalize(gx, **opts)
            finally:
                K._DIRECT_WORK = work
            d = cupy.abs(one.astype(cupy.float32) - two.astype(cupy.float32))
            assert float(d.max()) <= (1e-5 if dtype == "float32" else 2e-3 * 3)
    g8 = I.resize(gx, (200, 300), interpolation=interp, antialias=antialias)
    c8 = I.resize(x, (200, 300), interpolation=interp, antialias=antialias)
    d = np.abs(cupy.asnumpy(g8).astype(int) - c8)
    assert d.max() <= 2 and d.mean() < 0.01


def test_boxes_of_clips_of_any_size_in_one_launch(fake_cupy):
    """``resample_boxes``: clips of different sizes and strides, each with its box and flip,
    in one launch of the items kernel (emulated), equal the numpy reference: the recipe's
    folded path over a list of clips (``fused_resized_crop_normalize``), one clip at a time."""
    from avpipe.ops import image_augment as A

    big = _picture(3, 61, 83, seed=8)
    clips = [big, _picture(3, 40, 52, seed=9), big[:, 5:50, ::2]]  # the last one strided
    params = {"top": np.array([3, 0, 10]), "left": np.array([5, 10, 2]),
              "height": np.array([50, 40, 30]), "width": np.array([70, 30, 35]),
              "flip": np.array([False, True, True])}  # fmt: skip
    m, sd = np.array([0.4, 0.5, 0.45]), np.array([0.2, 0.25, 0.3])
    for dtype, layout in (("float16", "NCHW"), ("float32", "NHWC")):
        opts = dict(mean=m, std=sd, dtype=dtype, layout=layout)
        ref = A.fused_resized_crop_normalize(clips, params, (40, 48), **opts)  # numpy
        for b, c in enumerate(clips):  # one resize_crop_normalize per clip
            box = tuple(int(params[k][b]) for k in ("top", "left", "height", "width"))
            one = I.resize_crop_normalize(c, box=box, flip=bool(params["flip"][b]),
                                          size=(40, 48), short_side=None, crop_size=None,
                                          **opts)  # fmt: skip
            assert np.array_equal(ref[b], one)
        fake_cupy.launches = []
        a, b_ = I._affine(m, sd, 1 / 255, 3)
        boxes = list(zip(*(params[k].tolist() for k in ("top", "left", "height", "width"))))
        got = K.resample_boxes([c.view(_FakeArr) for c in clips], boxes, params["flip"], 40, 48,
                               "bilinear", True, nchw=layout == "NCHW", a=a, b=b_,
                               mode=K.MODE_F16 if dtype == "float16" else K.MODE_F32)  # fmt: skip
        assert fake_cupy.launches == ["items"]
        assert got.shape == ref.shape and got.dtype == ref.dtype
        d = np.abs(np.asarray(got, np.float32) - ref.astype(np.float32))
        assert d.max() <= (1e-4 if dtype == "float32" else 2e-3 * 3), d.max()
    # a box the one-pass kernel leaves to the two passes: None (the caller goes clip by clip)
    assert K.resample_boxes([big.view(_FakeArr)], [(0, 0, 61, 83)], [False], 4, 4, "bilinear",
                            True, nchw=True, mode=K.MODE_F32) is None  # fmt: skip


def test_boxes_of_a_batch_in_one_launch(fake_cupy):
    """``resample_boxes`` over one ``[B, T, H, W, C]`` array (the clip chain's resized crop:
    each item's address from the batch's, no view of it), any strides: uint8 rounded once
    (``round_mid=False``) equals ``apply_resized_crop``'s numpy reference within a level,
    float32 within float rounding, and a flip mirrors the columns."""
    from avpipe.ops import image_augment as A

    x = np.stack([_picture(3, 45, 80, seed=s) for s in range(4)])  # [4, 3, 45, 80, 3]
    p = A.sample_resized_crop_params(7, 0, np.arange(4), 45, 80)
    boxes = list(zip(*(p[k].tolist() for k in ("top", "left", "height", "width"))))
    flips = [False, True, False, True]
    for v in (x, np.moveaxis(np.ascontiguousarray(np.moveaxis(x, -1, 2)), 2, -1)):  # strided
        for mode, dtype in ((K.MODE_U8, None), (K.MODE_F32, "float32")):
            ref = A.apply_resized_crop(x, p, (24, 30), dtype=dtype)
            fake_cupy.launches = []
            got = K.resample_boxes(v.view(_FakeArr), boxes, flips, 24, 30, "bilinear", True,
                                   mode=mode, nchw=False, round_mid=False)  # fmt: skip
            assert fake_cupy.launches == ["items"]
            assert got.shape == ref.shape == (4, 3, 24, 30, 3) and got.dtype == ref.dtype
            got = np.asarray(got)
            got[1::2] = got[1::2, :, :, ::-1]  # the flipped items mirrored back
            d = np.abs(got.astype(np.float32) - ref.astype(np.float32))
            assert d.max() <= (1 if mode == K.MODE_U8 else 1e-3), d.max()


def test_boxes_need_one_box_and_one_flip_a_clip(fake_cupy):
    """A table of items with fewer boxes or flips than clips is refused with the counts named,
    never built short (a clip left out of the table would come back as uninitialised memory)."""
    x = np.stack([_picture(2, 20, 30, seed=s) for s in range(3)]).view(_FakeArr)
    boxes = [(0, 0, 20, 30)] * 3
    with pytest.raises(ValueError, match="3 clips, 2 boxes and 3 flips"):
        K.box_items(x, boxes[:2], [False] * 3, 10, 10, "bilinear", True, mode=K.MODE_U8)
    with pytest.raises(ValueError, match="3 clips, 3 boxes and 4 flips"):
        K.box_items(x, boxes, [False] * 4, 10, 10, "bilinear", True, mode=K.MODE_U8)
    assert K.box_items(x, boxes, [False] * 3, 10, 10, "bilinear", True, mode=K.MODE_U8) is not None
