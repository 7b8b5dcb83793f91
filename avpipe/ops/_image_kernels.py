"""Fused CUDA kernels for the separable resize (+ crop + normalize) on cupy input (private).

The numpy path of :mod:`avpipe.ops.image` is the reference; these kernels compute the same
linear map (the per-axis taps of :func:`avpipe.ops._image_resize.axis_weights`, with the crop
window folded in), accumulating in float32, by one of two routes:

* **one pass** (``avp_direct_*``, where :func:`direct_fits`: a few taps per pixel, as a clip's
  crop to 224 has) — one thread per output pixel computes its taps itself (``avp_taps``: the
  float64 steps of ``axis_weights``, its float32 weights bit for bit; a C++ build of it is
  checked against numpy on the CPU), sums each input row's horizontal taps, then the vertical
  ones, then ``v * a + b``: one launch, no host tables, no intermediate. The input's crop box,
  a window of a larger image and a flip are offsets and a reversed order of the taps.
* **two passes** (large downscales, whose taps the passes share):

1. **horizontal pass** — reads the input ``[N, H, W, C]`` (uint8 or float32, any strides) in
   place and writes a float32 intermediate ``[N, rows, out_w, C]`` restricted to the input rows
   ``row0 : row0 + rows`` that the vertical taps touch. For uint8 ``resize`` it rounds and clips
   to 0..255 here, as PIL (and the numpy path) do between the passes.
2. **vertical pass** — reads the intermediate, applies the vertical taps, then
   ``v * a[c] + b[c]`` (``a = scale / std``, ``b = -mean / std``, the numpy ``normalize``
   constants) and writes float32 / float16 (round to nearest even) or uint8 (half up, clipped)
   straight into a contiguous NCHW or NHWC output.

Each output row / column of the two passes has a *sparse tap table*: the first input index, the
number of taps and their weights (the dense ``axis_weights`` taps folded onto a contiguous
window: duplicate indices of the clamped torch-style filters are summed, zero weights at the
window ends dropped). :func:`plan` builds the tables on the host with numpy from the two axes'
:func:`axis_plan` (cached per axis); the device copies are cached per axis and device. A
horizontal flip of the output is the horizontal table in reverse order: no extra pass. One
thread per output element, grid-stride loops, 64-bit index math.

If the kernels do not compile (NVRTC missing or failing) a warning is logged once and callers
fall back to the array-module (cuBLAS) path; ``AVPIPE_IMAGE_KERNELS=0`` selects that path too.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import numpy as np

from .. import settings
from ..device import NO_TABLE, TABLE_CUDA, table_args, upload_many
from . import _image_resize as _rs

log = logging.getLogger("avpipe")

_THREADS = 256
_MAX_BLOCKS = 1 << 20

# Output modes of the vertical pass.
MODE_F32, MODE_F16, MODE_U8 = 0, 1, 2
_OUT_DTYPE = {MODE_F32: np.float32, MODE_F16: np.float16, MODE_U8: np.uint8}

_SOURCE = TABLE_CUDA + r"""
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
// launch's own table `tab` (items then a byte offset into it; device.py's TABLE_CUDA).
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
"""

_KERNEL_NAMES = ("avp_hpass_u8", "avp_hpass_f32", "avp_vpass", "avp_direct_u8", "avp_direct_f32",
                 "avp_direct_items_u8", "avp_direct_items_f32")


def enabled() -> bool:
    """False when ``AVPIPE_IMAGE_KERNELS=0`` (use the array-module / cuBLAS path)."""
    return settings.image_kernels()


# --- host-side tap tables ------------------------------------------------------------------------


@dataclass(frozen=True)
class AxisTaps:
    """Sparse taps of one axis: output ``i`` = ``sum_k weights[i, k] * in[start[i] + k]`` for
    ``k < count[i]``. ``table`` is ``[n, 2]`` int32 (start, count) as the kernels read it."""

    table: np.ndarray  # [n_out, 2] int32
    weights: np.ndarray  # [n_out, taps] float32 (zero past count)

    @property
    def start(self) -> np.ndarray:
        return self.table[:, 0]

    @property
    def count(self) -> np.ndarray:
        return self.table[:, 1]

    @property
    def taps(self) -> int:
        return int(self.weights.shape[1])


@dataclass(frozen=True)
class Plan:
    """Both axes of a resize restricted to an output window. ``y`` starts are relative to
    ``row0``: the horizontal pass computes input rows ``row0 : row0 + rows`` only."""

    x: AxisTaps
    y: AxisTaps
    row0: int
    rows: int
    key: tuple


def sparse_taps(idx: np.ndarray, w: np.ndarray) -> AxisTaps:
    """Fold dense taps (``idx``/``w`` of ``axis_weights``: [n, K]) onto contiguous windows."""
    idx = np.asarray(idx, np.int64)
    w = np.asarray(w, np.float64)
    n = idx.shape[0]
    if n == 0:
        return AxisTaps(np.zeros((0, 2), np.int32), np.zeros((0, 1), np.float32))
    lo = idx.min(axis=1)
    width = int((idx.max(axis=1) - lo).max()) + 1
    # add the taps into their rows' windows, in tap order (bincount adds in input order, as
    # np.add.at does, in float64)
    flat = (np.arange(n)[:, None] * width + (idx - lo[:, None])).reshape(-1)
    dense = np.bincount(flat, weights=w.reshape(-1), minlength=n * width).reshape(n, width)
    dense = dense.astype(np.float32)
    nz = dense != 0
    has = nz.any(axis=1)
    first = np.where(has, nz.argmax(axis=1), 0)
    last = np.where(has, width - 1 - nz[:, ::-1].argmax(axis=1), -1)
    count = (last - first + 1).astype(np.int64)
    taps = max(int(count.max()), 1)
    k = np.arange(taps)
    src = np.minimum(first[:, None] + k, width - 1)
    weights = np.where(k < count[:, None], dense[np.arange(n)[:, None], src], 0.0)
    weights = np.ascontiguousarray(weights, np.float32)
    start = np.where(has, lo + first, 0)
    table = np.ascontiguousarray(np.stack([start, count], axis=1).astype(np.int32))
    table.setflags(write=False)
    weights.setflags(write=False)
    return AxisTaps(table, weights)


@dataclass(frozen=True)
class AxisPlan:
    """One axis of a resize: ``table`` [out, 2] int32 (start, count; starts absolute),
    ``weights`` [out, taps] float32, and ``rel``: the table with its starts relative to
    ``row0``, the first input index read (``rows`` of them: the span the horizontal pass
    computes when this is the vertical axis). ``key``: what it was built from (the device cache's
    key). None of :func:`axis_plan` when a window lacks taps it needs."""

    table: np.ndarray
    rel: np.ndarray
    weights: np.ndarray
    row0: int
    rows: int
    key: tuple


@functools.lru_cache(maxsize=4096)
def axis_plan(in_size, out_size, lo, hi, interpolation, antialias, offset=0, full=None,
              flip=False) -> AxisPlan | None:
    """The sparse taps of output positions ``lo:hi`` of resizing an axis of ``full`` (default
    ``in_size``) to ``out_size``, the input holding positions ``offset : offset + in_size`` of it;
    ``flip``: the positions in reverse order (a mirrored output, folded into the taps). Cached
    per axis: a random resized crop draws its boxes from a few hundred sizes per axis, where a
    cache of whole 2-D plans would miss nearly every time. None if the window lacks a tap with
    a nonzero weight."""
    idx, w = _rs.axis_weights(in_size if full is None else full, out_size, interpolation,
                              bool(antialias), lo, hi)  # fmt: skip
    if full is not None:
        idx = _rs.shift_into(idx, w, offset, in_size)
        if idx is None:
            return None
    t = sparse_taps(idx, w)
    table, weights = t.table, t.weights
    if flip:
        table, weights = np.ascontiguousarray(table[::-1]), np.ascontiguousarray(weights[::-1])
    start, count = table[:, 0].astype(np.int64), table[:, 1].astype(np.int64)
    used = count > 0
    row0 = int(start[used].min()) if used.any() else 0
    span = int((start + count)[used].max()) - row0 if used.any() else 1
    rel = table.copy()
    rel[:, 0] = np.where(used, start - row0, 0)
    for a in (table, weights, rel):
        a.setflags(write=False)
    key = (in_size, out_size, lo, hi, interpolation, bool(antialias), offset, full, bool(flip))
    return AxisPlan(table, rel, weights, row0, max(span, 1), key)


@functools.lru_cache(maxsize=512)
def plan(h, w, out_h, out_w, rows, cols, interpolation, antialias, window=None,
         flip=False) -> Plan:
    """Tap tables for resizing ``h x w`` to ``out_h x out_w`` and keeping output rows
    ``rows = (r0, r1)`` and columns ``cols = (c0, c1)`` (``flip``: those columns mirrored).
    ``window=(top, left, full_h, full_w)``: the input is that part of a larger image (see
    :func:`avpipe.ops._image_resize.resize_taps`; ValueError if the taps reach outside it).
    Built from the two axes' :func:`axis_plan`."""
    antialias = bool(antialias)
    top, left, full_h, full_w = (0, 0, None, None) if window is None else window
    y = axis_plan(h, out_h, *rows, interpolation, antialias, top, full_h)
    x = axis_plan(w, out_w, *cols, interpolation, antialias, left, full_w, bool(flip))
    if x is None or y is None:  # the error that names what the window lacks
        _rs.resize_taps(h, w, out_h, out_w, tuple(rows), tuple(cols), interpolation, antialias,
                        window)  # fmt: skip
        raise AssertionError("resize_taps accepted a window that axis_plan did not")
    return Plan(x=AxisTaps(x.table, x.weights), y=AxisTaps(y.rel, y.weights), row0=y.row0,
                rows=y.rows, key=(x.key, y.key))  # fmt: skip


# --- device side ---------------------------------------------------------------------------------

_WARNED = []
_TABLES: dict = {}
_EVICTED: list = []  # the last generation of _TABLES cleared (see _device_tables)
_VECS: dict = {}


@functools.cache
def _kernels(device_id: int):
    """The compiled kernels on ``device_id`` (a dict name -> function), or None if they do not
    compile (warned once)."""
    import cupy

    try:
        with cupy.cuda.Device(device_id):
            mod = cupy.RawModule(code=_SOURCE)  # NVRTC defaults; plain C++ templates only
            return {name: mod.get_function(name) for name in _KERNEL_NAMES}
    except Exception as e:  # noqa: BLE001 - any compile/load failure -> the cuBLAS path
        if not _WARNED:
            _WARNED.append(True)
            log.warning(
                "avpipe: image resize kernels failed to compile (%s: %s); using the slower "
                "array-module path", type(e).__name__, e,
            )  # fmt: skip
        return None


def _device_tables(cupy, p: Plan, device_id: int):
    """``(x table, x weights, y table, y weights)`` of plan ``p`` on the device, cached per
    axis (a random resized crop's plan is new, its axes rarely are); the axes not cached yet
    go up in one copy, cached for every thread's stream: complete when this returns."""
    axes = ((p.x.table, p.x.weights), (p.y.table, p.y.weights))
    # the role is part of the key: a vertical table's starts are relative to its row0
    keys = [(role, k, device_id) for role, k in zip("xy", p.key)]
    got = [_TABLES.get(k) for k in keys]
    missing = [i for i, g in enumerate(got) if g is None]
    if missing:
        up = iter(upload_many(cupy, [a for i in missing for a in axes[i]], wait=True))
        if len(_TABLES) > 2048:  # evicted tables live one more generation: a kernel queued
            _EVICTED[:] = [dict(_TABLES)]  # on another stream may still read one
            _TABLES.clear()
        for i in missing:
            got[i] = _TABLES[keys[i]] = (next(up), next(up))
    return (*got[0], *got[1])


def _device_vec(cupy, v: np.ndarray, device_id: int):
    v = np.ascontiguousarray(v, np.float32)
    key = (v.tobytes(), device_id)
    hit = _VECS.get(key)
    if hit is None:
        hit = cupy.asarray(v)
        if len(_VECS) > 256:
            _VECS.clear()
        _VECS[key] = hit
    return hit


def _grid(total: int):
    return (min((total + _THREADS - 1) // _THREADS, _MAX_BLOCKS), 1, 1)


MAX_DIRECT_TAPS = 16  # AVP_MAXTAP: taps per axis the one-pass kernel holds
_FRAMES = 8  # AVP_FRAMES: the images a block of the one-pass kernel computes
_TILE = 16  # AVP_TILE: a block's output pixels are AVP_TILE x AVP_TILE
_DIRECT_ROWS = 144  # AVP_ROWS: the input rows of a tile's first pass at most
_DIRECT_WORK = 64  # the one-pass kernel's taps per pixel (rows x columns) at most


def axis_taps_bound(in_size: int, out_size: int, interpolation: str, antialias: bool) -> int:
    """At most how many taps an output position of this axis reads (``2 * ceil(support) + 1``
    for PIL's widened filters; 2 or 4 for torch's)."""
    if not antialias:
        return 2 if interpolation == "bilinear" else 4
    support = _rs._SUPPORT[interpolation] * max(in_size / out_size, 1.0)
    return 2 * math.ceil(support) + 1


def direct_fits(y_in, out_h, x_in, out_w, interpolation, antialias, c) -> bool:
    """Whether the one-pass kernel takes this resize: at most 16 taps an axis and 4 channels,
    and the input rows that a tile's 16 output rows read fit its shared memory
    (``_DIRECT_ROWS``). ``_DIRECT_WORK`` bounds the taps per pixel (the two passes are left
    the large filters)."""
    return _fits(int(y_in), int(out_h), int(x_in), int(out_w), interpolation, bool(antialias),
                 int(c), _DIRECT_WORK, _DIRECT_ROWS)  # fmt: skip


@functools.lru_cache(maxsize=8192)
def _fits(y_in, out_h, x_in, out_w, interpolation, antialias, c, work, max_rows) -> bool:
    """:func:`direct_fits` (cached: a batch of random crops meets a few hundred box sizes)."""
    if min(y_in, out_h, x_in, out_w) < 1:
        return False
    ty = axis_taps_bound(y_in, out_h, interpolation, antialias)
    tx = axis_taps_bound(x_in, out_w, interpolation, antialias)
    rows = math.ceil((_TILE - 1) * y_in / out_h) + ty + 2  # the centres' spread, the taps
    return c <= 4 and max(ty, tx) <= MAX_DIRECT_TAPS and ty * tx <= work and rows <= max_rows


def resample(
    xb,
    out_h: int,
    out_w: int,
    rows,
    cols,
    interpolation: str,
    antialias: bool,
    *,
    mode: int,
    nchw: bool,
    a=None,
    b=None,
    window=None,
    box=None,
    flip=False,
):
    """Resize cupy ``xb`` ``[N, H, W, C]``; returns a new contiguous cupy array (``[N, C, h, w]``
    if ``nchw`` else ``[N, h, w, C]``, float32 / float16 / uint8 by ``mode``), or None when the
    kernels are unavailable (then the caller takes the array-module path).

    ``a``, ``b``: per-channel float32 ``v * a + b`` for the float modes (default 1, 0); the
    uint8 mode also rounds/clips between the passes (PIL's 8-bit behaviour). ``window``:
    ``(top, left, full_h, full_w)``: ``xb`` holds that part of a larger image, which is what
    ``out_h``/``rows``/``cols`` refer to (see :func:`plan`). ``box``: ``(top, left, height,
    width)``: resize that region of ``xb`` (a crop folded into the resize, no view of it).
    ``flip``: the output mirrored horizontally.

    One launch with the taps computed in the kernel (no tables) where :func:`direct_fits`;
    else the two passes with the host's tap tables."""
    import cupy

    device_id = int(xb.device.id)
    kern = _kernels(device_id)
    if kern is None:
        return None
    if box is not None and window is not None:
        raise ValueError("give a box or a window, not both")
    out_dtype = _OUT_DTYPE[mode]
    c = int(xb.shape[3])
    # the geometry: an axis of y_in (x_in) positions, position t at input row t + y_off
    if box is not None:
        y_off, x_off, y_in, x_in = (int(v) for v in box)
    elif window is not None:
        top, left, y_in, x_in = (int(v) for v in window)
        y_off, x_off = -top, -left
    else:
        y_off, x_off, y_in, x_in = 0, 0, int(xb.shape[1]), int(xb.shape[2])
    if direct_fits(y_in, out_h, x_in, out_w, interpolation, antialias, c):
        if window is not None:  # ValueError if the taps reach outside the window
            _rs.resize_taps(int(xb.shape[1]), int(xb.shape[2]), int(out_h), int(out_w),
                            tuple(rows), tuple(cols), interpolation, bool(antialias),
                            tuple(int(v) for v in window))  # fmt: skip
        return _direct(cupy, kern, xb, (y_in, y_off, x_in, x_off), int(out_h), int(out_w), rows,
                       cols, interpolation, antialias, mode, nchw, a, b, flip, out_dtype,
                       device_id)  # fmt: skip
    if box is not None:
        xb = xb[:, y_off : y_off + y_in, x_off : x_off + x_in]
    n, h, w = (int(s) for s in xb.shape[:3])
    p = plan(h, w, int(out_h), int(out_w), tuple(rows), tuple(cols), interpolation, antialias,
             None if window is None else tuple(int(v) for v in window), bool(flip))  # fmt: skip
    oh, ow = p.y.table.shape[0], p.x.table.shape[0]
    with cupy.cuda.Device(device_id):
        shape = (n, c, oh, ow) if nchw else (n, oh, ow, c)
        out = cupy.empty(shape, dtype=out_dtype)
        if out.size == 0:
            return out
        xb, hk, (sn, sh, sw, sc) = _source(cupy, kern, xb, "avp_hpass")
        xtab, xw, ytab, yw = _device_tables(cupy, p, device_id)
        av = _device_vec(cupy, np.ones(c, np.float32) if a is None else a, device_id)
        bv = _device_vec(cupy, np.zeros(c, np.float32) if b is None else b, device_id)
        if av.size != c or bv.size != c:
            raise ValueError(f"a and b must have {c} values, got {av.size} and {bv.size}")
        tmp = cupy.empty((n, p.rows, ow, c), dtype=cupy.float32)
        total = tmp.size
        hk(
            _grid(total),
            (_THREADS, 1, 1),
            (
                xb, sn, sh, sw, sc,
                np.int32(n), np.int32(p.row0), np.int32(p.rows), np.int32(ow), np.int32(c),
                xtab, xw, np.int32(p.x.taps),
                np.int32(1 if mode == MODE_U8 else 0), tmp,
            ),
        )  # fmt: skip
        kern["avp_vpass"](
            _grid(out.size),
            (_THREADS, 1, 1),
            (
                tmp, np.int32(n), np.int32(p.rows), np.int32(ow), np.int32(c), np.int32(oh),
                ytab, yw, np.int32(p.y.taps), av, bv,
                np.int32(1 if nchw else 0), np.int32(mode), out,
            ),
        )  # fmt: skip
    return out


def _source(cupy, kern, xb, prefix):
    """``xb`` as the kernels read it (uint8 or float32, element strides), the kernel of
    ``prefix`` for its type and the strides in elements."""
    if xb.dtype == np.uint8:
        k = kern[prefix + "_u8"]
    else:
        if xb.dtype != np.float32:
            xb = xb.astype(cupy.float32)
        k = kern[prefix + "_f32"]
    item = xb.dtype.itemsize
    if any(s % item for s in xb.strides):
        xb = cupy.ascontiguousarray(xb)
    return xb, k, tuple(np.array(xb.strides, np.int64) // item)


def _affine_args(a, b, c):
    """The one-pass kernels' ``a0..a3, b0..b3``: float32 ``v * a + b`` per channel (default 1,
    0), padded to 4 channels."""
    av = [1.0] * c if a is None else np.asarray(a, np.float32).reshape(-1).tolist()
    bv = [0.0] * c if b is None else np.asarray(b, np.float32).reshape(-1).tolist()
    if len(av) != c or len(bv) != c:
        raise ValueError(f"a and b must have {c} values, got {len(av)} and {len(bv)}")
    return np.array(av + [1.0] * (4 - c) + bv + [0.0] * (4 - c), np.float32)


def _direct(cupy, kern, xb, geometry, out_h, out_w, rows, cols, interpolation, antialias, mode,
            nchw, a, b, flip, out_dtype, device_id):  # fmt: skip
    """The one-pass kernel (see :func:`resample`); ``geometry``: ``(y_in, y_off, x_in,
    x_off)``, each axis resized as ``*_in`` positions, position ``t`` at input index
    ``t + *_off``."""
    n, h, w, c = (int(s) for s in xb.shape)
    y_in, y_off, x_in, x_off = geometry
    (r0, r1), (c0, c1) = rows, cols
    oh, ow = int(r1) - int(r0), int(c1) - int(c0)
    floats = _affine_args(a, b, c)
    with cupy.cuda.Device(device_id):
        out = cupy.empty((n, c, oh, ow) if nchw else (n, oh, ow, c), dtype=out_dtype)
        if out.size == 0:
            return out
        xb, k, strides = _source(cupy, kern, xb, "avp_direct")
        # the scalars in the kernel's order, made by one array each (a numpy scalar apiece
        # costs more than the launch's other work)
        ints = np.array([n, c, y_in, out_h, r0, y_off, h, oh, x_in, out_w, c0, x_off, w, ow,
                         bool(flip), interpolation == "bicubic", bool(antialias),
                         mode == MODE_U8], np.int32)  # fmt: skip
        tail = np.array([bool(nchw), mode], np.int32)
        chunks = -(-n // _FRAMES)
        tiles = -(-oh // _TILE) * -(-ow // _TILE)
        k((tiles, min(chunks, 65535), 1), (_TILE * _TILE, 1, 1),
          (xb, *strides, *ints, *floats, *tail, out, np.int64(c * oh * ow)))
    return out


def resample_boxes(clips, boxes, flips, out_h: int, out_w: int, interpolation: str,
                   antialias: bool, *, mode: int, nchw: bool, a=None, b=None, round_mid=None):
    """The one-pass kernel over cupy ``clips`` (a list of ``[N, H, W, C]`` clips, the same
    ``N``, ``C`` and dtype, any sizes and strides; or one ``[B, N, H, W, C]`` array), clip
    ``i``'s ``boxes[i]`` (top, left, height, width) resized to ``out_h x out_w``, mirrored where
    ``flips[i]``: one launch and one small copy for all of them. ``round_mid``: round the
    first pass to uint8 levels (PIL's 8-bit two passes; by default in the uint8 mode, whose
    output is otherwise the float sums rounded once). Returns ``[B, N, C, out_h, out_w]``
    (``nchw``) or ``[B, N, out_h, out_w, C]``, or None where the kernels are unavailable or a
    box needs the two passes (then the caller resizes the clips one by one)."""
    got = box_items(clips, boxes, flips, out_h, out_w, interpolation, antialias, mode=mode)
    if got is None:
        return None
    rows, geometry = got
    return launch_boxes(rows, geometry, out_h, out_w, interpolation, antialias, mode=mode,
                        nchw=nchw, a=a, b=b, round_mid=round_mid)  # fmt: skip


def box_items(clips, boxes, flips, out_h: int, out_w: int, interpolation: str, antialias: bool,
              *, mode: int):  # fmt: skip
    """:func:`resample_boxes`' table of items (host int64 ``[B, 14]``: each clip's address,
    strides, geometry, flip and output offset) and ``geometry = (B, N, C, dtype, device id)``;
    None where it cannot take the clips. The table holds the clips' addresses: it is valid
    for these arrays only."""
    if isinstance(clips, (list, tuple)):
        B = len(clips)
        first = clips[0] if B else None
        items = [(x.data.ptr, x.shape, x.strides, x.dtype) for x in clips]
    else:  # one batch: its items' addresses without a view of each
        B, first = int(clips.shape[0]), clips
        base, st0 = clips.data.ptr, clips.strides[0]
        items = [(base + k * st0, clips.shape[1:], clips.strides[1:], clips.dtype)
                 for k in range(B)]  # fmt: skip
    if len(boxes) != B or len(flips) != B:
        raise ValueError(f"box_items: {B} clips, {len(boxes)} boxes and {len(flips)} flips; "
                         "one box and one flip a clip")
    if B == 0 or B > 65535:
        return None
    n, _, _, c = (int(v) for v in first.shape[-4:])
    device_id = int(first.device.id)
    if _kernels(device_id) is None:
        return None
    dtype = first.dtype
    if dtype != np.uint8 and dtype != np.float32:
        return None
    item = dtype.itemsize
    per = n * c * out_h * out_w * np.dtype(_OUT_DTYPE[mode]).itemsize
    rows = []
    for k, ((ptr, shape, st, dt), (top, left, bh, bw), f) in enumerate(zip(items, boxes, flips)):
        if (len(shape) != 4 or dt != dtype or shape[0] != n or shape[3] != c
                or st[0] % item or st[1] % item or st[2] % item or st[3] % item
                or not direct_fits(bh, out_h, bw, out_w, interpolation, antialias, c)):
            return None  # fmt: skip
        rows.append([ptr, st[0] // item, st[1] // item, st[2] // item, st[3] // item, n,
                     bh, top, shape[1], bw, left, shape[2], bool(f), k * per])  # fmt: skip
    return np.array(rows, np.int64), (B, n, c, dtype, device_id)


def launch_boxes(table, geometry, out_h: int, out_w: int, interpolation: str, antialias: bool,
                 *, mode: int, nchw: bool, a=None, b=None, round_mid=None):  # fmt: skip
    """The one launch of :func:`resample_boxes` for :func:`box_items`' rows and geometry: the
    rows ``table`` on the host (sent in the launch's own table where they fit,
    :func:`avpipe.device.table_args`, else copied up) or already on the device."""
    import cupy

    B, n, c, dtype, device_id = geometry
    if round_mid is None:
        round_mid = mode == MODE_U8
    floats = _affine_args(a, b, c)
    with cupy.cuda.Device(device_id):
        shape = (B, n, c, out_h, out_w) if nchw else (B, n, out_h, out_w, c)
        out = cupy.empty(shape, dtype=_OUT_DTYPE[mode])
        if out.size == 0:
            return out
        tab, inl = NO_TABLE, 0
        if isinstance(table, np.ndarray):
            tab, inl, (table,) = table_args(cupy, [table])
        ints = np.array([c, out_h, out_h, out_w, out_w, interpolation == "bicubic",
                         bool(antialias), bool(round_mid)], np.int32)  # fmt: skip
        tail = np.array([bool(nchw), mode], np.int32)
        k = _kernels(device_id)["avp_direct_items_u8" if dtype == np.uint8 else
                                "avp_direct_items_f32"]  # fmt: skip
        tiles = -(-out_h // _TILE) * -(-out_w // _TILE)
        k((tiles, min(-(-n // _FRAMES), 65535), B), (_TILE * _TILE, 1, 1),
          (table, *ints, *floats, *tail, out, np.int64(c * out_h * out_w), tab, np.int32(inl)))
    return out
