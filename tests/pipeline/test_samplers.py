"""The frame-index rules (avpipe.pipeline.samplers), which the video recipe and extraction use."""

from __future__ import annotations

import numpy as np
import pytest
from paths import SAMPLES

from avpipe._validate import nonneg_float, nonneg_int, pos_float, pos_int
from avpipe.pipeline.samplers import (
    clip_indices_at,
    clip_indices_random,
    clip_indices_regular,
    uniform_indices,
)


def test_clip_indices_at_lays_out_strided_frames_and_repeats_the_last():
    np.testing.assert_array_equal(clip_indices_at(100, 5, clip_length=4, stride=3), [5, 8, 11, 14])
    np.testing.assert_array_equal(clip_indices_at(10, 3, clip_length=4, stride=3), [3, 6, 9, 9])
    got = clip_indices_at(10, [0, 8], clip_length=3, stride=2)
    np.testing.assert_array_equal(got, [[0, 2, 4], [8, 9, 9]])


def test_regular_clips_span_the_video_first_to_last_start():
    idx = clip_indices_regular(100, clip_length=4, stride=4, num_clips=3)
    span = 3 * 4 + 1
    assert idx.shape == (3, 4)
    assert idx[0, 0] == 0 and idx[-1, 0] == 100 - span and idx[-1, -1] == 99
    np.testing.assert_array_equal(np.diff(idx, axis=1), 4)
    every = clip_indices_regular(100, clip_length=4, stride=4, interval=30)
    np.testing.assert_array_equal(every[:, 0], [0, 30, 60])


def test_short_video_raises_or_repeats_its_last_frame():
    with pytest.raises(ValueError, match="spans 13 frames, more than the video's 10"):
        clip_indices_regular(10, clip_length=4, stride=4, num_clips=2)
    got = clip_indices_regular(10, clip_length=4, stride=4, num_clips=2, short_video="repeat_last")
    np.testing.assert_array_equal(got, [[0, 4, 8, 9], [0, 4, 8, 9]])
    with pytest.raises(ValueError, match="short_video must be one of 'raise', 'repeat_last', "
                                         "got 'pad'"):  # fmt: skip
        clip_indices_regular(10, clip_length=4, num_clips=2, short_video="pad")
    with pytest.raises(ValueError, match="exactly one of num_clips and interval"):
        clip_indices_regular(100, clip_length=4)


def test_random_clips_fit_the_video_and_follow_the_seed():
    a = clip_indices_random(50, num_clips=200, clip_length=4, stride=5, seed=3)
    assert a.min() >= 0 and a.max() <= 49 and (a[:, 0] == 0).any() and (a[:, 0] == 34).any()
    np.testing.assert_array_equal(a, clip_indices_random(50, num_clips=200, clip_length=4,
                                                         stride=5, seed=3))  # fmt: skip


def test_uniform_indices_are_segment_centres():
    np.testing.assert_array_equal(uniform_indices(100, 4), [12, 37, 62, 87])
    np.testing.assert_array_equal(uniform_indices(2, 4), [0, 0, 1, 1])


def test_video_recipe_eval_clips_are_the_regular_rule():
    from avpipe.device import resolve_device
    from avpipe.recipes.video import VideoTask

    task = VideoTask(labels=[0], clip_length=8, stride=2, crop_size=32, train=False, seed=0,
                     device=resolve_device("cpu"), num_clips=4)  # fmt: skip
    for n in (300, 15, 1):
        want = clip_indices_regular(n, clip_length=8, stride=2, num_clips=4,
                                    short_video="repeat_last")  # fmt: skip
        np.testing.assert_array_equal(task._eval_indices(n, [0, 1, 2, 3]), want)
        np.testing.assert_array_equal(task._eval_indices(n, [2]), want[[2]])
    for epoch in range(3):  # a train clip fits the video, stride apart
        idx = task._train_indices(40, 0, epoch)
        assert idx.shape == (8,) and idx.min() >= 0 and idx.max() <= 39
        np.testing.assert_array_equal(np.diff(idx), 2)


@pytest.mark.parametrize("check, bad, message", [
    (pos_int, 2.5, "n must be a positive int, got 2.5"),
    (pos_int, "2", "n must be a positive int, got '2'"),
    (pos_int, True, "n must be a positive int, got True"),
    (pos_float, 0, "n must be a positive number, got 0"),
    (pos_float, float("nan"), "n must be a positive number, got nan"),
    (nonneg_int, -1, "n must be a non-negative int, got -1"),
    (nonneg_float, float("inf"), "n must be a non-negative number, got inf"),
])  # fmt: skip
def test_validators_name_the_parameter_and_value(check, bad, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(") + "$"):
        check("n", bad)


def test_feed_batch_size_must_be_an_int():
    import os

    from avpipe.recipes import rnnt_feed

    manifest = os.path.join(SAMPLES, "speech", "manifest.jsonl")
    for bad in (2.5, "2", 0):
        with pytest.raises(ValueError, match=f"batch_size must be a positive int, got {bad!r}"):
            rnnt_feed(manifest, batch_size=bad, device="cpu")
