"""The README's feed examples, run exactly as written (from the repository root, on samples/)."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RNNT = '''
import avpipe

feed = avpipe.recipes.rnnt_feed("samples/speech/manifest.jsonl", batch_size=4, seed=0)
print(len(feed), "batches per epoch")          # 2 (6 utterances)
for batch in feed:                              # one epoch, a new shuffle each epoch
    print(batch.features.shape, batch.feature_lengths.tolist(), batch.transcripts[0][:24])
state = feed.state_dict()                       # JSON: resume exactly with load_state_dict
print(feed.stats()["verdict"])
'''

RNNT_BUCKETS = '''
import avpipe

feed = avpipe.recipes.rnnt_feed("samples/speech/manifest.jsonl", max_duration=9.0,
                                seed=0, rank=0, world_size=2)
for batch in feed:                              # <= 9 s of padded audio a batch, rank 0 of 2
    print(len(batch.paths), batch.features.shape)
print(feed.errors)                              # [(path, message)] of skipped items
'''

VIDEO = '''
import avpipe

feed = avpipe.recipes.video_classification("samples/video/labels.csv", clip_length=8,
                                           stride=2, crop_size=112, batch_size=2, seed=0)
print(feed.classes)                             # ['circles', 'squares']
for batch in feed:
    print(batch.clips.shape, batch.clips.dtype, [feed.classes[i] for i in batch.labels.tolist()])
'''

IMAGE = '''
import glob
import avpipe

files = sorted(glob.glob("samples/images/scene.*"))
pairs = [(p, p.rsplit(".", 1)[1]) for p in files]  # (path, label); or a folder of classes / CSV
feed = avpipe.recipes.image_classification(pairs, batch_size=2, crop_size=128)
for batch in feed:
    print(batch.images.shape, batch.labels.tolist())
'''

TORCH = '''
import torch
import avpipe

feed = avpipe.recipes.rnnt_feed("samples/speech/manifest.jsonl", batch_size=2, device="cpu")
loader = torch.utils.data.DataLoader(feed.torch_dataset(), batch_size=None, num_workers=2,
                                     multiprocessing_context="forkserver")
for batch in loader:                            # the workers split the epoch's order
    print(type(batch.features).__name__, tuple(batch.features.shape))
'''

EXAMPLES = {"rnnt": RNNT, "rnnt_buckets": RNNT_BUCKETS, "video": VIDEO, "image": IMAGE,
            "torch": TORCH}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_readme_example_runs(name, monkeypatch, capsys):
    if name == "torch":
        pytest.importorskip("torch")
    monkeypatch.chdir(ROOT)
    exec(compile(EXAMPLES[name], f"<README {name}>", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    assert out.strip()
    if name == "rnnt":
        assert out.startswith("2 batches per epoch")
    if name == "video":
        assert "['circles', 'squares']" in out and "(2, 8, 3, 112, 112)" in out
