"""The log-mel kernels (``avpipe/ops/_log_mel.cu``), compiled as plain C++ and run here on the
CPU, against their numpy reference (the array-module code of ``avpipe.ops._audio_core``): the
windowed frames equal it exactly (the same float32 operations in the same order), the log +
per-feature normalization + transpose within float32 rounding of a different summation order.
The same source compiles for the GPU with nvcc where it is installed; the GPU tests
(test_ops_audio_gpu.py) run the whole fused path through NVRTC against the CPU and against
the array-module path on the GPU."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cpp_kernels import THREADS_PRELUDE, build, ptx

from avpipe.ops import _audio_core as C
from avpipe.ops import _log_mel as K
from avpipe.ops.audio import NEMO

# The threads' stand-ins (cpp_kernels.THREADS_PRELUDE): the finish launcher runs a block's
# threads as real threads meeting at __syncthreads; the frames kernel does not synchronize,
# so its launcher runs a block's threads one after another. Plus CUDA's rounding intrinsics.
PRELUDE = THREADS_PRELUDE + r"""
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
"""

LAUNCHER = r"""
extern "C" void frames(unsigned gx, unsigned gy, unsigned gz, unsigned bx, const float* x,
        const float* noise, float dither, long long n, const long long* lens,
        const long long* fl, const long long* off, float preemph, int has_preemph,
        const float* window, int n_fft, int hop, int pad, long long B, long long T, float* out) {
    gridDim = {gx, gy, gz}; blockDim = {bx, 1, 1};
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y)
    for (unsigned xb = 0; xb < gx; ++xb) { blockIdx = {xb, y, z};
        for (unsigned i = 0; i < bx; ++i) { threadIdx = {i, 0, 0};
            avpipe_log_mel_frames(x, noise, dither, n, lens, fl, off, preemph, has_preemph,
                                  window, n_fft, hop, pad, B, T, out); } }
}
struct FinishArgs {
    const float* mel; long long B, T; int M; const long long* fl; const long long* off;
    int guard_add; float guard;
    int norm, ddof; float eps; float* out; long long T_out; unsigned tid;
};
static void* finish_thread(void* p) {
    const FinishArgs& a = *(const FinishArgs*)p;
    threadIdx = {a.tid, 0, 0};
    avpipe_log_mel_finish(a.mel, a.B, a.T, a.M, a.fl, a.off, a.guard_add, a.guard, a.norm,
                          a.ddof, a.eps, a.out, a.T_out);
    return nullptr;
}
extern "C" int finish(unsigned threads, const float* mel, long long B, long long T, int M,
        const long long* fl, const long long* off, int guard_add, float guard, int norm,
        int ddof, float eps, float* out, long long T_out) {
    gridDim = {(unsigned)(B * M), 1, 1}; blockDim = {threads, 1, 1};
    if (pthread_barrier_init(&block_barrier, nullptr, threads)) return 1;
    FinishArgs args[1024];
    pthread_t ids[1024];
    for (unsigned r = 0; r < B * M; ++r) { blockIdx = {r, 0, 0};
        for (unsigned i = 0; i < threads; ++i) {
            args[i] = {mel, B, T, M, fl, off, guard_add, guard, norm, ddof, eps, out, T_out, i};
            if (threads == 1) finish_thread(&args[i]);  // one thread: this one
            else if (pthread_create(&ids[i], nullptr, finish_thread, &args[i])) return 1;
        }
        for (unsigned i = 0; threads > 1 && i < threads; ++i) pthread_join(ids[i], nullptr);
    }
    return pthread_barrier_destroy(&block_barrier);
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    with open(K.KERNEL_FILE) as f:
        return build(PRELUDE + f.read() + LAUNCHER, tmp_path_factory.mktemp("log_mel_kernels"),
                     flags=("-pthread",))


def _p(a):
    return ctypes.c_void_p(0 if a is None else a.ctypes.data)


def _frames_ref(x, lens, noise, scale, coeff, w, n_fft, hop, pad, T):
    """The array-module code's frames (float32 throughout, as on a GPU)."""
    xd = x if noise is None else x + np.float32(scale) * noise
    xd = C._mask_time(xd, lens).astype(np.float32)
    y = C.preemphasis(xd, lens, coeff=coeff) if coeff is not None else xd
    padded = C._pad_items(np, y.astype(np.float32), lens, lens, pad, "constant")
    return C._frames(np, padded, n_fft, hop, T).astype(np.float32) * w


@pytest.mark.parametrize("launch", ["log_mel", "one_thread_a_block", "strided"])
@pytest.mark.parametrize("dither", [False, True])
@pytest.mark.parametrize("center", [True, False])
def test_frames_equal_the_reference_exactly(lib, dither, center, launch):
    """The valid frames equal the reference bit for bit, packed one item after another (item
    b's min(fl[b], T) frames from row off[b]; no row past them written), under log_mel's launch
    (frames_launch), one thread a block over the full grid, and a grid smaller than the frames
    in every dimension (every index takes its stride loop: taps by 128, frames by 5, items by
    3)."""
    rng = np.random.default_rng(1)
    B, n, n_fft, hop = 6, 3000, 512, 160
    lens = np.array([3000, 1777, 100, 0, 2500, 3000])
    x = rng.standard_normal((B, n)).astype(np.float32)
    x[1, 1777:] = 9.0  # junk past a length is never read
    noise = rng.standard_normal((B, n)).astype(np.float32) if dither else None
    pad = n_fft // 2 if center else 0
    T = int(C.stft_frame_lengths([n], n_fft=n_fft, hop_length=hop, center=center)[0])
    # valid frames: the "floor_plus_one" rule (every frame of a centred STFT); the first and
    # the last item's past T (clipped there: the last one's would land past the packed rows)
    fl = (lens // hop + 1).astype(np.int64)
    fl[3] = 0
    fl[0] = fl[5] = T + 3
    off, R = K.packed_rows(fl, T)
    nv = np.minimum(fl, T)
    assert R == int(nv.sum()) and list(off) == [0, *np.cumsum(nv)[:-1]]
    w = C._window_np("hann", 400, False, n_fft).astype(np.float32)
    ref = _frames_ref(x, lens, noise, 1e-5, 0.97, w, n_fft, hop, pad, T)
    out = np.full((R + 3, n_fft), np.nan, np.float32)
    lens64 = lens.astype(np.int64)
    if launch == "log_mel":
        (gx, gy, gz), (bx,) = K.frames_launch(n_fft, T, B)
    elif launch == "one_thread_a_block":
        gx, gy, gz, bx = n_fft, T, B, 1
    else:
        gx, gy, gz, bx = 1, 5, 3, 128
    lib.frames(ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(gz), ctypes.c_uint(bx), _p(x),
               _p(noise), ctypes.c_float(1e-5), ctypes.c_longlong(n), _p(lens64), _p(fl),
               _p(off), ctypes.c_float(0.97), ctypes.c_int(1), _p(w), ctypes.c_int(n_fft),
               ctypes.c_int(hop), ctypes.c_int(pad), ctypes.c_longlong(B), ctypes.c_longlong(T),
               _p(out))  # fmt: skip
    want = np.concatenate([ref[b, : nv[b]] for b in range(B)])
    np.testing.assert_array_equal(out[:R], want)
    assert np.isnan(out[R:]).all()


@pytest.mark.parametrize("threads", [1, 4, 7, 33])
@pytest.mark.parametrize("norm,guard", [("per_feature", "add"), (None, "add"),
                                        ("per_feature", "clamp")])
def test_finish_equals_log_normalize_and_mask(lib, norm, guard, threads):
    """One block per row (b, m), its threads run as real threads meeting at __syncthreads:
    one (the serial sums), a power of two, an odd count (the halving tree's odd steps), and
    more threads than frames (threads with no frame add 0)."""
    rng = np.random.default_rng(2)
    B, T, M, ddof, eps, gv = 5, 70, 80, 1, 1e-5, 2.0**-24
    mel = (rng.random((B, T, M)) ** 4).astype(np.float32)
    mel[0, :, 3] = 0.0  # a silent band: the guard
    fl = np.array([70, 33, 1, 0, 2], np.int64)
    feats = C.log_guarded(np.ascontiguousarray(mel.transpose(0, 2, 1)), guard=guard,
                          guard_value=gv)
    if norm:
        ref = C.normalize(feats, fl, mode=norm, eps=eps, ddof=ddof)
        # a constant band (the silent one): (v - mean) / (0 + eps) is the float32 sum's rounding
        # residue, blown up (here -0.28); the kernel's shifted mean gives the exact 0
        ref[0, 3] = 0.0
    else:
        ref = C._mask_time(feats, fl)
    T_out = 80  # pad_to: zeros after T
    out = np.full((B, M, T_out), np.nan, np.float32)
    # the frames as the frames kernel packs them: each item's valid ones, one after another
    off, R = K.packed_rows(fl, T)
    packed = np.ascontiguousarray(np.concatenate([mel[b, :k] for b, k in enumerate(fl)]))
    assert packed.shape == (R, M)
    rc = lib.finish(ctypes.c_uint(threads), _p(packed), ctypes.c_longlong(B),
                    ctypes.c_longlong(T), ctypes.c_int(M), _p(fl), _p(off),
                    ctypes.c_int(guard == "add"), ctypes.c_float(gv),
                    ctypes.c_int(norm is not None), ctypes.c_int(ddof), ctypes.c_float(eps),
                    _p(out), ctypes.c_longlong(T_out))  # fmt: skip
    assert rc == 0  # the launcher's threads and barrier were made
    assert np.all(out[:, :, T:] == 0)
    np.testing.assert_allclose(out[:, :, :T], ref, rtol=2e-5, atol=2e-5)
    for b, k in enumerate(fl):  # exactly 0 past each length (a single frame normalizes to 0)
        assert np.all(out[b, :, k:] == 0)
    if norm:
        assert np.all(out[2] == 0)
        assert np.all(out[0, 3] == 0)  # the silent band: constant, normalized to exactly 0


def test_supported_covers_the_nemo_presets_only_where_it_can():
    x = np.zeros((2, 10), np.float32)
    assert K.supported(NEMO, x)
    assert K.supported(NEMO.replace(name="v1", frame_rule="floor_plus_one", pad_to=16), x)
    assert not K.supported(NEMO.replace(name="r", pad_mode="reflect"), x)
    assert not K.supported(NEMO.replace(name="a", normalize="all_features"), x)
    assert not K.supported(NEMO.replace(name="p", power=1.5), x)
    assert not K.supported(NEMO, x.astype(np.float64))
    assert not K.supported(NEMO, np.zeros((0, 10), np.float32))


def test_kernels_compile_for_the_gpu(tmp_path):
    """Both kernels compile for sm_90; the frames kernel, one thread an element, does no
    integer division (a 64-bit one is emulated in dozens of instructions); the finish kernel
    reduces in shared memory between barriers."""
    with open(K.KERNEL_FILE) as f:
        text = ptx(f.read(), tmp_path)
    assert "avpipe_log_mel_frames" in text and "avpipe_log_mel_finish" in text
    frames = text.split(".entry avpipe_log_mel_frames")[1].split(".entry")[0]
    assert "div." not in frames and "rem." not in frames
    finish = text.split(".entry avpipe_log_mel_finish")[1].split(".entry")[0]
    assert ".shared" in text and "bar.sync" in finish


def test_fft_rows_rounds_up_by_at_most_an_eighth_to_few_sizes():
    """The rFFT's row count (B * T) goes up to a size of the form m * 2**k, m in 8..15: never
    fewer rows, at most an eighth more, and eight sizes an octave (cuFFT plans reused)."""
    from avpipe.ops._log_mel import fft_rows

    for n in range(1, 5000):
        r = fft_rows(n)
        assert n <= r <= n + n // 8 + 1
    sizes = {fft_rows(n) for n in range(4097, 8193)}  # (4096, 8192]
    assert len(sizes) == 8 and all(fft_rows(s) == s for s in sizes)
