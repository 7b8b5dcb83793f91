// log_mel on a GPU in few launches (avpipe/ops/_log_mel.py runs them: frames -> cupy rfft ->
// |X|^2 -> mel GEMM -> finish). The numpy reference is the array-module code of
// avpipe/ops/_audio_core.py (dither, preemphasis, stft, log_guarded, normalize); the
// arithmetic of the first steps is the same float32 operations in the same order (no fused
// multiply-adds), so the frames equal that code's on cupy bit for bit.

// Windowed frames of the dithered, preemphasised, zero-padded signal, packed: item b's valid
// frames t < min(fl[b], T) only, at rows off[b] + t of frames [sum of those, n_fft] (the frames
// past an item's length are never computed: the finish kernel writes zeros there, and the FFT
// and the mel GEMM run over the valid frames alone). Frame t, tap k reads sample
// q = t * hop + k - pad of item b (0 outside 0 .. lens[b]). noise: [B, n] standard normal
// (null: no dither), scaled by `dither`.
// Launch: threads over the taps k (x), blocks over the frames t (y) and items b (z); each index
// strides by its grid's extent, so any n_fft, T and B are covered with gridDim.y and gridDim.z
// capped at 65535 (log_mel launches fewer frame rows than T: each block loops over several
// frames; _log_mel.py's frames_launch). (b, t, k) come from the launch indices: no integer
// division per element (a flat index's 64-bit divisions are emulated on a GPU in dozens of
// instructions).
extern "C" __global__ void avpipe_log_mel_frames(
    const float* x, const float* noise, float dither, long long n, const long long* lens,
    const long long* fl, const long long* off, float preemph, int has_preemph,
    const float* window, int n_fft, int hop, int pad, long long B, long long T, float* frames) {
    for (long long b = blockIdx.z; b < B; b += gridDim.z) {
        const float* row = x + b * n;
        const float* nrow = noise ? noise + b * n : nullptr;
        long long len = lens[b];
        long long nt = fl[b] < T ? fl[b] : T;
        for (long long t = blockIdx.y; t < nt; t += gridDim.y) {
            float* dst = frames + (off[b] + t) * n_fft;
            for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < n_fft;
                 k += gridDim.x * blockDim.x) {
                long long q = t * hop + k - pad;
                float v = 0.0f;
                if (q >= 0 && q < len) {
                    float cur = row[q];
                    if (nrow) cur = __fadd_rn(cur, __fmul_rn(dither, nrow[q]));
                    if (has_preemph && q > 0) {
                        float prev = row[q - 1];
                        if (nrow) prev = __fadd_rn(prev, __fmul_rn(dither, nrow[q - 1]));
                        cur = __fsub_rn(cur, __fmul_rn(preemph, prev));
                    }
                    v = __fmul_rn(cur, window[k]);
                }
                dst[k] = v;
            }
        }
    }
}

// The most threads a block may have (CUDA's limit): the size of the finish kernel's
// reduction buffer in shared memory (4 KiB).
#define AVPIPE_LOG_MEL_MAX_THREADS 1024

// The sum of every thread's x over the block, returned to every thread: the values go to
// red[0 .. blockDim.x) and fold in halves, red[i] += red[i + half] with half = ceil(h / 2),
// until one is left (any blockDim.x, a power of two or not; with one thread, x itself). The
// order is fixed by blockDim.x, so a result does not vary from run to run. Every thread of the
// block must call it (it synchronizes); red may be reused once it returns.
static __device__ float avpipe_block_sum(float* red, float x) {
    unsigned tid = threadIdx.x;
    red[tid] = x;
    __syncthreads();
    for (unsigned h = blockDim.x; h > 1;) {
        unsigned half = (h + 1) / 2;
        if (tid < h - half) red[tid] = __fadd_rn(red[tid], red[tid + half]);
        __syncthreads();
        h = half;
    }
    float s = red[0];
    __syncthreads();  // every thread has read red[0] before red is written again
    return s;
}

// Log, per-feature normalization over the valid frames, and the transpose: mel [R, M]
// (row-major; item b's valid frames at rows off[b] .. off[b] + min(fl[b], T), as the frames
// kernel packs them) -> out [B, M, T_out]. One block per output row r = (b, m) (gridDim.x = B * M,
// blockDim.x <= AVPIPE_LOG_MEL_MAX_THREADS); its threads stride over the frames t (thread i:
// t = i, i + blockDim.x, ...), so a warp writes 32 consecutive floats of the row. Valid frames:
// t < fl[b] (at most T). guard_add: ln(x + guard), else ln(max(x, guard)). norm: (v - mean) /
// (std + eps), std with `ddof` (0 when fl <= ddof); else v. Every position at or past fl[b]
// (up to T_out) is 0.
// The first pass writes the logs to the output row and the later passes read them back from
// there: each thread reads only the positions it wrote itself (no synchronization needed), mel's
// strided column is read once and each log computed once.
// The sums are per-thread partial sums, then a tree over the block (avpipe_block_sum): the
// array-module code's float32 mean and variance are plain sums, so the two agree within float32
// rounding of a different summation order, except on constant bands (below).
extern "C" __global__ void avpipe_log_mel_finish(
    const float* mel, long long B, long long T, int M, const long long* fl,
    const long long* off, int guard_add, float guard, int norm, int ddof, float eps, float* out,
    long long T_out) {
    __shared__ float red[AVPIPE_LOG_MEL_MAX_THREADS];
    long long r = blockIdx.x;  // the grid is exactly B * M blocks: no block returns early
    long long b = r / M;
    long long m = r - b * M;
    long long nv = fl[b] < T ? fl[b] : T;
    const float* src = mel + off[b] * M + m;
    float* dst = out + r * T_out;
    // the mean as the first value plus the mean offset from it: a band that is constant over
    // the valid frames (digital silence: ln(guard) throughout) gets its value back exactly and
    // normalizes to 0, as in float64, where a plain float32 sum leaves a rounding residue that
    // the division by (0 + eps) blows up to order 1. (Every thread reads src[0] itself.)
    float v0 = 0.0f;
    if (norm && nv > 0) {
        v0 = src[0];
        v0 = guard_add ? logf(__fadd_rn(v0, guard)) : logf(fmaxf(v0, guard));
    }
    float s = 0.0f;  // this thread's sum of (v - v0) over its valid frames
    for (long long t = threadIdx.x; t < T_out; t += blockDim.x) {
        float v = 0.0f;
        if (t < nv) {
            v = src[t * M];
            v = guard_add ? logf(__fadd_rn(v, guard)) : logf(fmaxf(v, guard));
            s = __fadd_rn(s, __fsub_rn(v, v0));
        }
        dst[t] = v;
    }
    if (!norm) return;  // norm is the same for the whole block: all threads return here
    float mean = __fadd_rn(v0, __fdiv_rn(avpipe_block_sum(red, s), (float)(nv > 1 ? nv : 1)));
    float s2 = 0.0f;  // this thread's sum of squared deviations
    for (long long t = threadIdx.x; t < nv; t += blockDim.x) {
        float d = __fsub_rn(dst[t], mean);
        s2 = __fadd_rn(s2, __fmul_rn(d, d));
    }
    s2 = avpipe_block_sum(red, s2);
    float var = nv > ddof ? __fdiv_rn(s2, (float)(nv - ddof > 1 ? nv - ddof : 1)) : 0.0f;
    float den = __fadd_rn(sqrtf(var), eps);
    for (long long t = threadIdx.x; t < nv; t += blockDim.x)
        dst[t] = __fdiv_rn(__fsub_rn(dst[t], mean), den);
}
