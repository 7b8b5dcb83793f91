// SpecAugment's masks applied to a batch of features in one pass: one thread per cell of
// x [B, F, T] (float32). The numpy reference is apply_spec_augment in
// avpipe/ops/audio_augment.py. p holds per item b, at p + b * (1 + 2 kf + 2 kt): its length
// in frames, kf frequency-mask starts, kf widths, kt time-mask starts, kt widths. A cell
// (b, f, t) with t < length is set to `value` when f lies in a frequency mask
// [start, start + width) or t in a time mask [start, min(start + width, length)); cells at or
// past the length are copied unchanged.

extern "C" __global__ void avpipe_spec_augment(
    const float* x, float* out, const long long* p, int kf, int kt, long long F, long long T,
    long long total, float value) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    long long t = i % T;
    long long f = (i / T) % F;
    long long b = i / (T * F);
    const long long* q = p + b * (1 + 2 * (long long)kf + 2 * (long long)kt);
    long long len = q[0];
    bool m = false;
    if (t < len) {
        for (int k = 0; k < kf; ++k) {
            long long s = q[1 + k], w = q[1 + kf + k];
            if (f >= s && f < s + w) m = true;
        }
        for (int k = 0; k < kt; ++k) {
            long long s = q[1 + 2 * kf + k], w = q[1 + 2 * kf + kt + k];
            long long e = s + w < len ? s + w : len;
            if (t >= s && t < e) m = true;
        }
    }
    out[i] = m ? value : x[i];
}
