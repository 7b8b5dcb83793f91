"""The RNN-T feed over sharded data against the same items as plain files, in one run.

Contenders (interleaved rounds, ratio of medians; each round one epoch of the CPU feed,
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

::

    python benchmarks/bench_shards.py --rounds 3 --out benchmarks/results/cpu_shards.json

The data (deterministic speech-like FLAC, 2-16 s) is made under ``--data`` once.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def log(*a):
    print(*a, file=sys.stderr, flush=True)


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


def epoch(spec, batch_size, seed, shard_order=False):
    """audio seconds and wall seconds of one training epoch of the CPU RNN-T feed."""
    from avpipe.recipes import rnnt_feed

    feed = rnnt_feed(spec, batch_size=batch_size, device="cpu", training=True, seed=seed,
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


def environment():
    import numpy

    import avpipe

    vers = {"avpipe": avpipe.__version__, "numpy": numpy.__version__,
            "python": platform.python_version()}
    for mod in ("fsspec", "s3fs", "moto", "soundfile"):
        try:
            vers[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            vers[mod] = None
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=ROOT, capture_output=True, text=True).stdout.strip())
    return {"commit": commit, "dirty": dirty, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                     time.gmtime()),
            "cpu": cpu, "cores": os.cpu_count(), "versions": vers}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "avpipe_bench_shards"))
    ap.add_argument("--items", type=int, default=192)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--big-items", type=int, default=0,
                    help="also measure peak RSS over one shard of this many 60 s items (about "
                         "1.24 MiB each: 850 make a shard over 1 GiB) against the same items as "
                         "files")
    ap.add_argument("--big-s3-items", type=int, default=0,
                    help="also measure peak RSS over one shard of this many 60 s items on the "
                         "moto S3 server (its read-ahead) against the same items as files (the "
                         "server reads a whole object for every ranged GET: keep it small)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ.setdefault("AVPIPE_DISABLE_GPU", "1")
    os.environ["AVPIPE_CACHE_DIR"] = os.path.join(a.data, "cache")
    make_data(a.data, a.items, a.shards)
    files = os.path.join(a.data, "files", "manifest.jsonl")
    spec_local = os.path.join(a.data, "shards", f"train-{{000000..{a.shards - 1:06d}}}.tar")
    from servers import s3_server

    res = {"workload": {"items": a.items, "shards": a.shards, "batch_size": a.batch_size,
                        "feed": "rnnt_feed(training=True, device='cpu'): speed perturbation, "
                                "log-mel (nemo), SpecAugment"},
           "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
           "environment": environment()}
    with s3_server(process=True):  # its own process: it shares no interpreter with the feed
        import boto3

        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="bench")
        for name in sorted(os.listdir(os.path.join(a.data, "shards"))):
            s3.upload_file(os.path.join(a.data, "shards", name), "bench", f"shards/{name}")
        spec_s3 = f"s3://bench/shards/train-{{000000..{a.shards - 1:06d}}}.tar"
        from avpipe import storage

        urls_local, urls_s3 = storage.expand(spec_local), storage.expand(spec_s3)
        rate = {"local": index_rate(urls_local), "s3": index_rate(urls_s3)}
        res["index_members_per_s"] = {k: round(v[0], 1) for k, v in rate.items()}
        log("index rate (members/s):", res["index_members_per_s"])
        # the indexes cached, as a feed finds them after its first run
        for u in urls_local + urls_s3:
            from avpipe.pipeline import shards as _sh

            _sh.index_shard(u)
        contenders = {"files": (files, False), "shards": (spec_local, False),
                      "s3": (spec_s3, False), "shards_by_shard": (spec_local, True),
                      "s3_by_shard": (spec_s3, True)}
        epoch(files, a.batch_size, 99)  # warm-up: imports, the page cache, thread pools
        rounds = {k: [] for k in contenders}
        for r in range(a.rounds):
            order = list(contenders)
            order = order[r % len(order):] + order[: r % len(order)]
            for k in order:
                spec, by_shard = contenders[k]
                audio, wall, n = epoch(spec, a.batch_size, r, by_shard)
                assert n == a.items, (k, n)
                rounds[k].append(audio / wall)
                log(f"round {r} {k}: {audio / wall:.0f} audio-s/s ({wall:.2f} s)")
        if a.big_s3_items:
            big = os.path.join(a.data, f"big{a.big_s3_items}")
            make_data(big, a.big_s3_items, 1, seed=2, seconds=(60, 60))
            tar = os.path.join(big, "shards", "train-000000.tar")
            s3.upload_file(tar, "bench", f"big{a.big_s3_items}/train-000000.tar")
            url = f"s3://bench/big{a.big_s3_items}/train-000000.tar"
            _sh.index_shard(url)
            env = {**os.environ, "PYTHONPATH": ROOT}
            pf = peak_rss(os.path.join(big, "files", "manifest.jsonl"), env)
            ps = peak_rss(url, env)
            res["peak_rss_s3"] = {"shard_mb": round(os.path.getsize(tar) / 2**20, 1),
                                  "files": pf, "s3": ps,
                                  "growth_mb": round(ps["peak_rss_mb"] - pf["peak_rss_mb"], 1)}
            log("peak RSS over S3:", res["peak_rss_s3"])
    med = {k: sorted(v)[len(v) // 2] for k, v in rounds.items()}
    res["audio_s_per_s"] = {k: {"median": round(med[k], 1), "rounds": [round(x, 1) for x in v]}
                            for k, v in rounds.items()}
    res["ratio_to_files"] = {k: round(med[k] / med["files"], 3) for k in med}
    log("ratio of medians to files:", res["ratio_to_files"])
    if a.big_items:
        big = os.path.join(a.data, f"big{a.big_items}")
        make_data(big, a.big_items, 1, seed=1, seconds=(60, 60))
        env = {**os.environ, "PYTHONPATH": ROOT}
        pf = peak_rss(os.path.join(big, "files", "manifest.jsonl"), env)
        ps = peak_rss(os.path.join(big, "shards", "train-000000.tar"), env)
        size = os.path.getsize(os.path.join(big, "shards", "train-000000.tar"))
        res["peak_rss"] = {"shard_mb": round(size / 2**20, 1), "files": pf, "shard": ps,
                           "growth_mb": round(ps["peak_rss_mb"] - pf["peak_rss_mb"], 1)}
        log("peak RSS:", res["peak_rss"])
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
