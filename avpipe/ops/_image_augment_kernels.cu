// The clip augmentation kernels that avpipe/ops/_image_augment_kernels.py launches (its
// docstring explains them). Loaded by avpipe.device.cuda_modules after launch_table.cuh
// (AvpTable, avp_tab).

#ifndef AVP_MUL
#define AVP_MUL(a, b) __fmul_rn((a), (b))
#define AVP_ADD(a, b) __fadd_rn((a), (b))
#endif
#define AVP_SMALL 0x7fffffffLL

template <typename T> __device__ __forceinline__ float avp_ld(const T* p);
template <> __device__ __forceinline__ float avp_ld<unsigned char>(const unsigned char* p) {
    return (float)(*p);
}
template <> __device__ __forceinline__ float avp_ld<float>(const float* p) { return *p; }

#ifndef AVP_F2H_DEFINED
// float -> float16 bits, rounded to nearest even (numpy's astype(float16))
__device__ __forceinline__ unsigned short avp_f2h(float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
#endif

__device__ __forceinline__ float avp_clip(float v, float hi) { return fminf(fmaxf(v, 0.0f), hi); }

// rounded half up, clipped to 0..255
__device__ __forceinline__ float avp_level(float v) { return avp_clip(floorf(v + 0.5f), 255.0f); }
__device__ __forceinline__ unsigned char avp_u8(float v) { return (unsigned char)avp_level(v); }

__device__ __forceinline__ float avp_gray(float r, float g, float b) {
    return AVP_ADD(AVP_ADD(AVP_MUL(r, 0.2989f), AVP_MUL(g, 0.587f)), AVP_MUL(b, 0.114f));
}

// f * v + (1 - f) * m, clipped to 0..bound (numpy: each product and the sum rounded)
__device__ __forceinline__ float avp_blend(float f, float v, float m, float bound) {
    return avp_clip(AVP_ADD(AVP_MUL(f, v), AVP_MUL(1.0f - f, m)), bound);
}

// torchvision's _rgb2hsv, shift by f turns (Python-style mod 1), _hsv2rgb, on values 0..bound
// without dividing them by bound: s, the channels' distances over the chroma and h are ratios
// (the same at any scale), and v * bound is maxc. Two divisions where the formulas have eight
// (the rest multiply by a reciprocal): the values differ from numpy's in the last bits only.
__device__ void avp_hue(float& r, float& g, float& b, float f, float bound) {
    const float maxc = fmaxf(fmaxf(r, g), b);
    const float minc = fminf(fminf(r, g), b);
    const bool eqc = maxc == minc;
    const float cr = maxc - minc;
    const float s = cr / (eqc ? 1.0f : maxc);
    const float inv = 1.0f / (eqc ? 1.0f : cr);
    const float rc = (maxc - r) * inv, gc = (maxc - g) * inv, bc = (maxc - b) * inv;
    float hh;
    if (maxc == r) hh = bc - gc;
    else if (maxc == g) hh = 2.0f + rc - bc;
    else hh = 4.0f + gc - rc;
    // Python's mod 1 of values in [-0.5, 2) as x - floor(x) (fmodf's values on these ranges,
    // without its slow path)
    float h = hh * (1.0f / 6.0f) + 1.0f;
    h = h - floorf(h);
    h = h + f;
    h = h - floorf(h);
    const float v = maxc;
    const float i6 = floorf(h * 6.0f);
    const float fr = h * 6.0f - i6;
    const int i = (((int)i6 % 6) + 6) % 6;
    const float p = avp_clip(v * (1.0f - s), bound);
    const float q = avp_clip(v * (1.0f - s * fr), bound);
    const float t = avp_clip(v * (1.0f - s * (1.0f - fr)), bound);
    switch (i) {
        case 0: r = v; g = t; b = p; break;
        case 1: r = q; g = v; b = p; break;
        case 2: r = p; g = v; b = t; break;
        case 3: r = p; g = q; b = v; break;
        case 4: r = t; g = p; b = v; break;
        default: r = v; g = p; b = q; break;
    }
}

// one step of the jitter: op 0 brightness, 1 contrast (m: the frame's gray mean), 2 saturation,
// 3 hue (skipped for a zero shift, as the numpy path)
__device__ __forceinline__ void avp_step(int op, float f, float m, float bound, float& r,
                                         float& g, float& b) {
    if (op == 0) {
        r = avp_clip(AVP_MUL(f, r), bound); g = avp_clip(AVP_MUL(f, g), bound);
        b = avp_clip(AVP_MUL(f, b), bound);
    } else if (op == 1 || op == 2) {
        const float t = op == 1 ? m : avp_gray(r, g, b);
        r = avp_blend(f, r, t, bound); g = avp_blend(f, g, t, bound); b = avp_blend(f, b, t, bound);
    } else if (f != 0.0f) {
        avp_hue(r, g, b, f, bound);
    }
}

__device__ __forceinline__ float avp_factor(int op, long long it, const double* fb,
                                            const double* fc, const double* fs,
                                            const double* fh) {
    const double* p = op == 0 ? fb : op == 1 ? fc : op == 2 ? fs : fh;
    return (float)p[it];
}

// an item's jitter steps, read once per thread: the ops in its order and their factors
struct AvpSteps {
    int op0, op1, op2, op3;
    float f0, f1, f2, f3;
};

__device__ __forceinline__ AvpSteps avp_steps(const long long* order, long long it,
                                              const double* fb, const double* fc,
                                              const double* fs, const double* fh) {
    AvpSteps q;
    q.op0 = (int)order[it * 4]; q.op1 = (int)order[it * 4 + 1];
    q.op2 = (int)order[it * 4 + 2]; q.op3 = (int)order[it * 4 + 3];
    q.f0 = avp_factor(q.op0, it, fb, fc, fs, fh); q.f1 = avp_factor(q.op1, it, fb, fc, fs, fh);
    q.f2 = avp_factor(q.op2, it, fb, fc, fs, fh); q.f3 = avp_factor(q.op3, it, fb, fc, fs, fh);
    return q;
}

// the item's steps before its contrast (n of them: 0..3), then the gray value
__device__ __forceinline__ float avp_gray_before_contrast(const AvpSteps& q, int n, float bound,
                                                          float r, float g, float b) {
    if (n > 0) avp_step(q.op0, q.f0, 0.0f, bound, r, g, b);
    if (n > 1) avp_step(q.op1, q.f1, 0.0f, bound, r, g, b);
    if (n > 2) avp_step(q.op2, q.f2, 0.0f, bound, r, g, b);
    return avp_gray(r, g, b);
}

// ---- gray mean per frame (contrast) ----------------------------------------------------------
// The sum of each frame's gray values (after the steps before its contrast) in gridDim.y parts:
// block (x, y) sums the pixels p = y * blockDim.x + threadIdx.x + k * gridDim.y * blockDim.x of
// frames blockIdx.x, blockIdx.x + gridDim.x, ... into part[frame * gridDim.y + y] (float64). A
// frame is spread over many blocks (all the SMs busy, each thread a few pixels whose loads can
// be in flight together); the pixel kernel adds a frame's parts in order (avp_frame_mean): the
// same mean on every run. An item's steps are read once per frame (not per pixel), and the
// branches on them are the same for the whole block.
#define AVP_MEAN_THREADS 256
template <typename T>
__device__ void avp_gray_mean_impl(
    const T* __restrict__ src, long long sb, long long st, long long sh, long long sw,
    long long sc, int nb, int nt, int h, int w, const long long* __restrict__ order,
    const double* fb, const double* fc, const double* fs, const double* fh, float bound,
    double* __restrict__ part)
{
    __shared__ double red[AVP_MEAN_THREADS];
    const unsigned npix = (unsigned)h * (unsigned)w;
    const unsigned step = gridDim.y * blockDim.x;
    for (long long fr = blockIdx.x; fr < (long long)nb * nt; fr += gridDim.x) {
        const long long it = fr / nt, t = fr % nt;
        const T* base = src + it * sb + t * st;
        const AvpSteps q = avp_steps(order, it, fb, fc, fs, fh);
        const int n = q.op0 == 1 ? 0 : q.op1 == 1 ? 1 : q.op2 == 1 ? 2 : 3;
        double acc = 0.0;
        // (32-bit positions: the host sends frames of fewer than 2**31 pixels)
        for (unsigned p = blockIdx.y * blockDim.x + threadIdx.x; p < npix; p += step) {
            const int y = (int)(p / (unsigned)w), x = (int)(p - (unsigned)y * (unsigned)w);
            const T* e = base + (long long)y * sh + (long long)x * sw;
            acc += (double)avp_gray_before_contrast(q, n, bound, avp_ld<T>(e), avp_ld<T>(e + sc),
                                                    avp_ld<T>(e + 2 * sc));
        }
        red[threadIdx.x] = acc;
        __syncthreads();
        for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
            __syncthreads();
        }
        if (threadIdx.x == 0) part[fr * gridDim.y + blockIdx.y] = red[0];
        __syncthreads();
    }
}

// a frame's gray mean from its `parts` sums (added in order)
__device__ __forceinline__ float avp_frame_mean(const double* __restrict__ part, long long fr,
                                                int parts, long long npix) {
    double s = 0.0;
    for (int k = 0; k < parts; ++k) s += part[fr * parts + k];
    return (float)(s / (double)npix);
}

// The launches' per-item parameters (order, the four factors, flip) are on the device, or
// (inl set) in the launch's own table `tab`, each pointer then a byte offset into it
// (device/launch_table.cuh); the gray sums (part) and the affine (a, bb) are on the device.
#define AVP_GRAY_MEAN(NAME, T)                                                                  \
extern "C" __global__ void __launch_bounds__(AVP_MEAN_THREADS) NAME(                            \
    const T* src, long long sb, long long st, long long sh, long long sw,                       \
    long long sc, int nb, int nt, int h, int w, const long long* order, const double* fb,       \
    const double* fc, const double* fs, const double* fh, float bound, double* part,            \
    const AVP_GRID_CONST AvpTable tab, int inl)                                                 \
{                                                                                               \
    avp_gray_mean_impl<T>(src, sb, st, sh, sw, sc, nb, nt, h, w, avp_tab(tab, inl, order),      \
                          avp_tab(tab, inl, fb), avp_tab(tab, inl, fc), avp_tab(tab, inl, fs),  \
                          avp_tab(tab, inl, fh), bound, part);                                  \
}
AVP_GRAY_MEAN(avp_gray_mean_u8, unsigned char)
AVP_GRAY_MEAN(avp_gray_mean_f32, float)

// ---- flip + jitter + round + normalize + layout ----------------------------------------------
// Frames fr = blockIdx.y, + gridDim.y, ...; in a frame the pixels p = blockIdx.x * blockDim.x
// + threadIdx.x, + gridDim.x * blockDim.x, ... (a thread reads its item's flip, steps and
// frame mean once per frame; the branches on them are the same for the whole block).
// flip: [B] bytes or null; order: [B, 4] or null (no jitter); part: [B * T, parts] (with a
// jitter: each frame's gray sums, avp_gray_mean's);
// round_u8: floor(v + 0.5) clipped to 0..255 after the jitter; a, bb: v * a[c] + bb[c] or null;
// out: contiguous [B, T, H, W, 3] (nchw 0) or [B, T, 3, H, W] (nchw 1), float32 (mode 0),
// float16 (mode 1: the float32 value rounded to nearest even, a NaN as the canonical one) or
// uint8 (mode 2). I: the type of a position in a frame (32 bits where a frame's values fit).
template <typename T, typename I>
__device__ void avp_pixels_impl(
    const T* __restrict__ src, long long sb, long long st, long long sh, long long sw,
    long long sc, int nb, int nt, int h, int w, const unsigned char* __restrict__ flip,
    const long long* __restrict__ order, const double* fb, const double* fc, const double* fs,
    const double* fh, const double* __restrict__ part, int parts, float bound, int round_u8,
    const float* __restrict__ a, const float* __restrict__ bb, int nchw, int mode,
    void* __restrict__ out)
{
    const I npix = (I)h * (I)w;
    const I pstep = (I)blockDim.x * (I)gridDim.x;
    const float a0 = a != 0 ? a[0] : 1.0f, a1 = a != 0 ? a[1] : 1.0f, a2 = a != 0 ? a[2] : 1.0f;
    const float b0 = a != 0 ? bb[0] : 0.0f, b1 = a != 0 ? bb[1] : 0.0f;
    const float b2 = a != 0 ? bb[2] : 0.0f;
    for (long long fr = blockIdx.y; fr < (long long)nb * nt; fr += gridDim.y) {
        const long long it = fr / nt, t = fr % nt;
        const bool fl = flip != 0 && flip[it];
        const T* base = src + it * sb + t * st;
        AvpSteps q = {0, 0, 0, 0, 0.0f, 0.0f, 0.0f, 0.0f};
        float m = 0.0f;
        if (order != 0) {
            q = avp_steps(order, it, fb, fc, fs, fh);
            m = avp_frame_mean(part, fr, parts, (long long)npix);
        }
        for (I p = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x; p < npix; p += pstep) {
            const int y = (int)(p / (I)w), x = (int)(p - (I)y * (I)w);
            const int xs = fl ? w - 1 - x : x;
            const T* e = base + (long long)y * sh + (long long)xs * sw;
            float v[3] = {avp_ld<T>(e), avp_ld<T>(e + sc), avp_ld<T>(e + 2 * sc)};
            if (order != 0) {
                avp_step(q.op0, q.f0, m, bound, v[0], v[1], v[2]);
                avp_step(q.op1, q.f1, m, bound, v[0], v[1], v[2]);
                avp_step(q.op2, q.f2, m, bound, v[0], v[1], v[2]);
                avp_step(q.op3, q.f3, m, bound, v[0], v[1], v[2]);
            }
            for (int c = 0; c < 3; ++c) {
                float o = v[c];
                if (round_u8) o = avp_level(o);
                if (a != 0) o = AVP_ADD(AVP_MUL(o, c == 0 ? a0 : c == 1 ? a1 : a2),
                                        c == 0 ? b0 : c == 1 ? b1 : b2);
                const long long j = nchw ? (fr * 3 + c) * (long long)npix + (long long)p
                                         : (fr * (long long)npix + (long long)p) * 3 + c;
                if (mode == 2) ((unsigned char*)out)[j] = avp_u8(o);
                else if (mode == 1) ((unsigned short*)out)[j] = avp_f2h(o);
                else ((float*)out)[j] = o;
            }
        }
    }
}

#define AVP_PIXELS(NAME, T)                                                                     \
extern "C" __global__ void NAME(                                                                \
    const T* src, long long sb, long long st, long long sh, long long sw, long long sc,         \
    int nb, int nt, int h, int w, const unsigned char* flip, const long long* order,            \
    const double* fb, const double* fc, const double* fs, const double* fh, const double* part, \
    int parts, float bound, int round_u8, const float* a, const float* bb, int nchw, int mode,  \
    void* out, const AVP_GRID_CONST AvpTable tab, int inl)                                      \
{                                                                                               \
    /* (a null flip or order stays null: no flips, no jitter) */                                \
    const unsigned char* fl = flip != 0 ? avp_tab(tab, inl, flip) : flip;                       \
    const long long* od = order != 0 ? avp_tab(tab, inl, order) : order;                        \
    fb = avp_tab(tab, inl, fb); fc = avp_tab(tab, inl, fc);                                     \
    fs = avp_tab(tab, inl, fs); fh = avp_tab(tab, inl, fh);                                     \
    if ((long long)h * w < AVP_SMALL)                                                           \
        avp_pixels_impl<T, unsigned int>(src, sb, st, sh, sw, sc, nb, nt, h, w, fl, od,         \
            fb, fc, fs, fh, part, parts, bound, round_u8, a, bb, nchw, mode, out);              \
    else                                                                                        \
        avp_pixels_impl<T, long long>(src, sb, st, sh, sw, sc, nb, nt, h, w, fl, od,            \
            fb, fc, fs, fh, part, parts, bound, round_u8, a, bb, nchw, mode, out);              \
}
AVP_PIXELS(avp_pixels_u8, unsigned char)
AVP_PIXELS(avp_pixels_f32, float)

// ---- resized crop of every item, per-item sparse taps ----------------------------------------
// tmp[b, t, r, ox, ch] = sum_k xw[b, ox, k] * src[b, t, row0[b] + r, xtab[b, ox].start + k, ch]
// for r < rows[b] (xtab starts are absolute input columns)
template <typename T, typename I>
__device__ void avp_crop_hpass_impl(
    const T* __restrict__ src, long long sb, long long st, long long sh, long long sw,
    long long sc, int nb, int nt, int maxrows, int ow, int c, const int* __restrict__ row0,
    const int* __restrict__ rows, const int* __restrict__ xtab, const float* __restrict__ xw,
    int taps, float* __restrict__ tmp)
{
    const I total = (I)nb * (I)nt * (I)maxrows * (I)ow * (I)c;
    const I step = (I)blockDim.x * (I)gridDim.x;
    for (I i = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x; i < total; i += step) {
        const int ch = (int)(i % (I)c);
        I t_ = i / (I)c;
        const int ox = (int)(t_ % (I)ow);
        t_ /= (I)ow;
        const int r = (int)(t_ % (I)maxrows);
        t_ /= (I)maxrows;
        const long long t = (long long)(t_ % (I)nt), it = (long long)(t_ / (I)nt);
        if (r >= rows[it]) continue;
        const long long e = it * ow + ox;
        const int start = xtab[2 * e], cnt = xtab[2 * e + 1];
        const T* p = src + it * sb + t * st + (long long)(row0[it] + r) * sh
                     + (long long)start * sw + (long long)ch * sc;
        const float* wk = xw + e * taps;
        float acc = 0.0f;
        for (int k = 0; k < cnt; ++k) acc += wk[k] * avp_ld<T>(p + (long long)k * sw);
        tmp[i] = acc;
    }
}

// out[b, t, oy, ox, ch] = sum_k yw[b, oy, k] * tmp[b, t, ytab[b, oy].start + k, ox, ch]
// float32 (mode 0) or uint8 rounded half up, clipped (mode 2)
template <typename I>
__device__ void avp_crop_vpass_impl(
    const float* __restrict__ tmp, int nb, int nt, int maxrows, int ow, int c, int oh,
    const int* __restrict__ ytab, const float* __restrict__ yw, int taps, int mode,
    void* __restrict__ out)
{
    const I total = (I)nb * (I)nt * (I)oh * (I)ow * (I)c;
    const I step = (I)blockDim.x * (I)gridDim.x;
    const long long rstride = (long long)ow * c;
    for (I i = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x; i < total; i += step) {
        const int ch = (int)(i % (I)c);
        I t_ = i / (I)c;
        const int ox = (int)(t_ % (I)ow);
        t_ /= (I)ow;
        const int oy = (int)(t_ % (I)oh);
        const long long fr = (long long)(t_ / (I)oh);  // it * nt + t
        const long long it = fr / nt;
        const long long e = it * oh + oy;
        const int start = ytab[2 * e], cnt = ytab[2 * e + 1];
        const float* p = tmp + ((fr * maxrows + start) * ow + ox) * (long long)c + ch;
        const float* wk = yw + e * taps;
        float acc = 0.0f;
        for (int k = 0; k < cnt; ++k) acc += wk[k] * p[(long long)k * rstride];
        if (mode == 2) ((unsigned char*)out)[i] = avp_u8(acc);
        else ((float*)out)[i] = acc;
    }
}

#define AVP_HPASS(NAME, T)                                                                      \
extern "C" __global__ void NAME(                                                                \
    const T* src, long long sb, long long st, long long sh, long long sw, long long sc,         \
    int nb, int nt, int maxrows, int ow, int c, const int* row0, const int* rows,               \
    const int* xtab, const float* xw, int taps, float* tmp)                                     \
{                                                                                               \
    if ((long long)nb * nt * maxrows * ow * c < AVP_SMALL)                                      \
        avp_crop_hpass_impl<T, unsigned int>(src, sb, st, sh, sw, sc, nb, nt, maxrows, ow, c,   \
                                             row0, rows, xtab, xw, taps, tmp);                  \
    else                                                                                        \
        avp_crop_hpass_impl<T, long long>(src, sb, st, sh, sw, sc, nb, nt, maxrows, ow, c,      \
                                          row0, rows, xtab, xw, taps, tmp);                     \
}
AVP_HPASS(avp_crop_hpass_u8, unsigned char)
AVP_HPASS(avp_crop_hpass_f32, float)

extern "C" __global__ void avp_crop_vpass(
    const float* tmp, int nb, int nt, int maxrows, int ow, int c, int oh, const int* ytab,
    const float* yw, int taps, int mode, void* out)
{
    if ((long long)nb * nt * oh * ow * c < AVP_SMALL)
        avp_crop_vpass_impl<unsigned int>(tmp, nb, nt, maxrows, ow, c, oh, ytab, yw, taps, mode,
                                          out);
    else
        avp_crop_vpass_impl<long long>(tmp, nb, nt, maxrows, ow, c, oh, ytab, yw, taps, mode,
                                       out);
}
