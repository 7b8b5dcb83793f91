"""The Ray engine: the same shards, computed by Ray Data actors anywhere on a cluster.

read: one row per shard to do (its inputs, as plain tuples) -> ``map_batches`` with a pool of
actors (``num_gpus=1`` each on GPUs; one actor per ``--devices`` entry on CPUs), each actor
computing a shard with the local engine's code (:func:`~._process.iter_shards`) and writing it
with the same writer (:func:`~._writers.write_shard`) -> the driver collects the shards' index
rows as they finish (progress) and merges the parts. The output folder must be reachable from
every node: a shared file system, or a URL (``s3://``, ``gs://``), which the actors write to
as the local engine does (:mod:`._writers`; each node needs the store's credentials, e.g.
``AWS_*`` in the environment); the files are byte-identical to the local engine's.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time

from ... import settings
from ...device import resolve_device
from ...pipeline.sources import Item
from . import _process
from ._engine_local import _FIRST_WAIT_EXTRA_S, _progress_payload
from ._process import Shard, iter_shards
from ._writers import is_remote, write_shard

log = logging.getLogger("avpipe.extract")


def watched_shards(shards, items, cfg, dev, *, workers, on_result=None, limit="auto"):
    """:func:`~._process.iter_shards` with the local engine's per-input rule, inside this
    process (a Ray actor): the shards are computed on a daemon thread while this one watches
    its wait on one input (``_process.WAITING``, as the local engine's watchdog does). Past
    ``limit`` seconds (``"auto"``: ``AVPIPE_EXTRACT_FILE_TIMEOUT``; the first input of each
    kind gets ``_FIRST_WAIT_EXTRA_S`` more) the input is a ``DecodeTimeoutError`` row, the
    thread stuck in its read is given up (nothing joins it: it is a daemon; its decoders stay
    with it) and the shards not yet finished are computed again without that input. Yields
    ``(shard, results)`` in order; ``on_result`` sees each result of a shard once it is done
    (never a given-up attempt's)."""
    limit = settings.extract_file_timeout() if limit == "auto" else limit
    blocked: dict = {}
    left = list(shards)
    while left:
        gen = iter_shards(left, items, cfg, dev, workers=workers, blocked=blocked)
        q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_drain, args=(gen, q), daemon=True,
                         name="avpipe-extract-ray-shards").start()
        stuck = None
        while stuck is None:
            try:
                kind, v = q.get(timeout=0.25 if limit else None)
            except queue.Empty:
                stuck = _stuck_input(limit)
                continue
            if kind == "error":
                raise v
            if kind == "done":
                return
            s, results = v
            left.pop(0)
            if on_result is not None:
                for r in results:
                    on_result(r)
            yield s, results
        path = items[stuck].path
        log.warning("no result for %s within %g s (a read that never returns?); it is "
                    "skipped and the %d shard(s) left are computed again", path, limit,
                    len(left))
        blocked[stuck] = ("DecodeTimeoutError",
                          f"{path}: no result within {limit:g} s "
                          "(AVPIPE_EXTRACT_FILE_TIMEOUT): a read that never returned; "
                          "the input was skipped")


def _drain(gen, q) -> None:
    try:
        for v in gen:
            q.put(("shard", v))
    except BaseException as e:  # noqa: BLE001 - raised on the watching thread
        q.put(("error", e))
    else:
        q.put(("done", None))


def _stuck_input(limit):
    """The input this process has waited on for longer than ``limit`` (``WAITING``), or None."""
    w = _process.WAITING
    i, since, first = w["index"], w["since"], w["first"]
    if not limit or i is None:
        return None
    allowed = limit + (_FIRST_WAIT_EXTRA_S if first else 0.0)
    if time.monotonic() - since <= allowed or w["index"] != i:
        return None
    w["index"] = None  # the given-up thread's wait is over for the watch
    return i


class _ShardActor:
    def __init__(self, cfg, out_dir, fmt, total, workers, duplicated, gpu):
        self.cfg, self.out_dir, self.fmt, self.total = cfg, out_dir, fmt, total
        self.workers, self.duplicated = workers, frozenset(duplicated)
        self.device = "cuda:0" if gpu else "cpu"  # Ray sets CUDA_VISIBLE_DEVICES per actor

    def __call__(self, batch):
        dev = resolve_device(self.device)
        out = {"start": [], "files": [], "errors": [], "seconds": [], "frames": []}
        for start, end, tasks in zip(batch["start"], batch["end"], batch["tasks"]):
            start, end = int(start), int(end)
            shard = Shard(start, end)
            items = {t[0]: Item.from_task(t) for t in json.loads(tasks)}
            acc = [0, 0, 0.0, 0.0]

            def add(r, acc=acc):
                p = _progress_payload(r)
                for i in range(4):
                    acc[i] += p[i]

            for s, results in watched_shards([shard], items, self.cfg, dev,
                                             workers=self.workers, on_result=add):
                write_shard(self.out_dir, s, results, self.cfg, self.fmt, self.total,
                            self.duplicated)
            out["start"].append(start)
            out["files"].append(acc[0])
            out["errors"].append(acc[1])
            out["seconds"].append(acc[2])
            out["frames"].append(acc[3])
        return out


def run_ray(devices, shards, items, cfg, out_dir, fmt, total, workers, duplicated, report,
            *, address=None) -> list[str]:
    """Compute ``shards`` on Ray; returns failures (empty when every shard was written)."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise RuntimeError("--engine ray needs Ray Data: pip install 'avpipe[ray]'") from None

    started = False
    if not ray.is_initialized():
        kw = {}
        if address is None and not os.environ.get("RAY_ADDRESS"):
            # a local instance started here: its workers import this avpipe (the folder that
            # holds the package, four levels above this file)
            here = os.path.abspath(__file__)
            top = here
            for _ in range(4):
                top = os.path.dirname(top)
            kw["runtime_env"] = {"env_vars": {
                "PYTHONPATH": os.pathsep.join(
                    x for x in (top,
                                os.environ.get("PYTHONPATH")) if x)}}
        ray.init(address=address, log_to_driver=False, include_dashboard=False, **kw)
        started = True
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
    except AttributeError:
        pass
    try:
        gpu = any(d.startswith("cuda") for d in devices)
        if gpu:
            n_actors = max(1, int(ray.cluster_resources().get("GPU", 0)))
        else:
            n_actors = len(devices)
        rows = []
        for s in shards:
            tasks = [items[i].to_task() for i in range(s.start, s.end)]
            rows.append({"start": s.start, "end": s.end, "tasks": json.dumps(tasks)})
        ds = ray.data.from_items(rows, override_num_blocks=len(rows))
        kwargs = dict(
            fn_constructor_kwargs=dict(cfg=cfg, out_dir=out_dir if is_remote(out_dir) else
                                       os.path.abspath(out_dir), fmt=fmt,
                                       total=total, workers=workers,
                                       duplicated=sorted(duplicated), gpu=gpu),
            batch_size=1, concurrency=min(n_actors, len(rows)), batch_format="numpy",
        )
        if gpu:
            kwargs["num_gpus"] = 1
        else:
            kwargs["num_cpus"] = 1
        out = ds.map_batches(_ShardActor, **kwargs)
        try:
            for r in out.iter_rows():
                report((int(r["files"]), int(r["errors"]), float(r["seconds"]),
                        float(r["frames"])))
        except Exception as e:  # noqa: BLE001 - an actor failed: the shards it had stay to do
            return [f"ray: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
        return []
    finally:
        if started:
            ray.shutdown()
