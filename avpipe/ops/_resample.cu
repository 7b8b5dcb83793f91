// Polyphase windowed-sinc resampling of a batch of rows, each at its own rate: one thread per
// output sample. The numpy reference is avpipe/ops/_resample.py (`resample`, `resample_rows`):
// output sample m of row b sits at input time m * down[b] / up[b]; it is the dot product of
// the row's samples base - (W - 1) .. base + W (base = floor(m * down / up)) with the taps of
// phase (m * down) mod up; samples outside 0 .. lens[b) count as zeros. Positions at or past
// n_out[b] are written as 0. Accumulates in float32, tap by tap.

extern "C" __global__ void avpipe_resample_rows(
    const float* x, long long n_in, const long long* lens, const int* up, const int* down,
    const int* half, const int* ktaps, const long long* toff, const float* taps,
    const long long* n_out, float* out, long long width, long long total) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= total) return;
    long long b = t / width;
    long long m = t - b * width;
    float acc = 0.0f;
    if (m < n_out[b]) {
        long long u = up[b], d = down[b];
        long long base = (m * d) / u;
        long long ph = (m * d) - base * u;
        int K = ktaps[b];
        const float* h = taps + toff[b] + ph * K;
        const float* row = x + b * n_in;
        long long L = lens[b];
        long long j = base - (half[b] - 1);
        for (int i = 0; i < K; ++i, ++j) {
            if (j >= 0 && j < L) acc += row[j] * h[i];
        }
    }
    out[t] = acc;
}
