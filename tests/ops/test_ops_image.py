"""avpipe.ops.image: resize vs PIL/torch, crop/flip/normalize/layout/dtype, NV12 vs PyAV,
the fused resize_crop_normalize; GPU (cupy) vs CPU (numpy)."""

from __future__ import annotations

import numpy as np
import pytest

import avpipe.ops
from avpipe.ops import image as I


def _picture(h, w, seed=0, noise=20):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack(
        [128 + 100 * np.sin(xx / 7 + c) * np.cos(yy / 11) for c in range(3)], -1
    ) + rng.normal(0, noise, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


SIZES = [((375, 500), (224, 299)), ((37, 53), (80, 61)), ((100, 100), (33, 77))]


def test_public_names_reexported():
    import importlib

    try:  # a name the audio ops also export resolves to theirs (avpipe.ops searches audio first)
        shadowed = set(importlib.import_module("avpipe.ops.audio").__all__)
    except ImportError:
        shadowed = set()
    for name in I.__all__:
        if name not in shadowed:
            assert getattr(avpipe.ops, name) is getattr(I, name)
    assert avpipe.ops.image.normalize is I.normalize


# --- resize ------------------------------------------------------------------------------------


@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.parametrize("src,dst", SIZES)
def test_resize_float_matches_torch(src, dst, interp, antialias):
    torch = pytest.importorskip("torch")
    img = _picture(*src).astype(np.float32)
    ours = I.resize(img, dst, interpolation=interp, antialias=antialias)
    t = torch.from_numpy(img).permute(2, 0, 1)[None]
    ref = (
        torch.nn.functional.interpolate(
            t, size=dst, mode=interp, align_corners=False, antialias=antialias
        )[0]
        .permute(1, 2, 0)
        .numpy()
    )
    assert ours.dtype == np.float32 and ours.shape == dst + (3,)
    assert np.abs(ours - ref).max() < 0.01


@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
@pytest.mark.parametrize("src,dst", SIZES)
def test_resize_uint8_antialias_matches_pil(src, dst, interp):
    from PIL import Image

    img = _picture(*src)
    ours = I.resize(img, dst, interpolation=interp, antialias=True)
    flt = Image.BILINEAR if interp == "bilinear" else Image.BICUBIC
    ref = np.asarray(Image.fromarray(img).resize(dst[::-1], flt))
    d = np.abs(ours.astype(int) - ref)
    assert ours.dtype == np.uint8
    assert d.max() <= 2 and d.mean() < 0.3


@pytest.mark.parametrize("antialias", [True, False])
def test_dense_weights_equal_taps(antialias):
    # the GPU path multiplies by the dense matrix; the CPU path sums gathered taps
    from avpipe.ops import _image_resize as rs

    x = _picture(50, 70).astype(np.float32).transpose(2, 0, 1)[None].copy()
    for axis, (n_in, n_out) in ((2, (50, 23)), (3, (70, 111))):
        idx, w = rs.axis_weights(n_in, n_out, "bicubic", antialias, 2, n_out - 3)
        taps = rs.apply_axis(np, x, idx, w, axis)
        m = rs._dense(idx, w, n_in)
        dense = np.matmul(m, x) if axis == 2 else np.matmul(x, m.T)
        assert taps.shape == dense.shape
        assert np.abs(taps - dense).max() < 1e-3


def test_resize_short_side_and_batch():
    clip = np.stack([_picture(60, 80, seed=s) for s in range(4)])  # [T, H, W, C]
    out = I.resize(clip, short_side=30)
    assert out.shape == (4, 30, 40, 3)
    for t in range(4):  # a clip is a batch of frames
        np.testing.assert_array_equal(out[t], I.resize(clip[t], short_side=30))
    assert I.resize(_picture(80, 60), short_side=30).shape == (40, 30, 3)
    assert I.resize_short_side_size(375, 500, 224) == (224, 298)
    # same size: identity
    img = _picture(20, 30)
    np.testing.assert_array_equal(I.resize(img, (20, 30)), img)


def test_resize_validation():
    img = _picture(10, 10)
    with pytest.raises(ValueError, match="interpolation"):
        I.resize(img, (5, 5), interpolation="nearest-ish")
    with pytest.raises(ValueError, match="exactly one"):
        I.resize(img, (5, 5), short_side=5)
    with pytest.raises(ValueError, match="size"):
        I.resize(img, (0, 5))
    with pytest.raises(ValueError, match="x must be"):
        I.resize(img[..., 0], (5, 5))


# --- crop / flip / normalize / layout / dtype -------------------------------------------------


def test_crop_center_crop_flip():
    img = _picture(20, 30)
    np.testing.assert_array_equal(I.crop(img, 2, 3, 5, 7), img[2:7, 3:10])
    np.testing.assert_array_equal(I.center_crop(img, 10), img[5:15, 10:20])
    np.testing.assert_array_equal(I.center_crop(img, (11, 9)), img[4:15, 10:19])
    np.testing.assert_array_equal(I.flip(img), img[:, ::-1])
    np.testing.assert_array_equal(I.flip(img, horizontal=False, vertical=True), img[::-1])
    clip = np.stack([img, img[::-1]])
    np.testing.assert_array_equal(I.flip(clip)[1], img[::-1, ::-1])
    with pytest.raises(ValueError, match="outside"):
        I.crop(img, 15, 0, 10, 5)


def test_center_crop_matches_torchvision_offsets():
    torch = pytest.importorskip("torch")
    tvf = pytest.importorskip("torchvision.transforms.functional")
    img = _picture(21, 30)
    ref = tvf.center_crop(torch.from_numpy(img).permute(2, 0, 1), [10, 13]).permute(1, 2, 0)
    np.testing.assert_array_equal(I.center_crop(img, (10, 13)), ref.numpy())


def test_normalize_layout_dtype():
    img = _picture(8, 9)
    mean, std = I.IMAGENET_MEAN, I.IMAGENET_STD
    out = I.normalize(img, mean, std, scale=1 / 255, dtype="float16")
    ref = (img / 255.0 - np.array(mean)) / np.array(std)
    assert out.dtype == np.float16
    assert np.abs(out.astype(np.float64) - ref).max() < 5e-3
    chw = I.to_chw(img)
    assert chw.shape == (3, 8, 9)
    np.testing.assert_array_equal(chw[1], img[..., 1])
    out_chw = I.normalize(chw, mean, std, scale=1 / 255, layout="CHW")
    np.testing.assert_allclose(out_chw, I.to_chw(I.normalize(img, mean, std, scale=1 / 255)))
    assert I.to_layout(np.stack([img, img]), "NCHW").shape == (2, 3, 8, 9)
    f = I.to_dtype(img, "float32")
    assert f.dtype == np.float32 and f.max() <= 1.0
    np.testing.assert_array_equal(I.to_dtype(f, "uint8"), img)
    np.testing.assert_array_equal(I.to_dtype(img, "float32", scale=False), img.astype(np.float32))
    with pytest.raises(ValueError, match="std"):
        I.normalize(img, 0.5, 0.0)
    with pytest.raises(ValueError, match="mean"):
        I.normalize(img, (1, 2), 1.0)
    with pytest.raises(ValueError, match="dtype"):
        I.to_dtype(img, "int7")


@pytest.mark.parametrize("interp,antialias", [("bilinear", True), ("bicubic", False)])
def test_resize_crop_normalize_equals_the_chain(interp, antialias):
    clip = np.stack([_picture(375, 500, seed=s) for s in range(2)])
    fused = I.resize_crop_normalize(
        clip, short_side=224, crop_size=224, interpolation=interp, antialias=antialias
    )
    assert fused.shape == (2, 3, 224, 224) and fused.dtype == np.float16
    r = I.resize(clip.astype(np.float32), short_side=224, interpolation=interp,
                 antialias=antialias)  # fmt: skip
    chain = I.to_chw(I.normalize(I.center_crop(r, 224), I.IMAGENET_MEAN, I.IMAGENET_STD,
                                 scale=1 / 255))  # fmt: skip
    assert np.abs(fused.astype(np.float32) - chain).max() < 0.01
    # one image in -> one image out, NHWC
    one = I.resize_crop_normalize(clip[0], short_side=224, crop_size=200, layout="NHWC",
                                  dtype="float32")  # fmt: skip
    assert one.shape == (200, 200, 3) and one.dtype == np.float32
    with pytest.raises(ValueError, match="crop_size"):
        I.resize_crop_normalize(clip, short_side=100, crop_size=224)


# --- NV12 -> RGB -------------------------------------------------------------------------------


def _yuv_planes(h, w, seed=0):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    y = np.clip(128 + 110 * np.sin(xx / 9) * np.cos(yy / 7) + rng.normal(0, 3, (h, w)), 0, 255)
    cy, cx = np.mgrid[0 : h // 2, 0 : w // 2]
    u = np.clip(128 + 120 * np.sin(cx / 5 + 1) + rng.normal(0, 3, cx.shape), 0, 255)
    v = np.clip(128 + 120 * np.cos(cy / 4) + rng.normal(0, 3, cy.shape), 0, 255)
    return y.astype(np.uint8), u.astype(np.uint8), v.astype(np.uint8)


@pytest.mark.parametrize(
    "colorspace,matrix",
    [(None, "bt601"), ("ITU709", "bt709"), ("ITU601", "bt601"), ("BT2020", "bt2020"),
     ("SMPTE240M", "smpte240m"), ("FCC", "fcc")],
)  # fmt: skip
@pytest.mark.parametrize("full_range", [False, True])
def test_nv12_to_rgb_matches_pyav(colorspace, matrix, full_range):
    av = pytest.importorskip("av")
    from av.video.reformatter import ColorRange, Colorspace

    h, w = 48, 64
    y, u, v = _yuv_planes(h, w)
    frame = av.VideoFrame.from_ndarray(
        np.concatenate([y, u.reshape(-1, w), v.reshape(-1, w)], 0), format="yuv420p"
    )
    if colorspace is not None:
        frame.colorspace = getattr(Colorspace, colorspace)
    if full_range:
        frame.color_range = ColorRange.JPEG
    ref = frame.to_ndarray(format="rgb24")
    uv = np.stack([u, v], -1)
    ours = I.nv12_to_rgb(y, uv, matrix=matrix, full_range=full_range)
    assert ours.dtype == np.uint8 and ours.shape == (h, w, 3)
    assert np.abs(ours.astype(int) - ref).max() <= 2
    # the NV12 plane layout [H/2, W] gives the same
    np.testing.assert_array_equal(I.nv12_to_rgb(y, uv.reshape(h // 2, w), matrix=matrix,
                                                full_range=full_range), ours)  # fmt: skip


def test_nv12_batch_odd_sizes_and_validation():
    y, u, v = _yuv_planes(48, 64)
    uv = np.stack([u, v], -1)
    clip = I.nv12_to_rgb(np.stack([y, y]), np.stack([uv, uv]))
    assert clip.shape == (2, 48, 64, 3)
    np.testing.assert_array_equal(clip[1], I.nv12_to_rgb(y, uv))
    odd = I.nv12_to_rgb(y[:47, :63], uv)
    np.testing.assert_array_equal(odd, clip[0, :47, :63])
    with pytest.raises(ValueError, match="matrix"):
        I.nv12_to_rgb(y, uv, matrix="bt999")
    with pytest.raises(ValueError, match="uv must be"):
        I.nv12_to_rgb(y, uv[:10])


# --- GPU: cupy vs numpy ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [True, False])
def test_gpu_resize_matches_cpu(interp, antialias):
    import cupy

    clip = np.stack([_picture(375, 500, seed=s) for s in range(3)])
    g = I.resize(cupy.asarray(clip), short_side=224, interpolation=interp, antialias=antialias)
    c = I.resize(clip, short_side=224, interpolation=interp, antialias=antialias)
    assert isinstance(g, cupy.ndarray) and g.shape == c.shape and g.dtype == np.uint8
    d = np.abs(cupy.asnumpy(g).astype(int) - c)
    assert d.max() <= 2 and d.mean() < 0.01  # only rare rounding flips
    gf = I.resize(cupy.asarray(clip, dtype=cupy.float32), (100, 130), interpolation=interp,
                  antialias=antialias)  # fmt: skip
    cf = I.resize(clip.astype(np.float32), (100, 130), interpolation=interp, antialias=antialias)
    assert np.abs(cupy.asnumpy(gf) - cf).max() < 0.01


@pytest.mark.gpu
def test_gpu_ops_match_cpu():
    import cupy

    clip = np.stack([_picture(375, 500, seed=s) for s in range(3)])
    gclip = cupy.asarray(clip)
    g = I.resize_crop_normalize(gclip)
    c = I.resize_crop_normalize(clip)
    assert isinstance(g, cupy.ndarray) and g.shape == (3, 3, 224, 224) and g.dtype == np.float16
    assert np.abs(cupy.asnumpy(g).astype(np.float32) - c.astype(np.float32)).max() < 0.02
    cupy.testing.assert_array_equal(I.center_crop(gclip, 100), I.center_crop(clip, 100))
    cupy.testing.assert_array_equal(I.flip(gclip, vertical=True), I.flip(clip, vertical=True))
    cupy.testing.assert_array_equal(I.to_chw(gclip), I.to_chw(clip))
    n = I.normalize(gclip, I.IMAGENET_MEAN, I.IMAGENET_STD, scale=1 / 255)
    cupy.testing.assert_allclose(n, I.normalize(clip, I.IMAGENET_MEAN, I.IMAGENET_STD,
                                                scale=1 / 255), atol=1e-5)  # fmt: skip
    cupy.testing.assert_array_equal(I.to_dtype(gclip, "float16"), I.to_dtype(clip, "float16"))


@pytest.mark.gpu
@pytest.mark.parametrize("matrix,full_range", [("bt601", False), ("bt709", False),
                                               ("bt709", True), ("bt2020", False)])  # fmt: skip
def test_gpu_nv12_matches_cpu_exactly(matrix, full_range):
    import cupy

    y, u, v = _yuv_planes(360, 640)
    uv = np.stack([u, v], -1)
    g = I.nv12_to_rgb(cupy.asarray(y), cupy.asarray(uv), matrix=matrix, full_range=full_range)
    c = I.nv12_to_rgb(y, uv, matrix=matrix, full_range=full_range)
    assert isinstance(g, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(g), c)
