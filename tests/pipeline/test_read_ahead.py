"""Reads of remote shard members planned ahead of decoding: members close together in a shard
come by one ranged request (sliced per member, the same bytes), the bytes held are bounded and
dropped, a failed run leaves each member to its own read so that only a bad member is named,
and the RNN-T feed over HTTP shards issues fewer requests than it has items."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import soundfile as sf
from servers import http_server
from shard_media import write_tar

from avpipe import storage
from avpipe.pipeline import sharded
from avpipe.recipes import rnnt_feed

SR = 16000


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("AVPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AVPIPE_DISABLE_GPU", "1")


def flac_bytes(i, seconds=0.5):
    n = int(SR * seconds)
    t = np.arange(n) / SR
    x = (0.3 * np.sin(2 * np.pi * (150 + 23 * i) * t) * np.hanning(n)).astype(np.float32)
    b = io.BytesIO()
    sf.write(b, x, SR, format="FLAC")
    return b.getvalue()


def make_shards(d, n_shards=2, per=6):
    """``n_shards`` tars of ``per`` audio samples each; returns key -> flac bytes."""
    ref = {}
    for s in range(n_shards):
        members = []
        for k in range(per):
            key = f"s{s}u{k:02d}"
            audio = flac_bytes(s * per + k)
            meta = {"text": f"text {s} {k}", "duration": 0.5}
            members += [(f"{key}.flac", audio), (f"{key}.json", json.dumps(meta).encode())]
            ref[key] = audio
        write_tar(d / f"train-{s:06d}.tar", members)
    return ref


def key_of(item):
    return item.path.rsplit("#", 1)[-1]


def test_coalesced_reads_give_each_member_its_bytes_by_one_request(tmp_path):
    ref = make_shards(tmp_path, n_shards=2, per=6)
    with http_server(tmp_path) as (base, srv):
        items = sharded.read_webdataset(base + "/train-{000000..000001}.tar",
                                        kind="audio").items
        assert len(items) == 12
        picked = items[::-1]  # any order: runs are formed per shard by offset
        owner = object()
        before = srv.requests
        assert sharded.read_ahead(picked, owner) == 2  # one run per shard
        for it in picked:
            assert it.locator.read() == ref[key_of(it)]
        assert srv.requests - before == 2
        assert sharded._READ_AHEAD.held == 0  # every member taken: nothing held
        # an unplanned read is one request of its own, as before
        before = srv.requests
        assert items[0].locator.read() == ref[key_of(items[0])]
        assert srv.requests - before == 1


def test_members_far_apart_are_not_coalesced(tmp_path, monkeypatch):
    ref = make_shards(tmp_path, n_shards=1, per=6)
    monkeypatch.setattr(sharded, "COALESCE_GAP", 0)  # only members with no bytes between
    with http_server(tmp_path) as (base, srv):
        items = sharded.read_webdataset(base + "/train-000000.tar", kind="audio").items
        every_other = items[::2]  # a json and another sample between each two
        before = srv.requests
        assert sharded.read_ahead(every_other, object()) == 3
        for it in every_other:
            assert it.locator.read() == ref[key_of(it)]
        assert srv.requests - before == 3


def test_read_ahead_is_bounded_and_dropped(tmp_path, monkeypatch):
    ref = make_shards(tmp_path, n_shards=1, per=8)
    with http_server(tmp_path) as (base, _srv):
        items = sharded.read_webdataset(base + "/train-000000.tar", kind="audio").items
        sizes = [it.locator.size for it in items]
        # room for about three members: a run of all eight does not fit, runs of one do
        monkeypatch.setattr(sharded, "COALESCE_GAP", 0)
        monkeypatch.setattr(sharded, "READ_AHEAD_BYTES", 3 * max(sizes) + 10)
        owner = object()
        issued = sharded.read_ahead(items, owner)
        assert 1 <= issued <= 3
        assert 0 < sharded._READ_AHEAD.held <= sharded.READ_AHEAD_BYTES
        for it in items:  # planned or not, every member reads right
            assert it.locator.read() == ref[key_of(it)]
        assert sharded._READ_AHEAD.held == 0
        # planned and never read (a feed closed early): forgetting its owner drops the bytes
        monkeypatch.setattr(sharded, "READ_AHEAD_BYTES", 64 << 20)
        assert sharded.read_ahead(items, owner) >= 1
        assert sharded._READ_AHEAD.held > 0
        sharded.forget_reads(owner)
        assert sharded._READ_AHEAD.held == 0 and not sharded._READ_AHEAD.planned
        # a plan's bytes are dropped after the TTL too
        monkeypatch.setattr(sharded, "READ_AHEAD_TTL", 0.0)
        sharded.read_ahead(items[:1], owner)
        sharded.read_ahead(items[1:2], object())  # planning again drops what expired
        assert all(k[1] != items[0].locator.span[0] for k in sharded._READ_AHEAD.planned)
        monkeypatch.setattr(sharded, "READ_AHEAD_TTL", 120.0)
        for it in items[:2]:
            assert it.locator.read() == ref[key_of(it)]
        assert sharded._READ_AHEAD.held == 0


def test_a_failed_run_leaves_each_member_its_own_read(tmp_path, monkeypatch):
    ref = make_shards(tmp_path, n_shards=1, per=6)
    with http_server(tmp_path) as (base, _srv):
        url = base + "/train-000000.tar"
        items = sharded.read_webdataset(url, kind="audio").items
        bad = items[2].locator
        real = storage.read_range
        spans = []

        def read_range(u, start, length, **kw):
            spans.append((start, length))
            if length > max(it.locator.size for it in items):
                raise storage.StorageError(u, "a run's read failed")
            if (start, length) == bad.span:
                raise storage.StorageError(u, f"bytes {start}.. unreadable")
            return real(u, start, length, **kw)

        monkeypatch.setattr(storage, "read_range", read_range)
        assert sharded.read_ahead(items, object()) == 1
        for it in items:
            if it.locator is bad:
                with pytest.raises(storage.StorageError, match="unreadable"):
                    it.locator.read()
            else:
                assert it.locator.read() == ref[key_of(it)]
        assert len(spans) == 1 + len(items)  # the run, then each member by itself
        assert sharded._READ_AHEAD.held == 0


def test_feed_over_http_reads_batches_by_fewer_requests(tmp_path):
    """The RNN-T feed over HTTP shards: the same features as the local shards, fewer requests
    than items while iterating, only the bad member named, and no bytes held after close."""
    make_shards(tmp_path, n_shards=2, per=6)
    # a member whose audio is garbage, among good ones
    members = [("b00.flac", flac_bytes(90)), ("b00.json", b'{"text": "a", "duration": 0.5}'),
               ("b01.flac", b"fLaC" + bytes(300)), ("b01.json", b'{"text": "b"}'),
               ("b02.flac", flac_bytes(91)), ("b02.json", b'{"text": "c", "duration": 0.5}')]
    write_tar(tmp_path / "train-000002.tar", members)
    kw = dict(batch_size=5, device="cpu", training=False, seed=3)
    spec = "/train-{000000..000002}.tar"
    ref = {p.rsplit("#", 1)[-1]: np.asarray(b.features[r, :, : int(b.feature_lengths[r])])
           for b in rnnt_feed(str(tmp_path) + spec, **kw) for r, p in enumerate(b.paths)}
    with http_server(tmp_path) as (base, srv):
        feed = rnnt_feed(base + spec, **kw)
        before = srv.requests
        got, order = {}, []
        for b in feed:
            for r, p in enumerate(b.paths):
                got[p.rsplit("#", 1)[-1]] = np.asarray(
                    b.features[r, :, : int(b.feature_lengths[r])])
                order.append(p)
        used = srv.requests - before
        names = [n for n, _ in feed.errors]
        feed.close()
    assert names == [base + "/train-000002.tar#b01"]
    assert sorted(got) == sorted(ref)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], atol=1e-5)
    assert used < 14, used  # 15 items (14 good): runs of a batch's members per shard
    assert sharded._READ_AHEAD.held == 0
    # the order is the local shards' order
    local = [p.rsplit("#", 1)[-1] for b in rnnt_feed(str(tmp_path) + spec, **kw)
             for p in b.paths]
    assert [p.rsplit("#", 1)[-1] for p in order] == local
