// The resize kernels that avpipe/ops/_resize_kernels.py launches (its docstring explains
// them). Loaded by avpipe.device.cuda_modules after launch_table.cuh (AvpTable, avp_tab).

// flat indices below this (with the grid-stride step added) fit in 32 bits
#define AVP_SMALL 0x7fffffffLL

template <typename T> __device__ __forceinline__ float avp_load(const T* p);
template <> __device__ __forceinline__ float avp_load<unsigned char>(const unsigned char* p) {
    return (float)(*p);
}
template <> __device__ __forceinline__ float avp_load<float>(const float* p) { return *p; }

__device__ __forceinline__ unsigned short avp_f2h(float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}

// tmp[b, r, ox, ch] = sum_k xw[ox, k] * src[b, row0 + r, xtab[ox].start + k, ch]
// I: the type of the flat index (32-bit division is much cheaper; 64-bit past 2^31 elements)
template <typename T, typename I>
__device__ __forceinline__ void avp_hpass(
    const T* __restrict__ src, long long sn, long long sh, long long sw, long long sc,
    int n, int row0, int rows, int ow, int c,
    const int* __restrict__ xtab, const float* __restrict__ xw, int taps,
    int round_mid, float* __restrict__ dst)
{
    const I total = (I)n * (I)rows * (I)ow * (I)c;
    const I step = (I)blockDim.x * (I)gridDim.x;
    for (I i = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x; i < total; i += step) {
        const int ch = (int)(i % (I)c);
        I t = i / (I)c;
        const int ox = (int)(t % (I)ow);
        t /= (I)ow;
        const int r = (int)(t % (I)rows);
        const long long b = (long long)(t / (I)rows);
        const int start = xtab[2 * ox];
        const int cnt = xtab[2 * ox + 1];
        const T* p = src + b * sn + (long long)(row0 + r) * sh + (long long)start * sw
                     + (long long)ch * sc;
        const float* w = xw + (long long)ox * taps;
        float acc = 0.0f;
        for (int k = 0; k < cnt; ++k) {
            acc += w[k] * avp_load<T>(p + (long long)k * sw);
        }
        if (round_mid) {
            acc = fminf(fmaxf(floorf(acc + 0.5f), 0.0f), 255.0f);
        }
        dst[i] = acc;
    }
}

// out[b, oy, ox, ch] = cast(a[ch] * sum_k yw[oy, k] * tmp[b, ytab[oy].start + k, ox, ch] + bb[ch])
// written at its linear index of a contiguous NCHW (nchw=1) or NHWC output.
// mode 0: float32, 1: float16 (bits), 2: uint8 (floor(v + 0.5) clipped to 0..255, a/bb unused).
template <typename I>
__device__ __forceinline__ void avp_vpass_impl(
    const float* __restrict__ tmp, int n, int rows, int ow, int c, int oh,
    const int* __restrict__ ytab, const float* __restrict__ yw, int taps,
    const float* __restrict__ a, const float* __restrict__ bb, int nchw, int mode,
    void* __restrict__ out)
{
    const I total = (I)n * (I)oh * (I)ow * (I)c;
    const I step = (I)blockDim.x * (I)gridDim.x;
    const long long rstride = (long long)ow * c;
    for (I i = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x; i < total; i += step) {
        int ch, ox, oy;
        long long b;
        I t;
        if (nchw) {
            ox = (int)(i % (I)ow);
            t = i / (I)ow;
            oy = (int)(t % (I)oh);
            t /= (I)oh;
            ch = (int)(t % (I)c);
            b = (long long)(t / (I)c);
        } else {
            ch = (int)(i % (I)c);
            t = i / (I)c;
            ox = (int)(t % (I)ow);
            t /= (I)ow;
            oy = (int)(t % (I)oh);
            b = (long long)(t / (I)oh);
        }
        const int start = ytab[2 * oy];
        const int cnt = ytab[2 * oy + 1];
        const float* p = tmp + ((b * rows + start) * ow + ox) * (long long)c + ch;
        const float* w = yw + (long long)oy * taps;
        float acc = 0.0f;
        for (int k = 0; k < cnt; ++k) {
            acc += w[k] * p[(long long)k * rstride];
        }
        if (mode == 2) {
            const float v = fminf(fmaxf(floorf(acc + 0.5f), 0.0f), 255.0f);
            ((unsigned char*)out)[i] = (unsigned char)v;
        } else {
            // (v * a) + b rounded separately, as numpy's normalize does
            const float v = __fadd_rn(__fmul_rn(acc, a[ch]), bb[ch]);
            if (mode == 1) {
                ((unsigned short*)out)[i] = avp_f2h(v);
            } else {
                ((float*)out)[i] = v;
            }
        }
    }
}

extern "C" __global__ void avp_hpass_u8(
    const unsigned char* __restrict__ src, long long sn, long long sh, long long sw, long long sc,
    int n, int row0, int rows, int ow, int c,
    const int* __restrict__ xtab, const float* __restrict__ xw, int taps,
    int round_mid, float* __restrict__ dst)
{
    if ((long long)n * rows * ow * c < AVP_SMALL)
        avp_hpass<unsigned char, unsigned int>(src, sn, sh, sw, sc, n, row0, rows, ow, c, xtab,
                                               xw, taps, round_mid, dst);
    else
        avp_hpass<unsigned char, long long>(src, sn, sh, sw, sc, n, row0, rows, ow, c, xtab,
                                            xw, taps, round_mid, dst);
}

extern "C" __global__ void avp_hpass_f32(
    const float* __restrict__ src, long long sn, long long sh, long long sw, long long sc,
    int n, int row0, int rows, int ow, int c,
    const int* __restrict__ xtab, const float* __restrict__ xw, int taps,
    int round_mid, float* __restrict__ dst)
{
    if ((long long)n * rows * ow * c < AVP_SMALL)
        avp_hpass<float, unsigned int>(src, sn, sh, sw, sc, n, row0, rows, ow, c, xtab, xw, taps,
                                       round_mid, dst);
    else
        avp_hpass<float, long long>(src, sn, sh, sw, sc, n, row0, rows, ow, c, xtab, xw, taps,
                                    round_mid, dst);
}

extern "C" __global__ void avp_vpass(
    const float* __restrict__ tmp, int n, int rows, int ow, int c, int oh,
    const int* __restrict__ ytab, const float* __restrict__ yw, int taps,
    const float* __restrict__ a, const float* __restrict__ bb, int nchw, int mode,
    void* __restrict__ out)
{
    if ((long long)n * oh * ow * c < AVP_SMALL)
        avp_vpass_impl<unsigned int>(tmp, n, rows, ow, c, oh, ytab, yw, taps, a, bb, nchw, mode,
                                     out);
    else
        avp_vpass_impl<long long>(tmp, n, rows, ow, c, oh, ytab, yw, taps, a, bb, nchw, mode,
                                  out);
}

// ---- the one-pass kernel: each output pixel's taps computed in the kernel (no tables) ----------
#define AVP_MAXTAP 16

// |x| through the filter, in float64 (numpy's _triangle / _cubic step for step; no fused
// multiply-adds, so the weights are numpy's bit for bit)
__device__ __forceinline__ double avp_filter(double x, int cubic, double a) {
    x = fabs(x);
    if (!cubic) return x < 1.0 ? __dsub_rn(1.0, x) : 0.0;
    const double x2 = __dmul_rn(x, x), x3 = __dmul_rn(x2, x);
    if (x < 1.0)
        return __dadd_rn(__dsub_rn(__dmul_rn(a + 2.0, x3), __dmul_rn(a + 3.0, x2)), 1.0);
    if (x < 2.0)
        return __dsub_rn(__dadd_rn(__dsub_rn(__dmul_rn(a, x3), __dmul_rn(__dmul_rn(5.0, a), x2)),
                                   __dmul_rn(__dmul_rn(8.0, a), x)), __dmul_rn(4.0, a));
    return 0.0;
}

// The taps of output position i of resizing an axis of in_size to out_size
// (_image_resize.axis_weights): *first, the first input index, and n weights (float32, as the
// tables hold them). aa: PIL's filters (widened when downscaling, renormalized; the sum as
// numpy's pairwise sum adds them); else torch's interpolate (align_corners=False).
__device__ __forceinline__ int avp_taps(int in_size, int out_size, int i, int cubic, int aa,
                                        int* first, float* w) {
    const double scale = (double)in_size / (double)out_size;
    double k[AVP_MAXTAP];
    int n;
    if (aa) {
        const double fscale = scale > 1.0 ? scale : 1.0;
        const double support = __dmul_rn(cubic ? 2.0 : 1.0, fscale);
        const double center = __dmul_rn((double)i + 0.5, scale);
        long long xmin = (long long)__dadd_rn(__dsub_rn(center, support), 0.5);
        long long xmax = (long long)__dadd_rn(__dadd_rn(center, support), 0.5);
        if (xmin < 0) xmin = 0;
        if (xmax > in_size) xmax = in_size;
        n = (int)(xmax - xmin);
        if (n < 0) n = 0;
        if (n > AVP_MAXTAP) n = AVP_MAXTAP;  // (the host picks this kernel only below that)
        for (int j = 0; j < n; ++j) {
            const double t = __ddiv_rn(__dadd_rn(__dsub_rn((double)(xmin + j), center), 0.5),
                                       fscale);
            k[j] = avp_filter(t, cubic, -0.5);
        }
        double total;
        if (n < 8) {
            total = 0.0;
            for (int j = 0; j < n; ++j) total = __dadd_rn(total, k[j]);
        } else {  // numpy's pairwise_sum: eight accumulators, then the rest in order
            double r[8];
            for (int j = 0; j < 8; ++j) r[j] = k[j];
            int j = 8;
            for (; j + 8 <= n; j += 8)
                for (int q = 0; q < 8; ++q) r[q] = __dadd_rn(r[q], k[j + q]);
            total = __dadd_rn(__dadd_rn(__dadd_rn(r[0], r[1]), __dadd_rn(r[2], r[3])),
                              __dadd_rn(__dadd_rn(r[4], r[5]), __dadd_rn(r[6], r[7])));
            for (; j < n; ++j) total = __dadd_rn(total, k[j]);
        }
        const double div = total != 0.0 ? total : 1.0;
        for (int j = 0; j < n; ++j) w[j] = (float)__ddiv_rn(k[j], div);
        *first = (int)xmin;
        return n;
    }
    double src = __dsub_rn(__dmul_rn((double)i + 0.5, scale), 0.5);
    if (!cubic) {
        if (src < 0.0) src = 0.0;
        long long x0 = (long long)floor(src);
        if (x0 > in_size - 1) x0 = in_size - 1;
        const double lam = __dsub_rn(src, (double)x0);
        *first = (int)x0;  // taps x0 and x0 + 1, clamped into the axis
        w[0] = (float)__dsub_rn(1.0, lam);
        w[1] = (float)lam;
        return -2;
    }
    const long long x0 = (long long)floor(src);
    const double t = __dsub_rn(src, (double)x0);
    for (int j = 0; j < 4; ++j) w[j] = (float)avp_filter(__dsub_rn(t, (double)(j - 1)), 1, -0.75);
    *first = (int)(x0 - 1);  // taps x0 - 1 .. x0 + 2, each clamped into the axis
    return -4;
}

// The input index of tap j from avp_taps (n < 0: the taps are clamped into 0 .. in - 1)
__device__ __forceinline__ int avp_tap_index(int first, int j, int n, int in_size) {
    const int v = first + j;
    if (n >= 0) return v;
    return v < 0 ? 0 : (v > in_size - 1 ? in_size - 1 : v);
}

// The input row / column of a tap: t + off, clamped into the input's 0 .. size - 1 (a tap
// outside it has a zero weight: the host checks a window holds every tap it reads)
__device__ __forceinline__ long long avp_at(int t, int off, int size) {
    const int v = t + off;
    return (long long)(v < 0 ? 0 : (v > size - 1 ? size - 1 : v));
}

// out[b, oy, ox, ch] (NHWC) or [b, ch, oy, ox] (NCHW), b's block at out + b * ob elements:
// output rows y_lo + oy and columns x_lo + ox (reversed when flip) of resizing the axes'
// (y_in x x_in) geometry to (y_out x x_out); tap t of an axis reads input index t + off of
// the input's y_size rows and x_size columns.
// A block (AVP_TILE^2 threads) computes a tile of AVP_TILE x AVP_TILE output pixels for the
// images of chunk blockIdx.y (AVP_FRAMES of them; grid-stride over the chunks). Its first
// threads compute the tile's column and row taps into shared memory, once; then, for as many
// images at once as AVP_ROWS rows hold, the block sums the horizontal taps of every input row
// the tile's rows read (the first pass, kept in shared memory: one image's at most AVP_ROWS
// rows, which the host checks), and each thread sums its pixel's vertical taps over them (the
// second pass), image by image: the two passes' values.
// mode 0: float32 v * a + b, 1: float16 of it, 2: uint8 (rounded and clipped). round_mid:
// each row's horizontal sum rounded and clipped to 0..255 first (PIL's 8-bit two passes).
#define AVP_FRAMES 8
#define AVP_TILE 16
#define AVP_ROWS 144
template <typename T>
__device__ __forceinline__ void avp_direct_impl(
    const T* __restrict__ src, long long sn, long long sh, long long sw, long long sc,
    int n, int c, int y_in, int y_out, int y_lo, int y_off, int y_size, int oh,
    int x_in, int x_out, int x_lo, int x_off, int x_size, int ow, int flip, int cubic, int aa,
    int round_mid, float a0, float a1, float a2, float a3, float b0, float b1, float b2,
    float b3, int nchw, int mode, void* __restrict__ out, long long ob)
{
    __shared__ float s_w[2][AVP_TILE][AVP_MAXTAP];  // [0]: the tile's columns, [1]: its rows
    __shared__ long long s_col[AVP_TILE][AVP_MAXTAP];  // the column taps' element offsets
    __shared__ int s_row[AVP_TILE][AVP_MAXTAP];  // the row taps' input rows
    __shared__ int s_n[2][AVP_TILE];
    __shared__ int s_span[2];  // the first and last input row the tile reads
    __shared__ float s_h[AVP_ROWS][AVP_TILE][4];  // the first pass, for one image
    const int tiles_x = (ow + AVP_TILE - 1) / AVP_TILE;
    const int tx0 = (int)(blockIdx.x % tiles_x) * AVP_TILE;
    const int ty0 = (int)(blockIdx.x / tiles_x) * AVP_TILE;
    const int tid = (int)threadIdx.x;
    if (tid < 2 * AVP_TILE) {
        const int axis = tid / AVP_TILE, j = tid % AVP_TILE;
        const int o = axis == 0 ? tx0 + j : ty0 + j;
        int cnt = 0;
        if (o < (axis == 0 ? ow : oh)) {
            int f;
            float* w = s_w[axis][j];
            if (axis == 0) {
                const int nx = avp_taps(x_in, x_out, x_lo + (flip ? ow - 1 - o : o), cubic, aa,
                                        &f, w);
                cnt = nx < 0 ? -nx : nx;
                for (int k = 0; k < cnt; ++k)
                    s_col[j][k] = avp_at(avp_tap_index(f, k, nx, x_in), x_off, x_size) * sw;
            } else {
                const int ny = avp_taps(y_in, y_out, y_lo + o, cubic, aa, &f, w);
                cnt = ny < 0 ? -ny : ny;
                for (int k = 0; k < cnt; ++k)
                    s_row[j][k] = (int)avp_at(avp_tap_index(f, k, ny, y_in), y_off, y_size);
            }
        }
        s_n[axis][j] = cnt;
    }
    __syncthreads();
    if (tid == 0) {
        int lo = 0x7fffffff, hi = -1;
        for (int j = 0; j < AVP_TILE; ++j)
            for (int k = 0; k < s_n[1][j]; ++k) {
                lo = min(lo, s_row[j][k]);
                hi = max(hi, s_row[j][k]);
            }
        s_span[0] = lo;
        s_span[1] = hi;
    }
    __syncthreads();
    const int rlo = s_span[0], nrows = s_span[1] - s_span[0] + 1;
    const int lx = tid % AVP_TILE, ly = tid / AVP_TILE;
    const int ox = tx0 + lx, oy = ty0 + ly;
    const bool mine = ox < ow && oy < oh;
    const float av[4] = {a0, a1, a2, a3}, bv[4] = {b0, b1, b2, b3};
    const int chunks = (n + AVP_FRAMES - 1) / AVP_FRAMES;
    // the images whose first passes fit s_h together: done at once (fewer rounds of loads
    // waited for and of barriers)
    const int fsim = min(AVP_FRAMES, max(1, AVP_ROWS / nrows));
    const int span = nrows * AVP_TILE;  // one image's first-pass values
    for (int chunk = (int)blockIdx.y; chunk < chunks; chunk += (int)gridDim.y) {
        const int b_end = chunk * AVP_FRAMES + AVP_FRAMES < n ? chunk * AVP_FRAMES + AVP_FRAMES : n;
        for (int b0 = chunk * AVP_FRAMES; b0 < b_end; b0 += fsim) {
            const int nf = min(fsim, b_end - b0);
            // first pass: the horizontal sums of the rows rlo .. rlo + nrows - 1 of images
            // b0 .. b0 + nf - 1 (image f's in s_h rows f * nrows ..)
            for (int q = tid; q < nf * span; q += AVP_TILE * AVP_TILE) {
                const int f = q / span, rr = q - f * span;
                const int r = rr / AVP_TILE, j = rr % AVP_TILE;
                const T* row = src + (long long)(b0 + f) * sn + (long long)(rlo + r) * sh;
                float h[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                const int kn = s_n[0][j];  // 0 past the output's last column
                for (int kx = 0; kx < kn; ++kx) {
                    const T* p = row + s_col[j][kx];
                    const float w = s_w[0][j][kx];
#pragma unroll
                    for (int ch = 0; ch < 4; ++ch)  // (unrolled: h stays in registers)
                        if (ch < c) h[ch] += w * avp_load<T>(p + ch * sc);
                }
#pragma unroll
                for (int ch = 0; ch < 4; ++ch)
                    if (ch < c)
                        s_h[f * nrows + r][j][ch] = round_mid
                            ? fminf(fmaxf(floorf(h[ch] + 0.5f), 0.0f), 255.0f) : h[ch];
            }
            __syncthreads();
            if (mine) {  // second pass: this pixel's vertical taps, image by image
                const int kn = s_n[1][ly];
                for (int f = 0; f < nf; ++f) {
                    const int b = b0 + f;
                    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    for (int ky = 0; ky < kn; ++ky) {
                        const float w = s_w[1][ly][ky];
                        const float* hv = s_h[f * nrows + s_row[ly][ky] - rlo][lx];
#pragma unroll
                        for (int ch = 0; ch < 4; ++ch)
                            if (ch < c) acc[ch] += w * hv[ch];
                    }
#pragma unroll
                    for (int ch = 0; ch < 4; ++ch) {
                        if (ch >= c) break;
                        const long long o = (long long)b * ob
                            + (nchw ? ((long long)ch * oh + oy) * ow + ox
                                    : ((long long)oy * ow + ox) * c + ch);
                        if (mode == 2) {
                            ((unsigned char*)out)[o] =
                                (unsigned char)fminf(fmaxf(floorf(acc[ch] + 0.5f), 0.0f), 255.0f);
                        } else {
                            const float v = __fadd_rn(__fmul_rn(acc[ch], av[ch]), bv[ch]);
                            if (mode == 1) ((unsigned short*)out)[o] = avp_f2h(v);
                            else ((float*)out)[o] = v;
                        }
                    }
                }
            }
            __syncthreads();  // the next images' first pass overwrites s_h
        }
    }
}

#define AVP_DIRECT_ARGS \
    long long sn, long long sh, long long sw, long long sc, int n, int c, int y_in, int y_out, \
    int y_lo, int y_off, int y_size, int oh, int x_in, int x_out, int x_lo, int x_off, \
    int x_size, int ow, int flip, \
    int cubic, int aa, int round_mid, float a0, float a1, float a2, float a3, float b0, \
    float b1, float b2, float b3, int nchw, int mode, void* __restrict__ out, long long ob
#define AVP_DIRECT_PASS \
    sn, sh, sw, sc, n, c, y_in, y_out, y_lo, y_off, y_size, oh, x_in, x_out, x_lo, x_off, \
    x_size, ow, flip, \
    cubic, aa, round_mid, a0, a1, a2, a3, b0, b1, b2, b3, nchw, mode, out, ob

extern "C" __global__ void avp_direct_u8(const unsigned char* __restrict__ src,
                                         AVP_DIRECT_ARGS)
{
    avp_direct_impl<unsigned char>(src, AVP_DIRECT_PASS);
}

extern "C" __global__ void avp_direct_f32(const float* __restrict__ src, AVP_DIRECT_ARGS)
{
    avp_direct_impl<float>(src, AVP_DIRECT_PASS);
}

// The one-pass kernel over a list of images of different sizes and strides (a batch of clips,
// each with its own crop box and flip), all resized to oh x ow: blockIdx.z is the item, whose
// AVP_ITEM int64 values are: its first element's address, its strides (image, row, column,
// channel; elements), its images, y_in, y_off, y_size, x_in, x_off, x_size, flip, and its
// output's byte offset from out. The items' table is on the device, or (inl set) in the
// launch's own table `tab` (items then a byte offset into it; device/launch_table.cuh).
#define AVP_ITEM 14
#define AVP_ITEMS_ARGS \
    const long long* __restrict__ items, int c, int y_out, int oh, int x_out, int ow, int cubic, \
    int aa, int round_mid, float a0, float a1, float a2, float a3, float b0, float b1, \
    float b2, float b3, int nchw, int mode, char* __restrict__ out, long long ob, \
    const AVP_GRID_CONST AvpTable tab, int inl
#define AVP_ITEMS_PASS(T) \
    const long long* it = avp_tab(tab, inl, items) + (long long)blockIdx.z * AVP_ITEM; \
    avp_direct_impl<T>((const T*)it[0], it[1], it[2], it[3], it[4], (int)it[5], c, (int)it[6], \
                       y_out, 0, (int)it[7], (int)it[8], oh, (int)it[9], x_out, 0, (int)it[10], \
                       (int)it[11], ow, (int)it[12], cubic, aa, round_mid, a0, a1, a2, a3, b0, \
                       b1, b2, b3, nchw, mode, (void*)(out + it[13]), ob)

extern "C" __global__ void avp_direct_items_u8(AVP_ITEMS_ARGS)
{
    AVP_ITEMS_PASS(unsigned char);
}

extern "C" __global__ void avp_direct_items_f32(AVP_ITEMS_ARGS)
{
    AVP_ITEMS_PASS(float);
}
