"""The benchmark harness on the CPU: a quick run end to end, the results JSON, the report, the
ratio of medians, the page-cache eviction, and the GPU suite skipping cleanly without a GPU."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import types

import pytest
from paths import REPO

from benchmarks import cache, harness, report
from benchmarks.workloads import SUITES

ROOT = REPO


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


def _fake_workload(**kw):
    mod = types.SimpleNamespace(
        NAME="fake", SUITE="cpu", UNIT="items/s", TITLE="a fake workload",
        CONTENDERS={"ours": "avpipe", "theirs": "the anchor, default settings",
                    "theirs_tuned": "the anchor, tuned"},
        RATIOS=[("ours", "theirs_best"), ("ours", "theirs")],
        BEST_OF={"theirs_best": ["theirs", "theirs_tuned"]})
    mod.__dict__.update(kw)
    return mod


def _runs(**values):
    return {c: [{"value": v} for v in vs] for c, vs in values.items()}


# --- the ratio of medians ---------------------------------------------------------------------


def test_ratio_is_the_ratio_of_the_medians_not_the_median_of_per_round_ratios():
    ours, theirs = [1.0, 10.0, 4.0], [2.0, 1.0, 8.0]
    # per round: 0.5, 10, 0.5 -> a median of ratios would say 0.5
    assert harness.ratio_of_medians(ours, theirs) == pytest.approx(4.0 / 2.0)
    doc = harness.result_doc(_fake_workload(RATIOS=[("ours", "theirs")], BEST_OF={}),
                             harness.Context(), _runs(ours=ours, theirs=theirs), command="x")
    (r,) = doc["ratios"]
    assert r["ratio"] == pytest.approx(2.0) and r["headline"]
    assert doc["contenders"]["ours"]["median"] == 4.0
    assert doc["contenders"]["theirs"]["values"] == theirs


def test_median_skips_failed_rounds_and_an_even_count_averages():
    assert harness.median([3.0, None, 1.0]) == 2.0
    assert harness.median([None, None]) is None
    assert harness.ratio_of_medians([1.0], [None]) is None


def test_best_of_stands_for_the_anchor_with_the_best_median():
    doc = harness.result_doc(_fake_workload(), harness.Context(),
                             _runs(ours=[9, 10, 11], theirs=[4, 5, 6], theirs_tuned=[7, 8, 9]),
                             command="x")
    best = doc["contenders"]["theirs_best"]
    assert best["chosen"] == "theirs_tuned" and best["values"] == [7, 8, 9]
    assert [(r["anchor"], r["ratio"]) for r in doc["ratios"]] == [("theirs_best", 1.25),
                                                                  ("theirs", 2.0)]
    assert "tuned" in doc["ratios"][0]["anchor_settings"]


def test_rounds_rotate_the_order():
    names = ["a", "b", "c"]
    assert [harness.rotated(names, r)[0] for r in range(3)] == ["a", "b", "c"]


# --- the results JSON and the report ----------------------------------------------------------


def test_result_doc_has_the_schema():
    doc = harness.result_doc(_fake_workload(), harness.Context(rounds=3),
                             _runs(ours=[1, 2, 3], theirs=[1, 1, 1], theirs_tuned=[2, 2, 2]),
                             command="python -m benchmarks run")
    assert harness.validate(doc) == []
    for k in ("commit", "dirty", "date", "host", "gpu", "versions", "rounds"):
        assert k in doc
    for k in ("avpipe", "dali", "pynvvideocodec", "cupy", "torch", "numpy", "av", "soundfile"):
        assert k in doc["versions"]
    assert set(doc["gpu"]) >= {"name", "driver", "cuda"}
    assert doc["reproduce"] == "python -m benchmarks run --suite cpu --only fake"
    bad = dict(doc)
    del bad["commit"]
    assert harness.validate(bad)


def test_committed_results_are_valid_and_render():
    paths = sorted(glob.glob(os.path.join(harness.RESULTS, "*.json")))
    assert paths
    for p in paths:
        with open(p) as f:
            assert harness.validate(json.load(f)) == [], p
    docs = report.load()
    text = report.render(docs)
    for d in docs:  # one current row per workload, with its commit and command
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| [{harness.result_key(d)}]"))
        assert d["commit"][:7] in row and d["reproduce"] in row


def test_committed_results_md_is_the_report_of_the_committed_results():
    with open(os.path.join(harness.HERE, "RESULTS.md")) as f:
        assert f.read() == report.render(report.load())


def test_report_keeps_the_latest_result_of_a_workload(tmp_path):
    mod = _fake_workload()
    for date, ours in (("2030-01-01T00:00:00+00:00", 5.0), ("2030-01-02T00:00:00+00:00", 7.0)):
        doc = harness.result_doc(mod, harness.Context(), _runs(ours=[ours] * 3,
                                                               theirs=[1.0] * 3), command="x")
        doc["date"] = date
        with open(tmp_path / f"{date[:10]}.json", "w") as f:
            json.dump(doc, f)
    (doc,) = report.load(str(tmp_path))
    assert doc["contenders"]["ours"]["median"] == 7.0
    text = report.render([doc])
    assert "**7x**" in text and text.count("| [fake]") == 1


# --- end to end --------------------------------------------------------------------------------


def test_cpu_suite_quick_run_end_to_end(tmp_path):
    out, data = tmp_path / "out", tmp_path / "data"
    cmd = [sys.executable, "-m", "benchmarks", "run", "--suite", "cpu", "--quick",
           "--only", "cpu_logmel,cpu_index", "--param", "files=4",
           "--contenders", "avpipe_per_file,librosa_per_file,workers_1",
           "--out", str(out), "--data", str(data)]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    docs = {}
    for path in glob.glob(str(out / "*.json")):
        with open(path) as f:
            d = json.load(f)
        assert harness.validate(d) == [], path
        docs[d["workload"]] = d
    assert set(docs) == {"cpu_logmel", "cpu_index"}
    lm = docs["cpu_logmel"]
    assert lm["rounds"] == 3 and lm["quick"] and lm["params"]["files"] == 4
    assert lm["command"].startswith("python -m benchmarks run --suite cpu --quick")
    for c in ("avpipe_per_file", "librosa_per_file"):
        e = lm["contenders"][c]
        assert len(e["values"]) == 3 and all(v > 0 for v in e["values"]) and not e["errors"]
    assert lm["checks"]["max_abs_difference_from_librosa_per_file"]["avpipe_per_file"] < 1e-3
    ix = docs["cpu_index"]["contenders"]["workers_1"]  # each round its own child process
    assert len(ix["values"]) == 3 and all(v > 0 for v in ix["values"])
    p = subprocess.run([sys.executable, "-m", "benchmarks", "report", "--results", str(out),
                        "--out", str(tmp_path / "R.md")], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "R.md").read_text()
    assert "cpu_logmel--librosa_per_file,avpipe_per_file" in text and "cpu_index" in text


def test_fewer_than_three_rounds_is_refused():
    p = subprocess.run([sys.executable, "-m", "benchmarks", "run", "--rounds", "2", "--out",
                        "/nonexistent"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0 and "at least 3" in p.stderr


# --- the GPU suite on the CPU ------------------------------------------------------------------


def test_every_workload_imports_without_a_gpu_library():
    code = ("import sys; from benchmarks import harness; from benchmarks.workloads import NAMES; "
            "[harness.workload(n) for n in NAMES]; "
            "bad = [m for m in ('cupy', 'nvidia.dali', 'PyNvVideoCodec', 'torch') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    for name in SUITES:
        mod = harness.workload(name)
        assert mod.SUITE == SUITES[name] and mod.CONTENDERS
        for s, a in mod.RATIOS:
            names = set(mod.CONTENDERS) | set(getattr(mod, "BEST_OF", {}))
            assert s in names and a in names, (name, s, a)


def test_gpu_suite_skips_cleanly_without_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "has_gpu", lambda: False)
    for name in (n for n, s in SUITES.items() if s == "gpu"):
        doc = harness.run_workload(name, data_dir=str(tmp_path / "data"), command="x")
        assert doc["skipped"] and "GPU" in doc["skipped"], name
    assert not (tmp_path / "data").exists()  # nothing was generated


def test_fair_anchors_are_declared():
    from benchmarks.workloads import extract, feeds, image, video

    assert image.RATIOS[0] == ("avpipe_hw1@jpeg", "dali_hw1@jpeg")  # headline: one setting
    assert ("avpipe_hw065@jpeg", "dali@jpeg") in image.RATIOS
    assert video.RATIOS[0] == ("avpipe_clip_cps", "dali_video_tuned")
    assert len(video.BEST_OF["dali_video_tuned"]) == 4
    assert "avpipe_pagecold_clip_cps" in video.CONTENDERS
    assert "disk" in " ".join(extract.NOTES)
    assert any("SpecAugment" in n for n in feeds.NOTES)


def test_extraction_anchor_writes_with_avpipes_writers(tmp_path, monkeypatch):
    import io
    import tarfile

    import numpy as np

    from benchmarks.workloads import extract

    monkeypatch.setenv("AVPIPE_EXTRACT_WRITEBACK_MB", "1")
    w = extract.TarShards(str(tmp_path), size=3)
    assert w.writers == 4 and w.every == 1 << 20
    arrays = [np.full((80, 5000), k, np.float32) for k in range(7)]
    for k, a in enumerate(arrays):
        w.put([(f"{k:09d}", a)])
    w.close()
    names = sorted(os.listdir(tmp_path))
    assert names == ["shard-000000-000002.tar", "shard-000003-000005.tar",
                     "shard-000006-000006.tar"]
    with tarfile.open(tmp_path / names[1]) as tf:
        got = [np.load(io.BytesIO(tf.extractfile(m).read())) for m in tf.getmembers()]
    assert [int(g[0, 0]) for g in got] == [3, 4, 5]
    ceiling = extract.disk_ceiling(str(tmp_path), total_mb=8, file_mb=4)
    assert ceiling["MB"] == 8 and ceiling["MB_per_s"] > 0 and ceiling["writers"] == 4


# --- page-cache eviction -----------------------------------------------------------------------


def test_evict_fsyncs_then_drops_the_pages(tmp_path, monkeypatch):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(1 << 20))
    calls = []
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync"))
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise",
                        lambda fd, off, n, adv: calls.append(("fadvise", off, n, adv))
                        or real(fd, off, n, adv))
    assert cache.evict([str(p)]) == 1
    assert calls == ["fsync", ("fadvise", 0, 0, os.POSIX_FADV_DONTNEED)]


def test_evict_leaves_the_file_out_of_the_page_cache(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(4 << 20))
    p.read_bytes()
    before = cache.resident_fraction(str(p))
    if before is None or before < 0.5:
        pytest.skip("this file system does not report its cached pages")
    cache.evict([str(p)])
    after = cache.resident_fraction(str(p))
    if after == before:
        pytest.skip("this file system keeps its pages (tmpfs)")
    assert after < 0.1


def test_cold_copies_are_copies_not_links(tmp_path):
    src = tmp_path / "a.mp4"
    src.write_bytes(b"x" * 10000)
    out = cache.cold_copies([str(src)], str(tmp_path / "cold"), copies=3)
    assert len(out) == 3 and len(set(out)) == 3
    for q in out:
        assert os.stat(q).st_ino != os.stat(src).st_ino
        assert open(q, "rb").read() == src.read_bytes()


def test_a_run_cut_short_keeps_its_finished_rounds(tmp_path, monkeypatch):
    calls = []

    class Session:
        def measure(self, name):
            calls.append(name)
            if len(calls) > 4:  # the third round dies
                raise KeyboardInterrupt
            return float(len(calls)), {}

        def close(self):
            pass

    mod = _fake_workload(RATIOS=[("ours", "theirs")], BEST_OF={},
                         CONTENDERS={"ours": "avpipe", "theirs": "the anchor"},
                         prepare=lambda ctx: {}, session=lambda ctx: Session())
    monkeypatch.setattr(harness, "workload", lambda name: mod)
    with pytest.raises(KeyboardInterrupt):
        harness.run_workload("fake", rounds=3, out_dir=str(tmp_path), command="x")
    with open(tmp_path / "fake.json") as f:
        doc = json.load(f)
    assert doc["complete"] is False and harness.validate(doc) == []
    assert doc["contenders"]["ours"]["values"] == [1.0, 4.0]  # rounds 0 and 1, order rotated
    assert doc["contenders"]["theirs"]["values"] == [2.0, 3.0]
    assert "(incomplete)" in report.render(report.load(str(tmp_path)))


def test_missing_names_absent_modules_even_dotted_ones():
    assert harness.missing(["json", "no_such_package_x.sub", "no_such_module_y"]) == [
        "no_such_package_x.sub", "no_such_module_y"]


@pytest.mark.parametrize("probe", ["probe_extract", "probe_rnnt_feed", "probe_video_clips",
                                   "profile_stages"])
def test_probes_import_from_the_package(probe):
    p = subprocess.run([sys.executable, "-m", f"benchmarks.probes.{probe}", "--help"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_a_child_that_runs_past_its_timeout_is_an_error_with_its_log_kept(tmp_path):
    ctx = harness.Context(data_dir=str(tmp_path), params={"files": 1},
                          data={"folder": str(tmp_path), "files": 1})
    m = harness.measure_in_child("cpu_index", "workers_1", ctx, timeout=0.05,
                                 log_path=str(tmp_path / "logs" / "x.log"))
    assert m["value"] is None and "timed out" in m["error"]
    assert (tmp_path / "logs" / "x.log").exists()


# --- against an earlier avpipe (--baseline) ---------------------------------------------------


def test_baseline_twins_measure_the_same_contender_with_the_other_avpipe(tmp_path, monkeypatch):
    seen = []

    def fake_child(name, contender, ctx, timeout, log_path=None, avpipe_from=None):
        seen.append((contender, avpipe_from))
        return {"value": 2.0 if avpipe_from is None else 1.0}

    mod = _fake_workload(RATIOS=[("ours", "theirs")], BEST_OF={},
                         CONTENDERS={"avpipe": "ours", "theirs": "the anchor"},
                         prepare=lambda ctx: {})
    mod.RATIOS = [("avpipe", "theirs")]
    monkeypatch.setattr(harness, "workload", lambda name: mod)
    monkeypatch.setattr(harness, "measure_in_child", fake_child)
    monkeypatch.setattr(harness, "baseline_tree", lambda c: ("/base", "a" * 40))
    doc = harness.run_workload("fake", rounds=3, command="x", baseline="HEAD~1")
    # the anchor is measured once a round, the avpipe contender twice: ours and the baseline's
    from collections import Counter

    assert Counter(seen) == Counter({("avpipe", None): 3, ("avpipe", "/base"): 3,
                                     ("theirs", None): 3})
    first = doc["ratios"][0]
    assert (first["subject"], first["anchor"], first["headline"]) == \
        ("avpipe", "avpipe@baseline", True)
    assert first["ratio"] == pytest.approx(2.0)
    assert harness.result_key(doc) == "fake--vs-aaaaaaa" and harness.validate(doc) == []
    assert "--baseline aaaaaaaaaaaa" in doc["reproduce"]
    text = report.render([doc])
    assert "## Against an earlier avpipe" in text


def test_baseline_tree_holds_that_commits_avpipe_and_a_child_imports_it(tmp_path):
    folder, full = harness.baseline_tree("HEAD")
    assert len(full) == 40 and os.path.isfile(os.path.join(folder, "avpipe", "__init__.py"))
    code = ("import avpipe, benchmarks.harness as h, subprocess, sys; print(h.avpipe_folder()); "
            "print(subprocess.run([sys.executable, '-c', 'import avpipe, benchmarks.harness as h; "
            "print(h.avpipe_folder())'], capture_output=True, text=True).stdout.strip())")
    # a child as the harness starts it: that avpipe, in it and in the processes it starts
    env, cwd = harness.child_env(folder)
    p = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-2:] == [folder, folder]
    assert p.stdout.strip().splitlines()[-1] == folder
