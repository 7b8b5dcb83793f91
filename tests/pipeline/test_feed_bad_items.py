"""Bad items at the end of an epoch and errors across processes: a training feed never yields
an empty batch (its short batches are filled with repeats) and keeps len(feed) on every rank;
an evaluation feed accounts for every item exactly once (in a batch or in feed.errors);
feed.errors lists each (path, message) once per feed; batches carry their errors, which reach
the main process's feed.errors from torch DataLoader workers."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from paths import SAMPLES

from avpipe.recipes import rnnt_feed, video_classification

ROOT = SAMPLES
MANIFEST = os.path.join(ROOT, "speech", "manifest.jsonl")
LABELS = os.path.join(ROOT, "video", "labels.csv")
CTX = "forkserver"


def _manifest(tmp_path, n=100, missing=10):
    """``n`` lines, ``missing`` of them (spread out) naming files that do not exist."""
    src = [json.loads(x) for x in open(MANIFEST) if x.strip()]
    gone = set(range(3, n, n // missing)) if missing else set()
    lines = []
    for i in range(n):
        if i in gone:
            lines.append({"audio_filepath": f"missing{i:03d}.wav", "duration": 0.5,
                          "text": "gone"})
        else:
            d = src[i % len(src)]
            lines.append({"audio_filepath": os.path.join(ROOT, "speech", d["audio_filepath"]),
                          "duration": 0.5, "text": f"{i}"})
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps(d) + "\n" for d in lines))
    return p, len(gone)


def test_rnnt_training_feed_with_missing_files_never_yields_an_empty_batch(tmp_path):
    """The issue's case: 100 lines, 10 missing, batch_size=8, training: the batch sizes were
    [8] * 11 + [2, 0] and a training loop died on the (0, 80, 0) batch."""
    m, bad = _manifest(tmp_path)
    assert bad == 10
    feed = rnnt_feed(m, batch_size=8, training=True, device="cpu", seed=3)
    for _ in range(2):  # two epochs
        got = list(feed)
        sizes = [len(b.transcripts) for b in got]
        assert sizes == [8] * 12 + [4] and len(got) == len(feed) == 13
        assert all(b.features.shape[0] == len(b.transcripts) > 0 for b in got)
        assert len({t for b in got for t in b.transcripts}) == 90  # every good item
        assert sum(len(b.errors) for b in got) >= 10  # each batch names its skipped items
    # feed.errors: each missing file once, not once per epoch
    assert sorted(os.path.basename(p) for p, _ in feed.errors) == sorted(
        f"missing{i:03d}.wav" for i in range(3, 100, 10))
    # two ranks: the same number of batches each, none empty
    ranks = [rnnt_feed(m, batch_size=8, training=True, device="cpu", seed=3, rank=r,
                       world_size=2) for r in range(2)]
    got = [[len(b.transcripts) for b in f] for f in ranks]
    assert len(got[0]) == len(got[1]) == len(ranks[0]) and min(min(g) for g in got) > 0


def test_rnnt_training_resume_inside_the_repeats_is_exact(tmp_path):
    m, _ = _manifest(tmp_path, n=30, missing=6)
    full = [b.transcripts for b in rnnt_feed(m, batch_size=8, device="cpu", seed=1)]
    for k in range(len(full) + 1):
        f = rnnt_feed(m, batch_size=8, device="cpu", seed=1)
        it = iter(f)
        head = [next(it).transcripts for _ in range(k)]
        st = json.loads(json.dumps(f.state_dict()))
        it.close()
        g = rnnt_feed(m, batch_size=8, device="cpu", seed=1)
        g.load_state_dict(st)
        assert head + [b.transcripts for b in g] == full, k


def _video_list(tmp_path, bad_rows):
    text = open(LABELS).read().splitlines()
    good = [r.split(",") for r in text[1:3]]
    rows = ["path,label"]
    for k in range(6):
        if k in bad_rows:
            (tmp_path / f"bad{k}.mp4").write_bytes(b"\x00" * 500)
            rows.append(f"bad{k}.mp4,circles")
        else:
            p, lab = good[k % 2]
            rows.append(f"{os.path.join(ROOT, 'video', p)},{lab}")
    p = tmp_path / "l.csv"
    p.write_text("\n".join(rows) + "\n")
    return p


def test_video_eval_feed_with_bad_rows_accounts_for_every_view_once(tmp_path):
    """The issue's case: 4 bad rows in 6, train=False: 36 batches, 24 of them empty, each bad
    file listed 12 times in feed.errors. Every good view comes exactly once; each bad file is
    listed once; the empty batches (len(feed) is fixed before decoding: 36 batches for the 72
    views) come last and are well-formed."""
    lst = _video_list(tmp_path, bad_rows={1, 2, 4, 5})
    feed = video_classification(lst, clip_length=2, crop_size=32, batch_size=2, train=False,
                                device="cpu")
    got = list(feed)
    assert len(got) == len(feed) == 36
    views = [(v, k) for b in got for v, k in zip(b.video_index.tolist(), b.view.tolist())]
    assert sorted(views) == [(v, k) for v in (0, 3) for k in range(12)]  # each once
    assert sorted(os.path.basename(p) for p, _ in feed.errors) == [
        "bad1.mp4", "bad2.mp4", "bad4.mp4", "bad5.mp4"]
    sizes = [len(b.paths) for b in got]
    assert sizes == [2] * 12 + [0] * 24  # the good views first, the empty batches last
    e = got[-1]
    assert e.clips.shape == (0, 2, 3, 32, 32) and e.clips.dtype == np.float16
    assert e.labels.shape == e.video_index.shape == e.view.shape == (0,)
    assert e.paths == [] and e.ids.shape == (0,)
    # the same list for training: no empty batch
    train = video_classification(lst, clip_length=2, crop_size=32, batch_size=2, device="cpu")
    got = [len(b.paths) for b in train]
    assert len(got) == len(train) == 3 and min(got) == 2
    assert len(train.errors) == 4


def test_errors_reach_the_main_process_from_dataloader_workers(tmp_path):
    """feed.torch_dataset(num_workers=2) as the README shows: the skipped items were reported
    in the workers' copies only; the main process's feed.errors stayed empty."""
    torch = pytest.importorskip("torch")
    m, _ = _manifest(tmp_path, n=12, missing=3)
    missing = sorted(f"missing{i:03d}.wav" for i in range(3, 12, 4))
    feed = rnnt_feed(m, batch_size=2, training=False, device="cpu", seed=2)
    dl = torch.utils.data.DataLoader(feed.torch_dataset(num_workers=2), batch_size=None,
                                     num_workers=2, multiprocessing_context=CTX)
    seen = []
    for b in dl:
        seen += [os.path.basename(p) for p, _ in b.errors]
    assert sorted(seen) == missing  # the batches carry them
    assert sorted(os.path.basename(p) for p, _ in feed.errors) == missing  # and the feed
    n = len(feed.errors)
    list(dl)  # another epoch: nothing new
    assert len(feed.errors) == n
    del dl
    # no workers: the dataset's replica in this process reports to the feed as well
    feed = rnnt_feed(m, batch_size=2, training=False, device="cpu", seed=2)
    dl = torch.utils.data.DataLoader(feed.torch_dataset(), batch_size=None, num_workers=0)
    list(dl)
    assert sorted(os.path.basename(p) for p, _ in feed.errors) == missing
