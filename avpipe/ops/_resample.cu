// Polyphase windowed-sinc resampling of a batch of rows, each at its own rate: one thread per
// output sample. The numpy reference is avpipe/ops/_resample.py (`resample`, `resample_rows`):
// output sample m of row b sits at input time m * down[b] / up[b]; it is the dot product of
// the row's samples base - (W - 1) .. base + W (base = floor(m * down / up)) with the taps of
// phase (m * down) mod up; samples outside 0 .. lens[b) count as zeros. Positions at or past
// n_out[b] are written as 0. Accumulates in float32, tap by tap. The per-row values are one
// int64 table rows[b * 7 + ...]: lens, up, down, half (W), ktaps (K), toff (the row's taps'
// offset in `taps`), n_out. Row b of x starts at x + b * n_in.

extern "C" __global__ void avpipe_resample_rows(
    const float* x, long long n_in, const long long* rows, const float* taps, float* out,
    long long width, long long total) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= total) return;
    long long b = t / width;
    long long m = t - b * width;
    const long long* r = rows + b * 7;
    float acc = 0.0f;
    if (m < r[6]) {
        long long u = r[1], d = r[2];
        long long base = (m * d) / u;
        long long ph = (m * d) - base * u;
        int K = (int)r[4];
        const float* h = taps + r[5] + ph * K;
        const float* row = x + b * n_in;
        long long L = r[0];
        long long j = base - (r[3] - 1);
        for (int i = 0; i < K; ++i, ++j) {
            if (j >= 0 && j < L) acc += row[j] * h[i];
        }
    }
    out[t] = acc;
}
