// The CUDA side of avpipe/ops/random.py: Philox4x32 and the standard normal draws built on it.
// Fragments, each after a "//@@ name" line; "@name@" alone on a line stands for that fragment
// (random.py reads them through avpipe.device.cuda_modules.read_fragments).

//@@ philox_body
// The rounds, as the body of one CUDA elementwise kernel (cupy): the same integer steps as
// random.py's numpy code, which is its reference (bit-identical; tests/ops/test_random.py runs
// this body as C++).
unsigned int a0 = c0, a1 = c1, a2 = c2, a3 = c3, key0 = k0, key1 = k1;
for (int r = 0; r < rounds; ++r) {
    unsigned long long p0 = (unsigned long long)a0 * 0xD2511F53ull;
    unsigned long long p1 = (unsigned long long)a2 * 0xCD9E8D57ull;
    unsigned int hi0 = (unsigned int)(p0 >> 32), lo0 = (unsigned int)p0;
    unsigned int hi1 = (unsigned int)(p1 >> 32), lo1 = (unsigned int)p1;
    a0 = hi1 ^ a1 ^ key0; a1 = lo1; a2 = hi0 ^ a3 ^ key1; a3 = lo0;
    key0 += 0x9E3779B9u; key1 += 0xBB67AE85u;
}
o0 = a0; o1 = a1; o2 = a2; o3 = a3;

//@@ philox_function
// The rounds as a device function, for kernels that draw their own parameters (put before
// their source: ops/_spec_augment.cu's draws).
__device__ inline void avpipe_philox(unsigned int c0, unsigned int c1, unsigned int c2,
    unsigned int c3, unsigned int k0, unsigned int k1, unsigned int& o0, unsigned int& o1,
    unsigned int& o2, unsigned int& o3) {
const int rounds = 10;
@philox_body@
}

//@@ normal_body
// A whole array of standard normal draws from a key alone (a dither's noise), the body of one
// elementwise kernel: element i takes the Philox4x32-10 words of the counter (i // 2, 0, 0, 0),
// the first two for an even i and the last two for an odd one, through Box-Muller's cosine
// branch in float64, rounded to float32 (no generator to set up: cuRAND's, made per call,
// waited for the whole device on every batch); standard_normal's numpy code is its reference.
unsigned long long c = (unsigned long long)i >> 1;
unsigned int c0 = (unsigned int)c, c1 = (unsigned int)(c >> 32), c2 = 0u, c3 = 0u;
unsigned int o0, o1, o2, o3;
const int rounds = 10;
@philox_body@
unsigned int u = (i & 1) ? o2 : o0, v = (i & 1) ? o3 : o1;
double r = sqrt(-2.0 * log(((double)u + 1.0) * 2.3283064365386963e-10));
z = (float)(r * cos(6.283185307179586 * ((double)v * 2.3283064365386963e-10)));

//@@ normal_rows
// The same draws over the rows of a [B, n] array, each row's first lens[b] elements only (the
// rest 0): a padded batch's noise without the padding's draws. Threads over the columns (x),
// blocks over the rows (y), both striding; the row lengths in the launch's table where they
// fit (launch_table.cuh, put before this).
extern "C" __global__ void avpipe_standard_normal_rows(
    unsigned int k0, unsigned int k1, const long long* lens, long long B, long long n,
    float* out, const AVP_GRID_CONST AvpTable tab, int inl) {
    const long long* L = avp_tab(tab, inl, lens);
    for (long long b = blockIdx.y; b < B; b += gridDim.y) {
        long long len = L[b];
        for (long long col = blockIdx.x * (long long)blockDim.x + threadIdx.x; col < n;
             col += (long long)gridDim.x * blockDim.x) {
            long long i = b * n + col;
            float z = 0.0f;
            if (col < len) {
@normal_body@
            }
            out[i] = z;
        }
    }
}
