"""NV12 (4:2:0) -> RGB, the way FFmpeg's swscale does it for PyAV's
``to_ndarray(format="rgb24")``: one colour table, one rule for tags, two arithmetic forms.

**The colour table** (:data:`MATRICES`) gives each colour matrix's (Kr, Kb): BT.601 (also under
FFmpeg's names ``smpte170m`` and ``bt470bg``), BT.709, BT.2020 (``bt2020``, FFmpeg's
``bt2020nc`` and ``bt2020c``), SMPTE 240M and FCC. Every conversion derives its coefficients
from it (``2(1-Kr)``, ``2(1-Kb)``, ``2Kb(1-Kb)/Kg``, ``2Kr(1-Kr)/Kg``, times 255/224 and
255/219 for limited range).

**The rule for tags** (:func:`matrix_for`): a stream's colour-matrix tag that is in the table
selects that matrix; any other tag -- untagged, ``"unknown"``, ``"reserved"``, ``"unspecified"``
or a name FFmpeg adds later -- means BT.601, as swscale does. Full range for the range tag
``"pc"`` and the ``yuvj*`` pixel formats, else limited (16..235). A ``matrix=`` that a caller
names (:func:`nv12_to_rgb`) must be in the table: anything else raises ``ValueError``.

**Arithmetic.** :func:`nv12_to_rgb` (numpy or cupy) is swscale's own fixed-point path,
bit-exact with PyAV on the same planes. The NVDEC backend's CUDA kernel
(:func:`nv12_to_rgb_device`, :func:`nv12_planes_to_rgb`) runs one thread per pixel in float32
with :func:`yuv_coefficients` (within 3 levels of swscale: it rounds once where swscale floors
each term; tests check both); :func:`nv12_to_rgb_reference` is its numpy reference, the same
float32 arithmetic.
Both forms upsample chroma by repeating each sample over its 2x2 block.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .._validate import check_choice
from ..device import array_module
from ..device.cuda_modules import CudaModule

__all__ = [
    "MATRICES",
    "matrix_for",
    "is_full_range",
    "yuv_coefficients",
    "nv12_to_rgb",
    "nv12_to_rgb_reference",
    "nv12_to_rgb_device",
    "nv12_planes_to_rgb",
]

# colour matrix name (ours and FFmpeg's colorspace names) -> (Kr, Kb)
MATRICES = {
    "bt601": (0.299, 0.114),
    "smpte170m": (0.299, 0.114),
    "bt470bg": (0.299, 0.114),
    "bt709": (0.2126, 0.0722),
    "bt2020": (0.2627, 0.0593),
    "bt2020nc": (0.2627, 0.0593),
    "bt2020c": (0.2627, 0.0593),
    "smpte240m": (0.212, 0.087),
    "fcc": (0.30, 0.11),
}


def matrix_for(tag: str | None) -> str:
    """The table's matrix for a stream's colour-matrix tag: the tag itself when the table has
    it, else ``"bt601"`` (untagged and unknown tags, as swscale)."""
    return tag if tag in MATRICES else "bt601"


def is_full_range(color_range: str | None, pix_fmt: str | None) -> bool:
    """Full range (0..255) for the range tag ``"pc"`` and the ``yuvj*`` formats, else limited."""
    return color_range == "pc" or bool(pix_fmt and pix_fmt.startswith("yuvj"))


def yuv_coefficients(color_space: str | None, color_range: str | None, pix_fmt: str | None = None):
    """(y_scale, y_offset, r_v, g_u, g_v, b_u) for R,G,B = y_scale*(Y-y_offset) + ... with
    chroma centred at 128: the float32 kernel's coefficients for a stream's tags."""
    kr, kb = MATRICES[matrix_for(color_space)]
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


_KERNELS = CudaModule(__file__, "_nv12_to_rgb.cu", names=("avpipe_nv12_to_rgb",))


def _kernel(device_id: int):
    return _KERNELS.get(device_id)["avpipe_nv12_to_rgb"]


def nv12_to_rgb_device(
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


_BLOCK = (32, 8, 1)


@functools.lru_cache(maxsize=256)
def _launch_consts(pitch, height, width, chw, coeffs):
    """The grid and the kernel's scalar arguments that stay the same from frame to frame of a
    stream: ``(grid, (pitch, height, width), (chw, ys, y0, rv, gu, gv, bu))`` as the kernel's C
    types (built once, not per frame)."""
    grid = ((width + 31) // 32, (height + 7) // 8, 1)
    dims = (np.int64(pitch), np.int32(height), np.int32(width))
    tail = (np.int32(1 if chw else 0),) + tuple(np.float32(c) for c in coeffs)
    if len(tail) != 7:
        raise ValueError(f"coeffs must be the 6 values of yuv_coefficients, got {coeffs!r}")
    return grid, dims, tail


def nv12_planes_to_rgb(
    luma_ptr: int, chroma_ptr: int, pitch: int, height: int, width: int, coeffs, out, *,
    chw: bool = False,
) -> None:  # fmt: skip
    """:func:`nv12_to_rgb_device` on raw device pointers (a decoder's frame without an array object
    around it): the luma plane at ``luma_ptr`` and the interleaved chroma plane at
    ``chroma_ptr``, both ``pitch`` bytes per row; the caller keeps the memory alive and ordered
    before the current stream."""
    grid, dims, tail = _launch_consts(int(pitch), int(height), int(width), bool(chw),
                                      tuple(coeffs))  # fmt: skip
    _kernel(int(out.device.id))(
        grid, _BLOCK, (np.uint64(luma_ptr), np.uint64(chroma_ptr)) + dims + (out,) + tail
    )


# --- swscale's fixed-point path (numpy or cupy) ---------------------------------------------


def _yuv_coeffs(matrix, full_range):
    """swscale's fixed-point yuv->rgb constants for ``matrix``/range.

    The 16.16 coefficients are FFmpeg's (``2(1-Kr)``, ``2(1-Kb)``, ``2Kb(1-Kb)/Kg``,
    ``2Kr(1-Kr)/Kg``, each times 255/224) derived from Kr/Kb; then reduced as swscale's SIMD
    ``yuv2rgb`` path does: Q13 multipliers used with a ``>> 16`` on values scaled by 8.
    """
    kr, kb = MATRICES[matrix]
    kg = 1.0 - kr - kb
    f = 255.0 / 224.0 * 65536.0

    def q(v):
        return int(math.floor(v + 0.5))

    crv, cbu = q(2 * (1 - kr) * f), q(2 * (1 - kb) * f)
    cgu, cgv = -q(2 * kb * (1 - kb) / kg * f), -q(2 * kr * (1 - kr) / kg * f)
    cy, oy = 1 << 16, 0
    if not full_range:
        cy, oy = (cy * 255) // 219, 16 << 16
    else:
        # C integer division truncates toward zero
        crv, cbu = (crv * 224) // 255, (cbu * 224) // 255
        cgu, cgv = -((-cgu * 224) // 255), -((-cgv * 224) // 255)

    def r16(v):  # swscale's roundToInt16(v * 2**13) etc.: (v + 2**15) >> 16
        return (v + (1 << 15)) >> 16

    return dict(
        yc=r16(cy << 13),
        yo=r16(oy << 3),
        vr=r16(crv << 13),
        ub=r16(cbu << 13),
        ug=r16(cgu << 13),
        vg=r16(cgv << 13),
    )


def nv12_to_rgb(y, uv, *, matrix: str = "bt601", full_range: bool = False):
    """NV12 (or any 4:2:0) -> RGB uint8 ``[..., H, W, 3]``, bit-exact with FFmpeg.

    ``y``: luma ``[..., H, W]`` uint8. ``uv``: interleaved chroma ``[..., ceil(H/2), ceil(W/2), 2]``
    (NV12's second plane, reshaped) or the same plane as ``[..., ceil(H/2), 2*ceil(W/2)]``.
    ``matrix``: a name of :data:`MATRICES` -- ``"bt601"`` (FFmpeg's default for untagged video),
    ``"bt709"``, ``"bt2020"``, ``"smpte240m"``, ``"fcc"`` or FFmpeg's names (``"smpte170m"``,
    ``"bt470bg"``, ``"bt2020nc"``, ``"bt2020c"``); for a stream's tag use
    ``matrix_for(tag)``. ``full_range``: JPEG/full range (0..255) instead of limited (16..235).

    The arithmetic is swscale's ``yuv420p -> rgb24`` fast path on x86 (what PyAV's
    ``to_ndarray(format="rgb24")`` runs for a software decoder's yuv420p frame): chroma
    replicated over each 2x2 block, fixed-point Q13 coefficients, terms floored, sum saturated.
    On the same planes it equals PyAV's output exactly (the tests allow 2 levels, for builds
    whose swscale takes its C path). Integer xp arithmetic: numpy and cupy give the same bytes.
    """
    check_choice("matrix", matrix, sorted(MATRICES))
    xp = array_module(y, uv)
    if y.ndim < 2:
        raise ValueError(f"y must be [..., H, W], got shape {tuple(y.shape)}")
    h, w = y.shape[-2], y.shape[-1]
    ch, cw = (h + 1) // 2, (w + 1) // 2
    if uv.shape[-3:] != (ch, cw, 2):
        if uv.shape[-2:] == (ch, 2 * cw):
            uv = uv.reshape(uv.shape[:-2] + (ch, cw, 2))
        else:
            raise ValueError(
                f"uv must be [..., {ch}, {cw}, 2] or [..., {ch}, {2 * cw}] for a {h}x{w} y plane, "
                f"got shape {tuple(uv.shape)}"
            )
    k = _yuv_coeffs(matrix, full_range)
    c = uv.astype(xp.int32) * 8 - 1024
    c = xp.repeat(xp.repeat(c, 2, axis=-3), 2, axis=-2)[..., :h, :w, :]
    u8, v8 = c[..., 0], c[..., 1]
    yy = ((y.astype(xp.int32) * 8 - k["yo"]) * k["yc"]) >> 16
    r = yy + ((v8 * k["vr"]) >> 16)
    g = yy + ((u8 * k["ug"]) >> 16) + ((v8 * k["vg"]) >> 16)
    b = yy + ((u8 * k["ub"]) >> 16)
    return xp.clip(xp.stack([r, g, b], axis=-1), 0, 255).astype(xp.uint8)
