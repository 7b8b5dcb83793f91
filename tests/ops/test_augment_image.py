"""Image / clip augmentations: each op against a plain reference written here (torchvision's
formulas in loops, ``colorsys`` for hue, torch ``interpolate`` for the resize), the sampled
parameters' distributions, determinism and resume, chains and layouts.

GPU tests (marked ``gpu``) compare cupy with numpy: parameters, crops, flips, N-crops and the
NV12 crop exactly; resize and colour jitter within 1e-3 of the value range (float output) and
1 level (uint8).
"""

from __future__ import annotations

import colorsys
import math

import numpy as np
import pytest
import torch

from avpipe.ops import image as IM
from avpipe.ops import image_augment as I
from avpipe.ops import random as R


def _clips(seed=0, shape=(3, 4, 30, 50, 3), dtype=np.uint8):
    rng = np.random.default_rng(seed)
    if dtype == np.uint8:
        return rng.integers(0, 256, shape, dtype=np.uint8)
    return rng.random(shape).astype(np.float32)


# --- random resized crop -----------------------------------------------------------------------


def _rrc_reference(seed, epoch, ids, H, W, scale, ratio, stream="random_resized_crop"):
    """torchvision RandomResizedCrop.get_params, item by item, on the same uniform words."""
    w = R.words(seed, stream, epoch, ids, 40)
    out = []
    for b in range(len(ids)):
        u = w[b].astype(np.float64) / 2**32
        area = H * W
        lr = (math.log(ratio[0]), math.log(ratio[1]))
        for a in range(10):
            target = area * (scale[0] + (scale[1] - scale[0]) * u[a])
            aspect = math.exp(lr[0] + (lr[1] - lr[0]) * u[10 + a])
            cw = int(round(math.sqrt(target * aspect)))
            ch = int(round(math.sqrt(target / aspect)))
            if 0 < cw <= W and 0 < ch <= H:
                top = (int(w[b, 20 + a]) * (H - ch + 1)) >> 32
                left = (int(w[b, 30 + a]) * (W - cw + 1)) >> 32
                out.append((top, left, ch, cw))
                break
        else:
            in_ratio = W / H
            if in_ratio < min(ratio):
                cw, ch = W, int(round(W / min(ratio)))
            elif in_ratio > max(ratio):
                ch, cw = H, int(round(H * max(ratio)))
            else:
                cw, ch = W, H
            out.append(((H - ch) // 2, (W - cw) // 2, ch, cw))
    return np.array(out)


@pytest.mark.parametrize("H,W,scale,ratio", [
    (30, 50, (0.08, 1.0), (3 / 4, 4 / 3)),
    (360, 640, (0.08, 1.0), (3 / 4, 4 / 3)),
    (100, 100, (1.5, 2.0), (3 / 4, 4 / 3)),   # always falls back (centre crop)
    (40, 200, (0.9, 1.0), (0.9, 1.1)),         # fallback with the ratio clamped
    (200, 40, (0.9, 1.0), (0.9, 1.1)),
])  # fmt: skip
def test_rrc_params_match_torchvision_rule(H, W, scale, ratio):
    ids = np.arange(300)
    p = I.sample_resized_crop_params(4, 1, ids, H, W, scale=scale, ratio=ratio)
    got = np.stack([p["top"], p["left"], p["height"], p["width"]], 1)
    np.testing.assert_array_equal(got, _rrc_reference(4, 1, ids, H, W, scale, ratio))
    assert np.all(p["top"] >= 0) and np.all(p["top"] + p["height"] <= H)
    assert np.all(p["left"] >= 0) and np.all(p["left"] + p["width"] <= W)


@pytest.mark.parametrize("kw", [dict(scale=(-0.1, 1.0)), dict(scale=(0.1, float("nan"))),
                                dict(ratio=(0.0, 1.0)), dict(ratio=(0.5, float("inf")))])
def test_rrc_params_refuse_bad_ranges(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        I.sample_resized_crop_params(0, 0, np.arange(3), 30, 50, **kw)


def test_rrc_params_distribution():
    n, H, W = 10000, 360, 640
    p = I.sample_resized_crop_params(0, 0, np.arange(n), H, W)
    frac = p["height"] * p["width"] / (H * W)
    r = p["width"] / p["height"]
    assert frac.min() > 0.07 and frac.max() <= 1.0
    assert r.min() > 0.70 and r.max() < 1.45  # the ratio range, widened by the rounding
    # a 16:9 frame holds at most 3/4 of its area at a ratio <= 4/3
    assert frac.max() <= 0.75 + 1e-9
    # on a square frame, areas below 1/ratio always fit on the first attempt: uniform there
    q = I.sample_resized_crop_params(0, 0, np.arange(n), 500, 500)
    fq = q["height"] * q["width"] / 500**2
    hist = np.histogram(fq, 4, (0.08, 0.6))[0] / n
    assert np.all(np.abs(hist - hist.mean()) < 0.015) and fq.max() > 0.95
    # top is uniform over the free range
    free = H - p["height"]
    rel = p["top"][free > 100] / free[free > 100]
    assert abs(rel.mean() - 0.5) < 0.02


@pytest.mark.parametrize("antialias", [True, False])
def test_rrc_apply_matches_torch_interpolate(antialias):
    x = _clips(shape=(3, 2, 30, 50, 3), dtype=np.float32) * 255
    p = I.sample_resized_crop_params(1, 0, np.arange(3), 30, 50, scale=(0.2, 1.0))
    y = I.apply_resized_crop(x, p, (16, 20), antialias=antialias)
    assert y.shape == (3, 2, 16, 20, 3) and y.dtype == np.float32
    for b in range(3):
        t, le, h, w = (int(p[k][b]) for k in ("top", "left", "height", "width"))
        crop = torch.from_numpy(x[b, :, t : t + h, le : le + w]).permute(0, 3, 1, 2)
        ref = torch.nn.functional.interpolate(crop.double(), size=(16, 20), mode="bilinear",
                                              align_corners=False, antialias=antialias)  # fmt: skip
        np.testing.assert_allclose(y[b], ref.permute(0, 2, 3, 1).numpy(), atol=0.01)
        # and avpipe.ops.image.resize of the crop: the same taps
        np.testing.assert_allclose(y[b], IM.resize(IM.crop(x[b], t, le, h, w), (16, 20),
                                                   antialias=antialias), atol=1e-3)  # fmt: skip


def test_rrc_uint8_and_fused_path():
    x = _clips()
    p = I.sample_resized_crop_params(2, 0, np.arange(3), 30, 50)
    y8 = I.apply_resized_crop(x, p, 16)
    yf = I.apply_resized_crop(x, p, 16, dtype="float32")
    assert y8.dtype == np.uint8
    np.testing.assert_array_equal(y8, np.clip(np.floor(yf + 0.5), 0, 255).astype(np.uint8))
    f = I.fused_resized_crop_normalize(x, p, 16, mean=0, std=1, scale=1.0, dtype="float32",
                                       layout="NHWC")  # fmt: skip
    np.testing.assert_allclose(f, yf, atol=1e-3)
    # layouts: channels-first in -> channels-first out, same values
    yc = I.apply_resized_crop(np.ascontiguousarray(np.moveaxis(x, -1, 2)), p, 16, layout="BTCHW")
    np.testing.assert_array_equal(np.moveaxis(yc, 2, -1), y8)
    yi = I.apply_resized_crop(x[:, 0], p, 16)
    np.testing.assert_array_equal(yi, y8[:, 0])
    # one box and one flip a clip, or a ValueError naming the param (on every device)
    for k, v in (("flip", np.zeros(4, bool)), ("height", p["height"][:2])):
        with pytest.raises(ValueError, match=rf"params\['{k}'\] must have one value per clip \(3\)"):
            I.fused_resized_crop_normalize(x, {**p, k: v}, 16, dtype="float32", layout="NHWC")


def _crop_jitter_normalize_steps(x, p, cj, size, **norm):
    """The steps ``fused_resized_crop_normalize(color_jitter=...)`` folds, one after another:
    the crops as 0..255 floats, the colour jitter, the normalize."""
    y = I.fused_resized_crop_normalize(x, p, size, mean=0.0, std=1.0, scale=1.0,
                                       dtype="float32", layout="NHWC")  # fmt: skip
    y = I.apply_color_jitter(y, cj, bound=255.0, layout="BTHWC")
    return I.Normalize(norm["mean"], norm["std"], scale=1 / 255, dtype=norm["dtype"],
                       out_layout=norm["layout"], layout="BTHWC").apply(y, {})  # fmt: skip


def test_fused_crop_with_color_jitter_is_the_steps_in_turn():
    x = _clips()
    p = {**I.sample_resized_crop_params(2, 0, np.arange(3), 30, 50),
         "flip": np.array([True, False, True])}  # fmt: skip
    cj = I.sample_color_jitter_params(5, 0, np.arange(3), brightness=0.4, contrast=0.4,
                                      saturation=0.4, hue=0.1)  # fmt: skip
    for dtype, layout in (("float16", "NCHW"), ("float32", "NHWC")):
        norm = dict(mean=IM.IMAGENET_MEAN, std=IM.IMAGENET_STD, dtype=dtype, layout=layout)
        got = I.fused_resized_crop_normalize(x, p, 16, color_jitter=cj, bound=255.0,
                                             scale=1 / 255, **norm)  # fmt: skip
        want = _crop_jitter_normalize_steps(x, p, cj, 16, **norm)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


# --- centre crop, N-crop -----------------------------------------------------------------------


def test_center_and_n_crop():
    x = _clips(shape=(2, 3, 30, 50, 3))
    np.testing.assert_array_equal(I.center_crop_clips(x, (20, 24)), x[:, :, 5:25, 13:37])
    c3 = I.n_crop(x, 30, 3)
    assert c3.shape == (2, 3, 3, 30, 30, 3)
    for k, le in enumerate([0, 10, 20]):
        np.testing.assert_array_equal(c3[:, k], x[:, :, :, le : le + 30])
    xt = np.ascontiguousarray(np.swapaxes(x, 2, 3))  # tall: crops along H
    c3t = I.n_crop(xt, 30, 3)
    for k, t in enumerate([0, 10, 20]):
        np.testing.assert_array_equal(c3t[:, k], xt[:, :, t : t + 30])
    c10 = I.n_crop(x, (10, 12), 10)
    boxes = [(0, 0), (0, 38), (20, 0), (20, 38), (10, 19)]
    for k, (t, le) in enumerate(boxes):
        np.testing.assert_array_equal(c10[:, k], x[:, :, t : t + 10, le : le + 12])
        np.testing.assert_array_equal(c10[:, 5 + k], x[:, :, :, ::-1][:, :, t : t + 10, le : le + 12])
    np.testing.assert_array_equal(I.n_crop(x, (10, 12), 5), c10[:, :5])


# --- flip, grayscale ---------------------------------------------------------------------------


def test_flip_and_grayscale_reference():
    x = _clips()
    p = I.sample_flip_params(0, 0, np.arange(3))
    y = I.apply_flip(x, p)
    for b in range(3):
        np.testing.assert_array_equal(y[b], x[b, :, :, ::-1] if p["flip"][b] else x[b])
    g = {"gray": np.array([True, False, True])}
    y = I.apply_grayscale(x, g)
    for b in range(3):
        if g["gray"][b]:
            lum = 0.2989 * x[b, ..., 0] + 0.587 * x[b, ..., 1] + 0.114 * x[b, ..., 2]
            ref = np.repeat(np.floor(lum + 0.5)[..., None], 3, -1)
            assert np.abs(y[b].astype(int) - ref).max() <= 1
        else:
            np.testing.assert_array_equal(y[b], x[b])
    f = I.sample_flip_params(0, 0, np.arange(10000), p=0.5)["flip"]
    assert abs(f.mean() - 0.5) < 0.015
    gr = I.sample_grayscale_params(0, 0, np.arange(10000), p=0.1)["gray"]
    assert abs(gr.mean() - 0.1) < 0.01


# --- colour jitter -----------------------------------------------------------------------------


def _jitter_reference(img, bri, con, sat, hue, order):
    """torchvision ColorJitter on one float clip [T, H, W, 3] in [0, 1], in ``order``."""
    x = img.astype(np.float64).copy()
    for o in order:
        gray = 0.2989 * x[..., 0] + 0.587 * x[..., 1] + 0.114 * x[..., 2]
        if o == 0:
            x = np.clip(bri * x, 0, 1)
        elif o == 1:
            m = gray.mean(axis=(1, 2))[:, None, None, None]
            x = np.clip(con * x + (1 - con) * m, 0, 1)
        elif o == 2:
            x = np.clip(sat * x + (1 - sat) * gray[..., None], 0, 1)
        elif hue != 0:
            out = np.empty_like(x)
            for idx in np.ndindex(x.shape[:-1]):
                h, s, v = colorsys.rgb_to_hsv(*x[idx])
                out[idx] = colorsys.hsv_to_rgb((h + hue) % 1.0, s, v)
            x = out
    return x


@pytest.mark.parametrize("random_order", [True, False])
def test_color_jitter_reference(random_order):
    x = _clips(shape=(6, 2, 5, 7, 3), dtype=np.float32)
    p = I.sample_color_jitter_params(3, 0, np.arange(6), brightness=0.4, contrast=0.4,
                                     saturation=0.4, hue=0.2, random_order=random_order)  # fmt: skip
    y = I.apply_color_jitter(x, p)
    for b in range(6):
        ref = _jitter_reference(x[b], p["brightness"][b], p["contrast"][b], p["saturation"][b],
                                p["hue"][b], p["order"][b])  # fmt: skip
        np.testing.assert_allclose(y[b], ref, atol=1e-5)
    if not random_order:
        assert np.all(p["order"] == [0, 1, 2, 3])
    # uint8: the float result on 0..255, rounded once
    x8 = _clips(shape=(6, 2, 5, 7, 3))
    y8 = I.apply_color_jitter(x8, p)
    yf = I.apply_color_jitter(x8.astype(np.float32) / 255, p) * 255
    assert y8.dtype == np.uint8 and np.abs(y8 - np.floor(yf + 0.5)).max() <= 1


def test_color_jitter_distributions():
    n = 10000
    p = I.sample_color_jitter_params(0, 0, np.arange(n), brightness=0.4, contrast=(0.5, 2.0),
                                     saturation=1.5, hue=0.1)  # fmt: skip
    b, c, s, h = p["brightness"], p["contrast"], p["saturation"], p["hue"]
    assert all(v.dtype == np.float64 and v.shape == (n,) and v.flags.c_contiguous
               for v in (b, c, s, h))  # fmt: skip  (plain arrays, as they are handed out)
    assert b.min() >= 0.6 and b.max() < 1.4 and abs(b.mean() - 1.0) < 0.01
    assert c.min() >= 0.5 and c.max() < 2.0
    assert s.min() >= 0.0 and s.max() < 2.5  # max(0, 1 - 1.5)
    assert h.min() >= -0.1 and h.max() < 0.1 and abs(h.mean()) < 0.003
    # orders: permutations, each of the 24 about equally often
    assert np.all(np.sort(p["order"], 1) == np.arange(4))
    codes = p["order"] @ np.array([64, 16, 4, 1])
    counts = np.unique(codes, return_counts=True)[1]
    assert counts.size == 24 and np.all(np.abs(counts / n - 1 / 24) < 0.012)


# --- temporal jitter ---------------------------------------------------------------------------


def test_temporal_jitter():
    base = np.tile(np.arange(0, 64, 4), (1000, 1))
    p = I.sample_temporal_jitter_params(0, 0, np.arange(1000), 16, max_shift=3, max_jitter=1)
    assert set(np.unique(p["shift"])) == set(range(-3, 4))
    assert set(np.unique(p["jitter"])) == {-1, 0, 1}
    out = I.apply_temporal_jitter(base, 60, p)
    for b in range(1000):
        ref = np.sort(np.clip(base[b] + p["shift"][b] + p["jitter"][b], 0, 59))
        np.testing.assert_array_equal(out[b], ref)
    assert np.all(np.diff(out, axis=1) >= 0)


# --- mixup, cutmix -----------------------------------------------------------------------------


def test_mixup_reference_and_distribution():
    x = _clips(dtype=np.float32)
    p = I.sample_mixup_params(0, 0, np.arange(3), alpha=0.4)
    y, t = I.apply_mixup(x, np.array([0, 2, 1]), p, num_classes=3)
    onehot = np.eye(3, dtype=np.float32)[[0, 2, 1]]
    for b in range(3):
        lam = p["lam"][b]
        np.testing.assert_allclose(y[b], lam * x[b] + (1 - lam) * x[b - 1], atol=1e-6)
        np.testing.assert_allclose(t[b], lam * onehot[b] + (1 - lam) * onehot[b - 1], atol=1e-6)
    for alpha in (0.2, 1.0, 2.0):
        lam = I.sample_mixup_params(1, 0, np.arange(10000), alpha=alpha)["lam"]
        assert lam.min() >= 0 and lam.max() <= 1
        assert abs(lam.mean() - 0.5) < 0.015
        assert abs(lam.var() - 1 / (4 * (2 * alpha + 1))) < 0.01
    u = I.sample_mixup_params(1, 0, np.arange(10000), alpha=1.0)["lam"]  # Beta(1, 1): uniform
    assert np.all(np.abs(np.histogram(u, 4, (0, 1))[0] / 10000 - 0.25) < 0.02)


def test_cutmix_reference():
    x = _clips()
    p = I.sample_cutmix_params(0, 0, np.arange(3), 30, 50, alpha=1.0)
    y, t = I.apply_cutmix(x, np.eye(3), p)
    for b in range(3):
        ref = x[b].copy()
        y1, x1, y2, x2 = (int(p[k][b]) for k in ("y1", "x1", "y2", "x2"))
        ref[:, y1:y2, x1:x2] = x[b - 1][:, y1:y2, x1:x2]
        np.testing.assert_array_equal(y[b], ref)
        lam = 1 - (y2 - y1) * (x2 - x1) / (30 * 50)
        assert abs(p["lam"][b] - lam) < 1e-12
        np.testing.assert_allclose(t[b].sum(), 1.0, atol=1e-6)
    q = I.sample_cutmix_params(0, 0, np.arange(10000), 30, 50)
    assert np.all(q["y1"] >= 0) and np.all(q["y2"] <= 30) and np.all(q["x2"] <= 50)
    assert q["lam"].min() >= 0 and q["lam"].max() <= 1
    off = I.sample_cutmix_params(0, 0, np.arange(100), 30, 50, p=0.0)
    assert np.all(off["lam"] == 1.0)


# --- NV12 crop ---------------------------------------------------------------------------------


def test_nv12_crop_equals_crop_of_conversion():
    rng = np.random.default_rng(0)
    for H, W in ((36, 64), (35, 63)):
        y = rng.integers(0, 256, (2, H, W), dtype=np.uint8)
        uv = rng.integers(0, 256, (2, (H + 1) // 2, (W + 1) // 2, 2), dtype=np.uint8)
        full = IM.nv12_to_rgb(y, uv)
        for _ in range(40):
            h, w = rng.integers(1, H + 1), rng.integers(1, W + 1)
            t, le = rng.integers(0, H - h + 1), rng.integers(0, W - w + 1)
            box, (dy, dx) = I.nv12_crop_box(t, le, h, w, H, W)
            assert box[0] % 2 == 0 and box[1] % 2 == 0 and box[2] - dy >= h
            yc, uvc = I.crop_nv12(y, uv, box)
            rgb = IM.nv12_to_rgb(yc, uvc)[:, dy : dy + h, dx : dx + w]
            np.testing.assert_array_equal(rgb, full[:, t : t + h, le : le + w])


# --- determinism and resume ----------------------------------------------------------------------


def _all_samplers(ids):
    return {
        "rrc": I.sample_resized_crop_params(5, 3, ids, 360, 640),
        "flip": I.sample_flip_params(5, 3, ids),
        "gray": I.sample_grayscale_params(5, 3, ids),
        "cj": I.sample_color_jitter_params(5, 3, ids, brightness=0.4, contrast=0.4,
                                           saturation=0.4, hue=0.1, p=0.8),  # fmt: skip
        "tj": I.sample_temporal_jitter_params(5, 3, ids, 8, max_shift=2),
        "mixup": I.sample_mixup_params(5, 3, ids, p=0.5),
        "cutmix": I.sample_cutmix_params(5, 3, ids, 224, 224),
    }


def test_resume_draws_equal_uninterrupted():
    ids = np.arange(1000)
    full, second, again = _all_samplers(ids), _all_samplers(ids[500:]), _all_samplers(ids)
    for name, params in full.items():
        for k, v in params.items():
            np.testing.assert_array_equal(v[500:], second[name][k], err_msg=f"{name}.{k}")
            np.testing.assert_array_equal(v, again[name][k], err_msg=f"{name}.{k}")
    assert not np.array_equal(I.sample_flip_params(5, 4, ids)["flip"], full["flip"]["flip"])


@pytest.mark.parametrize("flip_p,cj_p,random_order", [(0.5, 1.0, True), (0.3, 0.6, False),
                                                      (1.0, 0.0, True)])  # fmt: skip
def test_chain_draws_equal_the_samplers(flip_p, cj_p, random_order):
    """A chain's run of crop, flip, jitter and normalize draws in one pass exactly what the
    module's samplers draw stream by stream (ids given or not, any epoch)."""
    x = _clips(shape=(6, 2, 36, 64, 3))
    chain = I.Chain([I.RandomResizedCrop(16, scale=(0.2, 0.9)), I.RandomFlip(flip_p),
                     I.ColorJitter(0.4, (0.5, 1.5), 0.3, 0.1, p=cj_p, random_order=random_order),
                     I.Normalize()])  # fmt: skip
    for ids, epoch in ((None, 0), (np.arange(100, 106), 7)):
        _, ps = chain(x, seed=9, epoch=epoch, ids=ids, return_params=True)
        idv = np.arange(6) if ids is None else ids
        want = [I.sample_resized_crop_params(9, epoch, idv, 36, 64, scale=(0.2, 0.9)),
                I.sample_flip_params(9, epoch, idv, p=flip_p),
                I.sample_color_jitter_params(9, epoch, idv, brightness=0.4, contrast=(0.5, 1.5),
                                             saturation=0.3, hue=0.1, p=cj_p,
                                             random_order=random_order), {}]  # fmt: skip
        for got, ref in zip(ps, want):
            assert got.keys() == ref.keys()
            for k in ref:
                assert got[k].dtype == ref[k].dtype
                np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
        # each op alone draws the same
        for op, ref in zip(chain.ops, want):
            got = op.sample(x, seed=9, epoch=epoch, ids=ids)
            assert got.keys() == ref.keys() and all(np.array_equal(got[k], ref[k]) for k in ref)
    with pytest.raises(ValueError, match="p must be"):
        I.Chain([I.RandomFlip(1.5), I.Normalize()])(x, seed=0)


def test_chain_runs_keep_the_crop_first():
    """The crop joins the pixel ops' run only at its start (its sampler reads the frame size
    of what it gets); other ops split runs as before."""
    f, j, n = I.RandomFlip(), I.ColorJitter(0.1), I.Normalize()
    assert I.Chain([I.RandomResizedCrop(8), f, j, n])._runs() == [(0, 4)]
    assert I.Chain([f, I.RandomResizedCrop(8), j])._runs() == [(0, 1), (1, 3)]
    assert I.Chain([I.RandomResizedCrop(8), I.RandomGrayscale(), j, n])._runs() == [(0, 1), (1, 2),
                                                                                  (2, 4)]  # fmt: skip
    # a crop after a normalize that moved channels first samples the frame size it gets
    x = _clips(shape=(2, 3, 30, 50, 3))
    c = I.Chain([I.Normalize(out_layout="NCHW"), I.RandomResizedCrop(8, layout="BTCHW")])
    y, ps = c(x, seed=1, return_params=True)
    assert y.shape == (2, 3, 3, 8, 8)
    np.testing.assert_array_equal(ps[1]["top"] + ps[1]["height"] <= 30, True)
    np.testing.assert_array_equal(ps[1]["left"] + ps[1]["width"] <= 50, True)


# --- chains ------------------------------------------------------------------------------------


def test_video_chain_replay_layouts_and_config():
    x = _clips(shape=(3, 4, 36, 64, 3))
    chain = I.video_train_chain(16)
    y, params = chain(x, seed=2, epoch=1, return_params=True)
    assert y.shape == (3, 4, 3, 16, 16) and y.dtype == np.float32
    np.testing.assert_array_equal(chain.apply(x, params), y)
    # the ops one by one
    z = I.apply_resized_crop(x, params[0], 16)
    z = I.apply_flip(z, params[1])
    z = I.apply_color_jitter(z, params[2])
    z = IM.normalize(z, IM.IMAGENET_MEAN, IM.IMAGENET_STD, scale=1 / 255, dtype="float32")
    np.testing.assert_array_equal(np.moveaxis(z, -1, 2), y)
    # channels-first clips give the same
    yc = I.video_train_chain(16, layout="BTCHW")(np.ascontiguousarray(np.moveaxis(x, -1, 2)), seed=2, epoch=1)
    np.testing.assert_array_equal(yc, y)
    # images
    yi = I.video_train_chain(16)(x[:, 0], seed=2, epoch=1)
    assert yi.shape == (3, 3, 16, 16)
    cfg = [{"op": "random_resized_crop", "size": [16, 20], "scale": [0.25, 1.0]},
           {"op": "flip", "p": 0.5}, {"op": "grayscale", "p": 0.2},
           {"op": "color_jitter", "brightness": 0.2, "hue": 0.05},
           {"op": "center_crop", "size": 16}, {"op": "normalize", "dtype": "float16"}]  # fmt: skip
    c = I.Chain.from_config(cfg)
    out, ps = c(x, seed=0, return_params=True)
    assert out.shape == (3, 4, 3, 16, 16) and out.dtype == np.float16
    np.testing.assert_array_equal(c.apply(x, ps), out)


# --- GPU = CPU ---------------------------------------------------------------------------------


def _cp():
    import cupy

    return cupy


@pytest.mark.gpu
def test_gpu_params_identical():
    cp = _cp()
    ids = np.arange(1000)
    cpu = _all_samplers(ids)
    gid = cp.asarray(ids)
    gpu = {
        "rrc": I.sample_resized_crop_params(5, 3, gid, 360, 640, xp=cp),
        "flip": I.sample_flip_params(5, 3, gid, xp=cp),
        "gray": I.sample_grayscale_params(5, 3, gid, xp=cp),
        "cj": I.sample_color_jitter_params(5, 3, gid, brightness=0.4, contrast=0.4,
                                           saturation=0.4, hue=0.1, p=0.8, xp=cp),  # fmt: skip
        "tj": I.sample_temporal_jitter_params(5, 3, gid, 8, max_shift=2, xp=cp),
        "mixup": I.sample_mixup_params(5, 3, gid, p=0.5, xp=cp),
        "cutmix": I.sample_cutmix_params(5, 3, gid, 224, 224, xp=cp),
    }
    for name, params in cpu.items():
        for k, v in params.items():
            np.testing.assert_array_equal(cp.asnumpy(gpu[name][k]), v, err_msg=f"{name}.{k}")


@pytest.mark.gpu
def test_gpu_fused_crop_with_color_jitter():
    """On a GPU the folded crop + jitter + normalize (the jitter's params uploaded with the
    crops' table) equals the same steps on the GPU one after another bit for bit, and the
    numpy steps within the kernels' tolerance."""
    cp = _cp()
    x = _clips(shape=(4, 3, 60, 100, 3))
    p = {**I.sample_resized_crop_params(1, 0, np.arange(4), 60, 100),
         "flip": np.array([True, False, False, True])}  # fmt: skip
    cj = I.sample_color_jitter_params(6, 0, np.arange(4), brightness=0.4, contrast=0.4,
                                      saturation=0.4, hue=0.1)  # fmt: skip
    norm = dict(mean=IM.IMAGENET_MEAN, std=IM.IMAGENET_STD, dtype="float16", layout="NCHW")
    clips = [cp.asarray(c) for c in x]
    got = I.fused_resized_crop_normalize(clips, p, 32, color_jitter=cj, scale=1 / 255, **norm)
    steps = _crop_jitter_normalize_steps(clips, p, cj, 32, **norm)
    assert isinstance(got, cp.ndarray) and got.dtype == np.float16
    assert float(cp.abs(got.astype(cp.float32) - steps.astype(cp.float32)).max()) == 0.0
    ref = _crop_jitter_normalize_steps(list(x), p, cj, 32, **norm)
    # crops within 1e-3 of the range, the jitter within 1e-3 of it (a hue sector flipped by
    # a rounding step moves a pixel more), then / (255 * std): in levels after normalization
    d = np.abs(cp.asnumpy(got).astype(np.float32) - ref.astype(np.float32))
    level = 1 / 255 / 0.225
    assert d.mean() <= 0.1 * level and d.max() <= 8 * level, (float(d.mean()), float(d.max()))


@pytest.mark.gpu
def test_gpu_ops_equal_cpu():
    cp = _cp()
    x = _clips(shape=(4, 3, 60, 100, 3))
    xg = cp.asarray(x)
    p = I.sample_resized_crop_params(1, 0, np.arange(4), 60, 100)
    np.testing.assert_allclose(cp.asnumpy(I.apply_resized_crop(xg, p, 32, dtype="float32")),
                               I.apply_resized_crop(x, p, 32, dtype="float32"), atol=0.255)  # fmt: skip
    assert np.abs(cp.asnumpy(I.apply_resized_crop(xg, p, 32)).astype(int)
                  - I.apply_resized_crop(x, p, 32)).max() <= 1  # fmt: skip
    f = I.sample_flip_params(0, 0, np.arange(4))
    np.testing.assert_array_equal(cp.asnumpy(I.apply_flip(xg, f)), I.apply_flip(x, f))
    g = I.sample_grayscale_params(0, 0, np.arange(4), p=0.5)
    assert np.abs(cp.asnumpy(I.apply_grayscale(xg, g)).astype(int) - I.apply_grayscale(x, g)).max() <= 1
    xf = x.astype(np.float32) / 255
    cj = I.sample_color_jitter_params(0, 0, np.arange(4), brightness=0.4, contrast=0.4,
                                      saturation=0.4, hue=0.1)  # fmt: skip
    np.testing.assert_allclose(cp.asnumpy(I.apply_color_jitter(cp.asarray(xf), cj)),
                               I.apply_color_jitter(xf, cj), atol=1e-3)  # fmt: skip
    np.testing.assert_array_equal(cp.asnumpy(I.n_crop(xg, 50, 10)), I.n_crop(x, 50, 10))
    m = I.sample_mixup_params(0, 0, np.arange(4))
    np.testing.assert_allclose(cp.asnumpy(I.apply_mixup(cp.asarray(xf), cp.arange(4), m, num_classes=4)[0]),
                               I.apply_mixup(xf, np.arange(4), m, num_classes=4)[0], atol=1e-6)  # fmt: skip
    c = I.sample_cutmix_params(0, 0, np.arange(4), 60, 100)
    np.testing.assert_array_equal(cp.asnumpy(I.apply_cutmix(xg, cp.eye(4), c)[0]),
                                  I.apply_cutmix(x, np.eye(4), c)[0])  # fmt: skip
    # the chain rounds to uint8 after the crop and after the jitter: a value on a rounding
    # boundary may differ by a level or two there (1 level = 1 / 255 / std ~ 0.017 here)
    chain = I.video_train_chain(32)
    d = np.abs(cp.asnumpy(chain(xg, seed=3)) - chain(x, seed=3))
    assert d.max() < 4 / 255 / 0.224 and np.mean(d > 1e-3) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["1", "0"])
def test_gpu_kernels_equal_cpu(monkeypatch, kernels):
    """The fused kernels (avpipe.ops._image_augment_kernels; ``AVPIPE_IMAGE_KERNELS=0``: the
    array-module path) against numpy: resized crop within 1e-3 of the range on float output
    and 1 level on uint8; flip and normalize exact; colour jitter within 1e-3 of the range
    (float) and 1 level (uint8); a chain (flip + jitter + normalize in one pass) as
    test_gpu_ops_equal_cpu's (a level flipped by the rounding to uint8 after the crop may grow
    through the jitter factors: under 4 levels, rare)."""
    cp = _cp()
    monkeypatch.setenv("AVPIPE_IMAGE_KERNELS", kernels)
    x = _clips(shape=(5, 3, 45, 80, 3))
    xg = cp.asarray(x)
    ids = np.arange(5)
    p = I.sample_resized_crop_params(7, 0, ids, 45, 80)
    for interp, aa in (("bilinear", True), ("bicubic", True), ("bilinear", False)):
        kw = dict(interpolation=interp, antialias=aa)
        np.testing.assert_allclose(cp.asnumpy(I.apply_resized_crop(xg, p, (24, 30), dtype="float32", **kw)),
                                   I.apply_resized_crop(x, p, (24, 30), dtype="float32", **kw), atol=0.255)  # fmt: skip
        assert np.abs(cp.asnumpy(I.apply_resized_crop(xg, p, 24, **kw)).astype(int)
                      - I.apply_resized_crop(x, p, 24, **kw)).max() <= 1  # fmt: skip
    xc = np.ascontiguousarray(np.moveaxis(x, -1, 2))  # channels-first input
    yc = cp.asnumpy(I.apply_resized_crop(cp.asarray(xc), p, 24, layout="BTCHW"))
    assert yc.shape == (5, 3, 3, 24, 24)
    assert np.abs(yc.astype(int) - I.apply_resized_crop(xc, p, 24, layout="BTCHW")).max() <= 1
    f = I.sample_flip_params(3, 0, ids)
    np.testing.assert_array_equal(cp.asnumpy(I.apply_flip(xg, f)), I.apply_flip(x, f))
    np.testing.assert_array_equal(cp.asnumpy(I.apply_flip(cp.asarray(xc), f, layout="BTCHW")),
                                  I.apply_flip(xc, f, layout="BTCHW"))  # fmt: skip
    cj = I.sample_color_jitter_params(3, 0, ids, brightness=0.4, contrast=0.4, saturation=0.4,
                                      hue=0.1, p=0.8)  # fmt: skip
    xf = x.astype(np.float32) / 255
    np.testing.assert_allclose(cp.asnumpy(I.apply_color_jitter(cp.asarray(xf), cj)),
                               I.apply_color_jitter(xf, cj), atol=1e-3)  # fmt: skip
    assert np.abs(cp.asnumpy(I.apply_color_jitter(xg, cj)).astype(int)
                  - I.apply_color_jitter(x, cj)).max() <= 1  # fmt: skip
    n = I.Normalize()
    np.testing.assert_allclose(cp.asnumpy(n.apply(xg, {})), n.apply(x, {}), atol=1e-6, rtol=0)
    chain = I.video_train_chain(24)
    yg, ps = chain(xg, seed=4, epoch=2, return_params=True)
    y = chain.apply(x, [{k: cp.asnumpy(v) for k, v in q.items()} for q in ps])
    d = np.abs(cp.asnumpy(yg) - y)
    assert yg.shape == (5, 3, 3, 24, 24) and d.max() < 4 / 255 / 0.224 and np.mean(d > 1e-3) < 1e-2
    np.testing.assert_array_equal(cp.asnumpy(chain.apply(xg, ps)), cp.asnumpy(yg))  # replay
    yi = chain(xg[:, 0], seed=4, epoch=2)  # images
    assert yi.shape == (5, 3, 24, 24)


@pytest.mark.gpu
def test_gpu_resized_crop_paths_agree(monkeypatch):
    """The resized crop by the one-pass kernel (each item's taps computed in the kernel, a
    following flip folded in) and by the two passes with host tables (what boxes past the
    one-pass kernel's limits take): the folded flip is exactly the flip applied after the
    crop, and the two paths agree within a level (uint8) / float rounding (float32); the
    chain gives the same draws on both and agrees with numpy on both."""
    from avpipe.ops import _resize_kernels as IK

    cp = _cp()
    x = _clips(shape=(6, 3, 90, 160, 3))
    xg = cp.asarray(x)
    ids = np.arange(6)
    p = I.sample_resized_crop_params(2, 0, ids, 90, 160)
    f = I.sample_flip_params(2, 1, ids)
    assert f["flip"].any() and not f["flip"].all()
    got = {}
    for path in ("direct", "two_pass"):
        if path == "two_pass":
            monkeypatch.setattr(IK, "_DIRECT_WORK", 0)
        for dtype in (None, "float32"):
            y, flipped = I._resized_crop(xg, p, 32, "bilinear", True, None, dtype)
            assert not flipped
            yf, flipped = I._resized_crop(xg, p, 32, "bilinear", True, None, dtype, f["flip"])
            assert flipped == (path == "direct")
            if flipped:
                np.testing.assert_array_equal(cp.asnumpy(yf), cp.asnumpy(I.apply_flip(y, f)))
            got[path, dtype] = cp.asnumpy(y).astype(np.float32)
        chain = I.video_train_chain(32)
        yc, ps = chain(xg, seed=5, epoch=1, return_params=True)
        ref = chain.apply(x, [{k: cp.asnumpy(v) for k, v in q.items()} for q in ps])
        d = np.abs(cp.asnumpy(yc) - ref)
        assert d.max() < 4 / 255 / 0.224 and np.mean(d > 1e-3) < 1e-2, path
    assert np.abs(got["direct", None] - got["two_pass", None]).max() <= 1
    np.testing.assert_allclose(got["direct", "float32"], got["two_pass", "float32"], atol=0.01)


@pytest.mark.gpu
def test_gpu_chain_device_params_paths_agree():
    """The chain's one-copy path (params and tables uploaded together at sampling, applied
    without a copy) gives exactly what a replay from host params (copied at apply) gives, on
    the default stream and on a stream of its own; the benchmark's frame size against numpy."""
    cp = _cp()
    x = _clips(shape=(3, 4, 360, 640, 3))
    xg = cp.asarray(x)
    chain = I.video_train_chain(224)
    y, ps = chain(xg, seed=0, epoch=3, return_params=True)
    assert all(isinstance(v, cp.ndarray) for q in ps for v in q.values())
    hp = [{k: cp.asnumpy(v) for k, v in q.items()} for q in ps]
    np.testing.assert_array_equal(cp.asnumpy(chain.apply(xg, ps)), cp.asnumpy(y))
    np.testing.assert_array_equal(cp.asnumpy(chain.apply(xg, hp)), cp.asnumpy(y))
    with cp.cuda.Stream(non_blocking=True) as s:
        y2 = chain(xg, seed=0, epoch=3)
        s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(y2), cp.asnumpy(y))
    ref = chain.apply(x, hp)
    d = np.abs(cp.asnumpy(y) - ref)
    assert y.shape == (3, 4, 3, 224, 224) and d.max() < 4 / 255 / 0.224 and np.mean(d > 1e-3) < 1e-2
    for e in range(4):  # successive batches (the pinned sources of earlier copies reused)
        ye, pe = chain(xg, seed=1, epoch=e, return_params=True)
        he = [{k: cp.asnumpy(v) for k, v in q.items()} for q in pe]
        np.testing.assert_array_equal(cp.asnumpy(chain.apply(xg, he)), cp.asnumpy(ye))
