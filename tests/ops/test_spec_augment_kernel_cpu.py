"""The SpecAugment kernels (``avpipe/ops/_spec_augment.cu``: the draws and the masks),
compiled as plain C++ and run here on the CPU, equal their numpy references
(``sample_spec_augment_params`` and ``apply_spec_augment`` on numpy) exactly; the same source
compiles for the GPU with nvcc where it is installed. The GPU tests (test_augment_audio.py) run
them through NVRTC."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cpp_kernels import THREADS_PRELUDE, TablesOn, build, ptx

from avpipe import device as D
from avpipe.device import cuda_modules as CM
from avpipe.device import transfers as T
from avpipe.ops import _spec_augment as S
from avpipe.ops import audio_augment as A
from avpipe.ops import random as R

PRELUDE = r"""
#include <math.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads()
struct Dim3 { unsigned x, y, z; };
static Dim3 threadIdx, blockIdx, blockDim, gridDim;
"""

LAUNCHER = r"""
extern "C" void run(long long total, const float* x, float* out, const long long* lens,
        const long long* p, long long ld, int kf, int kt, long long F, long long T, float value) {
    blockDim.x = 1; threadIdx.x = 0;
    for (long long t = 0; t < total; ++t) { blockIdx.x = (unsigned)t;
        avpipe_spec_augment(x, out, lens, p, p + kf, p + 2 * kf, p + 2 * kf + kt, ld, kf, kt,
                            F, T, total, value); }
}
extern "C" void draw(const long long* ids, const long long* lens, long long B, int kf, int kt,
        long long n_mels, long long fcap, double time_width, int frac, double adaptive,
        unsigned fk0, unsigned fk1, unsigned tk0, unsigned tk1, unsigned epoch, long long* p,
        long long ld, long long* lens_out, const AvpTable* tab, int inl) {
    blockDim.x = 1; threadIdx.x = 0;
    for (long long b = 0; b < B; ++b) { blockIdx.x = (unsigned)b;
        avpipe_spec_augment_draw(ids, lens, B, kf, kt, n_mels, fcap, time_width, frac, adaptive,
                                 fk0, fk1, tk0, tk1, epoch, p, ld, lens_out, *tab, inl); }
}
extern "C" void fused(unsigned gy, unsigned gz, const float* x, float* out, int copy,
        const long long* ids, const long long* lens, long long B, int kf, int kt,
        long long n_mels, long long fcap, double time_width, int frac, double adaptive,
        unsigned fk0, unsigned fk1, unsigned tk0, unsigned tk1, unsigned epoch, long long T,
        float value, const AvpTable* tab, int inl) {
    // one thread a block (its loops over the masks and the frames take every index); the
    // blocks one after another
    gridDim = {1, gy, gz}; blockDim = {1, 1, 1}; threadIdx = {0, 0, 0};
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) { blockIdx = {0, y, z};
        avpipe_spec_augment_fused(x, out, copy, ids, lens, B, kf, kt, n_mels, fcap, time_width,
                                  frac, adaptive, fk0, fk1, tk0, tk1, epoch, T, value, *tab,
                                  inl); }
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    with open(S.KERNEL_FILE) as f:
        source = PRELUDE + D.TABLE_CUDA + R.PHILOX_FUNCTION + f.read() + LAUNCHER
    return build(source, tmp_path_factory.mktemp("spec_kernel"))


def _p(a):
    return ctypes.c_void_p(a.ctypes.data)



def _c(v):
    """A numpy scalar as the ctypes value of its C type."""
    return {np.int32: ctypes.c_int, np.int64: ctypes.c_longlong, np.uint32: ctypes.c_uint,
            np.float64: ctypes.c_double}[type(v)](v.item())


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
    table = S.spec_augment_table(p)
    assert table.shape == (B, 2 * 2 + 2 * 5) and table.dtype == np.int64
    out = np.full_like(x, np.nan)
    lib.run(ctypes.c_longlong(x.size), _p(x), _p(out), _p(lens), _p(table),
            ctypes.c_longlong(table.shape[1]), ctypes.c_int(2), ctypes.c_int(5),
            ctypes.c_longlong(F), ctypes.c_longlong(T), ctypes.c_float(value))
    np.testing.assert_array_equal(out, ref)
    assert (out != x).any()  # some cells were masked
    np.testing.assert_array_equal(out[4], x[4])  # an empty item is untouched


@pytest.mark.parametrize("kf,kt,time_width,adaptive,n_mels,fwidth", [
    (2, 10, 0.05, None, 80, 27),
    (1, 5, 0.2, 0.05, 40, 12),
    (3, 7, 25, None, 64, 100),  # widths in frames; the frequency cap above n_mels
    (0, 4, 0.5, 0.01, 80, 27),
    (2, 0, 0.05, None, 80, 27),
])
def test_draw_kernel_equals_the_sampler(lib, kf, kt, time_width, adaptive, n_mels, fwidth):
    ids = np.array([0, 1, 7, 2**32 - 1, 2**32 + 5, 2**40 + 3, 123456789, 42], np.int64)
    lens = np.array([1600, 0, 1, 19, 20, 21, 999, 5], np.int64)
    for seed, epoch in ((0, 0), (2**63 + 11, 2**32 + 3), (17, 5)):
        want = A.sample_spec_augment_params(seed, epoch, ids, lens, n_mels, freq_masks=kf,
                                            freq_width=fwidth, time_masks=kt,
                                            time_width=time_width,
                                            adaptive_time_masks=adaptive)  # fmt: skip
        ld = 2 * kf + 2 * kt
        got = np.full((len(ids), ld), -99, np.int64)
        # the arguments as the GPU path builds them
        checked = A._spec_settings(n_mels, kf, fwidth, kt, time_width, adaptive)
        scalars = S.draw_scalars(seed, epoch, n_mels, *checked, "spec_augment")
        lib.draw(_p(ids), _p(lens), ctypes.c_longlong(len(ids)), *map(_c, scalars), _p(got),
                 ctypes.c_longlong(ld), None, _p(np.zeros(D.TABLE_BYTES // 8, np.int64)),
                 ctypes.c_int(0))  # fmt: skip
        np.testing.assert_array_equal(got, S.spec_augment_table(want))
        # ids and lengths in the launch's own table (as launch_table packs them: from byte 8
        # on), the lengths written back to the device for the masks: the same draws
        table, (at_ids, at_lens) = D.launch_table(TablesOn, [ids, lens])
        tab = np.frombuffer(table.tobytes(), np.int64).copy()
        got2, lens_out = np.full_like(got, -99), np.full(len(ids), -1, np.int64)
        lib.draw(ctypes.c_void_p(int(at_ids)), ctypes.c_void_p(int(at_lens)), ctypes.c_longlong(len(ids)),
                 *map(_c, scalars), _p(got2), ctypes.c_longlong(ld), _p(lens_out), _p(tab),
                 ctypes.c_int(1))  # fmt: skip
        np.testing.assert_array_equal(got2, got)
        np.testing.assert_array_equal(lens_out, lens)
        if kt:
            assert want["time_width"].any()  # a draw that could differ


@pytest.mark.parametrize("mode", ["copy", "inplace", "inplace_table"])
@pytest.mark.parametrize("grid", ["full", "strided"])
@pytest.mark.parametrize("kf,kt,time_width,adaptive,fwidth", [
    (2, 10, 0.05, None, 27),
    (1, 5, 0.2, 0.05, 12),
    (3, 7, 25, None, 100),
    (0, 4, 0.5, None, 27),
])
def test_fused_kernel_equals_the_sampler_and_the_masks(lib, kf, kt, time_width, adaptive,
                                                       fwidth, mode, grid):
    """The one-launch kernel (draws into shared memory, then the masks) equals
    ``sample_spec_augment_params`` + ``apply_spec_augment`` exactly: writing every cell of
    another array, or only the masked cells of the features themselves; the ids and lengths
    in memory or in the launch's own table; over the full grid or a smaller one (the rows and
    items in strides)."""
    rng = np.random.default_rng(11)
    B, F, T = 7, 40, 90
    x = rng.standard_normal((B, F, T)).astype(np.float32)
    ids = np.array([0, 1, 2**32 + 5, 77, 9, 2**40, 3], np.int64)
    lens = np.array([90, 61, 1, 0, 12, 90, 40], np.int64)
    seed, epoch, value = 2**63 + 5, 3, -2.5
    want = A.sample_spec_augment_params(seed, epoch, ids, lens, F, freq_masks=kf,
                                        freq_width=fwidth, time_masks=kt, time_width=time_width,
                                        adaptive_time_masks=adaptive)  # fmt: skip
    ref = A.apply_spec_augment(x, lens, want, mask_value=value)
    checked = A._spec_settings(F, kf, fwidth, kt, time_width, adaptive)
    scalars = S.draw_scalars(seed, epoch, F, *checked, "spec_augment")
    copy = mode == "copy"
    out = np.full_like(x, np.nan) if copy else x.copy()
    src = x if copy else out
    tab = np.zeros(D.TABLE_BYTES // 8, np.int64)
    pids, plens, inl = _p(ids), _p(lens), 0
    if mode == "inplace_table":
        table, (at_ids, at_lens) = D.launch_table(TablesOn, [ids, lens])
        tab = np.frombuffer(table.tobytes(), np.int64).copy()
        pids, plens, inl = ctypes.c_void_p(int(at_ids)), ctypes.c_void_p(int(at_lens)), 1
    gy, gz = (F, B) if grid == "full" else (3, 2)
    lib.fused(ctypes.c_uint(gy), ctypes.c_uint(gz), _p(src), _p(out), ctypes.c_int(copy), pids,
              plens, ctypes.c_longlong(B), *map(_c, scalars), ctypes.c_longlong(T),
              ctypes.c_float(value), _p(tab), ctypes.c_int(inl))  # fmt: skip
    np.testing.assert_array_equal(out, ref)
    assert (out != x).any()  # some cells were masked
    np.testing.assert_array_equal(out[3], x[3])  # an empty item is untouched


THREADED_LAUNCHER = r"""
struct FusedArgs {
    const float* x; float* out; int copy; const long long* ids; const long long* lens;
    long long B; int kf, kt; long long n_mels, fcap; double time_width; int frac;
    double adaptive; unsigned fk0, fk1, tk0, tk1, epoch; long long T; float value;
    unsigned tid;
};
static void* fused_thread(void* p) {
    const FusedArgs& a = *(const FusedArgs*)p;
    threadIdx = {a.tid, 0, 0};
    AvpTable tab = {};
    avpipe_spec_augment_fused(a.x, a.out, a.copy, a.ids, a.lens, a.B, a.kf, a.kt, a.n_mels,
                              a.fcap, a.time_width, a.frac, a.adaptive, a.fk0, a.fk1, a.tk0,
                              a.tk1, a.epoch, a.T, a.value, tab, 0);
    return nullptr;
}
// each block's `threads` threads run as real threads meeting at __syncthreads; the blocks
// (gy rows x gz items, fewer than the batch's: each block takes several in turn) one by one
extern "C" int fused_threads(unsigned threads, unsigned gy, unsigned gz, FusedArgs a) {
    gridDim = {1, gy, gz}; blockDim = {threads, 1, 1};
    if (pthread_barrier_init(&block_barrier, nullptr, threads)) return 1;
    FusedArgs args[256];
    pthread_t ids[256];
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) {
        blockIdx = {0, y, z};
        for (unsigned i = 0; i < threads; ++i) {
            args[i] = a; args[i].tid = i;
            if (pthread_create(&ids[i], nullptr, fused_thread, &args[i])) return 1;
        }
        for (unsigned i = 0; i < threads; ++i) pthread_join(ids[i], nullptr);
    }
    return pthread_barrier_destroy(&block_barrier);
}
"""


@pytest.mark.parametrize("threads", [3, 8])
def test_fused_kernel_with_real_threads_and_barriers(tmp_path, threads):
    """The one-launch kernel with several threads a block, run as real threads meeting at
    __syncthreads: more masks than threads (each thread draws several), blocks taking several
    rows and items in turn (the shared tables rewritten between rows), in place: equal to the
    sampler + masks exactly."""

    class Args(ctypes.Structure):
        _fields_ = [("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("copy", ctypes.c_int),
                    ("ids", ctypes.c_void_p), ("lens", ctypes.c_void_p),
                    ("B", ctypes.c_longlong), ("kf", ctypes.c_int), ("kt", ctypes.c_int),
                    ("n_mels", ctypes.c_longlong), ("fcap", ctypes.c_longlong),
                    ("time_width", ctypes.c_double), ("frac", ctypes.c_int),
                    ("adaptive", ctypes.c_double), ("fk0", ctypes.c_uint),
                    ("fk1", ctypes.c_uint), ("tk0", ctypes.c_uint), ("tk1", ctypes.c_uint),
                    ("epoch", ctypes.c_uint), ("T", ctypes.c_longlong),
                    ("value", ctypes.c_float), ("tid", ctypes.c_uint)]  # fmt: skip

    with open(S.KERNEL_FILE) as f:
        source = (THREADS_PRELUDE + D.TABLE_CUDA + R.PHILOX_FUNCTION + f.read()
                  + THREADED_LAUNCHER)  # fmt: skip
    lib = build(source, tmp_path, flags=("-pthread",))
    rng = np.random.default_rng(5)
    B, F, T, kf, kt = 5, 12, 37, 3, 9
    x = rng.standard_normal((B, F, T)).astype(np.float32)
    ids = np.array([4, 0, 2**33, 7, 1], np.int64)
    lens = np.array([37, 20, 0, 5, 36], np.int64)
    want = A.sample_spec_augment_params(9, 1, ids, lens, F, freq_masks=kf, freq_width=4,
                                        time_masks=kt, time_width=0.2)  # fmt: skip
    ref = A.apply_spec_augment(x, lens, want, mask_value=0.0)
    checked = A._spec_settings(F, kf, 4, kt, 0.2, None)
    sc = S.draw_scalars(9, 1, F, *checked, "spec_augment")
    out = x.copy()
    a = Args(out.ctypes.data, out.ctypes.data, 0, ids.ctypes.data, lens.ctypes.data, B,
             *[v.item() for v in sc], T, 0.0, 0)  # fmt: skip
    lib.fused_threads.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, Args]
    assert lib.fused_threads(threads, 5, 2, a) == 0  # the threads and barrier were made
    np.testing.assert_array_equal(out, ref)
    assert (out != x).any()


def test_fused_mask_limit_is_the_kernels():
    """The host's limit on the one-launch path is the kernel's shared-memory size."""
    import re

    with open(S.KERNEL_FILE) as f:
        m = re.search(r"#define AVPIPE_SPEC_MAX_MASKS (\d+)", f.read())
    assert m and int(m.group(1)) == S.SPEC_FUSED_MAX_MASKS


def test_kernel_compiles_for_the_gpu(tmp_path):
    with open(S.KERNEL_FILE) as f:
        text = ptx(D.TABLE_CUDA + R.PHILOX_FUNCTION + f.read(), tmp_path)
    assert "avpipe_spec_augment" in text and "avpipe_spec_augment_draw" in text
    fused = text.split(".entry avpipe_spec_augment_fused")[1].split(".entry")[0]
    assert ".shared" in text and "bar.sync" in fused


def test_draw_constants_keep_the_seed_check():
    """The draw kernel's constants are cached per run, but a bool or float seed is refused as
    the host draws refuse it, also after the int seed of the same value was used."""
    S.draw_scalars(1, 0, 80, 2, 27, 10, 0.05, None, "spec_augment")
    for bad in (True, 1.0):
        with pytest.raises(TypeError, match="seed must be an int"):
            S.draw_scalars(bad, 0, 80, 2, 27, 10, 0.05, None, "spec_augment")
    a = S.draw_scalars(1, 3, 80, 2, 27, 10, 0.05, None, "spec_augment")
    b = S.draw_scalars(np.int64(1), 3, 80, 2, 27, 10, 0.05, None, "spec_augment")
    assert [int(v) if not isinstance(v, np.floating) else float(v) for v in a] == \
        [int(v) if not isinstance(v, np.floating) else float(v) for v in b]  # fmt: skip
    assert int(a[-1]) == 3


def test_draws_on_a_device_send_ids_and_lengths_in_the_launch(lib, monkeypatch):
    """``spec_augment_draws`` with host ids and lengths on a device that reads launch
    tables: they travel in the draw kernel's table (no copy), the kernel writes the lengths to
    the device for the masks, and the table of masks equals the sampler's. Without tables
    (an older GPU): one copy of both, the kernel's lengths argument that copy."""

    class Arr(np.ndarray):  # a device array of the fake
        device = type("Device", (), {"id": 0})()

    copies = []

    class FakeCupy:
        ndarray = Arr
        int64 = np.int64

        class cuda:
            class Device:
                def __init__(self, i=0):
                    self.id = int(i)

        @staticmethod
        def empty(shape, dtype):
            return np.full(shape, -7, dtype).view(Arr)

    def as_p(a):  # a table offset, a null pointer or an array
        if isinstance(a, np.uint64):
            return ctypes.c_void_p(int(a))
        return None if isinstance(a, int) else _p(a)

    def draw(grid, block, args):  # the compiled kernel, run here on the arrays and the table
        ids, lens, B, *sc, table, ld, lens_out, tab, inl = args
        tb = np.frombuffer(tab.tobytes(), np.int64).copy()
        lib.draw(as_p(ids), as_p(lens), _c(B), *map(_c, sc), _p(table), _c(ld), as_p(lens_out),
                 _p(tb), ctypes.c_int(int(inl)))  # fmt: skip

    monkeypatch.setattr(S, "_spec_kernels", lambda dev: (draw, None, None))
    monkeypatch.setattr(T, "upload_many", lambda cp, arrays: copies.append(len(arrays)) or [
        np.array(a).view(Arr) for a in arrays])  # fmt: skip
    ids = np.array([3, 9, 2**33, 5], np.int64)
    lens = np.array([400, 0, 17, 1000], np.int64)
    want = A.sample_spec_augment_params(1, 2, ids, lens, 80, freq_masks=2, freq_width=27,
                                        time_masks=10, time_width=0.05)  # fmt: skip
    checked = A._spec_settings(80, 2, 27, 10, 0.05, None)
    for cc, n_copies in (("90", 0), (None, 1)):
        copies.clear()
        CM._tables_ok.cache_clear()
        if cc:
            monkeypatch.setattr(FakeCupy.cuda.Device, "compute_capability", cc, raising=False)
        else:
            monkeypatch.delattr(FakeCupy.cuda.Device, "compute_capability", raising=False)
        try:
            table, lens_d = S.spec_augment_draws(FakeCupy, 1, 2, ids, lens, 80, *checked,
                                                    "spec_augment")  # fmt: skip
        finally:
            CM._tables_ok.cache_clear()
        assert len(copies) == n_copies and isinstance(lens_d, Arr)
        np.testing.assert_array_equal(np.asarray(lens_d), lens)
        np.testing.assert_array_equal(np.asarray(table), S.spec_augment_table(want))
