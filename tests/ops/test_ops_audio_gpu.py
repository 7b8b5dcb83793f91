"""GPU (cupy) results of every audio operator against the CPU (numpy) results.

Tolerances: relative 1e-3 on linear-scale outputs (power, mel energies), absolute 1e-3 on log
and normalized outputs. Run: ``python3 -m pytest -m gpu tests/ops/test_ops_audio_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from avpipe.ops import audio as A

pytestmark = pytest.mark.gpu

SR = 16000


def _cp():
    import cupy

    return cupy


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    lens = np.array([16000, 12345, 7000, 401])
    t = np.arange(16000) / SR
    x = np.zeros((4, 16000), np.float32)
    for i, n in enumerate(lens):
        f0 = 120 + 30 * i
        s = sum(np.sin(2 * np.pi * k * f0 * t) / k for k in range(1, 25)) * (0.5 - 0.5 * np.cos(2 * np.pi * 3 * t))
        x[i, :n] = (0.1 * s + 0.003 * rng.standard_normal(16000))[:n]
    return x, lens


def _rel(a, b):
    dt = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
    a, b = np.asarray(a, dt), np.asarray(b, dt)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def test_log_mel_presets_gpu_vs_cpu():
    cp = _cp()
    x, lens = _batch()
    for preset in ("nemo", "nemo_v1", "mlperf_rnnt"):
        want, fl = A.log_mel(x, lens, preset=preset)
        got, gfl = A.log_mel(cp.asarray(x), cp.asarray(lens), preset=preset)
        assert isinstance(got, cp.ndarray) and got.dtype == cp.float32
        np.testing.assert_array_equal(cp.asnumpy(gfl), fl)
        g = cp.asnumpy(got)
        assert g.shape == want.shape
        assert np.abs(g - want).max() <= 1e-3, (preset, np.abs(g - want).max())
        for i, k in enumerate(fl):
            assert np.all(g[i, :, k:] == 0)
    # 1-D input and training dither run on the GPU too
    f1, l1 = A.log_mel(cp.asarray(x[0]))
    assert f1.shape[0] == 1 and int(l1[0]) == x.shape[1] // 160  # current NeMo: n // 160
    ft, _ = A.log_mel(cp.asarray(x), cp.asarray(lens), training=True, seed=0)
    assert bool(cp.isfinite(ft).all())


def test_stft_spectrogram_mel_gpu_vs_cpu():
    cp = _cp()
    x, lens = _batch(1)
    for center, pad_mode, periodic in [(True, "constant", False), (True, "reflect", True), (False, "constant", True)]:
        kw = dict(n_fft=512, hop_length=160, win_length=400, center=center, pad_mode=pad_mode, periodic=periodic)
        p, fl = A.spectrogram(x, lens, **kw)
        pg, flg = A.spectrogram(cp.asarray(x), lens, **kw)
        np.testing.assert_array_equal(cp.asnumpy(flg), fl)
        assert _rel(cp.asnumpy(pg), p) <= 1e-3
        c, _ = A.stft(x, lens, **kw)
        cg, _ = A.stft(cp.asarray(x), lens, **kw)
        assert cg.dtype == cp.complex64
        assert _rel(cp.asnumpy(cg), c) <= 1e-3
        m = A.mel_spectrogram(p, fl, sample_rate=SR, n_mels=80)
        mg = A.mel_spectrogram(pg, cp.asarray(fl), sample_rate=SR, n_mels=80)
        assert _rel(cp.asnumpy(mg), m) <= 1e-3
        lg = A.log_guarded(m, fl)
        lgg = A.log_guarded(mg, fl)
        assert np.abs(cp.asnumpy(lgg) - lg).max() <= 1e-3
        db = A.power_to_db(m)
        dbg = A.power_to_db(mg)
        assert np.abs(cp.asnumpy(dbg) - db).max() <= 1e-3 * 10 / np.log(10) * 2
        mf = A.mfcc(db, fl, n_mfcc=13)
        mfg = A.mfcc(dbg, fl, n_mfcc=13)
        assert _rel(cp.asnumpy(mfg), mf) <= 1e-3


def test_waveform_and_feature_ops_gpu_vs_cpu():
    cp = _cp()
    x, lens = _batch(2)
    xg = cp.asarray(x)
    np.testing.assert_allclose(cp.asnumpy(A.preemphasis(xg, lens)), A.preemphasis(x, lens), atol=1e-6)
    d = A.dither(xg, lens, scale=1e-3, seed=0)
    assert isinstance(d, cp.ndarray)
    dn = cp.asnumpy(d) - x
    assert 0.5e-3 < dn[0].std() < 2e-3 and np.all(cp.asnumpy(d)[3, 401:] == 0)
    rng = np.random.default_rng(0)
    f = rng.standard_normal((3, 80, 50)).astype(np.float32) * 2 + 3
    fl = np.array([50, 31, 2])
    for mode in ("per_feature", "all_features"):
        a = A.normalize(f, fl, mode=mode)
        b = A.normalize(cp.asarray(f), cp.asarray(fl), mode=mode)
        assert np.abs(cp.asnumpy(b) - a).max() <= 1e-3
    s, sl = A.stack_frames(f, fl, stacking=3, subsampling=3)
    sg, slg = A.stack_frames(cp.asarray(f), fl, stacking=3, subsampling=3)
    np.testing.assert_array_equal(cp.asnumpy(sg), s)
    np.testing.assert_array_equal(cp.asnumpy(slg), sl)
    np.testing.assert_array_equal(cp.asnumpy(A.pad_to_multiple(cp.asarray(f), 16)), A.pad_to_multiple(f, 16))


def test_resample_gpu_vs_cpu():
    cp = _cp()
    t = np.arange(44100) / 44100
    s = (0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    for orig in (44100, 8000):
        sig = s if orig == 44100 else s[::1][:8000]
        r = A.resample(sig, orig, 16000)
        rg = A.resample(cp.asarray(sig), orig, 16000)
        assert isinstance(rg, cp.ndarray)
        assert np.abs(cp.asnumpy(rg) - r).max() <= 1e-5


def test_resample_rows_of_a_wider_buffer_gpu():
    """The speed perturbation's kernel on a slice of a wider batch (a feed's rows in its
    loader's buffer, read in place) equals it on a contiguous copy, and numpy within float32
    rounding."""
    from avpipe.ops import _resample as R

    cp = _cp()
    rng = np.random.default_rng(1)
    wide = rng.standard_normal((5, 9000)).astype(np.float32)
    lens = np.array([6000, 5000, 100, 0, 6000])
    rates = np.array([13600, 16000, 17000, 14400, 18400])
    x = cp.asarray(wide)[:, :6000]
    assert not x.flags.c_contiguous
    got, new = R.resample_rows(x, lens, rates, 16000, quality="fast")
    same, _ = R.resample_rows(cp.ascontiguousarray(x), lens, rates, 16000, quality="fast")
    ref, new_ref = R.resample_rows(wide[:, :6000], lens, rates, 16000, quality="fast")
    np.testing.assert_array_equal(new, new_ref)
    np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(same))
    np.testing.assert_allclose(cp.asnumpy(got), ref, atol=2e-6, rtol=2e-6)


def test_load_audio_to_gpu(tmp_path):
    cp = _cp()
    sf = pytest.importorskip("soundfile")
    from avpipe import load_audio

    x = (0.5 * np.sin(2 * np.pi * 1000 * np.arange(44100) / 44100)).astype(np.float32)
    p = tmp_path / "a.wav"
    sf.write(p, x, 44100, subtype="FLOAT")
    a = load_audio(p, sample_rate=16000, device="cuda")
    b = load_audio(p, sample_rate=16000)
    assert isinstance(a.samples, cp.ndarray) and a.sample_rate == 16000
    assert np.abs(cp.asnumpy(a.samples) - b.samples).max() <= 1e-5


def test_batch_loader_gpu_matches_cpu(tmp_path):
    cp = _cp()
    sf = pytest.importorskip("soundfile")
    from avpipe.ops import log_mel
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    rng = np.random.default_rng(5)
    paths = []
    for i, n in enumerate([3000, 8000, 1234, 5000, 4321]):
        p = tmp_path / f"u{i}.flac"
        sf.write(p, rng.uniform(-0.5, 0.5, n).astype(np.float32), SR, subtype="PCM_16")
        paths.append(p)
    with AudioBatchLoader(paths, batch_size=4, num_workers=2, prefetch=2, device="cpu") as cpu_loader:
        want = list(cpu_loader.batches(epochs=2))
    with AudioBatchLoader(paths, batch_size=4, num_workers=2, prefetch=2, device="cuda") as gpu_loader:
        got = list(gpu_loader.batches(epochs=2))
    assert len(got) == len(want) == 4
    for (xg, lg, _, eg), (xc, lc, _, ec) in zip(got, want):
        assert eg == ec == ()
        assert isinstance(xg, cp.ndarray) and xg.dtype == cp.float32
        np.testing.assert_array_equal(lg, lc)
        np.testing.assert_array_equal(cp.asnumpy(xg), xc)
        fg, _ = log_mel(xg, lg)
        fc, _ = log_mel(xc, lc)
        assert np.abs(cp.asnumpy(fg) - fc).max() <= 1e-3


def test_fused_log_mel_equals_the_array_module_path(monkeypatch):
    """The GPU's few-launch log-mel (ops/_log_mel) against the array-module code run on the GPU
    (the same noise for the dither), over the configurations it covers."""
    from avpipe.ops import _log_mel

    cp = _cp()
    assert _log_mel._kernels(0) is not None
    x, lens = _batch(3)
    xg = cp.asarray(x)
    cfgs = [A.NEMO, A.NEMO_V1, A.NEMO.replace(name="p16", pad_to=16),
            A.NEMO.replace(name="mag", power=1.0, log_guard="clamp"),
            A.NEMO.replace(name="raw", normalize=None, preemph=None),
            A.NEMO.replace(name="nc", center=False)]
    for cfg in cfgs:
        for training in (False, True):
            fused, ffl = A.log_mel(xg, lens, preset=cfg, training=training, seed=5)
            with monkeypatch.context() as m:
                m.setattr(_log_mel, "supported", lambda cfg, x: False)
                ref, rfl = A.log_mel(xg, lens, preset=cfg, training=training, seed=5)
            assert fused.shape == ref.shape, cfg.name
            np.testing.assert_array_equal(cp.asnumpy(ffl), cp.asnumpy(rfl))
            err = float(cp.abs(fused - ref).max())
            assert err <= 2e-4, (cfg.name, training, err)
