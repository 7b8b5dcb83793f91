"""NV12 -> RGB the way FFmpeg's swscale does it for PyAV's ``to_ndarray(format="rgb24")``.

swscale (as PyAV calls it) follows the frame's colour-matrix tag (BT.709, FCC, SMPTE 240M,
BT.2020; anything else, untagged included, is BT.601) and its range tag (full range for ``pc``
and the ``yuvj*`` formats, else limited), and upsamples 4:2:0 chroma by repeating each sample
over its 2x2 block. :func:`nv12_to_rgb_reference` is the numpy reference; :func:`nv12_to_rgb`
runs one CUDA kernel (cupy) per frame with the same float32 arithmetic.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["yuv_coefficients", "nv12_to_rgb_reference", "nv12_to_rgb", "nv12_planes_to_rgb"]

# colour matrix tag -> (Kr, Kb)
_KRKB = {
    "bt709": (0.2126, 0.0722),
    "fcc": (0.30, 0.11),
    "smpte240m": (0.212, 0.087),
    "bt2020nc": (0.2627, 0.0593),
    "bt2020c": (0.2627, 0.0593),
}
_BT601 = (0.299, 0.114)


def is_full_range(color_range: str | None, pix_fmt: str | None) -> bool:
    return color_range == "pc" or bool(pix_fmt and pix_fmt.startswith("yuvj"))


def yuv_coefficients(color_space: str | None, color_range: str | None, pix_fmt: str | None = None):
    """(y_scale, y_offset, c_scale, r_v, g_u, g_v, b_u) for R,G,B = y_scale*(Y-y_offset) + ...
    with chroma centred at 128."""
    kr, kb = _KRKB.get(color_space or "", _BT601)
    kg = 1.0 - kr - kb
    if is_full_range(color_range, pix_fmt):
        ys, y0, cs = 1.0, 0.0, 1.0
    else:
        ys, y0, cs = 255.0 / 219.0, 16.0, 255.0 / 224.0
    rv = 2.0 * (1.0 - kr) * cs
    bu = 2.0 * (1.0 - kb) * cs
    gu = -2.0 * (1.0 - kb) * kb / kg * cs
    gv = -2.0 * (1.0 - kr) * kr / kg * cs
    return ys, y0, rv, gu, gv, bu


def nv12_to_rgb_reference(nv12: np.ndarray, height: int, width: int, coeffs) -> np.ndarray:
    """[H*3/2 (rounded up), W] uint8 NV12 -> [H, W, 3] uint8 RGB (numpy, float32 math)."""
    ys, y0, rv, gu, gv, bu = (np.float32(c) for c in coeffs)
    y = nv12[:height, :width].astype(np.float32)
    ch = (height + 1) // 2
    uv = nv12[height : height + ch, : 2 * ((width + 1) // 2)].reshape(ch, -1, 2).astype(np.float32)
    u = np.repeat(np.repeat(uv[..., 0], 2, 0), 2, 1)[:height, :width] - np.float32(128)
    v = np.repeat(np.repeat(uv[..., 1], 2, 0), 2, 1)[:height, :width] - np.float32(128)
    yy = (y - y0) * ys
    r = yy + rv * v
    g = yy + gu * u + gv * v
    b = yy + bu * u
    out = np.stack([r, g, b], axis=-1)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


_KERNEL = r"""
extern "C" __global__ void avpipe_nv12_to_rgb(
    const unsigned char* __restrict__ luma, const unsigned char* __restrict__ chroma,
    long long pitch, int height, int width, unsigned char* __restrict__ dst, int chw,
    float ys, float y0, float rv, float gu, float gv, float bu)
{
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x >= width || y >= height) return;
    float Y = (float)luma[(long long)y * pitch + x];
    const unsigned char* uvrow = chroma + (long long)(y / 2) * pitch;
    int cx = (x / 2) * 2;
    float U = (float)uvrow[cx] - 128.0f;
    float V = (float)uvrow[cx + 1] - 128.0f;
    float yy = (Y - y0) * ys;
    float r = yy + rv * V;
    float g = yy + gu * U + gv * V;
    float b = yy + bu * U;
    int ri = min(max(__float2int_rn(r), 0), 255);
    int gi = min(max(__float2int_rn(g), 0), 255);
    int bi = min(max(__float2int_rn(b), 0), 255);
    if (chw) {
        long long plane = (long long)height * width;
        long long o = (long long)y * width + x;
        dst[o] = (unsigned char)ri; dst[plane + o] = (unsigned char)gi; dst[2 * plane + o] = (unsigned char)bi;
    } else {
        long long o = ((long long)y * width + x) * 3;
        dst[o] = (unsigned char)ri; dst[o + 1] = (unsigned char)gi; dst[o + 2] = (unsigned char)bi;
    }
}
"""


@functools.cache
def _kernel(device_id: int):
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.RawKernel(_KERNEL, "avpipe_nv12_to_rgb")


def nv12_to_rgb(
    src, height: int, width: int, coeffs, out, *, chw: bool = False, chroma_row: int | None = None
) -> None:
    """Convert one NV12 frame (a 2-D cupy uint8 array, rows of any pitch, luma rows then
    interleaved chroma rows starting at ``chroma_row``, default ``height``) into ``out``
    ([H, W, 3] or [3, H, W] contiguous cupy uint8), on the current stream."""
    import cupy

    if src.dtype != cupy.uint8 or src.ndim != 2 or src.strides[1] != 1:
        src = cupy.ascontiguousarray(src, dtype=cupy.uint8)
    pitch = int(src.strides[0])
    crow = height if chroma_row is None else int(chroma_row)
    base = int(src.data.ptr)
    nv12_planes_to_rgb(base, base + crow * pitch, pitch, height, width, coeffs, out, chw=chw)


def nv12_planes_to_rgb(
    luma_ptr: int, chroma_ptr: int, pitch: int, height: int, width: int, coeffs, out, *,
    chw: bool = False,
) -> None:  # fmt: skip
    """:func:`nv12_to_rgb` on raw device pointers (a decoder's frame without an array object
    around it): the luma plane at ``luma_ptr`` and the interleaved chroma plane at
    ``chroma_ptr``, both ``pitch`` bytes per row; the caller keeps the memory alive and ordered
    before the current stream."""
    ys, y0, rv, gu, gv, bu = (np.float32(c) for c in coeffs)
    k = _kernel(int(out.device.id))
    k(
        ((width + 31) // 32, (height + 7) // 8, 1),
        (32, 8, 1),
        (
            np.uint64(luma_ptr),
            np.uint64(chroma_ptr),
            np.int64(pitch),
            np.int32(height),
            np.int32(width),
            out,
            np.int32(1 if chw else 0),
            ys,
            y0,
            rv,
            gu,
            gv,
            bu,
        ),
    )
