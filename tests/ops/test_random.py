"""The counter-based generator: known answers, independence of position, CPU = GPU."""

import numpy as np
import pytest

from avpipe.ops import random as R


def test_philox_known_answers():
    # Random123's kat_vectors for philox4x32_10
    z = np.zeros(1, np.uint32)
    assert [int(x[0]) for x in R.philox4x32(z, z, z, z, 0, 0)] == [
        0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    f = np.full(1, 0xFFFFFFFF, np.uint32)
    assert [int(x[0]) for x in R.philox4x32(f, f, f, f, 0xFFFFFFFF, 0xFFFFFFFF)] == [
        0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def test_draws_depend_only_on_their_coordinates():
    a = R.uniform(7, "crop", 3, np.arange(100), 5)
    b = R.uniform(7, "crop", 3, [42, 99], 5)
    np.testing.assert_array_equal(a[[42, 99]], b)
    # a prefix of the draws of an item does not depend on how many are drawn
    np.testing.assert_array_equal(R.uniform(7, "crop", 3, [5], 2), a[5:6, :2])
    # seed, stream and epoch each change the draws
    for other in (R.uniform(8, "crop", 3, [5], 5), R.uniform(7, "flip", 3, [5], 5),
                  R.uniform(7, "crop", 4, [5], 5)):
        assert not np.array_equal(other, a[5:6])


def test_distributions():
    u = R.uniform(0, "u", 0, np.arange(20000), 1).ravel()
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.01
    k = R.integers(0, "k", 0, np.arange(20000), 1, low=2, high=7).ravel()
    assert set(np.unique(k).tolist()) == {2, 3, 4, 5, 6}
    counts = np.bincount(k - 2) / k.size
    assert np.all(np.abs(counts - 0.2) < 0.015)
    z = R.normal(0, "z", 0, np.arange(20000), 1).ravel()
    assert abs(z.mean()) < 0.03 and abs(z.std() - 1.0) < 0.03
    b = R.bernoulli(0, "b", 0, np.arange(20000), 1, p=0.3).ravel()
    assert abs(b.mean() - 0.3) < 0.015


def test_validation_names_the_parameter():
    with pytest.raises(ValueError, match="high"):
        R.integers(0, "k", 0, [0], 1, low=3, high=3)
    with pytest.raises(ValueError, match="p must"):
        R.bernoulli(0, "b", 0, [0], p=1.5)
    with pytest.raises(TypeError, match="seed"):
        R.uniform("x", "u", 0, [0])


@pytest.mark.gpu
def test_gpu_draws_equal_cpu_draws():
    import cupy

    ids = np.arange(1000)
    for fn, kw in ((R.uniform, {}), (R.integers, {"high": 1000}), (R.bernoulli, {"p": 0.5})):
        cpu = fn(11, "s", 2, ids, 7, **kw)
        gpu = fn(11, "s", 2, cupy.asarray(ids), 7, xp=cupy, **kw)
        np.testing.assert_array_equal(cpu, cupy.asnumpy(gpu))
    np.testing.assert_allclose(
        R.normal(1, "n", 0, ids, 3),
        cupy.asnumpy(R.normal(1, "n", 0, cupy.asarray(ids), 3, xp=cupy)), rtol=1e-12, atol=1e-12)
    for shape in ((37, 1001), 4099, (0,)):
        cpu = R.standard_normal(9, "dither", shape)
        gpu = R.standard_normal(9, "dither", shape, xp=cupy)
        assert gpu.dtype == cupy.float32 and gpu.shape == cpu.shape
        np.testing.assert_allclose(cupy.asnumpy(gpu), cpu, rtol=2e-7, atol=2e-7)
    lens = np.array([1001, 0, 3, 500] * 9 + [77])  # each row's first lengths[b] drawn only
    cpu = R.standard_normal(9, "dither", (37, 1001), lengths=lens)
    gpu = R.standard_normal(9, "dither", (37, 1001), lengths=lens, xp=cupy)
    np.testing.assert_allclose(cupy.asnumpy(gpu), cpu, rtol=2e-7, atol=2e-7)


def test_philox_kernel_body_as_cpp_equals_numpy(tmp_path):
    """The cupy kernel's body (``PHILOX_BODY``), compiled as C++ here, gives numpy's words."""
    import ctypes

    from cpp_kernels import build

    lib = build(
        'extern "C" void run(long long n, const unsigned* C0, const unsigned* C1, '
        "const unsigned* C2, const unsigned* C3, unsigned k0, unsigned k1, int rounds, "
        "unsigned* O0, unsigned* O1, unsigned* O2, unsigned* O3) {\n"
        "  for (long long i = 0; i < n; ++i) {\n"
        "    unsigned int c0 = C0[i], c1 = C1[i], c2 = C2[i], c3 = C3[i], o0, o1, o2, o3;\n"
        + R.PHILOX_BODY
        + "    O0[i] = o0; O1[i] = o1; O2[i] = o2; O3[i] = o3;\n  }\n}\n", tmp_path)
    rng = np.random.default_rng(0)
    c = [rng.integers(0, 2**32, 257, dtype=np.uint64).astype(np.uint32) for _ in range(4)]
    c[0][:3] = [0, 0xFFFFFFFF, 1]
    k0, k1 = R.stream_key(12345, "crop")
    for rounds in (10, 7):
        want = R.philox4x32(*c, k0, k1, rounds=rounds)
        got = [np.zeros(257, np.uint32) for _ in range(4)]
        p = [ctypes.c_void_p(a.ctypes.data) for a in (*c, *got)]
        lib.run(ctypes.c_longlong(257), *p[:4], ctypes.c_uint(k0), ctypes.c_uint(k1),
                ctypes.c_int(rounds), *p[4:])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_standard_normal_arrays():
    """Whole arrays of normal draws (a dither's noise): distributed N(0, 1), independent from
    one element to the next, a function of (seed, stream) and the flat index alone."""
    z = R.standard_normal(5, "dither", (400, 501))
    assert z.dtype == np.float32 and z.shape == (400, 501) and np.isfinite(z).all()
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1.0) < 0.01
    assert abs(np.mean(np.abs(z) < 1.0) - 0.6827) < 0.005  # the normal's mass within 1 sd
    flat = z.ravel()
    for lag in (1, 2, 3):  # the two halves of a counter and neighbouring counters
        assert abs(np.corrcoef(flat[:-lag], flat[lag:])[0, 1]) < 0.01
    np.testing.assert_array_equal(R.standard_normal(5, "dither", 1001), flat[:1001])
    np.testing.assert_array_equal(R.standard_normal(5, "dither", 7), R.standard_normal(5, "dither", 7))
    for other in (R.standard_normal(6, "dither", 7), R.standard_normal(5, "noise", 7)):
        assert not np.array_equal(other, flat[:7])
    assert R.standard_normal(5, "dither", (3, 0)).shape == (3, 0)


def test_standard_normal_kernel_body_as_cpp_equals_numpy(tmp_path):
    """The GPU kernel's body (``NORMAL_BODY``), compiled as C++ here, gives numpy's values
    (float64 log / cos of two C libraries: at most one float32 step apart)."""
    import ctypes

    from cpp_kernels import build

    lib = build(
        "#include <math.h>\n#include <stddef.h>\n"
        'extern "C" void run(long long n, unsigned k0, unsigned k1, float* out) {\n'
        "  for (ptrdiff_t i = 0; i < n; ++i) {\n    float z;\n"
        + R.NORMAL_BODY + "    out[i] = z;\n  }\n}\n", tmp_path)
    for seed in (0, 2**64 - 1, 77):
        k0, k1 = R.stream_key(seed, "dither")
        want = R.standard_normal(seed, "dither", 4099)
        got = np.full(4099, np.nan, np.float32)
        lib.run(ctypes.c_longlong(4099), ctypes.c_uint(k0), ctypes.c_uint(k1),
                ctypes.c_void_p(got.ctypes.data))
        np.testing.assert_allclose(got, want, rtol=2e-7, atol=2e-7)


def test_standard_normal_with_lengths_draws_each_rows_first_elements():
    """``lengths``: each row's first ``lengths[b]`` elements are the whole array's draws, the
    rest 0; lengths past the row are clipped to it; a wrong count names the parameter."""
    full = R.standard_normal(5, "dither", (4, 301))
    lens = [301, 0, 17, 999]
    z = R.standard_normal(5, "dither", (4, 301), lengths=lens)
    for b, k in enumerate([301, 0, 17, 301]):
        np.testing.assert_array_equal(z[b, :k], full[b, :k])
        assert not z[b, k:].any()
    with pytest.raises(ValueError, match="lengths"):
        R.standard_normal(5, "dither", (4, 301), lengths=[1, 2])
    with pytest.raises(ValueError, match="lengths"):
        R.standard_normal(5, "dither", 301, lengths=[1])

    class DeviceArray:  # lengths on a device: refused by name, not by numpy's conversion
        pass

    with pytest.raises(TypeError, match="lengths must be host"):
        R.standard_normal(5, "dither", (4, 301), lengths=DeviceArray())


@pytest.mark.parametrize("inl", [False, True])
@pytest.mark.parametrize("grid", [(None, None), (2, 3)])
def test_standard_normal_rows_kernel_as_cpp_equals_numpy(tmp_path, inl, grid):
    """The GPU's rows kernel (``NORMAL_ROWS_CUDA``: only each row's first lengths[b] drawn),
    compiled as C++ and launched block by block here, gives numpy's values and zeros past the
    lengths: with the lengths in the launch's own table or in memory, over the full grid and a
    grid smaller than the array (every index takes its stride loop)."""
    import ctypes

    from cpp_kernels import TablesOn, build

    from avpipe import device as D

    prelude = (
        "#include <math.h>\n#include <stddef.h>\n#define __global__\n#define __device__\n"
        "#define __forceinline__ inline\nstruct Dim3 { unsigned x, y; };\n"
        "static Dim3 threadIdx, blockIdx, blockDim, gridDim;\n")
    launcher = r"""
extern "C" void run(unsigned gx, unsigned gy, unsigned bx, unsigned k0, unsigned k1,
        const long long* lens, long long B, long long n, float* out, AvpTable tab, int inl) {
    gridDim = {gx, gy}; blockDim = {bx, 1};
    for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) for (unsigned t = 0;
         t < bx; ++t) { blockIdx = {x, y}; threadIdx = {t, 0};
        avpipe_standard_normal_rows(k0, k1, lens, B, n, out, tab, inl); }
}
"""
    lib = build(prelude + D.TABLE_CUDA + R.NORMAL_ROWS_CUDA + launcher, tmp_path)

    class Tab(ctypes.Structure):
        _fields_ = [("w", ctypes.c_longlong * (D.TABLE_BYTES // 8))]

    B, n, bx = 5, 203, 32
    lens = np.array([203, 0, 1, 100, 57], np.int64)
    gx, gy = grid if grid[0] else (-(-n // bx), B)
    k0, k1 = R.stream_key(77, "dither")
    want = R.standard_normal(77, "dither", (B, n), lengths=lens)
    got = np.full((B, n), np.nan, np.float32)
    tab = Tab()
    arg = ctypes.c_void_p(lens.ctypes.data)
    if inl:
        table, (off,) = D.launch_table(TablesOn, [lens])
        tab = Tab.from_buffer_copy(table.tobytes())
        arg = ctypes.c_void_p(int(off))
    lib.run.argtypes = [ctypes.c_uint] * 5 + [ctypes.c_void_p, ctypes.c_longlong,
                                              ctypes.c_longlong, ctypes.c_void_p, Tab,
                                              ctypes.c_int]  # fmt: skip
    lib.run(gx, gy, bx, k0, k1, arg, B, n, got.ctypes.data, tab, int(inl))
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=2e-7)
    assert not got[np.arange(n)[None, :] >= lens[:, None]].any()


def test_small_draws_in_python_integers_equal_numpy(monkeypatch):
    """Draws of up to ``_SMALL`` counters run Philox in Python integers; they equal the numpy
    rounds bit for bit, for edge counters, keys, seeds, ids and epochs."""
    edge32 = [0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
    rng = np.random.default_rng(5)
    cases = []
    for k in [(0, 0), (2**32 - 1, 2**32 - 1), (0, 2**32 - 1), (2**64 - 1, 2**64 + 5),
              R.stream_key(2**64 - 1, "crop"), R.stream_key(0, 2**32 - 1)]:  # fmt: skip
        for size in (1, 2, 3, 4, 7, 8, R._SMALL):
            c = [rng.choice(edge32, size).astype(np.uint32) for _ in range(4)]
            cases.append((c, k))
    for _ in range(200):
        size = int(rng.integers(1, R._SMALL + 1))
        c = [rng.integers(0, 2**32, size, dtype=np.uint64).astype(np.uint32) for _ in range(4)]
        cases.append((c, tuple(int(v) for v in rng.integers(0, 2**63, 2))))
    fast = [[R.philox4x32(*c, *k, rounds=r) for r in (10, 7, 0)] for c, k in cases]
    fast.append(R.philox4x32(*(np.array(v, np.uint32) for v in (5, 6, 7, 8)), 1, 2))
    shaped = [np.arange(6, dtype=np.uint32).reshape(2, 3) + i for i in range(4)]
    fast.append(R.philox4x32(*shaped, 3, 4))
    draws = [(seed, stream, epoch, ids, n)
             for seed in (0, 1, 2**32 - 1, 2**64 - 1, -1)
             for stream in ("clip", "random_resized_crop", 0, 2**32 - 1)
             for epoch in (0, 3, 2**32 - 1, 2**40 + 1, -1)
             for ids, n in (([0], 1), ([2**63 - 1], 4), ([-1, -(2**63)], 5),
                            ([2**32 - 1, 2**32, 7], 12), ([17], 40), ([3, 4], 0))]  # fmt: skip
    fast_words = [R.words(*d) for d in draws]
    monkeypatch.setattr(R, "_SMALL", 0)  # the numpy rounds from here on
    slow = [[R.philox4x32(*c, *k, rounds=r) for r in (10, 7, 0)] for c, k in cases]
    slow.append(R.philox4x32(*(np.array(v, np.uint32) for v in (5, 6, 7, 8)), 1, 2))
    slow.append(R.philox4x32(*shaped, 3, 4))
    for f, s in zip(fast, slow):
        for fr, sr in zip(f, s):
            for a, b in zip(fr, sr) if isinstance(fr, tuple) else [(fr, sr)]:
                a, b = np.asarray(a), np.asarray(b)
                assert a.dtype == b.dtype == np.uint32 and a.shape == b.shape
                np.testing.assert_array_equal(a, b)
    for d, f in zip(draws, fast_words):
        s = R.words(*d)
        assert f.dtype == s.dtype == np.uint32 and f.shape == s.shape
        np.testing.assert_array_equal(f, s)


def test_words_many_equal_words_per_stream():
    """The one-pass draw of several streams gives each stream's words bit for bit."""
    reqs = [("random_resized_crop", 40), ("flip", 1), ("color_jitter", 8), ("color_jitter.p", 1),
            ("x", 0), ("y", 7), ("z", 13)]  # fmt: skip
    for seed, epoch, ids in [(0, 0, np.arange(8)), (5, 3, np.arange(-3, 300)),
                             (2**40 + 7, 2**33 + 1, np.array([2**35 + 1, -5, 0])),
                             (1, 2, np.arange(1)), (3, 1, np.arange(0))]:  # fmt: skip
        got = R.words_many(seed, epoch, ids, reqs)
        for (stream, n), g in zip(reqs, got):
            want = R.words(seed, stream, epoch, ids, n)
            assert g.dtype == np.uint32 and g.shape == want.shape
            np.testing.assert_array_equal(g, want, err_msg=f"{stream} seed={seed}")
    with pytest.raises(ValueError, match="n must be"):
        R.words_many(0, 0, np.arange(2), [("a", -1)])


def test_drawn_together_hands_out_the_same_words(monkeypatch):
    ids = np.array([5, 2**33 + 1, -4, 9])
    reqs = [("a", 3), ("b", 20)]
    want = {s: R.words(7, s, 2, ids, n) for s, n in reqs}
    passes = []
    lanes, lanes32 = R.philox_lanes, R.philox_lanes32  # (words, words_many)
    monkeypatch.setattr(R, "philox_lanes", lambda *a: passes.append(1) or lanes(*a))
    monkeypatch.setattr(R, "philox_lanes32", lambda *a: passes.append(1) or lanes32(*a))
    with R.drawn_together(7, 2, ids, reqs):
        assert len(passes) == 1  # the one pass on entry; the words below come from it
        ids[0] = 6  # the caller's array changed afterwards: its words are drawn anew
        np.testing.assert_array_equal(R.words(7, "a", 2, ids, 3)[1:], want["a"][1:])
        assert not np.array_equal(R.words(7, "a", 2, ids, 3)[0], want["a"][0])
        ids[0] = 5
        passes.clear()
        for s, n in reqs:
            got = R.words(7, s, 2, ids, n)
            np.testing.assert_array_equal(got, want[s])
            got[:] = 0  # a copy: the next caller still gets the words
            np.testing.assert_array_equal(R.words(7, s, 2, ids, n), want[s])
        assert passes == []
        # anything else is drawn as usual
        assert not np.array_equal(R.words(7, "a", 3, ids, 3), want["a"])  # another epoch
        np.testing.assert_array_equal(R.words(7, "a", 2, ids[:2], 3), want["a"][:2])
    assert getattr(R._AHEAD, "words", None) is None


def test_drawn_table_is_the_table_in_effect():
    """drawn_table(): the table a drawn_from block gives this thread (None outside one), which
    serves a later drawn_from elsewhere (the video recipe's collate) with the same words."""
    ids = [4, 8, 15]
    want = R.words(1, "flip", 0, [15, 4], 1)  # drawn without a table
    table = R.draw_ahead(1, 0, ids, [("flip", 1)])
    assert R.drawn_table() is None
    with R.drawn_from(table):
        got = R.drawn_table()
        assert got is table
    assert R.drawn_table() is None
    with R.drawn_from(got):
        np.testing.assert_array_equal(R.words(1, "flip", 0, [15, 4], 1), want)


def test_draw_ahead_serves_any_of_its_ids_on_any_thread(monkeypatch):
    """A table drawn once (draw_ahead) serves each of its ids alone, in any order, to every
    thread that enters drawn_from with it, without a Philox pass; ids it lacks are drawn."""
    import threading

    ids = np.array([11, 3, 2**40 + 7, 5])
    reqs = [("clip", 1), ("random_resized_crop", 40)]
    want = {s: R.words(9, s, 4, ids, n) for s, n in reqs}
    table = R.draw_ahead(9, 4, ids, reqs)
    passes = []
    lanes, lanes32, ints = R.philox_lanes, R.philox_lanes32, R._philox_ints
    monkeypatch.setattr(R, "philox_lanes", lambda *a: passes.append(1) or lanes(*a))
    monkeypatch.setattr(R, "philox_lanes32", lambda *a: passes.append(1) or lanes32(*a))
    monkeypatch.setattr(R, "_philox_ints", lambda *a: passes.append(1) or ints(*a))
    got = {}

    def item(k):
        with R.drawn_from(table):
            got[k] = {s: R.words(9, s, 4, [int(ids[k])], n) for s, n in reqs}

    threads = [threading.Thread(target=item, args=(k,)) for k in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert passes == []
    for k in range(len(ids)):
        for s, _ in reqs:
            np.testing.assert_array_equal(got[k][s], want[s][k : k + 1])
    with R.drawn_from(table):
        np.testing.assert_array_equal(R.words(9, "clip", 4, ids[::-1], 1), want["clip"][::-1])
        assert passes == []
        R.words(9, "clip", 4, [11, 12], 1)  # 12 is not in the table: drawn
        assert passes
    assert getattr(R._AHEAD, "words", None) is None


def test_numpy_philox_broadcasts_like_the_kernel():
    z = np.arange(30, dtype=np.uint32).reshape(3, 10)
    got = R.philox4x32(z, np.uint32(0), z, z, 1, 2)
    want = R.philox4x32(z, np.zeros_like(z), z, z, 1, 2)
    for g, w in zip(got, want):
        assert g.shape == (3, 10)
        np.testing.assert_array_equal(g, w)



def test_philox_lanes32_equal_the_uint64_lanes(monkeypatch):
    """The 32-bit lanes (a widening multiply read back as its halves) give the uint64 lanes'
    words; so does their fallback where the machine is not little-endian."""
    rng = np.random.default_rng(2)
    a, b = (rng.integers(0, 2**32, (2, 37), dtype=np.uint64) for _ in range(2))
    keys = R._round_keys(0xDEADBEEF, 0x12345678, 10).reshape(10, 2, 1)
    x, y = R.philox_lanes(a, b, keys)
    for little in (True, False):
        monkeypatch.setattr(R, "_LITTLE", little)
        x32, y32 = R.philox_lanes32(a.astype(np.uint32), b.astype(np.uint32),
                                    keys.astype(np.uint32))  # fmt: skip
        assert x32.dtype == y32.dtype == np.uint32
        np.testing.assert_array_equal(x32, x.astype(np.uint32))
        np.testing.assert_array_equal(y32, y.astype(np.uint32))


def test_draw_ahead_groups_equals_a_pass_per_group():
    """One pass over several batches' ids gives each batch the table a pass of its own would:
    the same keys, ids and words (any sizes, a repeated id, an empty group)."""
    reqs = [("clip", 1), ("random_resized_crop", 40), ("flip", 1), ("color_jitter", 8)]
    groups = [[0, 1, 2], [7, 3], [], [2**40 + 5, 9, 9, 11]]
    tables = R.draw_ahead_groups(5, 3, groups, reqs)
    assert len(tables) == len(groups)
    for g, t in zip(groups, tables):
        want = R.draw_ahead(5, 3, g, reqs)
        assert t.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(t[k][0], want[k][0])
            np.testing.assert_array_equal(t[k][1], want[k][1])
            assert t[k][2] == want[k][2]
        fresh = R.words(5, "color_jitter", 3, np.array(g, np.int64), 8)  # (Philox, no table)
        with R.drawn_from(t):  # and words() reads it as it reads a table of its own
            np.testing.assert_array_equal(R.words(5, "color_jitter", 3, g, 8), fresh)
        assert len(g) == 0 or t[(5, "color_jitter", 3, 8)][1].shape == (len(g), 8)
    # ids as a numpy array or a scalar, as draw_ahead takes them
    one = R.draw_ahead_groups(5, 3, [np.array([4, 1]), 6], reqs)
    np.testing.assert_array_equal(one[0][(5, "flip", 3, 1)][1], R.words(5, "flip", 3, [4, 1], 1))
    np.testing.assert_array_equal(one[1][(5, "flip", 3, 1)][1], R.words(5, "flip", 3, [6], 1))
