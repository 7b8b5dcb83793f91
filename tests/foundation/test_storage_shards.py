"""Where the bytes live (avpipe.storage) and WebDataset shard indexes (avpipe.pipeline.shards):
local paths, file://, an HTTP server on 127.0.0.1 (one that fails requests too) and a moto S3
server; damaged and truncated tars."""

from __future__ import annotations

import io
import os
import tarfile

import pytest
from servers import http_server, s3_server

from avpipe import settings, storage
from avpipe.pipeline import shards


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AVPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AVPIPE_STORAGE_RETRIES", "6")


def make_shard(path, samples, *, fmt=tarfile.USTAR_FORMAT):
    """samples: [(key, {ext: bytes})] -> a tar; returns {key: {ext: bytes}}."""
    with tarfile.open(path, "w", format=fmt) as tf:
        for key, members in samples:
            for ext, data in members.items():
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size = len(data)
                ti.mtime = 1_700_000_000
                tf.addfile(ti, io.BytesIO(data))
    return {k: m for k, m in samples}


def some_samples(n=12, big=0):
    out = []
    for i in range(n):
        body = bytes((i * 7 + j) % 251 for j in range(100 + 37 * i + (big if i == 3 else 0)))
        out.append((f"utt{i:03d}", {"flac": body, "json": f'{{"text": "t{i}"}}'.encode()}))
    return out


# -- names --------------------------------------------------------------------------------------

def test_expand_braces_lists_and_nemo_spelling():
    assert storage.expand("s3://b/train-{000000..000002}.tar") == [
        "s3://b/train-000000.tar", "s3://b/train-000001.tar", "s3://b/train-000002.tar"]
    assert storage.expand("a{1..3}") == ["a1", "a2", "a3"]
    assert storage.expand("a{3..1}") == ["a3", "a2", "a1"]
    assert storage.expand("x_{a,b}_{0..1}") == ["x_a_0", "x_a_1", "x_b_0", "x_b_1"]
    assert storage.expand("audio__OP_0..2_CL_.tar") == ["audio_0.tar", "audio_1.tar",
                                                        "audio_2.tar"]
    assert storage.expand(["a{0..1}", "b"]) == ["a0", "a1", "b"]
    assert storage.expand("plain.tar") == ["plain.tar"]
    assert storage.expand("{x}") == ["{x}"]
    with pytest.raises(TypeError, match="shard spec"):
        storage.expand(3)


def test_local_paths_and_file_urls(tmp_path):
    p = tmp_path / "a b.bin"
    p.write_bytes(bytes(range(256)))
    for url in (str(p), "file://" + str(p), p):
        assert storage.read_range(url, 10, 5) == bytes(range(10, 15))
        assert storage.stat(url).size == 256
    assert storage.read_range(str(p), 250, 100) == bytes(range(250, 256))
    with pytest.raises(ValueError, match="start=-1"):
        storage.read_range(str(p), -1, 3)
    with pytest.raises(FileNotFoundError):
        storage.stat(str(tmp_path / "missing"))


def test_write_object_is_whole_and_atomic(tmp_path):
    url = str(tmp_path / "d" / "obj.json")
    storage.write_object(url, b"first")
    storage.write_object(url, b"second")
    assert storage.read_object(url) == b"second"
    assert os.listdir(tmp_path / "d") == ["obj.json"]  # no temporary left beside it
    storage.remove(url)
    storage.remove(url)  # a missing object is no error
    assert not storage.exists(url)


def test_cache_dir_setting(monkeypatch):
    monkeypatch.setenv("AVPIPE_CACHE_DIR", "relative/dir")
    with pytest.raises(ValueError, match="AVPIPE_CACHE_DIR .*'relative/dir'"):
        settings.cache_dir()


# -- shard indexes --------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_index_and_read_every_sample(tmp_path, fmt):
    samples = some_samples()
    long_key = "d/" + "x" * 150 + "/uttlong"  # a name past ustar's 100 characters
    samples.append((long_key, {"flac": b"L" * 900, "json": b"{}"}))
    if fmt == tarfile.USTAR_FORMAT:
        samples.pop()
    ref = make_shard(tmp_path / "s.tar", samples, fmt=fmt)
    idx = shards.index_shard(str(tmp_path / "s.tar"))
    assert [s.key for s in idx.samples] == [k for k, _ in samples]
    assert idx.errors == ()
    for s in idx.samples:
        assert s.exts() == ["flac", "json"]
        assert shards.read_sample(str(tmp_path / "s.tar"), s) == ref[s.key]


def test_key_is_the_name_up_to_the_first_dot():
    assert shards.split_key("a/b/utt1.seg.json") == ("a/b/utt1", "seg.json")
    assert shards.split_key("utt1.flac") == ("utt1", "flac")
    assert shards.split_key("a.b/c") is None
    assert shards.split_key("README") is None


def test_index_is_cached_per_shard_version(tmp_path, monkeypatch):
    p = tmp_path / "s.tar"
    make_shard(p, some_samples(4))
    a = shards.index_shard(str(p))
    walked = []
    real = shards._walk
    monkeypatch.setattr(shards, "_walk", lambda *a: walked.append(1) or real(*a))
    assert shards.index_shard(str(p)) == a and walked == []  # from the cache
    make_shard(p, some_samples(6))  # the shard changed: indexed again
    os.utime(p, ns=(1, 2))
    b = shards.index_shard(str(p))
    assert walked == [1] and len(b) == 6


def test_damaged_header_is_reported_and_the_rest_recovered(tmp_path):
    p = tmp_path / "s.tar"
    ref = make_shard(p, some_samples(10))
    idx = shards.index_shard(str(p), cache=False)
    victim = idx.samples[4]
    data = bytearray(p.read_bytes())
    data[victim.start + 20] ^= 0xFF  # the name field of utt004.flac's header: checksum fails
    p.write_bytes(bytes(data))
    idx = shards.index_shard(str(p), cache=False)
    keys = [s.key for s in idx.samples]
    assert "utt003" in keys and "utt005" in keys and "utt009" in keys
    assert len(idx.errors) == 1 and f"byte {victim.start}" in idx.errors[0][1]
    # utt004 keeps only the member after the damaged header; the others are whole
    for s in idx.samples:
        got = shards.read_sample(str(p), s)
        assert got == ({"json": ref["utt004"]["json"]} if s.key == "utt004" else ref[s.key])


def test_truncated_shard_names_the_sample_it_cut(tmp_path):
    p = tmp_path / "s.tar"
    make_shard(p, some_samples(8))
    idx = shards.index_shard(str(p), cache=False)
    cut_in = idx.samples[5]
    p.write_bytes(p.read_bytes()[: cut_in.members[0][1] + 10])  # inside utt005.flac's data
    idx = shards.index_shard(str(p), cache=False)
    assert [s.key for s in idx.samples] == [f"utt{i:03d}" for i in range(5)]
    assert [e[0] for e in idx.errors] == [shards.sample_name(str(p), "utt005")]
    assert "cut short" in idx.errors[0][1]


def test_shard_without_end_blocks_and_stray_members(tmp_path):
    p = tmp_path / "s.tar"
    make_shard(p, some_samples(3))
    raw = p.read_bytes().rstrip(b"\0")
    raw += b"\0" * ((-len(raw)) % 512)
    p.write_bytes(raw)  # some writers leave out the two zero blocks
    with tarfile.open(tmp_path / "t.tar", "w") as tf:
        d = tarfile.TarInfo("folder")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        ti = tarfile.TarInfo("README")
        ti.size = 3
        tf.addfile(ti, io.BytesIO(b"abc"))
        ti = tarfile.TarInfo("k.txt")
        ti.size = 2
        tf.addfile(ti, io.BytesIO(b"hi"))
    assert len(shards.index_shard(str(p), cache=False)) == 3
    idx = shards.index_shard(str(tmp_path / "t.tar"), cache=False)
    assert [s.key for s in idx.samples] == ["k"]


# -- remote ---------------------------------------------------------------------------------------

def test_http_shards_index_and_read(tmp_path):
    ref = make_shard(tmp_path / "train-000000.tar", some_samples(6, big=3_000_000))
    make_shard(tmp_path / "train-000001.tar", some_samples(2))
    with http_server(tmp_path) as (base, srv):
        urls = storage.expand(base + "/train-{000000..000001}.tar")
        idx = shards.index_shards(urls)
        assert [len(i) for i in idx] == [6, 2]
        before = srv.requests
        # the 3 MB member is skipped, not read, while indexing (windows of 1 MiB)
        assert before < 12, before
        for s in idx[0].samples:
            assert shards.read_sample(urls[0], s) == ref[s.key]
        assert storage.stat(urls[0]).size == os.path.getsize(tmp_path / "train-000000.tar")
        with pytest.raises(FileNotFoundError):
            storage.stat(base + "/missing.tar")


@pytest.mark.parametrize("mode", ["503", "reset"])
def test_flaky_http_server_is_retried(tmp_path, mode):
    """One request in five fails (503, or a connection closed mid-body): every read still
    returns the right bytes."""
    ref = make_shard(tmp_path / "s.tar", some_samples(20))
    with http_server(tmp_path, fail_every=5, fail_mode=mode) as (base, srv):
        url = base + "/s.tar"
        idx = shards.index_shard(url, cache=False)
        assert len(idx) == 20
        for s in idx.samples:
            assert shards.read_sample(url, s) == ref[s.key]
        assert srv.requests > 20


def test_http_errors_that_retries_cannot_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("AVPIPE_STORAGE_RETRIES", "2")
    make_shard(tmp_path / "s.tar", some_samples(2))
    with http_server(tmp_path, fail_every=1) as (base, srv):
        with pytest.raises(storage.StorageError, match="s.tar.*after 3 attempts") as e:
            storage.read_range(base + "/s.tar", 0, 10)
        assert e.value.transient and srv.requests == 3


def test_s3_shards_through_a_moto_server(tmp_path):
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    ref = make_shard(tmp_path / "s.tar", some_samples(7))
    with s3_server():
        s3 = boto3.client("s3")  # configured from the environment, as any boto3 user's
        s3.create_bucket(Bucket="data")
        s3.upload_file(str(tmp_path / "s.tar"), "data", "train/shard-000000.tar")
        url = "s3://data/train/shard-{000000..000000}.tar"
        (u,) = storage.expand(url)
        idx = shards.index_shard(u)
        assert [s.key for s in idx.samples] == [f"utt{i:03d}" for i in range(7)]
        for s in idx.samples:
            assert shards.read_sample(u, s) == ref[s.key]
        storage.write_object("s3://data/out/done.json", b"{}")
        assert storage.read_object("s3://data/out/done.json") == b"{}"
        assert storage.listdir("s3://data/out") == ["done.json"]
        with pytest.raises(FileNotFoundError):
            storage.stat("s3://data/nothing.tar")
