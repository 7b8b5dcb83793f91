"""The RNN-T feed over sharded data against the same items as plain files, in one run.

Contenders (each round one epoch of the feed,
``training=True``: speed perturbation, log-mel, SpecAugment):

* ``files``: the items as loose FLAC files and a NeMo manifest (the reference);
* ``shards``: the same bytes in WebDataset tar shards on the local disk;
* ``s3``: those shards on a moto S3 server on 127.0.0.1 (a real HTTP server: the feed reads the
  members of each batch ahead by ranged GETs, members close together in a shard by one GET);
* ``shards_by_shard`` / ``s3_by_shard``: the same, with the epoch order grouped by shard
  (``shard_order=True``: shards shuffled, items shuffled within each shard).

Also measured: the shard index rate (members per second, a cold index of every shard, the
cache off) and the peak memory (RSS) of an epoch over one large shard against the same items as
files, each in a fresh process.

The data (deterministic speech-like FLAC, 2-16 s, :func:`make_data`) is made in the data
folder once. The index rate and the peak memory (``big_items`` > 0: one shard of that many 60 s
items, about 1.24 MiB each: 850 make a shard over 1 GiB; ``big_s3_items`` > 0: one such shard on
the S3 server, through the read-ahead) against the same items as files are measured once,
beside the rounds. :mod:`benchmarks.workloads.gpu_shards` runs the same feed on the GPU.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time

from benchmarks.harness import ROOT, log

NAME = "cpu_shards"
SUITE = "cpu"
UNIT = "audio-s/s"
TITLE = ("The RNN-T training feed (CPU) over 192 FLAC items as loose files, as 4 WebDataset "
         "shards on the local disk and on a local moto S3 server")
DEVICE = "cpu"
CONTENDERS = {
    "files": "loose FLAC files + NeMo manifest (the reference)",
    "shards": "the same bytes in 4 local tar shards, global order",
    "s3": "those shards on a moto S3 server on 127.0.0.1 (ranged GETs), global order",
    "shards_by_shard": "local shards, shard_order=True",
    "s3_by_shard": "S3 shards, shard_order=True",
}
# every contender runs avpipe: --baseline measures each with the other avpipe too
OURS = ("files", "shards", "s3", "shards_by_shard", "s3_by_shard")
RATIOS = [("shards", "files"), ("s3", "files"), ("shards_by_shard", "files"),
          ("s3_by_shard", "files")]
PARAMS = {"items": 192, "shards": 4, "batch_size": 32, "big_items": 0, "big_s3_items": 0}
QUICK = {"items": 16, "shards": 2, "batch_size": 8}
REQUIRES = ("moto", "boto3", "s3fs")


def prepare(ctx):
    d = os.path.join(ctx.data_dir, "shards_workload")
    make_data(d, ctx.params["items"], ctx.params["shards"])
    n = ctx.params["shards"]
    return {"dir": d, "files": os.path.join(d, "files", "manifest.jsonl"),
            "local": os.path.join(d, "shards", f"train-{{000000..{n - 1:06d}}}.tar"),
            "s3": f"s3://bench/shards/train-{{000000..{n - 1:06d}}}.tar"}


class Session:
    """The S3 server (its own process) up for the whole run, the shards uploaded, the index
    rate measured cold, then every index cached (as a feed finds them after its first run)
    and one warm-up epoch."""

    def __init__(self, ctx, device=DEVICE, s3=True):
        sys.path.insert(0, os.path.join(ROOT, "tests", "_support"))
        self.ctx, self.device, self.facts = ctx, device, {}
        os.environ.setdefault("AVPIPE_CACHE_DIR", os.path.join(ctx.data["dir"], "cache"))
        if device == "cpu":
            os.environ.setdefault("AVPIPE_DISABLE_GPU", "1")
        from avpipe import storage
        from avpipe.pipeline import shards as _sh

        self.server = None
        urls = {"local": storage.expand(ctx.data["local"])}
        if s3:
            from servers import s3_server

            self.server = s3_server(process=True)
            self.server.__enter__()
            import boto3

            client = boto3.client("s3")
            client.create_bucket(Bucket="bench")
            sd = os.path.join(ctx.data["dir"], "shards")
            for name in sorted(os.listdir(sd)):
                client.upload_file(os.path.join(sd, name), "bench", f"shards/{name}")
            urls["s3"] = storage.expand(ctx.data["s3"])
        self.facts["index_members_per_s"] = {k: round(index_rate(u)[0], 1)
                                              for k, u in urls.items()}
        log("index rate (members/s):", self.facts["index_members_per_s"])
        for u in sum(urls.values(), []):
            _sh.index_shard(u)
        epoch(ctx.data["files"], ctx.params["batch_size"], 99, device=device)
        self.specs = {"files": (ctx.data["files"], False),
                      "shards": (ctx.data["local"], False),
                      "s3": (ctx.data["s3"], False),
                      "shards_by_shard": (ctx.data["local"], True),
                      "s3_by_shard": (ctx.data["s3"], True)}

    def measure(self, name):
        spec, by_shard = self.specs[name]
        audio, wall, n = epoch(spec, self.ctx.params["batch_size"], self.ctx.round, by_shard,
                               device=self.device)
        if n != self.ctx.params["items"]:
            raise RuntimeError(f"{name}: {n} items, not {self.ctx.params['items']}")
        return audio / wall, {"seconds": round(wall, 3), "audio_seconds": round(audio, 1)}

    def peak_rss_s3(self, n):
        """Peak RSS of an epoch over one shard of ``n`` 60 s items on the S3 server against the
        same items as files (the server reads a whole object for every ranged GET: keep it
        small)."""
        import boto3

        from avpipe.pipeline import shards as _sh

        big = os.path.join(self.ctx.data["dir"], f"big_s3_{n}")
        make_data(big, n, 1, seed=2, seconds=(60, 60))
        tar = os.path.join(big, "shards", "train-000000.tar")
        boto3.client("s3").upload_file(tar, "bench", f"big_s3_{n}/train-000000.tar")
        url = f"s3://bench/big_s3_{n}/train-000000.tar"
        _sh.index_shard(url)
        env = {**os.environ, "PYTHONPATH": ROOT}
        pf = peak_rss(os.path.join(big, "files", "manifest.jsonl"), env)
        ps = peak_rss(url, env)
        return {"shard_mb": round(os.path.getsize(tar) / 2**20, 1), "files": pf, "s3": ps,
                "growth_mb": round(ps["peak_rss_mb"] - pf["peak_rss_mb"], 1)}

    def close(self):
        if self.server is not None and self.ctx.params.get("big_s3_items"):
            _FACTS["peak_rss_s3"] = self.peak_rss_s3(int(self.ctx.params["big_s3_items"]))
        if self.server is not None:
            self.server.__exit__(None, None, None)
            self.server = None


_FACTS = {}


def session(ctx):
    sess = Session(ctx)
    _FACTS.update(sess.facts)
    return sess


def finish(ctx):
    """The index rate, and with ``big_items`` the peak RSS over one big shard against the same
    items as files."""
    out = dict(_FACTS)
    _FACTS.clear()
    n = ctx.params.get("big_items") or 0
    if n:
        big = os.path.join(ctx.data_dir, f"shards_big{n}")
        make_data(big, n, 1, seed=1, seconds=(60, 60))
        env = {**os.environ, "PYTHONPATH": ROOT}
        pf = peak_rss(os.path.join(big, "files", "manifest.jsonl"), env)
        ps = peak_rss(os.path.join(big, "shards", "train-000000.tar"), env)
        size = os.path.getsize(os.path.join(big, "shards", "train-000000.tar"))
        out["peak_rss"] = {"shard_mb": round(size / 2**20, 1), "files": pf, "shard": ps,
                           "growth_mb": round(ps["peak_rss_mb"] - pf["peak_rss_mb"], 1)}
    return out


def make_data(d, n, n_shards, seed=0, seconds=(2, 16)):
    """n FLAC utterances of ``seconds`` (a range; 16 kHz), a manifest, and the same as
    n_shards tars."""
    import numpy as np
    import soundfile as sf

    done = os.path.join(d, f"done-{n}-{n_shards}-{seed}-{seconds[0]}-{seconds[1]}")
    if os.path.exists(done):
        return
    os.makedirs(os.path.join(d, "files"), exist_ok=True)
    os.makedirs(os.path.join(d, "shards"), exist_ok=True)
    rng = np.random.default_rng(seed)
    lines, members = [], [[] for _ in range(n_shards)]
    for i in range(n):
        sec = float(rng.uniform(*seconds))
        m = int(sec * 16000)
        t = np.arange(m) / 16000
        f0 = 110 + 80 * np.sin(2 * np.pi * 0.5 * t + rng.uniform(0, 6))
        x = 0.2 * np.sin(2 * np.pi * np.cumsum(f0) / 16000) * (0.6 + 0.4 * np.sin(7 * t))
        x += 0.01 * rng.standard_normal(m)
        name = f"utt{i:05d}.flac"
        b = io.BytesIO()
        sf.write(b, x.astype(np.float32), 16000, format="FLAC")
        data = b.getvalue()
        with open(os.path.join(d, "files", name), "wb") as f:
            f.write(data)
        meta = {"text": f"utterance number {i}", "duration": m / 16000}
        lines.append(json.dumps({"audio_filepath": name, **meta}))
        members[i % n_shards] += [(name, data), (name.replace(".flac", ".json"),
                                                 json.dumps(meta).encode())]
    with open(os.path.join(d, "files", "manifest.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")
    for s, mem in enumerate(members):
        with tarfile.open(os.path.join(d, "shards", f"train-{s:06d}.tar"), "w") as tf:
            for name, data in mem:
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    open(done, "w").close()


def epoch(spec, batch_size, seed, shard_order=False, device="cpu"):
    """audio seconds and wall seconds of one training epoch of the CPU RNN-T feed."""
    from avpipe.recipes import rnnt_feed

    feed = rnnt_feed(spec, batch_size=batch_size, device=device, training=True, seed=seed,
                     shard_order=shard_order)
    t0 = time.perf_counter()
    audio = 0.0
    n = 0
    for b in feed:
        audio += float(sum(b.durations))
        n += len(b.paths)
    wall = time.perf_counter() - t0
    assert not feed.errors, feed.errors[:3]
    feed.close()
    return audio, wall, n


def index_rate(urls):
    """members per second of a cold index of every shard (the cache off)."""
    from avpipe.pipeline import shards

    t0 = time.perf_counter()
    idx = shards.index_shards(urls, cache=False)
    wall = time.perf_counter() - t0
    members = sum(len(s.members) for ix in idx for s in ix.samples)
    return members / wall, members, wall


_PEAK = r"""
import resource, sys, json
sys.path.insert(0, sys.argv[1])
from avpipe.recipes import rnnt_feed
feed = rnnt_feed(sys.argv[2], batch_size=16, device="cpu", training=False, seed=0)
n = sum(len(b.paths) for b in feed)
# VmHWM: this process's own high-water mark (ru_maxrss is carried over from the parent across
# fork and exec, so a parent larger than the child would be measured instead)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
try:
    with open("/proc/self/status") as f:
        peak = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024
except (OSError, StopIteration):
    pass
print(json.dumps({"items": n, "peak_rss_mb": peak}))
"""


def peak_rss(spec, env):
    out = subprocess.run([sys.executable, "-c", _PEAK, ROOT, spec], capture_output=True,
                         text=True, env=env, timeout=3600)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


