"""The resampling kernel (``avpipe/ops/_resample.cu``), compiled as plain C++ and run here on
the CPU, equals the numpy reference (``resample`` / ``resample_rows``) within float32 rounding;
the same source compiles for the GPU with nvcc where it is installed. The GPU test
(test_augment_audio.py / test_ops_audio_gpu.py) runs it through NVRTC."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cpp_kernels import build, ptx

from avpipe import device as D
from avpipe.device import cuda_modules as CM
from avpipe.device import transfers as T
from avpipe.ops import _resample as R

PRELUDE = r"""
#include <math.h>
#define __global__
#define __device__
#define __forceinline__ inline
struct Dim3 { unsigned x, y; };
static Dim3 threadIdx, blockIdx, blockDim, gridDim;
"""

# the GPU's launch (_rows_kernel): blockIdx.x the output position (blockDim 1 here), blockIdx.y
# the row, gridDim.y rows at most (a row past it is the next step of its block's loop)
LAUNCHER = r"""
extern "C" void run(int small, int grid_rows, int nrows, const float* x, long long n_in,
        const long long* rows, const float* taps, float* out, long long width,
        const AvpTable* tab, int inl) {
    blockDim.x = 1; threadIdx.x = 0; gridDim.y = (unsigned)grid_rows;
    for (int by = 0; by < grid_rows; ++by)
        for (long long m = 0; m < width; ++m) {
            blockIdx.x = (unsigned)m; blockIdx.y = (unsigned)by;
            if (small) avpipe_resample_rows32(x, n_in, rows, taps, out, width, nrows, *tab, inl);
            else avpipe_resample_rows(x, n_in, rows, taps, out, width, nrows, *tab, inl);
        }
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    with open(R.KERNEL_FILE) as f:
        return build(PRELUDE + D.TABLE_CUDA + f.read() + LAUNCHER,
                     tmp_path_factory.mktemp("resample_kernel"))  # fmt: skip


def _p(a):
    return ctypes.c_void_p(a.ctypes.data)


def run_cpu(lib, x, lens, rates, target, quality, *, small=None, grid_rows=None, inl=False):
    """The GPU runner's sequence (``_rows_kernel``), with the kernel run on the CPU (``small``:
    the 32-bit kernel, by default where ``index_fits``; ``grid_rows``: the grid's rows;
    ``inl``: the rows table in the launch's own table, as a GPU takes a batch's that fits)."""
    x = np.ascontiguousarray(x, np.float32)
    B, n = x.shape
    g = np.gcd(rates, target)
    up, down = target // g, rates // g
    new = -(-lens * up // down)
    width = int(new.max())
    pairs = tuple(sorted({(int(u), int(d)) for u, d in zip(up, down)}))
    taps, meta = R.table(pairs, quality)
    rows = R.row_args(lens, up, down, new, meta)
    assert rows.shape == (B, 7) and rows.dtype == np.int64 and rows.flags.c_contiguous
    out = np.full((B, width), np.nan, np.float32)
    I64 = ctypes.c_longlong
    if small is None:
        small = R.index_fits(width, down, lens, max(v[2] for v in meta.values()), up)
    tab = np.zeros(D.TABLE_BYTES // 8, np.int64)
    at = _p(rows)
    if inl:  # the rows at byte 8 of the table (the pointer argument then carries 8)
        tab[1 : 1 + rows.size] = rows.reshape(-1)
        at = ctypes.c_void_p(8)
    lib.run(int(small), int(grid_rows or B), B, _p(x), I64(n), at, _p(taps), _p(out),
            I64(width), _p(tab), ctypes.c_int(int(inl)))  # fmt: skip
    return out, new


@pytest.mark.parametrize("quality", ["fast", "high"])
def test_kernel_equals_reference_per_row_rates(lib, quality):
    rng = np.random.default_rng(3)
    B = 7
    lens = rng.integers(0, 6000, B)
    lens[2] = 0  # an empty row
    x = np.zeros((B, int(lens.max())), np.float32)
    for b, m in enumerate(lens):
        x[b, :m] = rng.standard_normal(m)
    x[0, lens[0]:] = 5.0  # junk past a length is never read
    rates = np.array([13600, 16000, 17000, 8000, 14400, 18400, 44100])
    out, new = run_cpu(lib, x, lens, rates, 16000, quality)
    ref, new_ref = R.resample_rows(x, lens, rates, 16000, quality=quality)
    np.testing.assert_array_equal(new, new_ref)
    assert out.shape == ref.shape
    # float32 sums over the filter's taps: the kernel adds tap by tap, the reference through
    # BLAS, whose order and FMA use vary between builds (OpenBLAS 0.3.31 here: up to 9 ulp of a
    # value near 2): a few ulp of the value, plus an absolute floor for values near 0
    np.testing.assert_allclose(out, ref, atol=2e-6, rtol=2e-6)
    for b in range(B):  # and each row is resample() of its samples
        if lens[b]:
            r = R.resample(x[b, : lens[b]], int(rates[b]), 16000, quality=quality)
            np.testing.assert_allclose(out[b, : new[b]], r, atol=2e-6, rtol=2e-6)
        assert not out[b, new[b]:].any()
    b = 1  # the same rate: the samples themselves
    assert rates[b] == 16000
    np.testing.assert_array_equal(out[b, : lens[b]], x[b, : lens[b]])


def test_kernel_index_widths_and_grids_give_the_same_output(lib):
    """The 32-bit and 64-bit index kernels, a grid with fewer rows than the batch (rows taken
    in steps of it), and the rows table read from the launch's own table, write the same values
    bit for bit; the taps at a row's edges (the bounds-tested sum) and inside it (the plain
    one) both count."""
    rng = np.random.default_rng(11)
    lens = np.array([3000, 17, 0, 2999, 1500])
    x = rng.standard_normal((5, 3000)).astype(np.float32)
    rates = np.array([13600, 18400, 16000, 44100, 8000])
    a, _ = run_cpu(lib, x, lens, rates, 16000, "fast", small=False)
    b, _ = run_cpu(lib, x, lens, rates, 16000, "fast", small=True)
    c, _ = run_cpu(lib, x, lens, rates, 16000, "fast", small=True, grid_rows=2)
    d, _ = run_cpu(lib, x, lens, rates, 16000, "fast", small=True, inl=True)
    e, _ = run_cpu(lib, x, lens, rates, 16000, "fast", small=False, inl=True, grid_rows=3)
    for got in (b, c, d, e):
        np.testing.assert_array_equal(a, got)
    ref, _ = R.resample_rows(x, lens, rates, 16000, quality="fast")
    np.testing.assert_allclose(a, ref, atol=2e-6, rtol=2e-6)


def test_index_fits_32_bits():
    assert R.index_fits(300_000, [17, 113], [256_000, 100], 32)
    assert not R.index_fits(5_000_000, [441], [100])  # 5e6 * 441 > 2**31
    assert not R.index_fits(10, [1], [2**31 - 1])
    assert R.index_fits(10, [1], [2**31 - 100], 64)
    assert not R.index_fits(10, [1], [2**31 - 100], 2**20)  # a wide filter's reach past the row
    assert R.index_fits(10, [], [])
    assert R.index_fits(10, [1], [100], 64, [2**24])  # the tap-major table: K * up
    assert not R.index_fits(10, [1], [100], 256, [2**24])


def test_kernel_compiles_for_the_gpu(tmp_path):
    with open(R.KERNEL_FILE) as f:
        code = ptx(D.TABLE_CUDA + f.read(), tmp_path)
    assert "avpipe_resample_rows32" in code and "avpipe_resample_rows(" in code
    # the launch's table read where the parameters are, not copied to each thread's memory
    assert "local" not in code.split(".entry avpipe_resample_rows32")[1].split(".entry")[0]


@pytest.mark.parametrize("rates", [(13900, 16000), (44100, 16000), (8000, 16000), (16000, 11025)])
def test_block_gemm_equals_phase_by_phase(rates, monkeypatch):
    """The array-module resample's two routes (the block-filter GEMM, and phase by phase for
    rate pairs whose block filter would be too large) give the same output."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4001)).astype(np.float32)
    a = R.resample(x, *rates, quality="high")
    monkeypatch.setattr(R, "_BLOCK_FILTER_MAX", 0)
    b = R.resample(x, *rates, quality="high")
    assert a.shape == b.shape == (3, -(-4001 * rates[1] // rates[0]))
    np.testing.assert_allclose(a, b, atol=2e-6, rtol=0)


def test_upload_many_packs_arrays_at_aligned_offsets():
    """The kernels' one-copy upload (``avpipe.device.upload_many``, used by the resampling and
    resize runners), with numpy as the array module: each array comes back equal, with its
    dtype and shape, from an offset aligned to 8 bytes, out of one buffer."""
    from avpipe.device import upload_many

    rng = np.random.default_rng(0)
    arrays = [rng.integers(-9, 9, 5).astype(np.int64), rng.integers(0, 9, (3, 2)).astype(np.int32),
              rng.standard_normal(7).astype(np.float32), np.zeros(0, np.int32),
              np.array([2**40], np.int64)]
    got = upload_many(np, arrays)
    assert len(got) == len(arrays)
    for a, g in zip(arrays, got):
        assert g.dtype == a.dtype and g.shape == a.shape
        np.testing.assert_array_equal(g, a)
        assert g.ctypes.data % 8 == 0 or a.size == 0


def test_taps_cache_holds_a_speed_perturbation_grid():
    """Speed perturbation on a 0.01 grid over (0.85, 1.15) uses 31 rate pairs every batch: the
    tap cache holds them all (a smaller cache recomputed the Kaiser windows every batch)."""
    R._taps32.cache_clear()
    rates = [round(16000 * (0.85 + 0.01 * k)) for k in range(31)]
    for _ in range(2):
        for r in rates:
            g = np.gcd(r, 16000)
            R._taps32(16000 // g, r // g, "fast")
    info = R._taps32.cache_info()
    assert info.misses == 31 and info.hits == 31


def test_rows_of_a_wider_buffer_read_in_place(monkeypatch):
    """``_rows_kernel`` on a slice of a wider batch (a feed's rows in its loader's buffer):
    the kernel gets the parent's row stride and no copy is made (an emulated cupy whose
    ``ascontiguousarray`` would record one)."""
    calls = []

    class FakeCupy:
        float32 = np.float32

        class cuda:
            class Device:
                id = 0

        @staticmethod
        def ascontiguousarray(a):
            calls.append("copy")
            return np.ascontiguousarray(a)

        @staticmethod
        def empty(shape, dtype):
            return np.empty(shape, dtype)

    launched = []
    monkeypatch.setattr(R, "_bank", lambda dev, q: type("B", (), {"get": lambda self, c, u, d: (
        None, R._PairMeta({pair: (0, 1, 1) for pair in zip(u.tolist(), d.tolist())}), None)})())  # fmt: skip
    monkeypatch.setattr(R, "upload_many", lambda cp, arrays: arrays)
    monkeypatch.setattr(T, "upload_many", lambda cp, arrays: arrays)
    monkeypatch.setattr(R, "_kernel",
                        lambda dev, small=False: lambda grid, block, args: launched.append(args))
    wide = np.zeros((3, 100), np.float32)
    R._rows_kernel(FakeCupy, wide[:, :60], np.array([60, 50, 40]), np.ones(3, int),
                   np.ones(3, int), np.array([60, 50, 40]), 60, "fast")  # fmt: skip
    assert calls == [] and launched[0][1] == 100  # the parent's row stride
    R._rows_kernel(FakeCupy, wide[:, ::2], np.array([50, 50, 50]), np.ones(3, int),
                   np.ones(3, int), np.array([50, 50, 50]), 50, "fast")  # fmt: skip
    assert calls == ["copy"] and launched[1][1] == 50  # strided samples: copied first


def test_pair_rows_found_for_the_batch_at_once():
    """``_PairMeta.rows_of`` finds each row's pair in any insertion order (one search for the
    batch), None where one is missing; row_args gathers the pairs' columns by it."""
    pairs = [(160, 153), (16, 17), (1, 1), (40, 37), (400, 441)]
    meta = R._PairMeta({p: (10 * k, k + 1, k + 2) for k, p in enumerate(pairs)})
    up = np.array([40, 1, 160, 40, 400, 16])
    down = np.array([37, 1, 153, 37, 441, 17])
    idx = meta.rows_of(up, down)
    assert [pairs[i] for i in idx] == list(zip(up.tolist(), down.tolist()))
    assert meta.rows_of(np.array([40, 2]), np.array([37, 1])) is None
    assert meta.rows_of(np.array([40]), np.array([36])) is None  # a near key
    assert R._PairMeta({}).rows_of(up, down) is None
    rows = R.row_args(np.arange(6), up, down, np.arange(6) + 1, meta)
    for b, (u, d) in enumerate(zip(up, down)):
        off, W, K = meta[(int(u), int(d))]
        assert rows[b].tolist() == [b, u, d, W, K, off, b + 1]
    with pytest.raises(ValueError, match="no taps"):
        R.row_args([1], [2], [1], [1], meta)
    # pairs past one int64 key each (rates from 2**32 on): found a row at a time, exactly
    big = R._PairMeta({(1, 2**33 + 5): (0, 1, 1), (3, 5): (8, 2, 2)})
    assert big.rows_of(np.array([3, 1]), np.array([5, 2**33 + 5])).tolist() == [1, 0]
    assert big.rows_of(np.array([1]), np.array([5])) is None


def test_rows_table_travels_in_the_launch(monkeypatch):
    """On a device that reads launch tables, ``_rows_kernel`` sends the batch's rows in the
    launch's parameters (the rows argument their byte offset, ``inl`` 1), no copy; a batch
    whose rows do not fit goes back to one copy (``inl`` 0)."""
    copies, launched = [], []

    class FakeCupy:
        float32 = np.float32

        class cuda:
            class Device:
                def __init__(self, i=0):
                    self.id = int(i)

                compute_capability = "90"

        @staticmethod
        def empty(shape, dtype):
            return np.empty(shape, dtype)

    meta = R._PairMeta({(1, 1): (0, 1, 1), (16, 17): (1, 5, 3)})
    monkeypatch.setattr(R, "_bank", lambda dev, q: type("B", (), {
        "get": lambda self, c, u, d: ("taps", meta, meta.rows_of(u, d))})())  # fmt: skip
    monkeypatch.setattr(R, "upload_many", lambda cp, arrays: copies.append(arrays) or arrays)
    monkeypatch.setattr(T, "upload_many", lambda cp, arrays: copies.append(arrays) or arrays)
    monkeypatch.setattr(R, "_kernel",
                        lambda dev, small=False: lambda grid, block, args: launched.append(args))
    CM._tables_ok.cache_clear()
    try:
        for B in (3, 64, 65):  # 65 rows of 7 int64: past the table
            lens = np.arange(B) + 10
            up, down = np.where(np.arange(B) % 2, 16, 1), np.where(np.arange(B) % 2, 17, 1)
            R._rows_kernel(FakeCupy, np.zeros((B, 80), np.float32), lens, up, down, lens + 1,
                           80, "fast")  # fmt: skip
            args = launched[-1]
            want = R.row_args(lens, up, down, lens + 1, meta)
            tab, inl = args[-2], args[-1]
            assert isinstance(tab, np.void) and isinstance(inl, np.int32)
            if B <= 64:
                assert int(inl) == 1 and args[2] == np.uint64(8) and not copies
                words = np.frombuffer(tab.tobytes(), np.int64)
                np.testing.assert_array_equal(words[1 : 1 + want.size], want.reshape(-1))
            else:
                assert int(inl) == 0 and len(copies) == 1
                np.testing.assert_array_equal(args[2], want)
                assert tab.tobytes() == D.NO_TABLE.tobytes()
    finally:
        CM._tables_ok.cache_clear()


@pytest.mark.parametrize("quality", ["high", "fast"])
def test_cpu_resample_is_a_function_of_the_row(quality, monkeypatch):
    """On the CPU a row's resampled samples are the same bits alone, in a batch of rows padded
    to another length (resample_rows), and with one BLAS thread or two (Ray's workers run
    one): extraction must write the same bytes for a file in any batch, in any process. Both
    routes (block filter, phase by phase)."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    rng = np.random.default_rng(9)
    lens = np.array([44100 * 3 + 17, 5000, 30001, 1, 0, 12345])
    x = np.zeros((len(lens), int(lens.max()) + 999), np.float32)
    for b, m in enumerate(lens):
        x[b, :m] = 0.1 * rng.standard_normal(m)
    for route in ("block", "phase"):
        if route == "phase":
            monkeypatch.setattr(R, "_BLOCK_FILTER_MAX", 0)
        for rate in (44100, 22050, 8000):
            alone = {}
            for threads in (1, 2):
                with threadpoolctl.threadpool_limits(threads):
                    for b in range(len(lens)):
                        r = R.resample(x[b, : lens[b]], rate, 16000, quality=quality)
                        if threads == 1:
                            alone[b] = r
                        else:
                            assert np.array_equal(r, alone[b]), (route, rate, b)
            out, new = R.resample_rows(x, lens, np.full(len(lens), rate), 16000, quality=quality)
            for b in range(len(lens)):
                assert np.array_equal(out[b, : new[b]], alone[b]), (route, rate, b)


def test_cpu_resample_rows_reads_each_row_at_its_own_length(monkeypatch):
    """On the CPU resample_rows resamples each row over its own samples only (a row sharing
    its rate with a longer one is not padded to it: speed perturbation's work is the batch's
    audio, not its padded size), on the cores' threads, with the same bits on one thread or
    several and as each row alone; rows at the target rate are copied."""
    rng = np.random.default_rng(4)
    lens = np.array([30001, 5000, 17, 0, 12345, 30001, 999])
    rates = np.array([13600, 13600, 13600, 13600, 18400, 16000, 18400])
    x = np.zeros((len(lens), int(lens.max()) + 77), np.float32)
    for b, m in enumerate(lens):
        x[b, :m] = 0.1 * rng.standard_normal(m)
    calls, names = [], set()
    real = R._resample_row_cpu

    def spy(row, up, down, quality, n_out):
        import threading

        calls.append((row.shape[0], up, down, n_out))
        names.add(threading.current_thread().name)
        return real(row, up, down, quality, n_out)

    monkeypatch.setattr(R, "_resample_row_cpu", spy)
    monkeypatch.setattr(R, "_cpu_threads", lambda: 2, raising=False)
    out, new = R.resample_rows(x, lens, rates, 16000, quality="fast")
    g = np.gcd(rates, 16000)
    want = sorted((int(n), int(16000 // gg), int(r // gg), int(-(-n * 16000 // r)))
                  for n, r, gg in zip(lens, rates, g) if n > 0 and r != 16000)
    assert sorted(calls) == want
    assert any(n.startswith("avpipe-resample") for n in names)
    np.testing.assert_array_equal(out[5, : new[5]], x[5, : lens[5]])
    monkeypatch.setattr(R, "_cpu_threads", lambda: 1)
    one, new1 = R.resample_rows(x, lens, rates, 16000, quality="fast")
    np.testing.assert_array_equal(one, out)
    np.testing.assert_array_equal(new1, new)
    for b in range(len(lens)):
        alone = R.resample(x[b, : lens[b]], int(rates[b]), 16000, quality="fast")
        np.testing.assert_array_equal(out[b, : new[b]], alone)
        assert not out[b, new[b]:].any()
