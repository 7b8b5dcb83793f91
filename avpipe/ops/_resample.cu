// Polyphase windowed-sinc resampling of a batch of rows, each at its own rate: one thread per
// output sample. The numpy reference is avpipe/ops/_resample.py (`resample`, `resample_rows`):
// output sample m of row b sits at input time m * down[b] / up[b]; it is the dot product of
// the row's samples base - (W - 1) .. base + W (base = floor(m * down / up)) with the taps of
// phase (m * down) mod up; samples outside 0 .. lens[b) count as zeros. A rate pair's taps are
// stored tap-major, [K, up] (tap i of phase ph at i * up + ph): a warp's 32 outputs have 32
// different phases, and this way their loads of tap i fall in a few cache lines, not 32.
// Positions at or past n_out[b] are written as 0. Accumulates in float32, tap by tap. The
// per-row values are one int64 table rows[b * 7 + ...]: lens, up, down, half (W), ktaps (K),
// toff (the row's taps' offset in `taps`), n_out; on the device, or (inl set) in the launch's
// own table `tab` (device/launch_table.cuh, compiled before this file: rows is then a byte
// offset into it). Row b of x starts at x + b * n_in; its output at out + b * width.
//
// Grid: blockIdx.x * blockDim.x + threadIdx.x is the output position m, blockIdx.y the row
// (rows beyond gridDim.y in steps of it). The index arithmetic is in I: 32-bit integers
// (avpipe_resample_rows32) where the host has checked that every m * down and every index
// fits (a 64-bit division costs many times a 32-bit one, and it is most of a thread's work),
// else 64-bit (avpipe_resample_rows). Taps wholly inside the row are summed without a bounds
// test per tap; the sums are the same either way (the same products, added in the same order).

template <typename I>
__device__ __forceinline__ void avpipe_resample_impl(
    const float* __restrict__ x, long long n_in, const long long* __restrict__ rows,
    const float* __restrict__ taps, float* __restrict__ out, long long width, int nrows) {
    const I m = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x;
    if ((long long)m >= width) return;
    for (int b = (int)blockIdx.y; b < nrows; b += (int)gridDim.y) {
        const long long* r = rows + (long long)b * 7;
        float acc = 0.0f;
        if ((long long)m < r[6]) {
            const I u = (I)r[1], d = (I)r[2];
            const I md = m * d;
            const I base = md / u;
            const I ph = md - base * u;
            const int K = (int)r[4];
            const float* h = taps + r[5] + (long long)ph;  // tap i at h[i * u]
            const float* row = x + (long long)b * n_in;
            const I L = (I)r[0];
            const I j0 = base - (I)(r[3] - 1);
            if (j0 >= 0 && j0 + (I)K <= L) {
                const float* p = row + j0;
                for (int i = 0; i < K; ++i) acc += p[i] * h[(I)i * u];
            } else {
                I j = j0;
                for (int i = 0; i < K; ++i, ++j) {
                    if (j >= 0 && j < L) acc += row[j] * h[(I)i * u];
                }
            }
        }
        out[(long long)b * width + m] = acc;
    }
}

extern "C" __global__ void avpipe_resample_rows(
    const float* x, long long n_in, const long long* rows, const float* taps, float* out,
    long long width, int nrows, const AVP_GRID_CONST AvpTable tab, int inl) {
    avpipe_resample_impl<long long>(x, n_in, avp_tab(tab, inl, rows), taps, out, width, nrows);
}

extern "C" __global__ void avpipe_resample_rows32(
    const float* x, long long n_in, const long long* rows, const float* taps, float* out,
    long long width, int nrows, const AVP_GRID_CONST AvpTable tab, int inl) {
    avpipe_resample_impl<int>(x, n_in, avp_tab(tab, inl, rows), taps, out, width, nrows);
}
