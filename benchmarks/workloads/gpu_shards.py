"""The RNN-T training feed on the GPU over local WebDataset shards against the same items as
loose files (:mod:`benchmarks.workloads.cpu_shards`' data and feed, ``device="cuda"``), in
interleaved rounds, ratio of medians; plus the shards in shard order."""

from __future__ import annotations

from benchmarks.workloads import cpu_shards

NAME = "gpu_shards"
SUITE = "gpu"
UNIT = "audio-s/s"
TITLE = ("The RNN-T training feed (GPU) over 512 FLAC items as loose files and as 8 WebDataset "
         "shards on the local disk")
CONTENDERS = {
    "files": "loose FLAC files + NeMo manifest (the reference)",
    "shards": "the same bytes in 8 local tar shards, global order",
    "shards_by_shard": "local shards, shard_order=True",
}
RATIOS = [("shards", "files"), ("shards_by_shard", "files")]
PARAMS = {"items": 512, "shards": 8, "batch_size": 64, "big_items": 0}
QUICK = {"items": 32, "shards": 2, "batch_size": 16}
REQUIRES = ("gpu", "cupy")

prepare = cpu_shards.prepare
finish = cpu_shards.finish


def session(ctx):
    sess = cpu_shards.Session(ctx, device="cuda", s3=False)
    cpu_shards._FACTS.update(sess.facts)
    return sess
