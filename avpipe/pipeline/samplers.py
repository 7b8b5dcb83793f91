"""Seeded frame and clip samplers over a :class:`~avpipe.decoding.video.VideoDecoder`.

Every sampler computes its indices first (numpy, seeded), then makes one request to the
decoder, which sorts, deduplicates and decodes each needed GOP once. Results carry the frames
plus their indices and pts.

* :func:`sample_uniform` — N frames spread evenly over the video (:func:`uniform_indices`: the
  centres of N equal segments, the one uniform rule in avpipe; ``avpipe extract`` uses it too).
* :func:`sample_random_clips` — clips of T frames with a stride at random starts.
* :func:`sample_regular_clips` — clips starting at regular intervals
  (:func:`clip_indices_regular`; every clip's frames laid out by :func:`clip_indices_at`).
* :func:`sample_clips_at` — clips starting at given times (seconds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._results import BatchResult
from .._validate import check_choice, pos_int

__all__ = [
    "Clips",
    "uniform_indices",
    "sample_uniform",
    "sample_random_clips",
    "sample_regular_clips",
    "sample_clips_at",
    "clip_indices_random",
    "clip_indices_regular",
    "clip_indices_at",
]


@dataclass(frozen=True)
class Clips(BatchResult):
    """``data`` [num_clips, T, ...frame shape] on the decoder's device; ``indices`` and
    ``pts_seconds`` [num_clips, T] numpy; ``errors`` always empty (a bad frame raises)."""

    data: Any
    indices: np.ndarray
    pts_seconds: np.ndarray
    errors: tuple = ()
    device: str = "cpu"

    def __len__(self) -> int:
        return int(self.indices.shape[0])


def _rng(seed):
    if isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(seed)


def _span(clip_length, stride):
    return (clip_length - 1) * stride + 1


def clip_indices_random(
    num_frames: int, *, num_clips: int = 1, clip_length: int = 16, stride: int = 1, seed=None
) -> np.ndarray:
    """[num_clips, clip_length] indices of clips at random starts (uniform over all valid
    starts). A video shorter than one clip raises ValueError."""
    num_clips, clip_length, stride = (
        pos_int("num_clips", num_clips),
        pos_int("clip_length", clip_length),
        pos_int("stride", stride),
    )
    span = _span(clip_length, stride)
    if span > num_frames:
        raise ValueError(
            f"clip_length={clip_length} with stride={stride} spans {span} frames, "
            f"more than the video's {num_frames}"
        )
    starts = _rng(seed).integers(0, num_frames - span + 1, size=num_clips)
    return clip_indices_at(num_frames, starts, clip_length=clip_length, stride=stride)


def clip_indices_at(num_frames: int, starts, *, clip_length: int = 16, stride: int = 1) -> np.ndarray:
    """``[..., clip_length]`` indices of clips starting at frame(s) ``starts``, ``stride``
    apart; an index past the last frame is the last frame (a clip longer than the video
    repeats its last frame). The one clip-layout rule: the samplers, the video recipe and
    ``avpipe extract`` build clips with it."""
    clip_length, stride = pos_int("clip_length", clip_length), pos_int("stride", stride)
    idx = np.asarray(starts, np.int64)[..., None] + np.arange(clip_length, dtype=np.int64) * stride
    return np.minimum(idx, max(int(num_frames) - 1, 0))


def clip_indices_regular(
    num_frames: int,
    *,
    clip_length: int = 16,
    stride: int = 1,
    num_clips: int | None = None,
    interval: int | None = None,
    short_video: str = "raise",
) -> np.ndarray:
    """Clips starting every ``interval`` frames, or ``num_clips`` clips spread evenly from the
    first frame to the last start that fits (exactly one of the two). A video shorter than one
    clip raises ValueError with ``short_video="raise"``; with ``"repeat_last"`` each clip
    starts at frame 0 and repeats the last frame (:func:`clip_indices_at`)."""
    clip_length, stride = pos_int("clip_length", clip_length), pos_int("stride", stride)
    check_choice("short_video", short_video, ("raise", "repeat_last"))
    span = _span(clip_length, stride)
    if span > num_frames and short_video == "raise":
        raise ValueError(
            f"clip_length={clip_length} with stride={stride} spans {span} frames, "
            f"more than the video's {num_frames}"
        )
    if (num_clips is None) == (interval is None):
        raise ValueError(
            f"give exactly one of num_clips and interval, got {num_clips!r} and {interval!r}"
        )
    last = max(num_frames - span, 0)
    if interval is not None:
        starts = np.arange(0, last + 1, pos_int("interval", interval))
    else:
        starts = np.round(np.linspace(0, last, pos_int("num_clips", num_clips))).astype(np.int64)
    return clip_indices_at(num_frames, starts, clip_length=clip_length, stride=stride)


def uniform_indices(num_frames: int, count: int) -> np.ndarray:
    """``count`` frame indices at the centres of ``count`` equal segments of ``num_frames``
    frames (repeats when the video has fewer than ``count`` frames)."""
    num_frames, count = pos_int("num_frames", num_frames), pos_int("count", count)
    idx = np.floor((np.arange(count) + 0.5) * num_frames / count).astype(np.int64)
    return np.clip(idx, 0, num_frames - 1)


def _clips(decoder, idx: np.ndarray) -> Clips:
    c, t = idx.shape
    batch = decoder.get_frames(idx.reshape(-1))
    data = batch.data.reshape(c, t, *batch.data.shape[1:])
    return Clips(
        data=data, indices=batch.indices.reshape(c, t), pts_seconds=batch.pts_seconds.reshape(c, t),
        device=batch.device,
    )


def sample_uniform(decoder, num_frames: int):
    """``num_frames`` frames spread evenly over the video (a FrameBatch): the centres of
    ``num_frames`` equal segments (:func:`uniform_indices`)."""
    return decoder.get_frames(uniform_indices(decoder.metadata.num_frames, num_frames))


def sample_random_clips(
    decoder, *, num_clips: int = 1, clip_length: int = 16, stride: int = 1, seed=None
) -> Clips:
    """Clips of ``clip_length`` frames, ``stride`` apart, at seeded random starts."""
    idx = clip_indices_random(
        decoder.metadata.num_frames,
        num_clips=num_clips,
        clip_length=clip_length,
        stride=stride,
        seed=seed,
    )
    return _clips(decoder, idx)


def sample_regular_clips(
    decoder,
    *,
    clip_length: int = 16,
    stride: int = 1,
    num_clips: int | None = None,
    interval: int | None = None,
) -> Clips:
    """Clips at regular intervals (``interval`` frames apart, or ``num_clips`` evenly)."""
    idx = clip_indices_regular(
        decoder.metadata.num_frames,
        clip_length=clip_length,
        stride=stride,
        num_clips=num_clips,
        interval=interval,
    )
    return _clips(decoder, idx)


def sample_clips_at(decoder, seconds, *, clip_length: int = 16, stride: int = 1) -> Clips:
    """One clip per start time: its first frame is the frame shown at t, then ``stride``
    frames apart. A clip running past the last frame raises ValueError."""
    clip_length, stride = pos_int("clip_length", clip_length), pos_int("stride", stride)
    starts = np.asarray(decoder.index_at(np.asarray(seconds, dtype=np.float64).reshape(-1)))
    idx = starts[:, None] + np.arange(clip_length)[None, :] * stride
    n = decoder.metadata.num_frames
    if idx.size and idx.max() >= n:
        raise ValueError(
            f"a clip starting at seconds={np.asarray(seconds).tolist()} runs past the last "
            f"frame ({n} frames)"
        )
    return _clips(decoder, idx)
