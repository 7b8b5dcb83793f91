"""Audio augmentations: each op against a plain numpy reference written here (loops), the
sampled parameters' distributions, determinism and resume, and the CPU train chain.

GPU tests (marked ``gpu``) compare cupy with numpy: parameters and masks exactly, waveforms
within 1e-4 of the signal's peak (resampling, noise, FFT convolution in float32).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.signal

import avpipe.ops as O
from avpipe.ops import _spec_augment as S
from avpipe.ops import audio_augment as A
from avpipe.ops import random as R

SR = 16000


def _batch(seed=0, lens=(16000, 12345, 7000, 401, 0)):
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int64)
    n = int(lens.max())
    x = np.zeros((lens.size, n), np.float32)
    for i, m in enumerate(lens):
        x[i, :m] = rng.standard_normal(m) * 0.1
    return x, lens


# --- the contract's entry points ---------------------------------------------------------------


def test_ops_namespace_resolves():
    assert O.spec_augment is A.spec_augment
    assert O.speed_perturb is A.speed_perturb


# --- speed perturbation ------------------------------------------------------------------------


def test_speed_perturb_matches_per_item_resampling():
    x, lens = _batch(lens=(16000, 9000, 4000, 0))
    f = np.array([1.1, 0.9, 1.0, 1.1])
    y, nl = A.speed_perturb(x, lens, factor=f, sample_rate=SR)
    for i in range(4):  # reference: each item alone, from sr*f to sr
        ref = O.audio.resample(x[i, : lens[i]], int(round(SR * f[i])), SR) if lens[i] else np.zeros(0)
        assert nl[i] == ref.size == math.ceil(lens[i] / f[i] - 1e-9)
        np.testing.assert_allclose(y[i, : nl[i]], ref, atol=1e-6)
        assert not np.any(y[i, nl[i]:])
    assert y.shape == (4, nl.max())


def test_speed_perturb_against_scipy_and_pitch():
    t = np.arange(SR) / SR
    x = (0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    y, nl = A.speed_perturb(x, factor=1.1, sample_rate=SR)
    assert y.ndim == 1 and nl[0] == y.size == math.ceil(SR / 1.1)
    # an independent polyphase resampler: 17600 Hz -> 16000 Hz (10 / 11)
    ref = scipy.signal.resample_poly(x.astype(np.float64), 10, 11)
    mid = slice(200, y.size - 200)  # away from the edges (different filter lengths)
    np.testing.assert_allclose(y[mid], ref[mid], atol=2e-3)
    spec = np.abs(np.fft.rfft(y * np.hanning(y.size)))
    peak_hz = np.argmax(spec) * SR / y.size
    assert abs(peak_hz - 1100) < 3  # pitch 1.1x higher


def test_speed_params_distribution_set_and_range():
    ids = np.arange(10000)
    f = A.sample_speed_params(0, 0, ids, factors=[0.9, 1.0, 1.1])["factor"]
    vals, counts = np.unique(f, return_counts=True)
    np.testing.assert_allclose(vals, [0.9, 1.0, 1.1])
    assert np.all(np.abs(counts / 10000 - 1 / 3) < 0.02)
    g = A.sample_speed_params(0, 0, ids, factor_range=(0.9, 1.1), step=0.05)["factor"]
    vals, counts = np.unique(np.round(g, 9), return_counts=True)
    np.testing.assert_allclose(vals, [0.9, 0.95, 1.0, 1.05, 1.1])
    # rounding a uniform draw to the grid: the end points get half the mass
    np.testing.assert_allclose(counts / 10000, [0.125, 0.25, 0.25, 0.25, 0.125], atol=0.02)
    h = A.sample_speed_params(0, 0, ids, factors=[0.9, 1.1], p=0.3)["factor"]
    assert abs(np.mean(h == 1.0) - 0.7) < 0.02


# --- gain, noise, RIR, shift, crop -------------------------------------------------------------


def test_gain_reference_and_distribution():
    x, lens = _batch()
    p = A.sample_gain_params(3, 1, np.arange(5), gain_db=(-6, 6))
    y, _ = A.apply_gain(x, lens, p)
    for i in range(5):
        np.testing.assert_allclose(y[i], x[i] * 10 ** (p["gain_db"][i] / 20), rtol=1e-6)
    g = A.sample_gain_params(3, 1, np.arange(10000), gain_db=(-6, 6))["gain_db"]
    assert g.min() >= -6 and g.max() < 6 and abs(g.mean()) < 0.1
    assert np.all(np.abs(np.histogram(g, 4, (-6, 6))[0] / 10000 - 0.25) < 0.02)


def test_noise_reference():
    x, lens = _batch()
    rng = np.random.default_rng(5)
    clips = [rng.standard_normal(20000), rng.standard_normal(300), rng.standard_normal(5000)]
    bank = A.NoiseBank(clips)
    p = A.sample_noise_params(1, 2, np.arange(5), clip_lengths=bank.lengths, snr_db=(0, 20))
    y, _ = A.apply_noise(x, lens, p, bank)
    for i in range(5):
        m = lens[i]
        c = clips[p["clip"][i]]
        noise = np.array([c[(p["offset"][i] + t) % c.size] for t in range(m)])
        if m == 0:
            np.testing.assert_array_equal(y[i], 0)
            continue
        ps = np.mean(x[i, :m].astype(np.float64) ** 2)
        pn = np.mean(noise**2)
        k = math.sqrt(ps / (pn * 10 ** (p["snr_db"][i] / 10)))
        np.testing.assert_allclose(y[i, :m], x[i, :m] + k * noise, atol=1e-6)
        assert not np.any(y[i, m:])
        snr = 10 * np.log10(ps / np.mean((y[i, :m] - x[i, :m]) ** 2))
        assert abs(snr - p["snr_db"][i]) < 1e-3


def test_noise_params_distribution():
    bank_len = np.array([100, 1000, 7])
    p = A.sample_noise_params(0, 0, np.arange(10000), clip_lengths=bank_len, snr_db=(5, 15), p=0.5)
    assert np.all(np.abs(np.bincount(p["clip"]) / 10000 - 1 / 3) < 0.02)
    assert np.all(p["offset"] < bank_len[p["clip"]]) and p["offset"].min() == 0
    off7 = p["offset"][p["clip"] == 2]
    assert np.all(np.abs(np.bincount(off7, minlength=7) / off7.size - 1 / 7) < 0.03)
    assert p["snr_db"].min() >= 5 and p["snr_db"].max() < 15
    assert abs(p["apply"].mean() - 0.5) < 0.02


def test_noise_not_applied_and_silent_items_unchanged():
    x, lens = _batch()
    bank = A.NoiseBank([np.ones(10)])
    p = A.sample_noise_params(0, 0, np.arange(5), clip_lengths=bank.lengths)
    p["apply"][:] = False
    np.testing.assert_array_equal(A.apply_noise(x, lens, p, bank)[0], x)


def test_rir_reference():
    x, lens = _batch()
    rng = np.random.default_rng(2)
    rirs = [np.exp(-np.arange(900) / 150) * rng.standard_normal(900), rng.standard_normal(50)]
    bank = A.RirBank(rirs)
    p = A.sample_rir_params(4, 0, np.arange(5), n_rirs=2)
    p["apply"] = np.array([True, True, False, True, True])
    y, _ = A.apply_rir(x, lens, p, bank)
    for i in range(5):
        h = np.asarray(rirs[p["rir"][i]], np.float64)
        h = h[np.argmax(np.abs(h)):]
        h = h / np.linalg.norm(h)
        m = lens[i]
        ref = np.convolve(x[i, :m].astype(np.float64), h)[:m] if p["apply"][i] and m else x[i, :m]
        np.testing.assert_allclose(y[i, :m], ref, atol=1e-5 * max(1, np.abs(ref).max(initial=0)))
        assert not np.any(y[i, m:])


def test_rir_fft_size():
    for n in (1, 2, 5, 1000, 16001, 40000):
        s = A._fft_size(n)
        assert s >= n
        k = s
        for p in (2, 3):
            while k % p == 0:
                k //= p
        assert k == 1


@pytest.mark.parametrize("mode", ["zero", "roll"])
def test_time_shift_reference(mode):
    x, lens = _batch()
    p = A.sample_time_shift_params(0, 0, np.arange(5), lens, max_shift=0.2)
    y, _ = A.apply_time_shift(x, lens, p, mode=mode)
    for i in range(5):
        m, s = lens[i], p["shift"][i]
        ref = np.zeros(x.shape[1], np.float32)
        for t in range(m):
            src = t - s
            if mode == "roll":
                src %= m
            if 0 <= src < m:
                ref[t] = x[i, src]
        np.testing.assert_array_equal(y[i], ref)
    s = A.sample_time_shift_params(0, 0, np.arange(10000), np.full(10000, 100), max_shift=3)["shift"]
    assert set(np.unique(s)) == set(range(-3, 4))
    assert np.all(np.abs(np.bincount(s + 3) / 10000 - 1 / 7) < 0.02)


def test_crop_pad_reference():
    x, lens = _batch()
    L = 8000
    p = A.sample_crop_pad_params(0, 0, np.arange(5), lens, length=L)
    y, nl = A.apply_crop_pad(x, lens, p, length=L)
    assert y.shape == (5, L)
    for i in range(5):
        m, o = lens[i], p["offset"][i]
        assert 0 <= o <= max(m - L, 0)
        ref = np.zeros(L, np.float32)
        k = min(m, L)
        ref[:k] = x[i, o : o + k]
        np.testing.assert_array_equal(y[i], ref)
        assert nl[i] == k
    o = A.sample_crop_pad_params(0, 0, np.arange(10000), np.full(10000, 13), length=10)["offset"]
    assert np.all(np.abs(np.bincount(o) / 10000 - 0.25) < 0.02)


# --- SpecAugment -------------------------------------------------------------------------------


def _spec_ref(feats, lens, p):
    out = feats.copy()
    B, F, T = feats.shape
    for b in range(B):
        for s, w in zip(p["freq_start"][b], p["freq_width"][b]):
            for f in range(s, s + w):
                for t in range(lens[b]):
                    out[b, f, t] = 0
        for s, w in zip(p["time_start"][b], p["time_width"][b]):
            for t in range(s, min(s + w, lens[b])):
                out[b, :, t] = 0
    return out


@pytest.mark.parametrize("time_width", [0.05, 0.3, 12])
def test_spec_augment_reference_and_valid_frames(time_width):
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((6, 40, 300)).astype(np.float32) + 5
    lens = np.array([300, 250, 100, 37, 5, 0])
    y, p = A.spec_augment(feats, lens, freq_width=15, time_masks=4, time_width=time_width,
                          seed=7, return_params=True)  # fmt: skip
    np.testing.assert_array_equal(y, _spec_ref(feats, lens, p))
    for b in range(6):
        np.testing.assert_array_equal(y[b, :, lens[b]:], feats[b, :, lens[b]:])
        assert np.all(p["time_start"][b] <= max(lens[b] - 1, 0))
    # replay from the params reproduces exactly
    np.testing.assert_array_equal(A.apply_spec_augment(feats, lens, p), y)
    # same seed, same masks; another seed or epoch, other masks
    np.testing.assert_array_equal(A.spec_augment(feats, lens, freq_width=15, time_masks=4,
                                                 time_width=time_width, seed=7), y)  # fmt: skip
    assert not np.array_equal(A.spec_augment(feats, lens, freq_width=15, time_masks=4,
                                             time_width=time_width, seed=8), y)  # fmt: skip
    # in place: the same masks, written into the features themselves
    own = feats.copy()
    got = A.spec_augment(own, lens, freq_width=15, time_masks=4, time_width=time_width, seed=7,
                         inplace=True)  # fmt: skip
    assert got is own
    np.testing.assert_array_equal(own, y)
    frozen = feats.copy()
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match="inplace"):
        A.spec_augment(frozen, lens, seed=7, inplace=True)


def test_spec_augment_distributions():
    n = 10000
    lens = np.full(n, 400)
    p = A.sample_spec_augment_params(0, 0, np.arange(n), lens, 80, freq_masks=1, freq_width=27,
                                     time_masks=1, time_width=0.05)  # fmt: skip
    fw, fs = p["freq_width"][:, 0], p["freq_start"][:, 0]
    assert fw.min() == 0 and fw.max() == 27 and fs.min() == 0 and fs.max() == 80 - 27
    assert np.all(np.abs(np.bincount(fw) / n - 1 / 28) < 0.01)
    tw, ts = p["time_width"][:, 0], p["time_start"][:, 0]
    W = int(0.05 * 400)
    assert tw.min() == 0 and tw.max() == W and ts.min() == 0 and ts.max() == 400 - W
    assert np.all(np.abs(np.bincount(tw) / n - 1 / (W + 1)) < 0.01)
    assert abs(ts.mean() - (400 - W) / 2) < 4


def test_spec_augment_settings_and_params_are_checked():
    lens = np.array([100, 50])
    for kw, name in ((dict(freq_masks=-1), "freq_masks"), (dict(time_masks=-2), "time_masks"),
                     (dict(adaptive_time_masks=-0.1), "adaptive_time_masks"),
                     (dict(adaptive_time_masks=float("nan")), "adaptive_time_masks"),
                     (dict(time_width=-0.05), "time_width"), (dict(freq_width=-3), "freq_width")):
        with pytest.raises(ValueError, match=name):
            A.sample_spec_augment_params(0, 0, np.arange(2), lens, 80, **kw)
    p = A.sample_spec_augment_params(0, 0, np.arange(2), lens, 80, freq_masks=2, time_masks=3)
    # the GPU path's check of given params: [B, k] or [1, k], widths as many as starts
    parts, kf, kt = S.spec_parts(p, 2, np)
    assert (kf, kt) == (2, 3) and all(a.shape[0] == 2 for a in parts)
    one = {k: v[:1] for k, v in p.items()}
    parts, _, _ = S.spec_parts(one, 2, np)
    np.testing.assert_array_equal(parts[2], np.repeat(p["time_start"][:1], 2, axis=0))
    with pytest.raises(ValueError, match="time_start"):
        S.spec_parts({**p, "time_start": p["time_start"][:, :, None]}, 2, np)
    with pytest.raises(ValueError, match="freq_start"):
        S.spec_parts({**p, "freq_start": np.zeros((3, 2), np.int64)}, 2, np)
    with pytest.raises(ValueError, match="as many"):
        S.spec_parts({**p, "time_width": p["time_width"][:, :2]}, 2, np)


def test_spec_augment_adaptive_counts():
    lens = np.array([1000, 400, 100, 10, 0])
    p = A.sample_spec_augment_params(0, 0, np.arange(5), lens, 80, time_masks=20, time_width=0.02,
                                     adaptive_time_masks=0.01)  # fmt: skip
    for b, m in enumerate(lens):  # masks past the count: none
        assert np.all(p["time_width"][b, min(20, int(0.01 * m)):] == 0)
    n = 5000
    q = A.sample_spec_augment_params(0, 0, np.arange(n), np.full(n, 1000), 80, time_masks=20,
                                     time_width=20, adaptive_time_masks=0.01)  # fmt: skip
    assert np.all(q["time_width"][:, 10:] == 0) and q["time_width"][:, :10].mean() > 9


# --- determinism and resume ----------------------------------------------------------------------


def _all_samplers(ids, lens):
    return {
        "speed": A.sample_speed_params(5, 3, ids, factor_range=(0.85, 1.15)),
        "gain": A.sample_gain_params(5, 3, ids, p=0.5),
        "noise": A.sample_noise_params(5, 3, ids, clip_lengths=[10, 20, 30], p=0.5),
        "rir": A.sample_rir_params(5, 3, ids, n_rirs=4, p=0.5),
        "shift": A.sample_time_shift_params(5, 3, ids, lens, max_shift=0.1),
        "crop": A.sample_crop_pad_params(5, 3, ids, lens, length=300),
        "spec": A.sample_spec_augment_params(5, 3, ids, lens, 64, adaptive_time_masks=0.02),
    }


def test_resume_draws_equal_uninterrupted():
    ids = np.arange(1000)
    lens = (np.arange(1000) * 37) % 997 + 3
    full = _all_samplers(ids, lens)
    second = _all_samplers(ids[500:], lens[500:])
    again = _all_samplers(ids, lens)
    for name, params in full.items():
        for k, v in params.items():
            np.testing.assert_array_equal(v[500:], second[name][k], err_msg=f"{name}.{k}")
            np.testing.assert_array_equal(v, again[name][k], err_msg=f"{name}.{k}")
    other = A.sample_gain_params(5, 4, ids)["gain_db"]
    assert not np.array_equal(other, full["gain"]["gain_db"])


def test_draws_use_ops_random():
    ids = np.arange(10)
    f = A.sample_speed_params(9, 2, ids, factors=[0.9, 1.0, 1.1])["factor"]
    k = R.integers(9, "speed_perturb", 2, ids, 1, high=3)[:, 0]
    np.testing.assert_array_equal(f, np.array([0.9, 1.0, 1.1])[k])


# --- chain ---------------------------------------------------------------------------------------


def test_train_chain_on_cpu_variable_lengths():
    x, lens = _batch(lens=(16000, 23000, 8000, 3000))
    rng = np.random.default_rng(1)
    chain = A.train_chain(noise=[rng.standard_normal(8000), rng.standard_normal(30000)],
                          noise_p=1.0, rirs=[np.exp(-np.arange(400) / 60) * rng.standard_normal(400)],
                          rir_p=1.0)  # fmt: skip
    (feats, fl), params = chain((x, lens), seed=11, epoch=2, ids=[7, 8, 9, 10], return_params=True)
    assert [type(o).__name__ for o in chain.ops] == ["SpeedPerturb", "AddNoise", "Reverb", "LogMel",
                                                     "SpecAugment"]  # fmt: skip
    # the chain equals the ops run one by one with the same params
    s, sl = A.apply_speed_perturb(x, lens, params[0], sample_rate=SR)
    s, _ = A.apply_noise(s, sl, params[1], chain.ops[1].bank)
    s, _ = A.apply_rir(s, sl, params[2], chain.ops[2].bank)
    f2, fl2 = O.audio.log_mel(s, sl, preset="nemo")
    f2 = A.apply_spec_augment(f2, fl2, params[4])
    np.testing.assert_array_equal(feats, f2)
    np.testing.assert_array_equal(fl, fl2)
    np.testing.assert_array_equal(fl, O.audio.log_mel_frame_lengths(sl))
    # masks only on valid frames
    for b in range(4):
        assert not np.any(feats[b, :, fl[b]:])
    # replay and determinism
    r, rl = chain.apply((x, lens), params)
    np.testing.assert_array_equal(r, feats)
    again = chain((x, lens), seed=11, epoch=2, ids=[7, 8, 9, 10])[0]
    np.testing.assert_array_equal(again, feats)
    # item 9 alone draws what it drew in the batch
    p9 = chain((x[2:3, :8000], lens[2:3]), seed=11, epoch=2, ids=[9], return_params=True)[1]
    assert p9[0]["factor"][0] == params[0]["factor"][2]
    np.testing.assert_array_equal(p9[4]["time_start"][0], params[4]["time_start"][2])


def test_chain_from_config_and_streams():
    cfg = [
        {"op": "speed_perturb", "factors": [0.9, 1.0, 1.1], "sample_rate": SR},
        {"op": "gain", "gain_db": [-3, 3]},
        {"op": "gain", "gain_db": [-3, 3]},
        {"op": "time_shift", "max_shift": 100},
        {"op": "crop_pad", "length": 12000},
        {"op": "log_mel", "preset": "nemo"},
        {"op": "spec_augment", "time_width": 0.05, "adaptive_time_masks": 0.04},
    ]
    chain = A.Chain.from_config(cfg)
    assert [o.stream for o in chain.ops][1:3] == ["gain#1", "gain#2"]
    x, lens = _batch(lens=(16000, 9000, 12000))
    (f, fl), params = chain((x, lens), seed=0, return_params=True)
    assert not np.array_equal(params[1]["gain_db"], params[2]["gain_db"])
    assert f.shape[0] == 3 and fl.max() <= f.shape[2]
    with pytest.raises(ValueError, match="unknown op"):
        A.Chain.from_config([{"op": "nope"}])
    assert "spec_augment" in A.Chain.ops_available() and "random_resized_crop" in A.Chain.ops_available()


def test_contract_signatures():
    import inspect

    s = inspect.signature(A.spec_augment)
    for name, default in (("freq_masks", 2), ("freq_width", 27), ("time_masks", 10),
                          ("time_width", 0.05), ("seed", 0)):  # fmt: skip
        assert s.parameters[name].default == default
    assert s.parameters["lengths"].default is None
    s = inspect.signature(A.speed_perturb)
    assert s.parameters["lengths"].default is None
    assert s.parameters["factor"].kind is inspect.Parameter.KEYWORD_ONLY
    assert s.parameters["sample_rate"].kind is inspect.Parameter.KEYWORD_ONLY


# --- GPU = CPU ---------------------------------------------------------------------------------


def _cp():
    import cupy

    return cupy


def _peak_close(a, b, tol=1e-4):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    assert np.abs(a - b).max() <= tol * max(np.abs(b).max(), 1e-30)


@pytest.mark.gpu
def test_gpu_params_identical():
    cp = _cp()
    ids = np.arange(1000)
    lens = (ids * 37) % 997 + 3
    cpu = _all_samplers(ids, lens)
    gpu = {
        "speed": A.sample_speed_params(5, 3, cp.asarray(ids), factor_range=(0.85, 1.15), xp=cp),
        "gain": A.sample_gain_params(5, 3, cp.asarray(ids), p=0.5, xp=cp),
        "noise": A.sample_noise_params(5, 3, cp.asarray(ids), clip_lengths=[10, 20, 30], p=0.5, xp=cp),
        "rir": A.sample_rir_params(5, 3, cp.asarray(ids), n_rirs=4, p=0.5, xp=cp),
        "shift": A.sample_time_shift_params(5, 3, cp.asarray(ids), cp.asarray(lens), max_shift=0.1, xp=cp),
        "crop": A.sample_crop_pad_params(5, 3, cp.asarray(ids), cp.asarray(lens), length=300, xp=cp),
        "spec": A.sample_spec_augment_params(5, 3, cp.asarray(ids), cp.asarray(lens), 64,
                                             adaptive_time_masks=0.02, xp=cp),
    }
    for name, params in cpu.items():
        for k, v in params.items():
            g = gpu[name][k]
            assert isinstance(g, cp.ndarray), (name, k)
            np.testing.assert_array_equal(cp.asnumpy(g), v, err_msg=f"{name}.{k}")


@pytest.mark.gpu
def test_gpu_ops_equal_cpu():
    cp = _cp()
    x, lens = _batch()
    xg, lg = cp.asarray(x), cp.asarray(lens)
    f = np.array([1.1, 0.9, 1.0, 0.95, 1.1])
    y, nl = A.speed_perturb(x, lens, factor=f, sample_rate=SR)
    yg, nlg = A.speed_perturb(xg, lg, factor=cp.asarray(f), sample_rate=SR)
    np.testing.assert_array_equal(cp.asnumpy(nlg), nl)
    _peak_close(cp.asnumpy(yg), y)
    rng = np.random.default_rng(3)
    bank = A.NoiseBank([rng.standard_normal(3000), rng.standard_normal(70000)])
    p = A.sample_noise_params(0, 0, np.arange(5), clip_lengths=bank.lengths)
    _peak_close(cp.asnumpy(A.apply_noise(xg, lg, p, bank)[0]), A.apply_noise(x, lens, p, bank)[0])
    rb = A.RirBank([np.exp(-np.arange(2000) / 300) * rng.standard_normal(2000)])
    p = A.sample_rir_params(0, 0, np.arange(5), n_rirs=1)
    _peak_close(cp.asnumpy(A.apply_rir(xg, lg, p, rb)[0]), A.apply_rir(x, lens, p, rb)[0])
    p = A.sample_gain_params(0, 0, np.arange(5))
    _peak_close(cp.asnumpy(A.apply_gain(xg, lg, p)[0]), A.apply_gain(x, lens, p)[0], 1e-6)
    p = A.sample_time_shift_params(0, 0, np.arange(5), lens, max_shift=0.2)
    np.testing.assert_array_equal(cp.asnumpy(A.apply_time_shift(xg, lg, p)[0]),
                                  A.apply_time_shift(x, lens, p)[0])  # fmt: skip
    p = A.sample_crop_pad_params(0, 0, np.arange(5), lens, length=5000)
    np.testing.assert_array_equal(cp.asnumpy(A.apply_crop_pad(xg, lg, p, length=5000)[0]),
                                  A.apply_crop_pad(x, lens, p, length=5000)[0])  # fmt: skip
    feats = rng.standard_normal((5, 80, 200)).astype(np.float32)
    fl = np.array([200, 150, 90, 3, 0])
    out = A.spec_augment(feats, fl, seed=4, adaptive_time_masks=0.05, time_masks=8)
    outg = A.spec_augment(cp.asarray(feats), cp.asarray(fl), seed=4, adaptive_time_masks=0.05,
                          time_masks=8)  # fmt: skip
    np.testing.assert_array_equal(cp.asnumpy(outg), out)
    # in place (one launch writing the masked cells only): the same cells, the same array; a
    # strided view is masked as a contiguous copy, copied back; more masks than the one-launch
    # path takes (its shared memory) go through the table of draws, in place too
    kw = dict(seed=4, adaptive_time_masks=0.05, time_masks=8)
    fg = cp.asarray(feats)
    assert A.spec_augment(fg, fl, inplace=True, **kw) is fg
    np.testing.assert_array_equal(cp.asnumpy(fg), out)
    wide = cp.zeros((5, 80, 400), cp.float32)
    wide[:, :, ::2] = cp.asarray(feats)
    view = wide[:, :, ::2]
    assert A.spec_augment(view, fl, inplace=True, **kw) is view
    np.testing.assert_array_equal(cp.asnumpy(wide[:, :, ::2]), out)
    assert not wide[:, :, 1::2].any()  # the cells between untouched
    many = dict(seed=4, time_masks=S.SPEC_FUSED_MAX_MASKS, time_width=2)
    want = A.spec_augment(feats, fl, **many)
    fg = cp.asarray(feats)
    assert A.spec_augment(fg, fl, inplace=True, **many) is fg
    np.testing.assert_array_equal(cp.asnumpy(fg), want)
    # the masks drawn on the device are the host's; replayed from device params (views of the
    # drawn table), host params and separate device arrays alike
    kw = dict(seed=4, adaptive_time_masks=0.05, time_masks=8, return_params=True)
    _, pc = A.spec_augment(feats, fl, **kw)
    _, pg = A.spec_augment(cp.asarray(feats), fl, **kw)
    for k in pc:
        np.testing.assert_array_equal(cp.asnumpy(pg[k]), pc[k], err_msg=k)
    for params in (pg, pc, {k: cp.array(v) for k, v in pc.items()}):
        np.testing.assert_array_equal(
            cp.asnumpy(A.apply_spec_augment(cp.asarray(feats), fl, params)), out)


@pytest.mark.gpu
def test_gpu_train_chain_equals_cpu():
    cp = _cp()
    x, lens = _batch(lens=(16000, 23000, 8000, 3000))
    rng = np.random.default_rng(1)
    chain = A.train_chain(noise=[rng.standard_normal(8000)], noise_p=1.0,
                          rirs=[np.exp(-np.arange(400) / 60) * rng.standard_normal(400)], rir_p=1.0)  # fmt: skip
    (f, fl), p = chain((x, lens), seed=3, return_params=True)
    (fg, flg), pg = chain((cp.asarray(x), cp.asarray(lens)), seed=3, return_params=True)
    for a, b in zip(p, pg):
        for k in a:
            np.testing.assert_array_equal(cp.asnumpy(cp.asarray(b[k])), np.asarray(a[k]))
    np.testing.assert_array_equal(cp.asnumpy(flg), fl)
    # log-mel's documented CPU/GPU agreement is 1e-3 absolute on normalized features of the
    # same input; here the waveforms already differ by float32 rounding (resample, FFT)
    assert np.abs(cp.asnumpy(fg) - f).max() < 5e-3


def test_banks_from_files_and_a_manifest(tmp_path):
    """Files are decoded by the pipeline's bank builders; the ops' banks take arrays only."""
    import json

    import soundfile as sf

    from avpipe.pipeline.banks import noise_bank, rir_bank

    rng = np.random.default_rng(3)
    clips = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (1600, 3200)]
    for i, c in enumerate(clips):
        sf.write(tmp_path / f"n{i}.wav", c, 16000, subtype="FLOAT")
    with open(tmp_path / "noise.jsonl", "w") as f:
        for i in range(2):
            f.write(json.dumps({"audio_filepath": f"n{i}.wav", "duration": 0.1}) + "\n")
    for src in (tmp_path / "noise.jsonl", tmp_path, [tmp_path / "n0.wav", tmp_path / "n1.wav"]):
        bank = noise_bank(src, sample_rate=16000)
        np.testing.assert_array_equal(bank.lengths, [1600, 3200])
    rb = rir_bank(tmp_path, sample_rate=16000)
    assert rb is not None
    with pytest.raises(TypeError, match="noise_bank"):
        A.NoiseBank([str(tmp_path / "n0.wav")])


def test_chain_keeps_host_lengths_on_the_host():
    """Host lengths stay host lengths through the chain (log-mel's frame lengths too, equal to
    log_mel's own), so a GPU chain never waits for a device copy of them."""
    x, lens = _batch(lens=(16000, 23000, 8000, 3000))
    chain = A.train_chain()
    (f, fl), params = chain((x, lens), seed=3, return_params=True)
    assert isinstance(fl, np.ndarray)
    y, ylens = A.apply_speed_perturb(x, lens, params[0], sample_rate=16000)
    from avpipe.ops.audio import log_mel

    _, ref_fl = log_mel(y, ylens, preset="nemo")
    np.testing.assert_array_equal(fl, ref_fl)
    assert all(isinstance(v, np.ndarray) for p in params for v in p.values())
