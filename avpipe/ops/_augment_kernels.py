"""Fused CUDA kernels for the clip augmentations on cupy input (private).

The numpy code of :mod:`avpipe.ops.image_augment` is the reference; these kernels compute the
same float32 arithmetic per element, in a handful of launches per batch:

* **resized crop** (two launches for the whole batch; used for the boxes that the one-pass
  kernel of :mod:`avpipe.ops._image_kernels` cannot take, large downscales): a horizontal pass reads each clip's crop
  of the input in place (uint8 or float32, any strides) into a float32 intermediate of the rows
  the vertical taps touch, then a vertical pass writes ``[B, T, oh, ow, C]`` (float32, or uint8
  rounded half up once). Each item has its own sparse tap tables (the axes of
  :func:`avpipe.ops._image_kernels.plan` of its crop, the same taps as the numpy GEMMs, cached
  per axis size: :func:`axis_taps`), built for the batch on the host and copied up in one copy
  (with the batch's parameters when a chain drew them).
* **pixels** (one launch; its per-item parameters read where they are on the device, or
  copied up together): per pixel, an optional per-item horizontal flip, the colour jitter
  (brightness, contrast, saturation, hue in each item's order, torchvision's formulas, each
  clipped to ``0..bound``), rounding to uint8 levels, and ``v * a[c] + b[c]`` (normalize), written
  to a contiguous ``[B, T, H, W, C]`` or ``[B, T, C, H, W]`` uint8 / float32 output. The grid's
  ``y`` is the frames, so a thread reads its item's steps and its frame's mean once, not per
  pixel.
* **gray mean** (one launch, only with a jitter): each frame's mean luma of the image as it is
  when that item's contrast step comes (the previous steps applied on the fly; torchvision's
  rule): each frame's float64 sum in parts (``mean_parts``: a block per 8,192 pixels, so that
  a batch's frames keep every SM busy), which the pixel kernel adds in order.

The source is plain C++ with CUDA qualifiers (no CUDA headers): the CPU tests compile it with
g++ behind a small prelude and run it against the numpy reference. Tolerances (GPU vs numpy):
resize within 1e-3 of the value range on float output, colour jitter within 1e-3 of the range
(float) / 1 level (uint8, a value on a rounding boundary); flip and normalize exact (normalize
rounds ``v * a`` and ``+ b`` separately as numpy does).

If the kernels do not compile (NVRTC missing or failing) a warning is logged once and callers
take the array-module path; ``AVPIPE_IMAGE_KERNELS=0`` selects that path too.
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from ..device import NO_TABLE, TABLE_CUDA, _is_cupy, table_args, upload_many
from . import _image_kernels as _ik

log = logging.getLogger("avpipe")

_THREADS = 256
_MEAN_THREADS = 256  # AVP_MEAN_THREADS: the gray means' blocks
_MEAN_PIXELS = 8192  # the gray means: a block (a part of a frame) per this many pixels
_MAX_BLOCKS = 1 << 20
_PIXELS_PER_THREAD = 4  # the pixel kernel: a thread's pixels of a frame (its item's steps read once)
MODE_F32, MODE_F16, MODE_U8 = 0, 1, 2  # output modes (as in _image_kernels)
_OUT_DTYPE = {MODE_F32: np.float32, MODE_F16: np.float16, MODE_U8: np.uint8}

SOURCE = TABLE_CUDA + r"""
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
// (device.py's TABLE_CUDA); the gray sums (part) and the affine (a, bb) are on the device.
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
"""

KERNEL_NAMES = ("avp_gray_mean_u8", "avp_gray_mean_f32", "avp_pixels_u8", "avp_pixels_f32",
                "avp_crop_hpass_u8", "avp_crop_hpass_f32", "avp_crop_vpass")  # fmt: skip

_WARNED = []


def enabled() -> bool:
    return _ik.enabled()


@functools.cache
def _kernels(device_id: int):
    """The compiled kernels on ``device_id`` (name -> function), or None (warned once)."""
    import cupy

    try:
        with cupy.cuda.Device(device_id):
            mod = cupy.RawModule(code=SOURCE)
            return {name: mod.get_function(name) for name in KERNEL_NAMES}
    except Exception as e:  # noqa: BLE001 - any compile/load failure -> the array-module path
        if not _WARNED:
            _WARNED.append(True)
            log.warning("avpipe: augmentation kernels failed to compile (%s: %s); using the "
                        "slower array-module path", type(e).__name__, e)  # fmt: skip
        return None


def available(x) -> bool:
    """Whether ``x`` is a cupy array the kernels can take (enabled, and they compile)."""
    return not isinstance(x, np.ndarray) and enabled() and _kernels(int(x.device.id)) is not None


def _grid(total: int):
    return (max(1, min((total + _THREADS - 1) // _THREADS, _MAX_BLOCKS)), 1, 1)


def _pixel_grid(frames: int, npix: int):
    """The pixel kernel's grid: ``y`` the frames (in steps of 65,535), ``x`` enough blocks for
    ``_PIXELS_PER_THREAD`` of a frame's pixels a thread."""
    per = _THREADS * _PIXELS_PER_THREAD
    return (max(1, min(-(-npix // per), _MAX_BLOCKS)), max(1, min(frames, 65535)), 1)


def _strides(x5):
    item = x5.dtype.itemsize
    return tuple(np.int64(s // item) for s in x5.strides)


def _src(cupy, x5):
    """uint8 or float32 input with element strides (other dtypes cast to float32)."""
    if x5.dtype not in (np.uint8, np.float32):
        x5 = x5.astype(cupy.float32)
    if any(s % x5.dtype.itemsize for s in x5.strides):
        x5 = cupy.ascontiguousarray(x5)
    return x5, ("u8" if x5.dtype == np.uint8 else "f32")


# --- host tables for the batched resized crop ---------------------------------------------------


def axis_taps(in_size: int, out_size: int, interpolation: str, antialias: bool) -> _ik.AxisPlan:
    """The sparse taps of resizing one axis of ``in_size`` to ``out_size``: the whole axis's
    :func:`avpipe.ops._image_kernels.axis_plan` (cached per size: a batch of random crops draws
    its boxes from a few hundred sizes, where a cache of whole 2-D plans would miss nearly
    every time)."""
    return _ik.axis_plan(int(in_size), int(out_size), 0, int(out_size), interpolation,
                         bool(antialias))  # fmt: skip


def crop_tables(top, left, height, width, oh, ow, interpolation, antialias):
    """Per-item sparse taps of each item's crop resize (host numpy, no per-item device work):
    returns ``(tables, meta)``: ``tables = (row0 [B], rows [B], xtab [B, ow, 2], ytab [B, oh,
    2]`` int32 (x starts absolute, y starts relative to the item's ``row0``), ``xw [B, ow, xt],
    yw [B, oh, yt]`` float32), ``meta = (maxrows, xt, yt)``: the kernels' arguments in order."""
    aa = bool(antialias)
    xs = [axis_taps(int(w), ow, interpolation, aa) for w in width]
    ys = [axis_taps(int(h), oh, interpolation, aa) for h in height]
    B = len(xs)
    xt = max((a.weights.shape[1] for a in xs), default=1)
    yt = max((a.weights.shape[1] for a in ys), default=1)
    rows = np.array([a.rows for a in ys], np.int32)
    maxrows = int(rows.max()) if B else 1
    row0 = (np.asarray(top, np.int64).reshape(-1) + np.array([a.row0 for a in ys], np.int64))
    xtab = np.stack([a.table for a in xs]) if B else np.zeros((0, ow, 2), np.int32)
    xtab[:, :, 0] += np.asarray(left, np.int32).reshape(-1, 1)
    ytab = np.stack([a.rel for a in ys]) if B else np.zeros((0, oh, 2), np.int32)
    xw = np.zeros((B, ow, xt), np.float32)
    yw = np.zeros((B, oh, yt), np.float32)
    for b in range(B):  # host copies of cached rows (the taps differ in width per size)
        xw[b, :, : xs[b].weights.shape[1]] = xs[b].weights
        yw[b, :, : ys[b].weights.shape[1]] = ys[b].weights
    return (row0.astype(np.int32), rows, xtab, ytab, xw, yw), (maxrows, xt, yt)


def crop_launch(x5, tables, meta, oh, ow, *, mode):
    """cupy ``x5`` ``[B, T, H, W, C]`` -> ``[B, T, oh, ow, C]`` float32 (``MODE_F32``) or uint8
    (``MODE_U8``, rounded once) with :func:`crop_tables`' ``tables`` already on the device: two
    launches, nothing copied."""
    import cupy

    kern = _kernels(int(x5.device.id))
    B, T, H, W, C = (int(s) for s in x5.shape)
    row0, rows, xtab, ytab, xw, yw = tables
    maxrows, xt, yt = meta
    with cupy.cuda.Device(x5.device.id):
        out = cupy.empty((B, T, oh, ow, C), np.uint8 if mode == MODE_U8 else np.float32)
        if out.size == 0:
            return out
        src, kind = _src(cupy, x5)
        tmp = cupy.empty((B, T, maxrows, ow, C), cupy.float32)
        kern[f"avp_crop_hpass_{kind}"](_grid(tmp.size), (_THREADS, 1, 1), (
            src, *_strides(src), np.int32(B), np.int32(T), np.int32(maxrows), np.int32(ow),
            np.int32(C), row0, rows, xtab, xw, np.int32(xt), tmp))  # fmt: skip
        kern["avp_crop_vpass"](_grid(out.size), (_THREADS, 1, 1), (
            tmp, np.int32(B), np.int32(T), np.int32(maxrows), np.int32(ow), np.int32(C),
            np.int32(oh), ytab, yw, np.int32(yt), np.int32(mode), out))  # fmt: skip
    return out


def resized_crop(x5, top, left, height, width, oh, ow, interpolation, antialias, *, mode):
    """:func:`crop_launch` of host boxes: their :func:`crop_tables` in one host -> device copy,
    then the two launches."""
    import cupy

    tables, meta = crop_tables(top, left, height, width, oh, ow, interpolation, antialias)
    with cupy.cuda.Device(x5.device.id):
        dev = upload_many(cupy, tables)
    return crop_launch(x5, dev, meta, oh, ow, mode=mode)


# --- flip / jitter / normalize ------------------------------------------------------------------

_VECS: dict = {}
_JITTER = ("order", "brightness", "contrast", "saturation", "hue")


def _vec(cupy, v, device_id):
    v = np.ascontiguousarray(v, np.float32)
    key = (v.tobytes(), device_id)
    hit = _VECS.get(key)
    if hit is None:
        if len(_VECS) >= 256:  # full: this call's own copy, on its stream (the cached ones
            (hit,) = upload_many(cupy, [v])  # may still be read by queued kernels: kept)
            return hit
        # cached for every stream (the recipe's decode threads each run on their own): the
        # copy completes before the array is handed out
        (hit,) = upload_many(cupy, [v], wait=True)
        _VECS[key] = hit
    return hit


def on_device(cupy, values, dtypes):
    """``values`` (device or host arrays) as contiguous device arrays of ``dtypes``: device
    arrays of the right kind as they are, the host ones in one host -> device copy."""
    out, pending = list(values), []
    for i, (v, dt) in enumerate(zip(values, dtypes)):
        if not isinstance(v, np.ndarray) and (_is_cupy(v) or hasattr(v, "__cuda_array_interface__")):
            if v.dtype != dt or not v.flags.c_contiguous:
                out[i] = cupy.ascontiguousarray(cupy.asarray(v, dtype=dt))
        else:
            pending.append(i)
            out[i] = np.ascontiguousarray(v, dt)
    if pending:
        for i, d in zip(pending, upload_many(cupy, [out[i] for i in pending])):
            out[i] = d
    return out


def mean_parts(npix: int) -> int:
    """The parts each frame's gray sum is split into (``gridDim.y`` of the gray-mean launch):
    one per ``_MEAN_PIXELS`` pixels, 1..64. A function of the frame's size alone, so a frame's
    mean (its parts added in order) is the same in any batch: a clip transformed alone and in
    its batch get the same values."""
    return max(1, min(64, -(-int(npix) // _MEAN_PIXELS)))


def pixels(x5, *, flip=None, jitter=None, bound=255.0, round_u8=False, affine=None, nchw=False,
           mode=MODE_F32):  # fmt: skip
    """cupy ``x5`` ``[B, T, H, W, 3]`` (uint8 / float32, any strides) -> a new contiguous
    ``[B, T, H, W, 3]`` (``nchw``: ``[B, T, 3, H, W]``) array of ``mode``'s dtype (float32,
    float16: the float32 values rounded to nearest even, or uint8): ``flip`` (bool
    [B]) mirrors items, ``jitter`` (the colour-jitter params dict) applies the jitter in each
    item's order, ``round_u8`` rounds to uint8 levels after it, ``affine = (a, b)`` (3 float32
    each) maps ``v * a + b``. The parameters may be on the device (used in place) or the host
    (in the launches' own table where they fit, else copied up together, once:
    :func:`avpipe.device.table_args`). One launch (two with a jitter: the gray means)."""
    import cupy

    dev = int(x5.device.id)
    kern = _kernels(dev)
    B, T, H, W, C = (int(s) for s in x5.shape)
    if C != 3:
        raise ValueError(f"the pixel kernel needs 3 channels, got {C}")
    if jitter is not None and H * W >= 2**31:  # (the gray means count pixels in 32 bits)
        raise ValueError(f"frames of {H}x{W} pixels are too large for the gray means")
    with cupy.cuda.Device(dev):
        src, kind = _src(cupy, x5)
        shape = (B, T, 3, H, W) if nchw else (B, T, H, W, 3)
        out = cupy.empty(shape, _OUT_DTYPE[mode])
        if out.size == 0:
            return out
        st = _strides(src)
        vals, dts = [], []
        if flip is not None:
            vals, dts = [flip], [np.dtype(bool)]  # (bytes of 0 or 1: the kernel's uint8)
        if jitter is not None:
            vals += [jitter[k] for k in _JITTER]
            dts += [np.dtype(np.int64)] + [np.dtype(np.float64)] * 4
        tab, inl = NO_TABLE, 0
        if vals and all(isinstance(v, np.ndarray) for v in vals):  # host params: the table's
            tab, inl, vals = table_args(cupy, [np.ascontiguousarray(v, dt)
                                               for v, dt in zip(vals, dts)])  # fmt: skip
        else:
            vals = on_device(cupy, vals, dts)
        fl = vals.pop(0) if flip is not None else 0
        if flip is not None and not inl:
            fl = fl.view(cupy.uint8)
        if jitter is not None:
            order, *fac = vals
            parts = mean_parts(H * W)
            mean = cupy.empty(B * T * parts, cupy.float64)
            grid = (max(1, min(B * T, _MAX_BLOCKS)), parts, 1)
            kern[f"avp_gray_mean_{kind}"](grid, (_MEAN_THREADS, 1, 1), (
                src, *st, np.int32(B), np.int32(T), np.int32(H), np.int32(W), order, *fac,
                np.float32(bound), mean, tab, np.int32(inl)))  # fmt: skip
        else:
            order, mean, parts = 0, 0, 0
            fac = [0, 0, 0, 0]
        a = b = 0
        if affine is not None:
            a, b = _vec(cupy, affine[0], dev), _vec(cupy, affine[1], dev)
        kern[f"avp_pixels_{kind}"](_pixel_grid(B * T, H * W), (_THREADS, 1, 1), (
            src, *st, np.int32(B), np.int32(T), np.int32(H), np.int32(W), fl, order, *fac, mean,
            np.int32(parts), np.float32(bound), np.int32(1 if round_u8 else 0), a, b,
            np.int32(1 if nchw else 0), np.int32(mode), out, tab, np.int32(inl)))  # fmt: skip
    return out
