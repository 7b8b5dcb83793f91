"""The reliability fuzz suite, reduced: a seeded corpus of damaged files (32 cases per format
family) through every CPU decoder in replaceable worker processes, plus bad-then-good sequences,
``avpipe extract`` over the damaged folder and the training feeds (``rnnt_feed``,
``video_classification``, ``image_classification``) over lists of damaged and clean files.
Nothing may hang, crash, raise an untyped error, or make a good file fail after bad ones; a feed
puts every item in a batch or in ``feed.errors``. The full run is ``python -m tests.fuzz.run``."""

from __future__ import annotations

import os
import sys

import pytest
from paths import REPO, TESTS

sys.path.insert(0, TESTS)

from fuzz import corpus, harness  # noqa: E402
from fuzz.run import sequences  # noqa: E402

PER_FORMAT = 32


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz") / "corpus"
    corpus.generate(root, per_format=PER_FORMAT, seed=11)
    return root, corpus.load(root)


def _check(records):
    bad = harness.failures(records)
    assert not bad, "\n".join(
        f"{r['backend']} {r['id']} {r['damage']} {r['detail']}: {r['outcome']}: "
        f"{r.get('error', '')[:300]}" for r in bad[:20]
    ) + "\n" + harness.table(records) + "\n" + (bad[0].get("traceback") or "") if bad else ""


def test_corpus_is_seeded_and_complete(tmp_path):
    a = corpus.generate(tmp_path / "a", per_format=14, seed=3, families=["wav", "png"])
    b = corpus.generate(tmp_path / "b", per_format=14, seed=3, families=["wav", "png"])
    assert [c["damage"] for c in a] == [c["damage"] for c in b]
    for x, y in zip(a, b):
        with open(x["path"], "rb") as f, open(y["path"], "rb") as g:
            assert f.read() == g.read()
    dmg = {c["damage"] for c in a if c["family"] == "wav"}
    assert {"clean", "truncate", "flip_header", "flip_payload", "zero_length", "header_only",
            "wrong_extension", "zero_frames", "absurd", "header_lies"} <= dmg  # fmt: skip


def test_fuzz_cpu_backends(small_corpus, tmp_path):
    root, info = small_corpus
    cases, seeds = info["cases"], info["seeds"]
    assert all(sum(c["family"] == f for c in cases) >= 30 for f in corpus.FAMILIES)
    units = harness.make_units(cases, harness.CPU_BACKENDS, seeds,
                               sequences=sequences(cases, seeds, gpu=False))  # fmt: skip
    records = harness.run_units(units, workers=os.cpu_count(), case_timeout=60,
                                log_dir=str(tmp_path), progress=False)  # fmt: skip
    _check(records)
    for be, kind in harness.CPU_BACKENDS.items():  # every case ran through every backend
        ran = {r["id"] for r in records if r["backend"] == be}
        assert {c["id"] for c in cases if c["kind"] == kind} <= ran
    goods = [r for r in records if r["damage"] == "good_after_bad"]
    assert goods and all(r["outcome"] == "decoded" for r in goods)
    # damage is reported, not silent: WAV files cut short decode with a damage flag
    cut = [r for r in records if r["backend"] == "audio_cpu" and r["family"] == "wav"
           and r["damage"] == "truncate_tail"]  # fmt: skip
    assert cut and all(r["outcome"] in ("decoded_damaged", "typed_error") for r in cut)
    # audio header totals that lie are reported by every audio backend (``silent_damage``, a
    # failure, otherwise); a streamed FLAC (no sample count) decodes
    lies = [r for r in records if r["damage"] == "header_lies"]
    assert {r["family"] for r in lies} == {"wav", "wav_float", "flac", "ogg"}
    assert all(r["outcome"] in ("typed_error", "skipped", "decoded_damaged") for r in lies)
    streamed = [r for r in records if r["damage"] == "streamed"]
    assert streamed and all(r["outcome"] == "decoded" for r in streamed)


@pytest.mark.parametrize("pad,max_duration", [("repeat", None), ("empty", None),
                                                ("repeat", 9.0), ("empty", 9.0)])
def test_fuzz_state_attacks(pad, max_duration):
    """Random mutations of real feed states (mid-epoch, ranks of 1-3, failing items counted as
    replacements): each load is a StateError or an exact resume, never another exception and
    never a silently different rest of the epoch."""
    import random

    from fuzz import states

    rng = random.Random(17 if pad == "repeat" else 18)
    recs = states.attack(states.synthetic_feed_factory(pad=pad, max_duration=max_duration),
                         rng, 300)
    bad = [r for r in recs if r["outcome"] in states.FAILING]
    assert not bad, bad[:5]
    outcomes = {r["outcome"] for r in recs}
    assert outcomes == {"typed_error", "exact"}  # both branches were reached


def test_fuzz_state_attacks_on_a_recipe(tmp_path):
    """The same on rnnt_feed over the sample manifest with a missing file (fewer rounds: each
    exact resume decodes the rest of an epoch)."""
    import json
    import random

    from fuzz import states

    from avpipe.recipes import rnnt_feed

    src = os.path.join(REPO, "samples",
                       "speech")
    lines = [json.loads(x) for x in open(os.path.join(src, "manifest.jsonl")) if x.strip()]
    for d in lines:
        d["audio_filepath"] = os.path.join(src, d["audio_filepath"])
        d["duration"] = 0.5
    lines.insert(2, {"audio_filepath": "gone.wav", "duration": 0.5, "text": "x"})
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps(d) + "\n" for d in lines))

    def make(*, rank, world_size):
        return rnnt_feed(m, batch_size=2, device="cpu", seed=1, rank=rank,
                         world_size=world_size, prefetch=0, threads=2)

    recs = states.attack(make, random.Random(5), 40, world_sizes=(1, 2))
    bad = [r for r in recs if r["outcome"] in states.FAILING]
    assert not bad, bad[:5]


def test_fuzz_extract_folder(small_corpus, tmp_path):
    root, info = small_corpus
    recs = harness.run_extract_folder(root, tmp_path / "out", device="cpu", timeout=300,
                                      cases=info["cases"])  # fmt: skip
    _check(recs)
    assert len(recs) == len(info["cases"])


def _check_feeds(records, cases, backends):
    _check(records)
    for be, kind in backends.items():  # every case ran through every feed, once
        ran = [r["id"] for r in records if r["backend"] == be]
        mine = {c["id"] for c in cases if c["kind"] == kind}
        assert mine <= set(ran) and len([i for i in ran if i in mine]) == len(mine), be
    goods = [r for r in records if r["damage"] == "good_after_bad" or r["damage"] == "clean"]
    assert goods and all(r["outcome"] == "decoded" for r in goods)
    # an empty file is never in a batch: it is skipped and reported with a message
    empty = [r for r in records if r["damage"] == "zero_length"]
    assert empty and all(r["outcome"] == "skipped" and r["info"] for r in empty)


def test_fuzz_feed_backends(small_corpus, tmp_path):
    """The training feeds, one epoch over each unit's list (damaged files, clean seeds after
    every few and at the end): decoded, or skipped and reported; the clean ones decoded."""
    root, info = small_corpus
    cases, seeds = info["cases"], info["seeds"]
    units = harness.make_units(cases, harness.FEED_CPU_BACKENDS, seeds)
    records = harness.run_units(units, workers=os.cpu_count(), case_timeout=120,
                                log_dir=str(tmp_path), progress=False)  # fmt: skip
    _check_feeds(records, cases, harness.FEED_CPU_BACKENDS)
    # the RNN-T feed reports audio whose header totals lie (never trains it silently)
    lies = [r for r in records if r["backend"] == "rnnt_feed_cpu" and r["damage"] == "header_lies"]
    assert lies and all(r["outcome"] in ("skipped", "decoded_damaged") for r in lies)


# the GPU runs: last in the session (tests/conftest.py), each with a wall budget, so that a run
# that cannot finish (a hang re-run case by case) fails with a table instead of holding the suite
GPU_BUDGET_S = 240


@pytest.mark.gpu
@pytest.mark.fuzz
def test_fuzz_gpu_feed_backends(small_corpus, tmp_path):
    root, info = small_corpus
    cases, seeds = info["cases"], info["seeds"]
    backends, _ = harness.usable(harness.FEED_GPU_BACKENDS)
    units = harness.make_units(cases, backends, seeds)
    records = harness.run_units(units, workers=min(4, os.cpu_count() or 1), case_timeout=180,
                                log_dir=str(tmp_path), progress=False,
                                budget_s=GPU_BUDGET_S)  # fmt: skip
    _check_feeds(records, cases, backends)


@pytest.mark.gpu
@pytest.mark.fuzz
def test_fuzz_gpu_backends(small_corpus, tmp_path):
    root, info = small_corpus
    cases, seeds = info["cases"], info["seeds"]
    backends, _ = harness.usable(harness.GPU_BACKENDS)
    units = harness.make_units(cases, backends, seeds,
                               sequences=sequences(cases, seeds, gpu=True))  # fmt: skip
    records = harness.run_units(units, workers=min(8, os.cpu_count() or 1), case_timeout=120,
                                log_dir=str(tmp_path), progress=False,
                                budget_s=GPU_BUDGET_S)  # fmt: skip
    _check(records)


def test_run_units_budget_records_what_it_did_not_reach(small_corpus, tmp_path):
    """Past its wall budget a run stops, and every case it did not run is a failing
    ``not_run`` record (also in records.jsonl): a run that cannot finish says so."""
    import json
    import time

    root, info = small_corpus
    cases, seeds = info["cases"], info["seeds"]
    units = harness.make_units(cases, {"audio_cpu": "audio"}, seeds)
    n = sum(len(u[1]) for u in units)
    t0 = time.monotonic()
    records = harness.run_units(units, workers=1, case_timeout=60, log_dir=str(tmp_path),
                                progress=False, budget_s=0.0)  # fmt: skip
    assert time.monotonic() - t0 < 30
    ids = sorted(r["id"] for r in records)
    assert ids == sorted(c["id"] for u in units for c in u[1])  # each case once, run or not
    assert n == len(ids)
    assert all(r["outcome"] == "not_run" for r in records)  # a budget of 0: nothing reached
    assert len(harness.failures(records)) == n
    with open(tmp_path / "records.jsonl") as f:
        assert len([json.loads(line) for line in f]) == len(records)


def test_fuzz_feed_blocking_reads(small_corpus, tmp_path):
    """The damage kind "blocking reads" (a file whose read never returns) through the feeds
    that can abandon a read: each such case is skipped as a DecodeTimeoutError within the
    feed's deadline (a handled timeout, not a hang), the clean files around it decode, and the
    worker serves its next unit."""
    root, info = small_corpus
    seeds = info["seeds"]
    blocking = corpus.blocking_cases(tmp_path / "blocking")
    backends = {b: k for b, k in harness.FEED_CPU_BACKENDS.items()
                if b.split("_feed")[0] in harness.BLOCKING_FEEDS}
    units = harness.make_units(blocking, backends, seeds)
    units += units  # the same worker again after a stuck read
    exits = []
    records = harness.run_units(units, workers=1, case_timeout=30, log_dir=str(tmp_path),
                                progress=False, exits=exits)
    _check(records)
    assert exits == [True]  # the stuck threads did not hold the worker's exit
    got = [r for r in records if r["damage"] == "blocking_read"]
    assert len(got) == 4 and all(r["outcome"] == "skipped" and "DecodeTimeoutError" in r["info"]
                                 for r in got), got


def test_backends_whose_decoders_do_not_import_are_left_out_and_named(monkeypatch):
    """A machine without the image decoders (DALI, nvImageCodec) runs the other backends, and
    says which it left out: a missing library is not counted against the files."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("nvidia.") else real(name, *a))
    kept, left = harness.usable({**harness.GPU_BACKENDS, **harness.FEED_GPU_BACKENDS})
    assert "video_cuda" in kept and "rnnt_feed_cuda" in kept
    assert not [b for b, k in kept.items() if k == "image"]
    assert any(w.startswith("image_cuda: nvidia.dali") for w in left)
