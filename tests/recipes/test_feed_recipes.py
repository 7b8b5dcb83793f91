"""The recipes on the sample media: rnnt_feed, video_classification, image_classification
(shapes, labels, shards, resume with identical values, skipped files, torch / JAX faces)."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest
from paths import SAMPLES

import avpipe
from avpipe.recipes import image_classification, rnnt_feed, video_classification

# DataLoader workers start from a fork server, never as forks of the test process: a fork copies
# the locks its other threads hold (a feed's producer, BLAS), and such a worker can hang
CTX = "forkserver"

ROOT = SAMPLES
MANIFEST = os.path.join(ROOT, "speech", "manifest.jsonl")
LABELS = os.path.join(ROOT, "video", "labels.csv")


def _lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


# --- rnnt ---------------------------------------------------------------------------------


def test_rnnt_batches_on_samples():
    feed = rnnt_feed(MANIFEST, batch_size=4, seed=0, device="cpu", training=False)
    assert len(feed) == 2
    texts = {os.path.join(ROOT, "speech", d["audio_filepath"]): d["text"]
             for d in _lines(MANIFEST)}
    seen = []
    for b in feed:
        B = len(b.paths)
        assert b.features.dtype == np.float32 and b.features.ndim == 3
        assert b.features.shape[:2] == (B, 80) and b.feature_lengths.shape == (B,)
        assert b.features.shape[2] >= int(b.feature_lengths.max())
        for p, t in zip(b.paths, b.transcripts):
            assert os.path.isabs(p) and texts[p] == t
        # zero past each item's length
        for r, n in enumerate(b.feature_lengths.tolist()):
            assert not np.any(b.features[r, :, n:])
        seen += b.paths
    assert sorted(seen) == sorted(texts)
    assert not feed.errors


def test_rnnt_offset_and_duration_honoured(tmp_path):
    shutil.copy(os.path.join(ROOT, "speech", "utt01.wav"), tmp_path / "a.wav")
    (tmp_path / "m.jsonl").write_text(
        json.dumps({"audio_filepath": "a.wav", "offset": 0.5, "duration": 1.0, "text": "x"})
        + "\n" + json.dumps({"audio_filepath": "a.wav", "duration": 2.0, "text": "y"}) + "\n")
    feed = rnnt_feed(tmp_path / "m.jsonl", batch_size=2, shuffle=False, device="cpu",
                     training=False)
    (b,) = list(feed)
    # nemo preset (current NeMo): hop 160, frames = samples // 160
    assert b.feature_lengths.tolist() == [16000 // 160, 32000 // 160]
    # the features are those of the samples cut by hand: the whole file, then the slices
    whole = avpipe.load_audio(str(tmp_path / "a.wav"), sample_rate=16000).samples
    assert whole.shape[0] >= 32000 + 8000

    def feats(rows):
        x = np.zeros((2, 32000), np.float32)
        for r, v in enumerate(rows):
            x[r, : v.shape[0]] = v
        return avpipe.ops.audio.log_mel(x, np.array([16000, 32000]), preset="nemo")[0]

    np.testing.assert_array_equal(b.features, feats([whole[8000:24000], whole[:32000]]))
    at0 = feats([whole[:16000], whole[:32000]])
    assert not np.allclose(b.features[0], at0[0])  # not the file's first second


def test_rnnt_max_duration_and_too_long_items():
    feed = rnnt_feed(MANIFEST, max_duration=8.0, seed=1, device="cpu")
    durs = {os.path.join(ROOT, "speech", d["audio_filepath"]): d["duration"]
            for d in _lines(MANIFEST)}
    n = 0
    for b in feed:
        assert len(b.paths) * max(durs[p] for p in b.paths) <= 8.0
        n += len(b.paths)
    assert n == 6
    feed = rnnt_feed(MANIFEST, max_duration=4.0, seed=1, device="cpu")
    got = [p for b in feed for p in b.paths]
    assert len(got) == 3 and len(feed.errors) == 3
    assert all("max_duration" in m for _, m in feed.errors)


def test_rnnt_max_duration_is_manifest_seconds_before_speed_perturbation():
    """The documented behaviour: the budget holds on manifest seconds; speed perturbation at
    0.85 stretches the padded batch up to max_duration / 0.85, past max_duration."""
    kw = dict(max_duration=9.0, seed=0, device="cpu", training=True, spec_augment=None)
    padded = {}
    for sp in ([0.85], None):
        padded[sp is None] = []
        for b in rnnt_feed(MANIFEST, speed_perturb=sp, **kw):
            assert len(b.paths) * max(b.durations) <= 9.0  # manifest seconds
            padded[sp is None].append(b.features.shape[0] * b.features.shape[2] * 160 / 16000)
    assert max(padded[True]) <= 9.0 + 0.01  # unperturbed: within a frame of the budget
    assert 9.0 < max(padded[False]) <= 9.0 / 0.85 + 0.02  # perturbed: over, by at most 1/0.85


def test_rnnt_shards_and_resume_with_dither():
    W = 2
    feeds = [rnnt_feed(MANIFEST, batch_size=1, seed=3, rank=r, world_size=W, device="cpu")
             for r in range(W)]
    assert len(feeds[0]) == len(feeds[1]) == 3
    paths = [p for f in feeds for b in f for p in b.paths]
    assert len(paths) == len(set(paths)) == 6
    ref = [b.features.copy() for b in rnnt_feed(MANIFEST, batch_size=2, seed=3, device="cpu")]
    f = rnnt_feed(MANIFEST, batch_size=2, seed=3, device="cpu")
    it = iter(f)
    first = next(it).features.copy()
    st = json.loads(json.dumps(f.state_dict()))
    it.close()
    g = rnnt_feed(MANIFEST, batch_size=2, seed=3, device="cpu")
    g.load_state_dict(st)
    rest = [b.features for b in g]
    assert len(rest) == 2
    for a, b in zip([first] + rest, ref):
        np.testing.assert_array_equal(a, b)  # dither included: the same draws


def _bad_manifest(tmp_path):
    lines = _lines(MANIFEST)
    for d in lines:
        d["audio_filepath"] = os.path.join(ROOT, "speech", d["audio_filepath"])
    (tmp_path / "broken.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunkjunkjunk")
    lines.insert(2, {"audio_filepath": "broken.wav", "duration": 1.0, "text": "bad"})
    lines.insert(4, {"audio_filepath": "missing.flac", "duration": 1.0, "text": "gone"})
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps(d) + "\n" for d in lines))
    return p


def test_rnnt_skip_fills_and_names_the_file(tmp_path):
    feed = rnnt_feed(_bad_manifest(tmp_path), batch_size=3, seed=0, device="cpu",
                     training=False)
    got = [b.paths for b in feed]
    assert len(got) == len(feed) == 3
    assert [len(g) for g in got][:2] == [3, 3]  # full; only the last one is short
    assert sum(len(g) for g in got) == 6
    bad = sorted(os.path.basename(p) for p, _ in feed.errors)
    assert bad == ["broken.wav", "missing.flac"]
    # training: the planned sizes (3, 3, 2), the last filled with repeats
    feed = rnnt_feed(_bad_manifest(tmp_path), batch_size=3, seed=0, device="cpu")
    got = [b.paths for b in feed]
    assert [len(g) for g in got] == [3, 3, 2] and len({p for g in got for p in g}) == 6
    with pytest.raises(Exception, match="broken.wav|missing.flac"):
        for _ in rnnt_feed(_bad_manifest(tmp_path), batch_size=3, shuffle=False, device="cpu",
                           on_error="raise"):
            pass


@pytest.mark.parametrize("training", [False, True])
def test_rnnt_an_empty_batch_keeps_the_mel_axis(tmp_path, training):
    """Evaluation batches whose items were all skipped are [0, n_mels, 0] (they were [0, 0, 0],
    which a model's layer over the mel axis refuses); a training feed fills them with repeats,
    and gives an empty one only when no item of the epoch decodes."""
    lines = _lines(MANIFEST)[:2]
    for d in lines:
        d["audio_filepath"] = os.path.join(ROOT, "speech", d["audio_filepath"])
    (tmp_path / "bad.wav").write_bytes(b"RIFF junk" * 50)
    lines += [{"audio_filepath": "bad.wav", "duration": 3.0, "text": "b"}] * 4
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps(d) + "\n" for d in lines))
    feed = rnnt_feed(p, batch_size=2, shuffle=False, device="cpu", training=training)
    shapes = [tuple(b.features.shape) for b in feed]
    if training:
        assert [s[:2] for s in shapes] == [(2, 80)] * 3
    else:
        assert shapes[0][:2] == (2, 80) and shapes[1:] == [(0, 80, 0), (0, 80, 0)]
    assert len(feed.errors) == 1  # the four lines' one file and message, once
    p.write_text("".join(json.dumps(d) + "\n" for d in lines[2:]))  # every item bad
    feed = rnnt_feed(p, batch_size=2, shuffle=False, device="cpu", training=training)
    assert [tuple(b.features.shape) for b in feed] == [(0, 80, 0), (0, 80, 0)]


@pytest.mark.parametrize("decoder", ["threads", "processes"])
def test_rnnt_skips_absurd_and_nan_samples(tmp_path, decoder):
    # found by the fuzz run: a float WAV with a flipped exponent bit decodes to finite samples
    # of 1e37, whose features came out NaN in the batch; the loaders' rows were not checked for
    # NaN either. Both are skipped and reported; unscaled float audio (int16 range) is kept.
    import soundfile as sf

    t = np.arange(16000) / 16000
    x = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    loud, nan = x.copy(), x.copy()
    loud[1234] = 1.3e37
    nan[777] = np.nan
    for name, y in (("loud.wav", loud), ("nan.wav", nan), ("scaled.wav", x * 32767)):
        sf.write(tmp_path / name, y, 16000, subtype="FLOAT")
    lines = _lines(MANIFEST)
    for d in lines:
        d["audio_filepath"] = os.path.join(ROOT, "speech", d["audio_filepath"])
    for k, name in ((1, "loud.wav"), (3, "nan.wav"), (5, "scaled.wav")):
        lines.insert(k, {"audio_filepath": name, "duration": 1.0, "text": name})
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps(d) + "\n" for d in lines))
    feed = rnnt_feed(m, batch_size=3, shuffle=False, device="cpu", training=True,
                     decoder=decoder)
    seen = []
    for b in feed:
        for r, n in enumerate(b.feature_lengths.tolist()):
            assert np.isfinite(b.features[r, :, :n]).all(), b.paths[r]
        seen += b.paths
    feed.close()
    bad = dict((os.path.basename(p), msg) for p, msg in feed.errors)
    assert sorted(bad) == ["loud.wav", "nan.wav"]
    assert "magnitude" in bad["loud.wav"] and "NaN" in bad["nan.wav"]
    assert sorted({os.path.basename(p) for p in seen}) == sorted(  # (training: + repeats)
        ["scaled.wav"] + [os.path.basename(d["audio_filepath"]) for d in _lines(MANIFEST)])


def test_rnnt_augmentation_resumes_identically():
    # training=True: speed perturbation + dither + SpecAugment by default
    kw = dict(batch_size=2, seed=5, device="cpu")
    ref = [(b.features.copy(), b.feature_lengths.copy()) for b in rnnt_feed(MANIFEST, **kw)]
    f = rnnt_feed(MANIFEST, **kw)
    it = iter(f)
    next(it)
    st = json.loads(json.dumps(f.state_dict()))
    it.close()
    g = rnnt_feed(MANIFEST, **kw)
    g.load_state_dict(st)
    rest = [(b.features, b.feature_lengths) for b in g]
    assert len(rest) == 2
    for (a, la), (b, lb) in zip(rest, ref[1:]):
        np.testing.assert_array_equal(la, lb)
        np.testing.assert_array_equal(a, b)


def _plain_features(path_order, preset="nemo"):
    from avpipe.decoding.audio import load_audio
    from avpipe.ops.audio import log_mel

    sig = [load_audio(p, sample_rate=16000).samples for p in path_order]
    n = max(len(s) for s in sig)
    x = np.zeros((len(sig), n), np.float32)
    for r, s in enumerate(sig):
        x[r, : len(s)] = s
    return log_mel(x, np.array([len(s) for s in sig]), preset=preset)


def test_rnnt_processes_loader_equals_threads():
    kw = dict(batch_size=4, seed=3, device="cpu", training=False)
    fp = rnnt_feed(MANIFEST, decoder="processes", **kw)
    got = list(fp)
    assert fp.task._loader is not None and fp.task._loader.decoder == "cpu"
    fp.close()
    ft = rnnt_feed(MANIFEST, decoder="threads", **kw)
    want = list(ft)
    assert ft.task._loader is None
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        assert a.paths == b.paths
        np.testing.assert_array_equal(a.feature_lengths, b.feature_lengths)
        np.testing.assert_allclose(a.features, b.features, atol=1e-4, rtol=0)
    # auto on the CPU: the threads; processes need a fixed batch size
    assert rnnt_feed(MANIFEST, device="cpu", batch_size=2).task._loader_kind(fp.items) is None
    with pytest.raises(ValueError, match="fixed batch_size"):
        rnnt_feed(MANIFEST, device="cpu", max_duration=8.0, decoder="processes")


def test_rnnt_training_false_is_unaugmented():
    for b in rnnt_feed(MANIFEST, batch_size=3, seed=1, device="cpu", training=False):
        feats, fl = _plain_features(b.paths)
        np.testing.assert_array_equal(b.feature_lengths, fl)
        np.testing.assert_array_equal(b.features, feats)


def test_rnnt_training_augments_with_the_ops():
    from avpipe.ops import audio_augment as aug

    kw = dict(batch_size=3, seed=2, device="cpu", shuffle=False)
    off = list(rnnt_feed(MANIFEST, speed_perturb=None, spec_augment=None, **kw))
    on = list(rnnt_feed(MANIFEST, **kw))
    ids = np.arange(6)
    f = aug.sample_speed_params(2, 0, ids, factor_range=(0.85, 1.15), step=0.01)["factor"]
    assert len(np.unique(f)) > 1 and np.all((f >= 0.85) & (f <= 1.15))
    for k, (a, b) in enumerate(zip(off, on)):
        # speed: lengths follow the drawn factors (n -> ceil(n / f) samples, frames n // 160)
        sig = [int(round(d * 16000)) for d in a.durations]
        exp = [-(-n * 16000 // int(round(16000 * ff))) // 160
               for n, ff in zip(sig, f[3 * k : 3 * k + 3])]
        assert np.abs(b.feature_lengths - np.array(exp)).max() <= 1
        # SpecAugment: the masked cells are exactly 0 inside each item's length
        for r, n in enumerate(b.feature_lengths.tolist()):
            assert (b.features[r, :, :n] == 0).any()
            assert not (a.features[r, :, : a.feature_lengths[r]] == 0).all(axis=1).any()
    # the speed factor list form, and a generic hook still applied after it
    seen = []

    def hook(arrays, seed, epoch, ids):
        seen.append(np.asarray(arrays["lengths"]).copy())
        return arrays

    list(rnnt_feed(MANIFEST, speed_perturb=[0.9, 1.1], signal_augment=[hook], **kw))
    assert len(seen) == 2


def test_rnnt_spec_augment_matches_the_op():
    from avpipe.ops import audio_augment as aug

    kw = dict(batch_size=6, seed=4, device="cpu", shuffle=False, speed_perturb=None)
    (masked,) = list(rnnt_feed(MANIFEST, **kw))
    (clean,) = list(rnnt_feed(MANIFEST, spec_augment=None, **kw))
    ref = aug.spec_augment(clean.features, clean.feature_lengths, seed=4, epoch=0,
                           ids=np.arange(6), freq_masks=2, freq_width=27, time_masks=10,
                           time_width=0.05)
    np.testing.assert_array_equal(masked.features, ref)


def test_rnnt_batch_draws_in_one_philox_pass(monkeypatch):
    # a training batch's samplers (speed, dither, SpecAugment) take their words from one
    # pass (ops.random.drawn_together): the same batch as drawing each alone
    from avpipe.ops import random as R

    kw = dict(batch_size=6, seed=4, device="cpu", shuffle=False, training=True)
    plain = rnnt_feed(MANIFEST, **kw)
    plain.task._draws = lambda: []  # each sampler draws alone
    (want,) = list(plain)
    plain.close()  # (its producer stops: nothing else draws while the passes are counted)
    feed = rnnt_feed(MANIFEST, **kw)
    task = feed.task
    calls = {"lanes": 0, "ints": 0}
    lanes, lanes32, ints = R.philox_lanes, R.philox_lanes32, R._philox_ints

    def count_lanes(*a):
        calls["lanes"] += 1
        return lanes(*a)

    def count_lanes32(*a):  # (words_many's lanes)
        calls["lanes"] += 1
        return lanes32(*a)

    def count_ints(*a):
        calls["ints"] += 1
        return ints(*a)

    pairs = list(enumerate(feed.items[:6]))
    values = task.decode_items(pairs)
    monkeypatch.setattr(R, "philox_lanes", count_lanes)
    monkeypatch.setattr(R, "philox_lanes32", count_lanes32)
    monkeypatch.setattr(R, "_philox_ints", count_ints)
    got = task.collate(values, pairs, 0, 0)
    assert calls == {"lanes": 1, "ints": 0}
    np.testing.assert_array_equal(got["features"], want.features)
    np.testing.assert_array_equal(got["feature_lengths"], want.feature_lengths)
    feed.close()


# --- video --------------------------------------------------------------------------------


def test_video_train_batches():
    feed = video_classification(LABELS, clip_length=4, stride=2, crop_size=64, batch_size=2,
                                seed=0, device="cpu")
    assert feed.classes == ["circles", "squares"] and len(feed) == 3
    names = []
    for b in feed:
        assert b.clips.shape == (2, 4, 3, 64, 64) and b.clips.dtype == np.float16
        assert np.isfinite(b.clips).all() and abs(float(b.clips.mean())) < 3
        for p, lab in zip(b.paths, b.labels.tolist()):
            assert feed.classes[lab] == os.path.basename(p).split("_")[0]
        names += b.paths
    assert len(set(names)) == 6


def test_video_resume_same_clips_crops_flips():
    kw = dict(clip_length=4, stride=2, crop_size=48, batch_size=2, seed=7, device="cpu")
    ref = [b.clips.copy() for b in video_classification(LABELS, **kw)]
    f = video_classification(LABELS, **kw)
    it = iter(f)
    next(it)
    st = f.state_dict()
    del it
    g = video_classification(LABELS, **kw)
    g.load_state_dict(st)
    rest = [b.clips for b in g]
    assert len(rest) == 2
    for a, b in zip(rest, ref[1:]):
        np.testing.assert_array_equal(a, b)
    # another epoch draws other clips / crops
    h = video_classification(LABELS, **kw)
    list(h)
    e1 = {tuple(b.paths): b.clips for b in h}
    e0 = {tuple(b.paths): c for b, c in zip(video_classification(LABELS, **kw), ref)}
    assert e1.keys() != e0.keys() or any(not np.array_equal(e1[k], e0[k]) for k in e1)


def test_video_eval_views():
    # the unit of an eval batch is a view: clips [B, T, 3, S, S], labels / video_index / view [B]
    feed = video_classification(LABELS, clip_length=4, stride=2, crop_size=48, batch_size=4,
                                train=False, num_clips=2, device="cpu")
    V = 6
    assert len(feed.items) == 6 * V and len(feed) == 6 * V // 4
    b = next(iter(feed))
    assert b.clips.shape == (4, 4, 3, 48, 48) and b.clips.dtype == np.float16
    assert b.labels.shape == (4,) and b.labels.dtype == np.int64
    assert b.video_index.tolist() == [0, 0, 0, 0] and b.view.tolist() == [0, 1, 2, 3]
    assert b.paths == [os.path.join(ROOT, "video", "circles_h264.mp4")] * 4  # no shuffle
    # the three crops of one clip differ, the views of one video share its label
    assert not np.array_equal(b.clips[0], b.clips[1])
    assert len(set(b.labels.tolist())) == 1


def test_video_eval_single_crop_is_the_centre_of_the_resize():
    # num_crops=1: the centre crop folded into the resize equals cropping the whole resize
    from avpipe.device import resolve_device
    from avpipe.ops.image import resize_crop_normalize
    from avpipe.ops.image_augment import center_crop_clips
    from avpipe.recipes.video import VideoTask

    task = VideoTask(labels=[0], clip_length=3, stride=1, crop_size=40, train=False, seed=0,
                     device=resolve_device("cpu"), num_clips=1, num_crops=1)  # fmt: skip
    fr = np.random.default_rng(1).integers(0, 256, (3, 61, 97, 3), dtype=np.uint8)
    full = resize_crop_normalize(fr, short_side=40, crop_size=None, layout="NCHW")
    want = center_crop_clips(full[None], 40, layout="BTCHW")
    got = task._eval_views(fr)
    assert got.shape == (1, 3, 3, 40, 40)
    np.testing.assert_array_equal(got, want)


def _logit(clips):  # a stand-in model: one score per view
    return clips.astype(np.float64).mean(axis=(1, 2, 3, 4))


def test_video_eval_views_once_across_ranks_and_average_by_video():
    kw = dict(clip_length=2, stride=3, crop_size=32, train=False, num_clips=2, num_crops=3,
              device="cpu")
    V = 6
    # reference: one batch per video (batch_size = V, in order)
    ref = np.zeros(6)
    for b in video_classification(LABELS, batch_size=V, **kw):
        assert len(set(b.video_index.tolist())) == 1 and b.view.tolist() == list(range(V))
        ref[int(b.video_index[0])] = _logit(b.clips).mean()
    W = 2
    seen, sums, counts = [], np.zeros(6), np.zeros(6)
    for r in range(W):
        f = video_classification(LABELS, batch_size=3, rank=r, world_size=W, shuffle=True,
                                 seed=3, **kw)
        assert len(f) == 6 * V // (3 * W)
        for b in f:
            assert b.clips.shape[1:] == (2, 3, 32, 32) and len(b.paths) == len(b.view)
            seen += list(zip(b.video_index.tolist(), b.view.tolist()))
            np.add.at(sums, b.video_index, _logit(b.clips))
            np.add.at(counts, b.video_index, 1)
    assert sorted(seen) == [(v, k) for v in range(6) for k in range(V)]  # each once
    np.testing.assert_allclose(sums / counts, ref, rtol=1e-6)


def test_video_eval_resume_by_view():
    kw = dict(clip_length=2, stride=2, crop_size=32, batch_size=5, train=False, num_clips=2,
              device="cpu")
    ref = [(b.video_index.tolist(), b.view.tolist(), b.clips.copy())
           for b in video_classification(LABELS, **kw)]
    f = video_classification(LABELS, **kw)
    it = iter(f)
    next(it)
    next(it)
    st = json.loads(json.dumps(f.state_dict()))
    it.close()
    g = video_classification(LABELS, **kw)
    g.load_state_dict(st)
    rest = [(b.video_index.tolist(), b.view.tolist(), b.clips) for b in g]
    assert len(rest) == len(ref) - 2
    for (v, k, c), (v2, k2, c2) in zip(rest, ref[2:]):
        assert v == v2 and k == k2
        np.testing.assert_array_equal(c, c2)


def test_video_train_extras_deterministic():
    kw = dict(clip_length=4, stride=2, crop_size=32, batch_size=3, seed=2, device="cpu",
              color_jitter=dict(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1),
              grayscale_p=0.5, temporal_jitter=1)
    a = [b.clips.copy() for b in video_classification(LABELS, **kw)]
    b2 = [b.clips.copy() for b in video_classification(LABELS, **kw)]
    plain = [b.clips.copy() for b in video_classification(
        LABELS, **{k: v for k, v in kw.items()
                   if k not in ("color_jitter", "grayscale_p", "temporal_jitter")})]
    for x, y in zip(a, b2):
        assert x.shape == (3, 4, 3, 32, 32) and np.isfinite(x).all()
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(a, plain))


def test_video_train_draws_are_made_once_per_batch(monkeypatch):
    """A training batch's draws (clip start, crop box, flip and the extras') come from one
    Philox pass on the producer (Task.ahead): the decoding threads make none."""
    import threading

    from avpipe.ops import random as R

    calls = []
    lanes, ints = R.philox_lanes, R._philox_ints

    def seen(f):
        def g(*a):
            calls.append(threading.current_thread().name)
            return f(*a)
        return g

    monkeypatch.setattr(R, "philox_lanes", seen(lanes))
    monkeypatch.setattr(R, "philox_lanes32", seen(R.philox_lanes32))
    monkeypatch.setattr(R, "_philox_ints", seen(ints))
    kw = dict(clip_length=4, stride=2, crop_size=32, batch_size=3, seed=2, device="cpu",
              color_jitter=dict(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1),
              grayscale_p=0.5, temporal_jitter=1)
    batches = list(video_classification(LABELS, **kw))
    assert batches and calls  # the producer drew
    assert not [n for n in calls if n.startswith("avpipe-feed_")], calls


def test_video_train_crop_matches_the_ops():
    # the recipe's crop + flip are image_augment's draws (keyed by seed, epoch, item id)
    from avpipe.decoding.video import VideoDecoder
    from avpipe.ops import image_augment as aug
    from avpipe.ops import random as R
    from avpipe.ops.image import resize_crop_normalize

    kw = dict(clip_length=2, stride=1, crop_size=32, batch_size=6, seed=4, device="cpu",
              shuffle=False)
    feed = video_classification(LABELS, **kw)
    (b,) = list(feed)
    for i, it in enumerate(feed.items):
        with VideoDecoder(it.path, device="cpu") as dec:
            n = len(dec)
            start = int(R.integers(4, "clip", 0, [i], high=max(1, n - 1))[0, 0])
            fr = dec.get_frames(np.minimum(start + np.arange(2), n - 1)).data
        p = aug.sample_resized_crop_params(4, 0, [i], fr.shape[1], fr.shape[2],
                                           scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3))
        t, le, h, w = (int(p[k][0]) for k in ("top", "left", "height", "width"))
        y = resize_crop_normalize(fr[:, t : t + h, le : le + w], short_side=None,
                                  size=(32, 32), crop_size=None, layout="NCHW")
        if aug.sample_flip_params(4, 0, [i])["flip"][0]:
            y = y[..., ::-1]
        np.testing.assert_array_equal(b.clips[i], y)


_JITTER = dict(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1)


@pytest.mark.parametrize("colour", [{}, {"color_jitter": _JITTER},
                                    {"color_jitter": _JITTER, "grayscale_p": 0.5}])  # fmt: skip
def test_video_train_deferred_clips_resized_in_the_collate(colour):
    """The collate's batched crop of deferred clips (the GPU's path for small clips, forced
    here on the CPU), colour jitter and grayscale included, gives the values of the per-clip
    transform: all clips deferred, and a mix of deferred and transformed ones in batch
    order."""
    from avpipe.recipes.video import _Deferred

    kw = dict(clip_length=4, stride=2, crop_size=40, batch_size=3, seed=9, device="cpu",
              **colour)  # fmt: skip
    ref = [b.clips for b in video_classification(LABELS, **kw)]
    feed = video_classification(LABELS, **kw)
    feed.task._defer = True
    seen = []
    resize = feed.task._resize_deferred

    def spy(values, ids, epoch):
        seen.append(sum(isinstance(v, _Deferred) for v in values))
        return resize(values, ids, epoch)

    feed.task._resize_deferred = spy
    got = [b.clips for b in feed]
    assert seen == [3, 3] and len(got) == len(ref)
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g, r)
    # a mix: clip 1 transformed on its thread, clips 0 and 2 deferred
    task = feed.task
    task.epoch = 0
    pairs = list(enumerate(feed.items[:3]))
    vals = task.decode_items(pairs)
    assert all(isinstance(v, _Deferred) for v in vals)
    assert all(v.draws is vals[0].draws is not None for v in vals)  # the batch's ahead table
    vals[1] = task._train_transform(vals[1].frames, 1, 0)
    out = task._resize_deferred(vals, [0, 1, 2], 0)
    want = [task._train_transform(v.frames, i, 0) if isinstance(v, _Deferred) else v
            for i, v in enumerate(vals)]  # fmt: skip
    assert isinstance(out, list) and not any(isinstance(v, _Deferred) for v in out)
    for o, w in zip(out, want):
        np.testing.assert_array_equal(o, w)
    feed.close()


def test_video_skip_bad_file(tmp_path):
    text = open(LABELS).read().splitlines()
    (tmp_path / "bad.mp4").write_bytes(b"\x00" * 1000)
    rows = [text[0]] + [f"{os.path.join(ROOT, 'video', r.split(',')[0])},{r.split(',')[1]}"
                        for r in text[1:]] + ["bad.mp4,circles"]
    (tmp_path / "l.csv").write_text("\n".join(rows) + "\n")
    feed = video_classification(tmp_path / "l.csv", clip_length=2, crop_size=32, batch_size=2,
                                device="cpu", seed=1)
    got = [b.paths for b in feed]
    assert len(got) == 4 and len({p for g in got for p in g}) == 6
    assert all(len(g) for g in got)  # training: filled with repeats, never empty
    assert [os.path.basename(p) for p, _ in feed.errors] == ["bad.mp4"]


# --- image --------------------------------------------------------------------------------


@pytest.fixture
def image_folder(tmp_path):
    src = os.path.join(ROOT, "images")
    for i, name in enumerate(sorted(os.listdir(src))):
        d = tmp_path / ("a" if i % 2 else "b")
        d.mkdir(exist_ok=True)
        shutil.copy(os.path.join(src, name), d / name)
    return tmp_path


def test_image_feed_train_and_eval(image_folder):
    f = image_classification(image_folder, batch_size=2, crop_size=32, resize_size=40,
                             device="cpu", seed=0)
    assert f.classes == ["a", "b"] and len(f) == 3
    ref = []
    for b in f:
        assert b.images.shape == (2, 3, 32, 32) and b.images.dtype == np.float16
        assert [f.classes[k] for k in b.labels.tolist()] == \
            [os.path.basename(os.path.dirname(p)) for p in b.paths]
        ref.append(b.images.copy())
    g = image_classification(image_folder, batch_size=2, crop_size=32, resize_size=40,
                             device="cpu", seed=0)
    it = iter(g)
    next(it)
    st = g.state_dict()
    it.close()
    h = image_classification(image_folder, batch_size=2, crop_size=32, resize_size=40,
                             device="cpu", seed=0)
    h.load_state_dict(st)
    for a, b in zip([b.images for b in h], ref[1:]):
        np.testing.assert_array_equal(a, b)
    e = image_classification(image_folder, batch_size=4, crop_size=32, resize_size=40,
                             device="cpu", train=False)
    assert [b.images.shape[0] for b in e] == [4, 2]


# --- faces --------------------------------------------------------------------------------


def test_torch_framework_and_dataloader_workers():
    torch = pytest.importorskip("torch")
    feed = rnnt_feed(MANIFEST, batch_size=1, seed=2, device="cpu", framework="torch")
    b = next(iter(feed))
    assert isinstance(b.features, torch.Tensor) and b.features.dtype == torch.float32
    assert isinstance(b.feature_lengths, torch.Tensor)
    ds = rnnt_feed(MANIFEST, batch_size=1, seed=2, device="cpu").torch_dataset()
    assert len(ds) == 6
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                     multiprocessing_context=CTX)
    paths = [p for b in dl for p in b.paths]
    assert len(paths) == len(set(paths)) == 6
    # the workers' round robin = the feed with 2x the ranks, in global batch order
    ref = [rnnt_feed(MANIFEST, batch_size=1, seed=2, device="cpu", rank=r, world_size=2)
           for r in range(2)]
    per = [[b.paths[0] for b in f] for f in ref]
    assert paths == [p for pair in zip(*per) for p in pair]


def test_jax_framework():
    pytest.importorskip("jax")
    feed = rnnt_feed(MANIFEST, batch_size=2, device="cpu", framework="jax")
    b = next(iter(feed))
    assert type(b.features).__module__.startswith("jax")


def test_stats_say_whether_input_bound():
    feed = rnnt_feed(MANIFEST, batch_size=2, device="cpu")
    for _ in feed:
        pass
    st = feed.stats()
    assert {"read", "decode", "gpu", "wait"} <= set(st)
    # 6 items read in the epoch (and maybe some of the next: the producer runs ahead)
    assert st["decode"]["n"] >= 1 and st["read"]["n"] >= 6 and st["gpu"]["p50"] is not None
    assert isinstance(st["input_bound"], bool) and "input" in st["verdict"]


def test_stats_verdict_follows_the_consumer():
    """A consumer slower than the feed reads as not input-bound; one that takes batches as fast
    as it can, on a feed whose decoding is slowed, as input-bound."""
    feed = rnnt_feed(MANIFEST, batch_size=1, device="cpu", shuffle=False)
    for _ in feed:
        time.sleep(0.3)
    st = feed.stats()
    assert st["input_bound"] is False and "not input-bound" in st["verdict"], st
    feed = rnnt_feed(MANIFEST, batch_size=1, device="cpu", shuffle=False)
    task = feed.task
    decode = task.decode_one

    def slow_decode(i, item):
        time.sleep(0.3)
        return decode(i, item)

    task.decode_one = slow_decode
    for _ in feed:
        pass
    st = feed.stats()
    assert st["input_bound"] is True and "input-bound" in st["verdict"], st
    assert "not input-bound" not in st["verdict"]


def test_avpipe_recipes_namespace():
    assert avpipe.recipes.rnnt_feed is rnnt_feed
    assert avpipe.pipeline.Feed is avpipe.pipeline.feed.Feed


def test_image_skip_bad_and_missing(image_folder):
    (image_folder / "a" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 64)
    (image_folder / "b" / "empty.png").write_bytes(b"")
    f = image_classification(image_folder, batch_size=3, crop_size=32, resize_size=40,
                             device="cpu", seed=4)
    got = [b.paths for b in f]
    assert len(got) == len(f) == 3
    assert [len(g) for g in got][:2] == [3, 3] and len({p for g in got for p in g}) == 6
    assert all(len(g) for g in got)  # training: filled with repeats, never empty
    assert sorted(os.path.basename(p) for p, _ in f.errors) == ["broken.jpg", "empty.png"]
    pairs = [(str(image_folder / "a" / "gone.jpg"), "a")] + \
        [(p, "b") for p in sorted(str(x) for x in (image_folder / "b").iterdir())]
    g = image_classification(pairs, batch_size=2, crop_size=32, device="cpu", train=False)
    assert sum(len(b.paths) for b in g) == len(pairs) - 2  # gone.jpg and empty.png
    assert any("gone.jpg" in p for p, _ in g.errors)


def test_torch_workers_state_resumes_in_a_plain_feed():
    torch = pytest.importorskip("torch")
    ds = rnnt_feed(MANIFEST, batch_size=1, seed=8, device="cpu").torch_dataset()
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                     multiprocessing_context=CTX)
    it = iter(dl)
    seen = [next(it).paths[0] for _ in range(2)]  # one full round of the 2 workers
    del it
    st = json.loads(json.dumps(ds.state_dict(batches_consumed=2, num_workers=2)))
    f = rnnt_feed(MANIFEST, batch_size=1, seed=8, device="cpu")
    f.load_state_dict(st)
    rest = [b.paths[0] for b in f]
    assert len(rest) == 4 and not set(rest) & set(seen)
    assert sorted(seen + rest) == sorted(os.path.join(ROOT, "speech", d["audio_filepath"])
                                         for d in _lines(MANIFEST))


def test_video_eval_skips_a_bad_video_view_by_view(tmp_path):
    text = open(LABELS).read().splitlines()
    (tmp_path / "bad.mp4").write_bytes(b"\x00" * 1000)
    rows = [text[0]] + [f"{os.path.join(ROOT, 'video', r.split(',')[0])},{r.split(',')[1]}"
                        for r in text[1:3]] + ["bad.mp4,circles"]
    (tmp_path / "l.csv").write_text("\n".join(rows) + "\n")
    feed = video_classification(tmp_path / "l.csv", clip_length=2, crop_size=32, batch_size=4,
                                device="cpu", train=False, num_clips=1, num_crops=3)
    got = [(b.video_index.tolist(), b.view.tolist()) for b in feed]
    pairs = [(v, k) for vi, ks in got for v, k in zip(vi, ks)]
    assert sorted(pairs) == [(v, k) for v in range(2) for k in range(3)]
    assert [os.path.basename(p) for p, _ in feed.errors] == ["bad.mp4"]  # once, not per view


def test_rnnt_collate_takes_the_loaders_batch_only_when_rows_are_its_rows():
    """The GPU collate uses the loader's padded batch as is only when the values are its rows
    0..B-1 in order (references); any other list (a refill, a dropped item, host arrays) is
    copied, and a reference slices to its row."""
    from avpipe.recipes.rnnt import LoaderRow, _rows_of_one_batch

    batch = np.arange(150, dtype=np.float32).reshape(3, 50)
    rows = [LoaderRow(batch, r, n) for r, n in enumerate((50, 20, 7))]
    assert _rows_of_one_batch(rows) is batch
    assert [v.shape for v in rows] == [(50,), (20,), (7,)]
    np.testing.assert_array_equal(rows[2].array(), batch[2, :7])
    assert _rows_of_one_batch(rows[:2]) is None  # not every row
    assert _rows_of_one_batch([rows[1], rows[0], rows[2]]) is None  # out of order
    other = batch.copy()
    assert _rows_of_one_batch(rows[:2] + [LoaderRow(other, 2, 7)]) is None  # a refill
    assert _rows_of_one_batch(rows[:2] + [batch[2, :7]]) is None  # an array among them
    assert _rows_of_one_batch([np.zeros(3)] * 3) is None  # host arrays: always copied
    assert _rows_of_one_batch([]) is None


@pytest.mark.parametrize("training", [False, True])
def test_rnnt_collate_of_loader_rows_equals_collate_of_arrays(training):
    """The loader's row references collate to the batch its rows' arrays give: whole (the
    loader's padded batch taken as is) and mixed with a refilled array (each row sliced)."""
    from avpipe.device import Device
    from avpipe.pipeline.sources import Item
    from avpipe.recipes.rnnt import LoaderRow, RnntTask

    rng = np.random.default_rng(0)
    lens = [16000, 9000, 12345]
    batch = np.zeros((3, 16000), np.float32)
    for r, n in enumerate(lens):
        batch[r, :n] = 0.1 * rng.standard_normal(n)
    task = RnntTask(preset="nemo", training=training, sample_rate=16000, seed=3,
                    device=Device("cpu"), speed_perturb=(0.9, 1.1) if training else None,
                    spec_augment={} if training else None)
    pairs = [(i, Item(path=f"/d/u{i}.flac", raw_path=f"u{i}.flac")) for i in range(3)]
    refs = [LoaderRow(batch, r, n) for r, n in enumerate(lens)]
    arrays = [batch[r, :n].copy() for r, n in enumerate(lens)]
    mixed = refs[:2] + [arrays[2]]
    want = task.collate(arrays, pairs, 1, 0)
    for values in (refs, mixed):
        got = task.collate(values, pairs, 1, 0)
        np.testing.assert_array_equal(got["feature_lengths"], want["feature_lengths"])
        np.testing.assert_allclose(got["features"], want["features"], rtol=0, atol=1e-6)


def test_video_training_draws_of_several_batches_at_once_are_each_batchs_own():
    """``drawn_in_groups`` hands the groups on unchanged and draws DRAW_GROUPS batches' words
    in one pass; ``ahead`` then hands each batch the words a pass of its own draws (and once
    only: a batch seen again, a replacement, draws anew), also across an epoch's change."""
    from avpipe.device import resolve_device
    from avpipe.ops import random as R
    from avpipe.recipes.video import VideoTask

    task = VideoTask(labels=[0], clip_length=4, stride=1, crop_size=32, train=True, seed=3,
                     device=resolve_device("cpu"), color_jitter=dict(brightness=0.4))  # fmt: skip
    task.DRAW_GROUPS = 3
    groups = [[(i, None) for i in range(k * 4, k * 4 + 4)] for k in range(7)]
    calls = []
    real = R.draw_ahead_groups

    def counted(*a, **k):
        calls.append(len(a[2]))
        return real(*a, **k)

    R.draw_ahead_groups, seen, got = counted, [], []
    try:
        for e in (1, 2):
            task.epoch = e
            for g in task.drawn_in_groups(iter(groups)):
                seen.append(g)
                got.append((e, g, task.ahead(g)))
    finally:
        R.draw_ahead_groups = real
    assert seen == groups * 2
    assert calls == [3, 3, 1, 3, 3, 1]  # a pass every 3 batches, none by ahead itself
    assert getattr(task._made, "tables", {}) == {}  # each handed out once
    for e, g, table in got:
        want = R.draw_ahead(3, e, [i for i, _ in g], task._ahead_requests())
        assert table.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(table[k][1], want[k][1])
    task.epoch = 2
    real_calls = len(calls)
    R.draw_ahead_groups = counted
    try:
        task.ahead(groups[0])  # seen again: drawn anew
    finally:
        R.draw_ahead_groups = real
    assert len(calls) == real_calls + 1


def test_video_decode_groups_hands_every_batch_its_pre_drawn_table(monkeypatch):
    """Through ``decode_groups``, with the scan ahead on (its lookahead pulls groups ahead of
    the draws), every training batch gets the table drawn with its chunk: one pass per
    DRAW_GROUPS batches, none of its own."""
    from avpipe.device import resolve_device
    from avpipe.ops import random as R
    from avpipe.recipes.video import VideoTask

    task = VideoTask(labels=[0], clip_length=4, stride=1, crop_size=32, train=True, seed=1,
                     device=resolve_device("cpu"))  # fmt: skip
    task._scan_ahead = type("Ahead", (), {"active": True, "submit": lambda self, paths: list(paths),
                                          "close": lambda self: None})()  # fmt: skip
    calls = []
    real = R.draw_ahead_groups
    monkeypatch.setattr(R, "draw_ahead_groups", lambda *a: calls.append(len(a[2])) or real(*a))
    def submit(self, pairs):  # the table each batch's decoding would get, as its values
        table = self.ahead(pairs)
        return lambda: [table] * len(pairs)

    monkeypatch.setattr(VideoTask, "submit", submit)
    item = type("It", (), {"path": "x.mp4", "locator": None})()
    groups = [[(k * 2 + j, item) for j in range(2)] for k in range(20)]
    task.epoch = 4
    out = list(task.decode_groups(iter(groups)))
    assert len(out) == 20 and calls == [8, 8, 4]  # a pass a chunk, no batch drawn alone
    monkeypatch.setattr(R, "draw_ahead_groups", real)
    for g, vals in zip(groups, out):
        want = R.draw_ahead(1, 4, [i for i, _ in g], task._ahead_requests())
        for k in want:
            np.testing.assert_array_equal(vals[0][k][1], want[k][1])


def test_evaluation_feeds_give_every_item_once_across_ranks():
    """Evaluation (training=False) never repeats an utterance across ranks; training does where
    there are fewer left than ranks (the usual DistributedSampler padding)."""
    for training, once in ((False, True), (True, False)):
        feeds = [rnnt_feed(MANIFEST, batch_size=1, shuffle=False, device="cpu", rank=r,
                           world_size=4, training=training) for r in range(4)]
        paths = [p for f in feeds for b in f for p in b.paths]
        n = len(_lines(MANIFEST))
        assert len(set(paths)) == n and (len(paths) == n) == once, (training, len(paths), n)


@pytest.mark.parametrize("train", [True, False])
def test_video_layout_cthw_is_the_default_clips_transposed(train):
    """layout="CTHW": clips [B, 3, T, S, S] (torchvision's / PyTorchVideo's video models),
    the same values as the default [B, T, 3, S, S] transposed."""
    kw = dict(clip_length=3, crop_size=32, batch_size=2, device="cpu", seed=4, train=train,
              num_clips=1, num_crops=1)
    ref = [b.clips for b in video_classification(LABELS, **kw)]
    got = [b.clips for b in video_classification(LABELS, layout="CTHW", **kw)]
    assert len(got) == len(ref) and all(r.shape[1:] == (3, 3, 32, 32) for r in ref)
    for g, r in zip(got, ref):
        assert g.shape == (r.shape[0], 3, 3, 32, 32) and g.flags.c_contiguous
        np.testing.assert_array_equal(g, r.transpose(0, 2, 1, 3, 4))
    with pytest.raises(ValueError, match=r"layout must be one of 'TCHW', 'CTHW', got 'NCHW'"):
        video_classification(LABELS, layout="NCHW", device="cpu")


def test_video_layout_of_an_array_module_batch_and_an_empty_batch():
    """clips_in_layout is what the collate runs on the CPU and (cupy) on a GPU: written
    against the array module; an empty batch keeps its axes."""
    from avpipe.recipes.video import VideoTask, clips_in_layout

    x = np.arange(2 * 4 * 3 * 5 * 5, dtype=np.float32).reshape(2, 4, 3, 5, 5)
    assert clips_in_layout(x, "TCHW") is x
    y = clips_in_layout(x, "CTHW")
    assert y.shape == (2, 3, 4, 5, 5) and y.flags.c_contiguous and y[1, 2, 3, 4, 0] == \
        x[1, 3, 2, 4, 0]
    with pytest.raises(ValueError, match="layout"):
        clips_in_layout(x, "THWC")
    task = VideoTask(labels=[0], clip_length=4, stride=1, crop_size=8, train=True, seed=0,
                     device=avpipe.device.resolve_device("cpu"), layout="CTHW")
    assert task.collate([], [], 0, 0)["clips"].shape == (0, 3, 4, 8, 8)
