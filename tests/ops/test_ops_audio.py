"""CPU tests of avpipe.ops.audio: librosa for the filterbank / STFT / MFCC parts, and plain
float64 numpy transcriptions (written here, independent of avpipe) of the NeMo and MLPerf
RNN-T feature formulas for the presets."""

from __future__ import annotations

import math

import numpy as np
import pytest

from avpipe.ops import audio as A

SR = 16000


def speech_like(n, seed):
    """Harmonics of a gliding f0 under two moving formants, syllable-rate AM, a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / SR
    f0 = rng.uniform(100, 220) * (1 + 0.2 * np.sin(2 * np.pi * 0.7 * t))
    ph = 2 * np.pi * np.cumsum(f0) / SR
    x = np.zeros(n)
    for k in range(1, 30):
        fk = k * f0
        env = np.exp(-0.5 * ((fk - 600) / 150) ** 2) + 0.5 * np.exp(-0.5 * ((fk - 1700) / 250) ** 2)
        x += np.where(fk < SR / 2 - 100, env / k ** 0.5, 0) * np.sin(k * ph)
    x *= 0.5 * (1 - np.cos(2 * np.pi * 4 * t))
    x = 0.1 * x / (np.sqrt(np.mean(x ** 2)) + 1e-9) + 1e-3 * rng.standard_normal(n)
    return x.astype(np.float32)


def random_signal(n, seed):
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def padded_batch(items):
    n = max(len(a) for a in items)
    out = np.zeros((len(items), n), np.float32)
    for i, a in enumerate(items):
        out[i, :len(a)] = a
    return out, np.array([len(a) for a in items])


# ---------------------------------------------------------------------------------------------
# reference transcriptions (float64, one item at a time, explicit loops)
# ---------------------------------------------------------------------------------------------


def ref_window(win, n_fft, symmetric=True):
    w = np.array([0.5 - 0.5 * math.cos(2 * math.pi * k / ((win - 1) if symmetric else win))
                  for k in range(win)])
    full = np.zeros(n_fft)
    left = (n_fft - win) // 2
    full[left:left + win] = w
    return full


def ref_slaney_fb(n_fft, n_mels, fmax):
    def hz2mel(f):
        return f / (200 / 3) if f < 1000 else 15 + math.log(f / 1000) / (math.log(6.4) / 27)

    def mel2hz(m):
        return m * (200 / 3) if m < 15 else 1000 * math.exp((m - 15) * math.log(6.4) / 27)

    lo, hi = hz2mel(0.0), hz2mel(fmax)
    pts = [mel2hz(lo + (hi - lo) * i / (n_mels + 1)) for i in range(n_mels + 2)]
    freqs = [SR / 2 * j / (n_fft // 2) for j in range(n_fft // 2 + 1)]
    fb = np.zeros((n_mels, len(freqs)))
    for m in range(n_mels):
        a, b, c = pts[m], pts[m + 1], pts[m + 2]
        for j, f in enumerate(freqs):
            w = max(0.0, min((f - a) / (b - a), (c - f) / (c - b)))
            fb[m, j] = w * 2.0 / (c - a)
    return fb


def ref_features(x, *, win, pad_mode, guard, n_valid, n_fft=512, hop=160, preemph=0.97):
    """The shared formula: preemphasis, centred STFT, |X|^2, Slaney mel, ln(+guard),
    per-feature normalization over n_valid frames (n-1 std, +1e-5), zeros past n_valid."""
    x = np.asarray(x, np.float64)
    n = len(x)
    y = np.empty(n)
    y[0] = x[0]
    for t in range(1, n):
        y[t] = x[t] - preemph * x[t - 1]
    p = n_fft // 2
    if pad_mode == "reflect":
        yp = np.concatenate([y[1:p + 1][::-1], y, y[-p - 1:-1][::-1]])
    else:
        yp = np.concatenate([np.zeros(p), y, np.zeros(p)])
    w = ref_window(win, n_fft)
    T = 1 + n // hop
    fb = ref_slaney_fb(n_fft, 80, 8000.0)
    k = np.arange(n_fft // 2 + 1)[:, None] * np.arange(n_fft)[None, :]
    dft = np.exp(-2j * np.pi * k / n_fft)
    feats = np.zeros((80, T))
    for t in range(T):
        X = dft @ (yp[t * hop:t * hop + n_fft] * w)
        feats[:, t] = np.log(fb @ (np.abs(X) ** 2) + guard)
    v = feats[:, :n_valid]
    mean = v.mean(axis=1, keepdims=True)
    std = np.sqrt(((v - mean) ** 2).sum(axis=1, keepdims=True) / (n_valid - 1))
    out = np.zeros_like(feats)
    out[:, :n_valid] = (v - mean) / (std + 1e-5)
    return out, n_valid


def ref_nemo(x):
    """Current NeMo (NVIDIA-NeMo/NeMo 009d1c15, features.py): get_seq_len =
    floor_divide(n + n_fft // 2 * 2 - n_fft, hop) = n // 160; statistics over those frames; the
    rest (the STFT's last frame included) masked to 0."""
    n_valid = (len(x) + 512 // 2 * 2 - 512) // 160
    return ref_features(x, win=400, pad_mode="constant", guard=2.0 ** -24, n_valid=n_valid)


def ref_nemo_v1(x):
    """NeMo 1.x (NVIDIA/NeMo bcb749ef): one more valid frame, n // 160 + 1."""
    return ref_features(x, win=400, pad_mode="constant", guard=2.0 ** -24, n_valid=len(x) // 160 + 1)


def ref_mlperf(x):
    return ref_features(x, win=320, pad_mode="reflect", guard=1e-20, n_valid=-(-len(x) // 160))


# ---------------------------------------------------------------------------------------------
# presets against the transcriptions
# ---------------------------------------------------------------------------------------------

LENGTHS = [12000, 7777, 3200, 4000]


@pytest.mark.parametrize(
    "preset,ref", [("nemo", ref_nemo), ("nemo_v1", ref_nemo_v1), ("mlperf_rnnt", ref_mlperf)]
)
@pytest.mark.parametrize("kind", ["speech", "random"])
def test_log_mel_matches_reference(preset, ref, kind):
    make = speech_like if kind == "speech" else random_signal
    items = [make(n, seed=i) for i, n in enumerate(LENGTHS)]
    x, lens = padded_batch(items)
    feats, fl = A.log_mel(x, lens, preset=preset)
    assert feats.dtype == np.float32 and feats.shape[:2] == (4, 80)
    assert feats.shape[2] >= fl.max()
    for i, a in enumerate(items):
        want, nv = ref(a)
        assert fl[i] == nv
        got = feats[i, :, :nv]
        err = np.abs(got - want[:, :nv]).max()
        assert err <= 1e-4, (preset, kind, i, err)
        assert np.all(feats[i, :, nv:] == 0)


def test_nemo_frame_count_and_padding_zero():
    for n in (159, 160, 161, 16000, 16001):
        f, fl = A.log_mel(random_signal(n, 1), preset="nemo")
        assert fl.tolist() == [n // 160]
        assert f.shape[-1] == n // 160 + 1 and np.all(f[..., n // 160:] == 0)  # last frame masked
        _, fl = A.log_mel(random_signal(n, 1), preset="nemo_v1")
        assert fl.tolist() == [n // 160 + 1]
        _, fl = A.log_mel(random_signal(n, 1), preset="mlperf_rnnt")
        assert fl.tolist() == [-(-n // 160)]


def test_log_mel_batch_invariant_and_1d():
    items = [speech_like(n, seed=10 + i) for i, n in enumerate([9000, 5000])]
    x, lens = padded_batch(items)
    for preset in ("nemo", "mlperf_rnnt"):
        batch, fl = A.log_mel(x, lens, preset=preset)
        alone, fl1 = A.log_mel(items[1], preset=preset)
        assert alone.ndim == 3 and alone.shape[0] == 1
        k = int(fl[1])
        assert fl1[0] == k
        np.testing.assert_allclose(batch[1, :, :k], alone[0, :, :k], atol=2e-5)
        # garbage in the padding does not leak into the item
        noisy = x.copy()
        noisy[1, 5000:] = 1.0
        b2, _ = A.log_mel(noisy, lens, preset=preset)
        np.testing.assert_array_equal(b2, batch)


def test_log_mel_training_dither_and_validation():
    x = random_signal(4000, 3)
    a, _ = A.log_mel(x, training=False)
    b, _ = A.log_mel(x, training=False)
    np.testing.assert_array_equal(a, b)
    c, _ = A.log_mel(x, training=True, seed=1)
    assert not np.array_equal(a, c)
    assert np.abs(a - c).max() < 0.5   # dither 1e-5 barely moves speech-level features
    with pytest.raises(ValueError, match="preset"):
        A.log_mel(x, preset="kaldi")
    with pytest.raises(ValueError, match="sample_rate"):
        A.log_mel(x, sample_rate=8000)
    with pytest.raises(ValueError, match="lengths"):
        A.log_mel(x[None], [5000])


def test_short_and_empty_items():
    items = [random_signal(3000, 0), random_signal(100, 1), np.zeros(0, np.float32),
             random_signal(200, 2)]
    x, lens = padded_batch(items)
    for preset in ("nemo", "nemo_v1", "mlperf_rnnt"):
        f, fl = A.log_mel(x, lens, preset=preset)
        assert np.isfinite(f).all()
        assert fl[2] == 0 and np.all(f[2] == 0)
        # 100 samples: no whole hop under current NeMo; one (centred) frame otherwise
        assert fl[1] == (0 if preset == "nemo" else 1)
        assert fl[3] == (1 if preset == "nemo" else 2)
        assert np.all(f[1] == 0)   # one valid frame normalizes to 0, the rest is padding
        if preset == "nemo":
            assert np.all(f[3] == 0)


# ---------------------------------------------------------------------------------------------
# operators against librosa
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("htk,norm", [(False, "slaney"), (True, None), (True, "slaney"), (False, None)])
def test_mel_filterbank_librosa(htk, norm):
    librosa = pytest.importorskip("librosa")
    for sr, n_fft, n_mels, fmin, fmax in [(16000, 512, 80, 0.0, 8000.0), (22050, 1024, 128, 30.0, None),
                                          (8000, 256, 40, 20.0, 3800.0)]:
        want = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax, htk=htk, norm=norm)
        got = A.mel_filterbank(sample_rate=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax, htk=htk, norm=norm)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("center,pad_mode,periodic", [(True, "constant", True), (True, "reflect", False),
                                                      (False, "constant", True)])
def test_stft_librosa(center, pad_mode, periodic):
    librosa = pytest.importorskip("librosa")
    sig = speech_like(8000, 4)
    w = "hann" if periodic else np.asarray(A.get_window("hann", 400, periodic=False), np.float64)
    want = librosa.stft(sig.astype(np.float64), n_fft=512, hop_length=160, win_length=400, window=w,
                        center=center, pad_mode=pad_mode)
    got, fl = A.stft(sig, n_fft=512, hop_length=160, win_length=400, periodic=periodic, center=center,
                     pad_mode=pad_mode)
    assert got.dtype == np.complex64 and got.shape == want.shape and fl == want.shape[1]
    scale = np.abs(want).max()
    assert np.abs(got - want).max() / scale < 1e-5
    p, _ = A.spectrogram(sig, n_fft=512, hop_length=160, win_length=400, periodic=periodic, center=center,
                         pad_mode=pad_mode, power=2.0)
    assert np.abs(p - np.abs(want) ** 2).max() / scale ** 2 < 1e-5


def test_window_shapes():
    scipy_signal = pytest.importorskip("scipy.signal")
    np.testing.assert_allclose(A.get_window("hann", 400, periodic=True), scipy_signal.get_window("hann", 400),
                               atol=1e-7)
    np.testing.assert_allclose(A.get_window("hann", 400, periodic=False),
                               scipy_signal.get_window("hann", 400, fftbins=False), atol=1e-7)
    w = A.get_window("hann", 400, n_fft=512)
    assert w.shape == (512,) and np.all(w[:56] == 0) and np.all(w[456:] == 0)
    with pytest.raises(ValueError, match="win_length"):
        A.get_window("hann", 600, n_fft=512)
    with pytest.raises(ValueError, match="window"):
        A.get_window("kaiser", 400)


def test_mfcc_and_db_librosa():
    librosa = pytest.importorskip("librosa")
    sig = speech_like(16000, 5).astype(np.float64)
    S = librosa.feature.melspectrogram(y=sig, sr=SR, n_fft=512, hop_length=160, n_mels=64)
    want_db = librosa.power_to_db(S)
    got_db = A.power_to_db(S.astype(np.float32))
    assert np.abs(got_db - want_db).max() < 1e-3
    want = librosa.feature.mfcc(S=want_db, n_mfcc=20)
    got = A.mfcc(want_db.astype(np.float32), n_mfcc=20)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    # the whole chain from signal through our operators
    P, fl = A.spectrogram(sig.astype(np.float32), n_fft=512, hop_length=160, win_length=512,
                          periodic=True, pad_mode="constant")
    M = A.mel_spectrogram(P, sample_rate=SR, n_mels=64)
    S2 = librosa.feature.melspectrogram(y=sig, sr=SR, n_fft=512, hop_length=160, n_mels=64, pad_mode="constant")
    assert np.abs(M - S2).max() / S2.max() < 1e-5


def test_log_guard_preemph_dither():
    x = np.array([[0.0, 1e-30, 1.0, 2.0]], np.float32)
    np.testing.assert_allclose(A.log_guarded(x, guard="add", guard_value=1e-3), np.log(x + 1e-3), rtol=1e-6)
    np.testing.assert_allclose(A.log_guarded(x, guard="clamp", guard_value=1e-3),
                               np.log(np.maximum(x, 1e-3)), rtol=1e-6)
    with pytest.raises(ValueError, match="guard"):
        A.log_guarded(x, guard="floor")
    s = np.array([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0]], np.float32)
    y = A.preemphasis(s, [4, 2], coeff=0.5)
    np.testing.assert_allclose(y, [[1.0, 1.5, 2.0, 7.5], [4.0, 3.0, 0.0, 0.0]])
    d = A.dither(np.zeros((2, 1000), np.float32), [1000, 10], scale=0.1, seed=0)
    assert 0.08 < d[0].std() < 0.12 and np.all(d[1, 10:] == 0) and np.any(d[1, :10] != 0)


def test_normalize_modes():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 10)).astype(np.float32) * 3 + 1
    fl = [10, 6]
    y = A.normalize(x, fl, mode="per_feature")
    v = x[1, :, :6].astype(np.float64)
    want = (v - v.mean(1, keepdims=True)) / (v.std(1, ddof=1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y[1, :, :6], want, atol=1e-5)
    assert np.all(y[1, :, 6:] == 0)
    z = A.normalize(x, fl, mode="all_features")
    want = (v - v.mean()) / (v.std(ddof=1) + 1e-5)
    np.testing.assert_allclose(z[1, :, :6], want, atol=1e-5)
    with pytest.raises(ValueError, match="mode"):
        A.normalize(x, fl, mode="global")


def test_stack_frames_mlperf_rule():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 10)).astype(np.float32)
    fl = np.array([10, 7])
    x[1, :, 7:] = 0
    y, nl = A.stack_frames(x, fl, stacking=3, subsampling=3)
    assert nl.tolist() == [4, 3] and y.shape == (2, 12, 4)
    for b in range(2):
        for t in range(int(nl[b])):
            for k in range(3):
                src = 3 * t + k
                want = x[b, :, src] if src < fl[b] else np.zeros(4)
                np.testing.assert_array_equal(y[b, 4 * k:4 * k + 4, t], want)
        assert np.all(y[b, :, nl[b]:] == 0)


def test_pad_to_multiple():
    x = np.ones((2, 3, 10), np.float32)
    assert A.pad_to_multiple(x, 16).shape == (2, 3, 16)
    assert A.pad_to_multiple(x, 0).shape == (2, 3, 10)
    assert np.all(A.pad_to_multiple(x, 4)[..., 10:] == 0)
    with pytest.raises(ValueError, match="multiple"):
        A.pad_to_multiple(x, -1)


def test_resample_tone():
    for orig in (44100, 8000):
        n = orig * 2
        t = np.arange(n) / orig
        s = np.sin(2 * np.pi * 1000.0 * t).astype(np.float32)
        r = A.resample(s, orig, 16000)
        assert r.shape == (-(-n * 16000 // orig),) and r.dtype == np.float32
        mid = r[2000:-2000].astype(np.float64)
        rms = np.sqrt(np.mean(mid ** 2))
        assert abs(rms / np.sqrt(0.5) - 1) < 0.01
        spec = np.abs(np.fft.rfft(mid * np.hanning(len(mid)), n=16 * len(mid)))
        peak = np.argmax(spec) * 16000 / (16 * len(mid))
        assert abs(peak - 1000.0) < 1.0, peak


def test_operator_arg_errors():
    x = np.zeros((2, 1000), np.float32)
    with pytest.raises(ValueError, match="n_fft"):
        A.stft(x, n_fft=-3)
    with pytest.raises(ValueError, match="pad_mode"):
        A.stft(x, pad_mode="edge")
    with pytest.raises(ValueError, match="lengths"):
        A.stft(x, [1000, 2000])
    with pytest.raises(ValueError, match="signals"):
        A.stft(np.zeros((1, 2, 3), np.float32))
    with pytest.raises(ValueError, match="target_sr"):
        A.resample(x, 16000, 0)


def test_ops_namespace_exports():
    import avpipe.ops
    from avpipe.ops import image as I

    for name in A.__all__:
        if name in I.__all__:  # shared names must be taken from their module
            continue
        assert getattr(avpipe.ops, name) is getattr(A, name)


def test_ops_all_lists_every_public_name_once():
    import avpipe.ops
    from avpipe.ops import audio_augment as AA
    from avpipe.ops import image as I
    from avpipe.ops import image_augment as IA

    mods = [A, I, AA, IA]
    names = [n for m in mods for n in m.__all__]
    # a name two modules give different objects is left out (one object under two: kept)
    shared = {n for n in names if len({id(getattr(m, n)) for m in mods if n in m.__all__}) > 1}
    want = {"audio", "color", "image", "random", "registry", "audio_augment", "image_augment"}
    want |= set(names) - shared
    assert set(avpipe.ops.__all__) == want and len(avpipe.ops.__all__) == len(want)
    assert avpipe.ops.Chain is AA.Chain is IA.Chain
    with pytest.raises(AttributeError, match="ambiguous"):
        avpipe.ops.normalize  # noqa: B018


def test_log_mel_frame_lengths_on_the_host_equal_log_mels():
    """log_mel_frame_lengths(..., frames=T) is log_mel's frame_lengths, computed on the host."""
    rng = np.random.default_rng(4)
    lens = np.array([16000, 12345, 159, 0])
    x = rng.standard_normal((4, 16000)).astype(np.float32)
    for preset in ("nemo", "nemo_v1", "mlperf_rnnt"):
        feats, fl = A.log_mel(x, lens, preset=preset)
        got = A.log_mel_frame_lengths(lens, preset=preset, frames=feats.shape[-1])
        np.testing.assert_array_equal(got, fl)
    assert A.log_mel_frame_lengths([1600, 800], preset="nemo", frames=6).tolist() == [6, 5]


# ---------------------------------------------------------------------------------------------
# the CPU path: each item alone, bit for bit, whatever the batch
# ---------------------------------------------------------------------------------------------

CONFIGS = [
    "nemo", "nemo_v1", "mlperf_rnnt",
    A.NEMO.replace(name="p1", power=1.0, log_guard="clamp", normalize="all_features"),
    A.NEMO.replace(name="plain", normalize=None, preemph=None, n_mels=64, fmax=None),
    A.NEMO.replace(name="no_center", center=False, window="hamming", periodic=True,
                   win_length=512, pad_to=8),
]


def _batches(items, rng, count):
    """``count`` batches of random subsets of ``items``, in random order, with random
    extra padding: (indices, x, lengths)."""
    for _ in range(count):
        idx = rng.permutation(len(items))[: int(rng.integers(1, len(items) + 1))]
        n = max(len(items[i]) for i in idx) + int(rng.integers(0, 4000))
        x = np.zeros((len(idx), n), np.float32)
        for r, i in enumerate(idx):
            x[r, : len(items[i])] = items[i]
        yield idx, x, np.array([len(items[i]) for i in idx])


@pytest.mark.parametrize("preset", CONFIGS, ids=lambda c: c if isinstance(c, str) else c.name)
def test_log_mel_of_an_item_is_the_same_bits_in_any_batch(preset, monkeypatch):
    """An item's features do not depend on the batch it is computed in: its row of any batch
    (other items, their order, the padding, the batch size) equals it computed alone, bit for
    bit, on one thread or several; past its frames the row is 0."""
    from avpipe.ops import _log_mel

    rng = np.random.default_rng(7)
    items = [speech_like(int(n), seed=i) for i, n in enumerate(rng.integers(100, 40000, 9))]
    items.append(random_signal(48000, 3))
    alone = [A.log_mel(a, preset=preset) for a in items]
    for threads in (1, 3):
        monkeypatch.setattr(_log_mel, "cpu_threads", lambda t=threads: t)
        for idx, x, lens in _batches(items, rng, 3):
            feats, fl = A.log_mel(x, lens, preset=preset)
            for r, i in enumerate(idx):
                f1, fl1 = alone[i]
                k = int(fl1[0])
                assert fl[r] == k
                assert np.array_equal(feats[r, :, :k], f1[0, :, :k]), (threads, r, i)
                assert not feats[r, :, k:].any()


@pytest.mark.parametrize("preset", CONFIGS, ids=lambda c: c if isinstance(c, str) else c.name)
def test_log_mel_cpu_path_agrees_with_the_float64_reference(preset):
    """The CPU path (float64 FFT over each item's frames, float32 log) against the
    array-module code over the padded batch in float64, for every knob it covers."""
    from avpipe.ops.audio import _log_mel_array_module, resolve_preset

    items = [speech_like(n, seed=20 + i) for i, n in enumerate([12000, 7777, 300, 16000])]
    items.insert(3, np.zeros(0, np.float32))
    x, lens = padded_batch(items)
    feats, fl = A.log_mel(x, lens, preset=preset)
    want, wfl = _log_mel_array_module(x, lens, resolve_preset(preset))
    np.testing.assert_array_equal(fl, wfl)
    assert feats.shape == want.shape and feats.dtype == np.float32
    np.testing.assert_allclose(feats, want, atol=5e-5, rtol=1e-5)
    # float64 input: the same features
    f64, _ = A.log_mel(x.astype(np.float64), lens, preset=preset)
    np.testing.assert_allclose(f64, feats, atol=1e-5)


def test_log_mel_training_dither_cpu_path():
    """The dither draws the same noise for the batch as the reference (seeded), and reaches
    each item's samples only."""
    from avpipe.ops.audio import _log_mel_array_module

    x, lens = padded_batch([speech_like(9000, 1), speech_like(5000, 2)])
    got, _ = A.log_mel(x, lens, training=True, seed=3)
    want, _ = _log_mel_array_module(x, lens, A.NEMO, training=True, seed=3)
    np.testing.assert_allclose(got, want, atol=5e-5)
    again, _ = A.log_mel(x, lens, training=True, seed=3)
    np.testing.assert_array_equal(got, again)


def test_feature_operators_are_the_same_bits_in_any_batch():
    """The operators extraction's "mel" / "mfcc" / "normalize" steps run: an item's outputs
    in a batch equal it alone, bit for bit (their products and statistics do not depend on
    the batch's size or padding)."""
    rng = np.random.default_rng(11)
    items = [speech_like(int(n), seed=30 + i) for i, n in enumerate(rng.integers(2000, 30000, 6))]

    def chain(x, lens):
        P, fl = A.spectrogram(x, lens, n_fft=512, hop_length=160, win_length=400)
        M = A.mel_spectrogram(P, fl, sample_rate=SR, n_mels=64)
        db = A.power_to_db(M)
        mf = A.mfcc(db, fl, n_mfcc=20)
        return [M, mf, A.normalize(mf, fl), A.normalize(db, fl, mode="all_features")], fl

    alone = [chain(a[None], [len(a)]) for a in items]
    for idx, x, lens in _batches(items, rng, 3):
        outs, fl = chain(x, lens)
        for r, i in enumerate(idx):
            k = int(alone[i][1][0])
            assert fl[r] == k
            for got, want in zip(outs, alone[i][0]):
                assert np.array_equal(got[r, :, :k], want[0, :, :k]), (r, i)


def test_sparse_rows_product_equals_the_dense_one():
    from avpipe.ops._sparse_rows import SparseRows

    rng = np.random.default_rng(2)
    fb = A.mel_filterbank(sample_rate=SR, n_fft=512, n_mels=80).astype(np.float64)
    dense = rng.standard_normal((7, 257))
    dense[3] = 0  # a row of zeros
    for w in (fb, dense, np.zeros((0, 257))):
        s = rng.standard_normal((2, 257, 33))
        np.testing.assert_allclose(SparseRows(w).apply(s), w @ s, rtol=1e-12, atol=1e-12)


def test_cpu_dither_draws_each_items_samples_alone(monkeypatch):
    """On the CPU the dither's noise of an item is its own stream's draws for its samples
    only: the same values however far the batch is padded (no draws for the padding), in
    log_mel (drawn on the items' threads) as in dither() (the reference); and log_mel with
    training and a seed is the same bits on one thread or two."""
    from avpipe.ops import _log_mel

    sig = [speech_like(9000, 1), speech_like(5000, 2), speech_like(700, 3)]
    x, lens = padded_batch(sig)
    wide = np.zeros((x.shape[0], x.shape[1] + 4321), np.float32)
    wide[:, : x.shape[1]] = x
    a, _ = A.log_mel(x, lens, training=True, seed=11)
    b, _ = A.log_mel(wide, lens, training=True, seed=11)
    np.testing.assert_array_equal(a[:, :, : a.shape[2]], b[:, :, : a.shape[2]])
    da = A.dither(x, lens, scale=1e-3, seed=5)
    db = A.dither(wide, lens, scale=1e-3, seed=5)
    np.testing.assert_array_equal(da, db[:, : x.shape[1]])
    assert not db[:, x.shape[1]:].any()
    monkeypatch.setattr(_log_mel, "cpu_threads", lambda: 1)
    one, _ = A.log_mel(x, lens, training=True, seed=11)
    np.testing.assert_array_equal(one, a)
