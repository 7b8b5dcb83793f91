// log_mel on a GPU in few launches (avpipe/ops/_log_mel.py runs them: frames -> cupy rfft ->
// |X|^2 -> mel GEMM -> finish). The numpy reference is the array-module code of
// avpipe/ops/_audio_core.py (dither, preemphasis, stft, log_guarded, normalize); the
// arithmetic of the first steps is the same float32 operations in the same order (no fused
// multiply-adds), so the frames equal that code's on cupy bit for bit.

// Windowed frames [B, T, n_fft] of the dithered, preemphasised, zero-padded signal: frame t,
// tap k reads sample q = t * hop + k - pad of item b (0 outside 0 .. lens[b]). noise: [B, n]
// standard normal (null: no dither), scaled by `dither`.
extern "C" __global__ void avpipe_log_mel_frames(
    const float* x, const float* noise, float dither, long long n, const long long* lens,
    float preemph, int has_preemph, const float* window, int n_fft, int hop, int pad,
    long long T, float* frames, long long total) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    long long k = i % n_fft;
    long long t = (i / n_fft) % T;
    long long b = i / ((long long)n_fft * T);
    long long q = t * hop + k - pad;
    float v = 0.0f;
    if (q >= 0 && q < lens[b]) {
        const float* row = x + b * n;
        float cur = row[q];
        if (noise) cur = __fadd_rn(cur, __fmul_rn(dither, noise[b * n + q]));
        if (has_preemph && q > 0) {
            float prev = row[q - 1];
            if (noise) prev = __fadd_rn(prev, __fmul_rn(dither, noise[b * n + q - 1]));
            cur = __fsub_rn(cur, __fmul_rn(preemph, prev));
        }
        v = __fmul_rn(cur, window[k]);
    }
    frames[i] = v;
}

// Log, per-feature normalization over the valid frames, and the transpose: mel [B, T, M]
// (row-major) -> out [B, M, T_out]; one thread per (item, mel band), reading a warp's bands
// side by side. Valid frames: t < fl[b] (at most T). guard_add: ln(x + guard), else
// ln(max(x, guard)). norm: (v - mean) / (std + eps), std with `ddof` (0 when fl <= ddof);
// else v. Every position at or past fl[b] is 0. (The array-module code's float32 mean is a
// plain sum: the two agree within float32 rounding except on constant bands, below.)
extern "C" __global__ void avpipe_log_mel_finish(
    const float* mel, long long B, long long T, int M, const long long* fl, int guard_add,
    float guard, int norm, int ddof, float eps, float* out, long long T_out) {
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= B * M) return;
    long long b = r / M;
    long long m = r - b * M;
    long long nv = fl[b] < T ? fl[b] : T;
    const float* src = mel + b * T * M + m;
    float* dst = out + r * T_out;
    float mean = 0.0f, den = 1.0f;
    if (norm) {
        // the mean as the first value plus the mean offset from it: a band that is constant
        // over the valid frames (digital silence: ln(guard) throughout) gets its value back
        // exactly and normalizes to 0, as in float64, where a plain float32 sum leaves a
        // rounding residue that the division by (0 + eps) blows up to order 1
        float v0 = 0.0f;
        if (nv > 0) {
            v0 = src[0];
            v0 = guard_add ? logf(__fadd_rn(v0, guard)) : logf(fmaxf(v0, guard));
        }
        float s = 0.0f;
        for (long long t = 0; t < nv; ++t) {
            float v = src[t * M];
            v = guard_add ? logf(__fadd_rn(v, guard)) : logf(fmaxf(v, guard));
            s = __fadd_rn(s, __fsub_rn(v, v0));
        }
        mean = __fadd_rn(v0, __fdiv_rn(s, (float)(nv > 1 ? nv : 1)));
        float s2 = 0.0f;
        for (long long t = 0; t < nv; ++t) {
            float v = src[t * M];
            v = guard_add ? logf(__fadd_rn(v, guard)) : logf(fmaxf(v, guard));
            float d = __fsub_rn(v, mean);
            s2 = __fadd_rn(s2, __fmul_rn(d, d));
        }
        float var = nv > ddof ? __fdiv_rn(s2, (float)(nv - ddof > 1 ? nv - ddof : 1)) : 0.0f;
        den = __fadd_rn(sqrtf(var), eps);
    }
    for (long long t = 0; t < T_out; ++t) {
        float v = 0.0f;
        if (t < nv) {
            v = src[t * M];
            v = guard_add ? logf(__fadd_rn(v, guard)) : logf(fmaxf(v, guard));
            if (norm) v = __fdiv_rn(__fsub_rn(v, mean), den);
        }
        dst[t] = v;
    }
}
