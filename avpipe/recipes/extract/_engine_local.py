"""The local engine: one worker per device entry, each over a contiguous range of shards.

A worker computes shard after shard (:func:`~._process.iter_shards`) and hands each finished
shard to a writer thread through a bounded queue, so decoding, features and writing overlap.
One worker runs in this process; several run as spawned processes (a GPU worker sees only its
GPU, through ``CUDA_VISIBLE_DEVICES``) and report progress through a queue.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

from . import _deps
from ._inputs import Item
from ._process import PROFILE, Result, Shard, iter_shards, profile_report, timed
from ._writers import write_shard

# shards are written by WRITERS threads (default 4; a shard's files are its own, so any order
# is fine), with at most WRITE_QUEUE computed shards waiting for them
WRITERS = max(1, int(os.environ.get("AVPIPE_EXTRACT_WRITERS", "4")))
WRITE_QUEUE = 2


def _progress_payload(r: Result) -> tuple:
    seconds = frames = 0.0
    if r.ok:
        if r.item.kind == "audio":
            seconds = float(r.info.get("seconds", 0.0))
        elif r.item.kind == "video":
            frames = float(len(r.info.get("times", ())))
        else:
            frames = 1.0
    return (1, 0 if r.ok else 1, seconds, frames)


def run_worker(
    device: str,
    shards: list[Shard],
    items: list[Item],
    cfg: dict,
    out_dir: str,
    fmt: str,
    total: int,
    workers: int,
    duplicated: frozenset,
    report: Callable[[tuple], None],
) -> None:
    """Compute and write ``shards`` on ``device``; ``report((files, errors, audio_s, frames))``
    after each input."""
    dev = _deps.resolve_device(device)
    if dev.is_cuda:
        import cupy

        cupy.cuda.Device(dev.index).use()
    q: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE)
    failure: list[BaseException] = []

    def writer():
        while True:
            job = q.get()
            if job is None:
                return
            if failure:
                continue  # drain: the run is failing
            shard, results = job
            try:
                with timed("write"):
                    write_shard(out_dir, shard, results, cfg, fmt, total, duplicated)
            except BaseException as e:  # noqa: BLE001 - re-raised in the worker
                failure.append(e)

    # decoders first: the audio loader forks its workers, better before any thread starts
    results = iter_shards(shards, items, cfg, dev, workers=workers,
                          on_result=lambda r: report(_progress_payload(r)))
    threads = [threading.Thread(target=writer, name=f"avpipe-extract-writer-{i}", daemon=True)
               for i in range(WRITERS)]
    for t in threads:
        t.start()
    try:
        for shard, rs in results:
            if failure:
                break
            with timed("writer queue wait"):
                q.put((shard, rs))
    finally:
        for _ in threads:
            q.put(None)
        with timed("final write wait"):
            for t in threads:
                t.join()
        if PROFILE:
            import sys

            print(f"avpipe extract profile ({device}): {profile_report()}", file=sys.stderr)
    if failure:
        raise failure[0]


def split_shards(shards: list[Shard], n: int) -> list[list[Shard]]:
    """Contiguous ranges of shards, as even as possible."""
    n = max(1, min(n, len(shards))) if shards else 1
    k, r = divmod(len(shards), n)
    out, a = [], 0
    for i in range(n):
        b = a + k + (1 if i < r else 0)
        out.append(shards[a:b])
        a = b
    return out


def _visible(index: int) -> str:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        ids = [x.strip() for x in env.split(",") if x.strip()]
        if index < len(ids):
            return ids[index]
    return str(index)


def run_local(devices: list[str], shards, items, cfg, out_dir, fmt, total, workers, duplicated,
              report) -> list[str]:
    """Run ``shards`` over ``devices``; returns the workers' failures (empty when all ran)."""
    groups = split_shards(shards, len(devices))
    if len(groups) == 1:
        try:
            run_worker(devices[0], groups[0], items, cfg, out_dir, fmt, total, workers,
                       duplicated, report)
        except Exception as e:  # noqa: BLE001 - a worker failure (not an input's)
            return [f"{devices[0]}: {type(e).__name__}: {e}"]
        return []
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    pq = ctx.Queue()
    procs = []
    for dev, group in zip(devices, groups):
        if not group:
            continue
        full = {i: items[i].to_task() for s in group for i in range(s.start, s.end)}
        vis = ""
        if dev.startswith("cuda"):
            vis = _visible(int(dev.split(":")[1]) if ":" in dev else 0)
        p = ctx.Process(
            target=_child_full, daemon=False,
            args=(len(procs), os.getpid(), dev, vis, group, full, cfg, out_dir, fmt, total, workers,
                  duplicated, pq),
        )
        p.start()
        procs.append((dev, p))
    failures = []
    finished: set[int] = set()
    while len(finished) < len(procs):
        try:
            wid, kind, payload = pq.get(timeout=1.0)
        except queue.Empty:
            for wid, (d, p) in enumerate(procs):
                if wid not in finished and p.exitcode is not None:
                    failures.append(f"{d}: worker ended without finishing (exit code "
                                    f"{p.exitcode})")
                    finished.add(wid)
            continue
        if kind == "p":
            report(payload)
        elif kind == "error":
            failures.append(payload)
            finished.add(wid)
        else:
            finished.add(wid)
    for _, p in procs:
        p.join()
    return failures


def _die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when its parent dies (a killed run leaves no worker
    writing behind the next one's back)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent is already gone
        os._exit(1)


def _child_full(wid, parent, device, visible, shards, full, cfg, out_dir, fmt, total, workers,
                duplicated, pq):
    _die_with_parent(parent)
    if device.startswith("cuda"):
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        device = "cuda:0"
    items = {i: Item.from_task(t) for i, t in full.items()}
    try:
        run_worker(device, shards, items, cfg, out_dir, fmt, total, workers, duplicated,
                   lambda p: pq.put((wid, "p", p)))
    except BaseException as e:  # noqa: BLE001
        pq.put((wid, "error", f"{device}: {type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    pq.put((wid, "done", None))
