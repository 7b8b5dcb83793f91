"""Every batch API returns one family of results: errors are ``(index, DecodeError)``."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from paths import REPO

import avpipe
from avpipe._results import BatchResult
from avpipe.pipeline import samplers

SAMPLES = pathlib.Path(REPO) / "samples"


def test_frame_batches_and_clips_are_batch_results():
    path = str(SAMPLES / "video" / "circles_h264.mp4")
    with avpipe.VideoDecoder(path, device="cpu") as dec:
        fb = dec.get_frames([0, 1])
        clips = samplers.sample_random_clips(dec, clip_length=2, seed=0)
    for r in (fb, clips):
        assert isinstance(r, BatchResult) and r.ok and r.errors == () and r.device == "cpu"
        r.raise_first()


def test_audio_batches_are_batch_results(tmp_path):
    sf = pytest.importorskip("soundfile")
    from avpipe.pipeline.audio_loader import AudioBatch, AudioBatchLoader

    good = tmp_path / "a.wav"
    sf.write(good, np.zeros(100, np.float32), 16000, subtype="PCM_16")
    empty = tmp_path / "b.wav"
    empty.write_bytes(b"")
    with AudioBatchLoader([good, empty], batch_size=2, num_workers=1, device="cpu") as L:
        (b,) = list(L.batches())
    assert isinstance(b, AudioBatch) and isinstance(b, BatchResult) and not b.ok
    x, lengths, paths, errors = b
    assert b[1] is lengths and lengths.tolist() == [100, 0]
    (i, e), = errors
    assert i == 1 and isinstance(e, avpipe.DecodeError) and e.source == str(empty)
    with pytest.raises(avpipe.DecodeError):
        b.raise_first()
