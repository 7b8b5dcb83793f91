"""``avpipe extract --out s3://...`` (and ``file://``): the objects are those of a local run,
byte for byte; killed with SIGKILL and run again, the same objects; a finished job run again
writes nothing. Against a moto S3 server on 127.0.0.1."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("moto")
pytest.importorskip("s3fs")
boto3 = pytest.importorskip("boto3")

from paths import REPO  # noqa: E402
from servers import s3_server  # noqa: E402

from avpipe.recipes.extract import run_extract  # noqa: E402

ROOT = Path(REPO)
SAMPLES = ROOT / "samples"
ARGS = ["--preset", "quickstart", "--shard-size", "2", "--batch-size", "2", "--devices", "cpu"]


def tree(out) -> dict:
    out = Path(out)
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def _client():
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])


def objects(bucket, prefix) -> dict:
    c = _client()
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix) + 1:]] = c.get_object(Bucket=bucket,
                                                           Key=o["Key"])["Body"].read()
    return dict(sorted(out.items()))


def versions(bucket) -> list:
    """Every version of every object (a PUT adds one, even of the same bytes)."""
    c = _client()
    out = []
    for page in c.get_paginator("list_object_versions").paginate(Bucket=bucket):
        out += [(v["Key"], v["VersionId"]) for v in page.get("Versions", [])]
        out += [(v["Key"], v["VersionId"]) for v in page.get("DeleteMarkers", [])]
    return sorted(out)


def _bucket(name, versioned=False):
    c = _client()
    c.create_bucket(Bucket=name)
    if versioned:
        c.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Audio and images (14 inputs: 7 shards of 2), 2 of them bad."""
    d = tmp_path_factory.mktemp("in")
    shutil.copytree(SAMPLES / "speech", d / "speech")
    shutil.copytree(SAMPLES / "images", d / "images")
    (d / "speech" / "zz_bad.flac").write_bytes(b"fLaC" + bytes(range(64)))
    (d / "images" / "zz_trunc.jpg").write_bytes(
        (SAMPLES / "images" / "scene.jpg").read_bytes()[:300])
    return d


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The files of one uninterrupted local run (and how long it took)."""
    out = tmp_path_factory.mktemp("ref") / "out"
    t0 = time.monotonic()
    r = subprocess.run(_cmd(data, out), capture_output=True, text=True, cwd=ROOT, env=_env(),
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    t = tree(out)
    assert len([k for k in t if k.startswith("shards/")]) == 7
    return t, time.monotonic() - t0


def _cmd(inp, out):
    return [sys.executable, "-m", "avpipe", "extract", str(inp), "--out", str(out), *ARGS]


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}


@pytest.mark.parametrize("fmt", ["tar", "npy"])
def test_s3_objects_equal_local_files(data, tmp_path, fmt):
    local = tmp_path / "local"
    with s3_server():
        bucket = f"same-{fmt}"
        _bucket(bucket, versioned=True)
        s1 = run_extract(data, preset="quickstart", out_dir=local, devices="cpu",
                         shard_size=4, format=fmt, workers=1)
        s2 = run_extract(data, preset="quickstart", out_dir=f"s3://{bucket}/out", devices="cpu",
                         shard_size=4, format=fmt, workers=1)
        assert s1.complete and s2.complete, s2.failures
        assert s2.total_written == s1.total_written == 12
        assert s2.total_errors == s1.total_errors == 2
        ref = tree(local)
        assert objects(bucket, "out") == ref
        assert "errors.jsonl" in ref and any(k.startswith("parts/") for k in ref)
        # run again: nothing to do, and not one object written (no new version)
        before = versions(bucket)
        s3 = run_extract(data, preset="quickstart", out_dir=f"s3://{bucket}/out", devices="cpu",
                         shard_size=4, format=fmt, workers=1)
        assert s3.complete and s3.total_written == 0 and s3.skipped == 12
        assert versions(bucket) == before
        # a shard's data gone: that shard (and the index) redone, the rest untouched
        c = _client()
        gone = next(k for k in ref if k.startswith(("shards/", "features/")))
        c.delete_object(Bucket=bucket, Key=f"out/{gone}")
        s4 = run_extract(data, preset="quickstart", out_dir=f"s3://{bucket}/out", devices="cpu",
                         shard_size=4, format=fmt, workers=1)
        assert s4.complete and 0 < s4.total_written < 12
        assert objects(bucket, "out") == ref


def test_file_url(data, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    s1 = run_extract(data, preset="quickstart", out_dir=a, devices="cpu", shard_size=4,
                     workers=1)
    s2 = run_extract(data, preset="quickstart", out_dir=b.as_uri(), devices="cpu",
                     shard_size=4, workers=1)
    assert s1.complete and s2.complete
    assert tree(a) == tree(b) and len(tree(b)) > 5
    assert not Path("file:").exists()  # not a relative folder named after the URL


def test_resume_reads_parts_from_the_url(data, tmp_path):
    """A truncated part and a missing one (their shards are redone: the part is uploaded after
    the run listed the prefix, and read back) read from the URL; the other shards' objects
    are not written again, and the objects end as they were."""
    with s3_server():
        _bucket("resume", versioned=True)
        url = "s3://resume/x/y"
        s1 = run_extract(data, preset="quickstart", out_dir=url, devices="cpu", shard_size=4,
                         workers=1)
        assert s1.complete
        c = _client()
        keys_bytes = objects("resume", "x/y")
        keys = sorted(keys_bytes)
        parts = [k for k in keys if k.startswith("parts/")]
        assert len(parts) == 4
        body = c.get_object(Bucket="resume", Key=f"x/y/{parts[1]}")["Body"].read()
        c.put_object(Bucket="resume", Key=f"x/y/{parts[1]}", Body=body[: len(body) // 2])
        c.delete_object(Bucket="resume", Key=f"x/y/{parts[2]}")
        ref_tar = parts[0].replace("parts/", "shards/").replace(".jsonl", ".tar")
        before = {k for k in versions("resume") if k[0] == f"x/y/{ref_tar}"}
        s2 = run_extract(data, preset="quickstart", out_dir=url, devices="cpu", shard_size=4,
                         workers=1)
        assert s2.complete and 0 < s2.total_written <= 8
        assert s2.total_written + s2.skipped == 12
        assert objects("resume", "x/y") == keys_bytes
        assert {k for k in versions("resume") if k[0] == f"x/y/{ref_tar}"} == before


def test_read_after_a_listing_sees_new_objects():
    """An object written (by another process) after its prefix was listed is read, not
    reported missing from the cached listing."""
    from avpipe import storage

    with s3_server():
        _bucket("listed")
        c = _client()
        c.put_object(Bucket="listed", Key="j/a/1", Body=b"x")
        assert storage.list_tree("s3://listed/j") == ["a/1"]
        c.put_object(Bucket="listed", Key="j/a/2", Body=b"y")
        assert storage.read_object("s3://listed/j/a/2") == b"y"
        assert storage.exists("s3://listed/j/a/2")
        assert storage.listdir("s3://listed/j/a") == ["1", "2"]


def _objects_now(bucket, prefix) -> int:
    c = _client()
    r = c.list_objects_v2(Bucket=bucket, Prefix=prefix + "/parts/")
    return len(r.get("Contents", []))


def _kill(p) -> bool:
    alive = p.poll() is None
    if alive:
        os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    return alive


@pytest.mark.slow
def test_killed_three_times_then_resumed(data, reference, tmp_path):
    """``avpipe extract --out s3://`` (a subprocess, the S3 server in its own process) killed
    with SIGKILL three times: after the first part, at a random time, and after 4 of 7 parts;
    run again, it leaves the objects of an uninterrupted local run, byte for byte; then a run
    of the finished job writes nothing."""
    ref, span = reference
    rng = random.Random(7)
    staging = tmp_path / "tmp"  # the runs' TMPDIR: where they stage their uploads
    staging.mkdir()
    with s3_server(process=True):
        env = {**_env(), "TMPDIR": str(staging)}  # with the server's AWS_* settings
        _bucket("kills", versioned=True)
        url = "s3://kills/job"
        cut, parts = [], []
        for target in (1, None, 4):
            p = subprocess.Popen(_cmd(data, url), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, cwd=ROOT, env=env)
            if target is None:
                time.sleep(rng.uniform(0.2, 0.6) * max(1.0, span))
            else:
                deadline = time.monotonic() + 120
                while (_objects_now("kills", "job") < target and p.poll() is None
                       and time.monotonic() < deadline):
                    time.sleep(0.02)
            cut.append(_kill(p))
            time.sleep(0.5)  # spawned workers die with their parent
            parts.append(_objects_now("kills", "job"))
        assert all(cut), f"a kill came after its run had finished: {cut}"
        assert parts[0] < 7, parts  # the job was unfinished
        r = subprocess.run(_cmd(data, url), capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert objects("kills", "job") == ref
        assert os.listdir(staging) == []  # what the killed runs staged is removed
        before = versions("kills")
        r = subprocess.run(_cmd(data, url), capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "nothing new written" in r.stdout + r.stderr
        assert versions("kills") == before


@pytest.mark.slow
def test_ray_engine_writes_objects(data, tmp_path):
    """``--engine ray``: the actors upload the objects; the same as a local run's files."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    local = tmp_path / "local"
    s1 = run_extract(data, preset="quickstart", out_dir=local, devices="cpu", shard_size=4,
                     workers=1)
    with s3_server():
        _bucket("ray-out")
        env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                          "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
        path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path, "AVPIPE_DISABLE_GPU": "1",
                                           **env}})
        try:
            s2 = run_extract(data, preset="quickstart", out_dir="s3://ray-out/o",
                             devices="cpu,cpu", shard_size=4, workers=1, engine="ray")
        finally:
            ray.shutdown()
        assert s1.complete and s2.complete, s2.failures
        assert s2.total_written == s1.total_written
        assert objects("ray-out", "o") == tree(local)


def test_put_file_large_is_multipart(tmp_path):
    """A file of several parts goes up as a multipart upload, whole."""
    from avpipe import storage

    f = tmp_path / "big.bin"
    data = bytes(range(256)) * (11 * 4096)  # 11 MiB: parts of 5 MiB
    f.write_bytes(data)
    with s3_server():
        _bucket("big")
        storage.put_file(f, "s3://big/x/big.bin", part_size=5 << 20)
        head = _client().head_object(Bucket="big", Key="x/big.bin")
        assert head["ContentLength"] == len(data)
        assert head["ETag"].strip('"').endswith("-3")  # a multipart upload of 3 parts
        assert storage.read_object("s3://big/x/big.bin") == data
    storage.put_file(f, (tmp_path / "copy.bin").as_uri())
    assert (tmp_path / "copy.bin").read_bytes() == data


@pytest.mark.slow
def test_s3_shards_to_s3_killed_three_times(tmp_path):
    """WebDataset shards in S3 extracted to S3, killed with SIGKILL three times at different
    points and run again: the same objects, byte for byte, as an uninterrupted S3-to-S3 run."""
    import json

    from shard_media import write_tar

    speech = ROOT / "samples" / "speech"
    lines = [json.loads(x) for x in (speech / "manifest.jsonl").read_text().splitlines()]
    members = [[], [], []]
    for k, x in enumerate(lines * 2):  # 12 samples over 3 shards
        key = f"u{k:02d}"
        ext = x["audio_filepath"].rsplit(".", 1)[1]
        members[k % 3] += [(f"{key}.{ext}", (speech / x["audio_filepath"]).read_bytes()),
                           (f"{key}.json", json.dumps({"text": x["text"]}).encode())]
    for s, m in enumerate(members):
        write_tar(tmp_path / f"in-{s}.tar", m)
    staging = tmp_path / "tmp"
    staging.mkdir()
    with s3_server(process=True):
        env = {**_env(), "TMPDIR": str(staging), "AVPIPE_CACHE_DIR": str(tmp_path / "cache")}
        _bucket("data")
        _bucket("out")
        for s in range(3):
            _client().upload_file(str(tmp_path / f"in-{s}.tar"), "data", f"in-{s}.tar")
        spec = "s3://data/in-{0..2}.tar"
        t0 = time.monotonic()
        r = subprocess.run(_cmd(spec, "s3://out/ref"), capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=300)
        span = time.monotonic() - t0
        assert r.returncode == 0, r.stdout + r.stderr
        ref = objects("out", "ref")
        assert len([k for k in ref if k.startswith("shards/")]) == 6
        rng = random.Random(11)
        cut = []
        # the kill at a random time comes first, on a job started from nothing: a job resumed
        # after a kill has less left to do than the reference run's span measures
        for target in (None, 1, 3):
            p = subprocess.Popen(_cmd(spec, "s3://out/job"), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, cwd=ROOT, env=env)
            if target is None:
                time.sleep(rng.uniform(0.2, 0.6) * max(1.0, span))
            else:
                deadline = time.monotonic() + 120
                while (_objects_now("out", "job") < target and p.poll() is None
                       and time.monotonic() < deadline):
                    time.sleep(0.02)
            cut.append(_kill(p))
            time.sleep(0.5)
        assert all(cut), f"a kill came after its run had finished: {cut}"
        r = subprocess.run(_cmd(spec, "s3://out/job"), capture_output=True, text=True,
                           cwd=ROOT, env=env, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert objects("out", "job") == ref
