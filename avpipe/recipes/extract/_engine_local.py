"""The local engine: one worker per device entry, each over a contiguous range of shards.

A worker computes shard after shard (:func:`~._process.iter_shards`) and hands each finished
shard to a writer thread through a bounded queue, so decoding, features and writing overlap.
Workers are :class:`~avpipe.pipeline.workers.Worker` processes, fresh interpreters (a GPU
worker sees only its GPU, through ``CUDA_VISIBLE_DEVICES``; the first is started ahead, see
:class:`Standby`, forked instead for a CPU job on Linux when the caller runs no other thread),
each given its shards as one request; they report progress to the parent as messages during
that call (:func:`~avpipe.pipeline.workers.tell`). A worker a native decoder crashes is replaced
(see ``run_local``), so a crash costs the input that caused it, not the run.

Operators registered outside avpipe (:mod:`avpipe.ops.registry`) reach every worker: each
imports the modules that registered them before its work. One registered in the caller's
``__main__`` reaches a forked worker only; a run that would need it in a fresh interpreter fails
before its work starts (:class:`~avpipe.ops.registry.OperatorNotImportableError`).
"""

from __future__ import annotations

import importlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

from ... import settings
from ...device import resolve_device
from ...ops import registry
from ...pipeline import workers as _workers
from ...pipeline.audio_loader import drop_readers_ahead, start_readers_ahead
from ...pipeline.sources import Item
from ...pipeline.workers import Worker, tell
from ._process import (
    WAITING,
    Result,
    Shard,
    iter_shards,
    mark,
    profile_report,
    profiling,
    timed,
)
from ._writers import listing, read_part, write_shard

# shards are written by WRITERS threads (default 4; a shard's files are its own, so any order
# is fine), with at most WRITE_QUEUE computed shards waiting for them

WRITE_QUEUE = 2


def _progress_payload(r: Result) -> tuple:
    seconds = frames = 0.0
    if r.ok:
        if r.item.kind == "audio":
            seconds = float(r.info.get("seconds", 0.0))
        elif r.item.kind == "video":  # images are not frames
            frames = float(len(r.info.get("times", ())))
    return (1, 0 if r.ok else 1, seconds, frames)


class _Tally:
    """Progress payloads summed and sent every ``every`` inputs (and on :meth:`flush`): one
    message per batch instead of one per input through the pipe to the parent."""

    def __init__(self, report: Callable[[tuple], None], every: int = 64):
        self.report, self.every = report, every
        self.files = self.errors = 0
        self.seconds = self.frames = 0.0

    def __call__(self, r: Result) -> None:
        files, errors, seconds, frames = _progress_payload(r)
        self.files += files
        self.errors += errors
        self.seconds += seconds
        self.frames += frames
        if self.files >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.files:
            self.report((self.files, self.errors, self.seconds, self.frames))
            self.files = self.errors = 0
            self.seconds = self.frames = 0.0


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
    blocked: dict | None = None,
) -> None:
    """Compute and write ``shards`` on ``device``; ``report((files, errors, audio_s, frames))``
    every batch of inputs and at the end of each shard."""
    t0 = time.perf_counter()
    with timed("start: device"):  # CUDA's driver; its context comes with the decoders' set-up
        dev = resolve_device(device)
    q: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE)
    failure: list[BaseException] = []
    first_written: list[float] = []

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
                if not first_written:
                    first_written.append(time.perf_counter() - t0)
                    mark("start: first shard written", first_written[0])
            except BaseException as e:  # noqa: BLE001 - re-raised in the worker
                failure.append(e)

    # decoders first: the audio loader forks its workers, better before any thread starts
    tally = _Tally(report, every=int(cfg.get("batch_size", 64)))
    with timed("start: decoders set up"):
        # the audio decoders' warm-up threads create the device's context while the loader
        # reads the files' headers (in processes); this thread uses the device after both
        results = iter_shards(shards, items, cfg, dev, workers=workers, on_result=tally,
                              blocked=blocked)
        if dev.is_cuda:
            import cupy

            cupy.cuda.Device(dev.index).use()
    # the decoders are set up: readers the standby started ahead and no loader took (a CPU
    # worker, a job without FLAC) would only idle
    drop_readers_ahead()
    threads = [threading.Thread(target=writer, name=f"avpipe-extract-writer-{i}", daemon=True)
               for i in range(settings.extract_writers())]
    for t in threads:
        t.start()
    try:
        for shard, rs in results:
            tally.flush()
            if shard is shards[0]:
                mark("start: first shard computed", time.perf_counter() - t0)
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
        if profiling():
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


def _visible_for(device: str) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a worker on ``device`` ("" for the CPU)."""
    if not device.startswith("cuda"):
        return ""
    return _visible(int(device.split(":")[1]) if ":" in device else 0)


def _visible(index: int) -> str:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        ids = [x.strip() for x in env.split(",") if x.strip()]
        if index < len(ids):
            return ids[index]
    return str(index)


# A decoder that crashes the process (a native fault in a library, on a damaged file) costs
# only the worker process it ran in: the run goes on with a new worker on the shards left, and a
# shard that ends two workers has its inputs probed in their own processes (halving the groups
# that crash); the inputs that end theirs are reported as errors and the shard is done without
# them. A shard that ends eight workers is given up (the run fails, and stays resumable).
_CRASHES_BEFORE_PROBING = 2
# a crash is charged to the first shard without a part, but the worker decodes ahead of the
# shards it writes: where that shard holds no culprit, this many inputs after it are probed
_PROBE_AHEAD = 512
_CRASHES_PER_SHARD = 8  # then the shard is given up (a failure; the run stays resumable)
_MAX_RESTARTS = 64
# the first input of each kind waits this much longer: its wait includes the decoders' start
# (worker processes, libraries' first calls, kernels compiled on a GPU)
_FIRST_WAIT_EXTRA_S = 60.0
_STUCK_EXIT = 75  # a worker's exit code after its watchdog gave up an input (_watch_inputs)


class Standby:
    """A worker process (a :class:`~avpipe.pipeline.workers.Worker`) started before the parent
    knows its work: its interpreter starts and imports what a worker needs (CuPy too, without
    touching the GPU) while the parent counts the GPUs, resolves the inputs and reads what an
    earlier run left; its first request (:func:`_prepare`) starts what the work will need,
    and :func:`run_local` sends it the first group of shards as its second (:meth:`start_work`).
    :meth:`stop` ends it when it was not used (nothing to do, an error).
    ``audio``: the job is audio, so the GPU FLAC loader's reader processes start meanwhile too
    (``start_readers_ahead``; ended once the decoders are set up if no loader took them).
    ``cpu``: the job runs on the CPU alone: on Linux, where this process runs no thread but its
    main one (no lock another thread holds is copied into the child), the worker is forked, its
    modules already imported (a fresh interpreter spends most of a second starting and
    importing, ahead of a CPU job's first shard); it imports the CPU log-mel's FFT before its
    work comes."""

    def __init__(self, *, audio: bool = False, cpu: bool = False):
        self.proc = Worker(fork=bool(cpu))
        self.forked = self.proc.forked
        self.used = False
        try:
            self.proc.send((_prepare, (bool(audio), bool(cpu))))
        except (OSError, ValueError):  # gone already: start_work says so
            pass

    def start_work(self, request: tuple) -> bool:
        """Send it its work, a ``(fn, args)`` request; False when it is gone (the caller
        starts a new worker instead)."""
        if self.used or not self.proc.alive:
            return False
        try:
            self.proc.send(request)
        except (OSError, ValueError):
            return False
        self.used = True
        return True

    def stop(self) -> None:
        if not self.used:  # it has touched nothing: no need to wait for its imports
            self.used = True
            self.proc.stop()


def _prepare(audio: bool, cpu: bool) -> None:
    """A standby worker's first request: what its work will need, started ahead. What a worker
    needs came with this module's imports (the decoders and operators, through _process); not
    CuPy (CUDA_VISIBLE_DEVICES, set by _worker_main for the device it is given, must come
    first)."""
    if audio:
        start_readers_ahead()  # the GPU FLAC loader's readers (they need no device)
    if cpu:
        import scipy.fft  # noqa: F401 - the CPU log-mel's FFT, imported at its first item else


def run_local(devices: list[str], shards, items, cfg, out_dir, fmt, total, workers, duplicated,
              report, standby: Standby | None = None) -> list[str]:
    """Run ``shards`` over ``devices``, one worker process each; returns the workers' failures
    (empty when all ran). ``standby``: a started :class:`Standby`, used for the first worker."""
    groups = [g for g in split_shards(shards, len(devices)) if g]
    todo = list(zip(devices, groups))
    crashes: dict[int, int] = {}  # shard start -> workers it ended
    blocked: dict[int, str] = {}
    failures: list[str] = []
    restarts = 0
    while todo:
        ended = _run_workers(todo, items, cfg, out_dir, fmt, total, workers, duplicated,
                             report, blocked, standby)
        standby = None
        todo = []
        present = listing(out_dir)  # a URL's objects, listed once
        for dev, group, why in ended:
            left = [sh for sh in group if read_part(out_dir, sh, total, present) is None]
            if why is None or not left:
                continue
            if why.startswith("stuck "):  # one input's read never returned: it is skipped
                _, index, limit = why.split(" ")
                index = int(index)
                print(f"avpipe extract: no result for {items[index].path} within {limit} s "
                      f"(a read that never returns?); it is skipped and a new worker on {dev} "
                      f"takes the {len(left)} shard(s) left", file=sys.stderr)
                blocked[index] = ("DecodeTimeoutError",
                                  f"{items[index].path}: no result within {limit} s "
                                  "(AVPIPE_EXTRACT_FILE_TIMEOUT): a read that never returned; "
                                  "the input was skipped")
                todo.append((dev, left))
                continue
            if not why.startswith("signal") or restarts >= _MAX_RESTARTS:
                failures.append(f"{dev}: {why}")
                continue
            first = left[0]
            if crashes.get(first.start, 0) >= _CRASHES_PER_SHARD:
                failures.append(f"{dev}: shard {first.start}-{first.end - 1} ended "
                                f"{_CRASHES_PER_SHARD} workers (last: {why})")
                continue
            restarts += 1
            print(f"avpipe extract: the worker on {dev} was ended by a {why} (a native decoder "
                  f"crash); a new one takes the {len(left)} shard(s) left", file=sys.stderr)
            crashes[first.start] = crashes.get(first.start, 0) + 1
            if crashes[first.start] >= _CRASHES_BEFORE_PROBING:
                found = _probe(dev, range(first.start, first.end), items, cfg, workers, blocked)
                if not found:  # decoded ahead of the writer: the culprit may be further on
                    ahead = [i for sh in left[1:] for i in range(sh.start, sh.end)]
                    found = _probe(dev, ahead[:_PROBE_AHEAD], items, cfg, workers, blocked)
                blocked.update(found)
            todo.append((dev, left))
    return failures


def _ops_in_main(cfg: dict) -> list[str]:
    """The operators ``cfg`` names that were registered in the caller's ``__main__``: a fresh
    interpreter cannot import them."""
    out = []
    for section, kind in (("audio", "audio"), ("video", "image"), ("image", "image")):
        for op in (cfg.get(section) or {}).get("ops", ()):
            try:
                entry = registry.get(op["op"], kind)
            except KeyError:
                continue
            if entry.module == "__main__" and entry.name not in out:
                out.append(entry.name)
    return out


def _check_fresh_workers_can_run(cfg: dict) -> None:
    """OperatorNotImportableError when ``cfg`` names an operator registered in ``__main__``
    (it is about to be run by a fresh interpreter, which never imports the caller's script)."""
    names = _ops_in_main(cfg)
    if names:
        raise registry.OperatorNotImportableError(
            f"operator(s) {', '.join(map(repr, names))} registered in the script being run "
            "(__main__), which extraction's worker processes do not import: register them in "
            "an importable module (one the script imports) instead")


def _import_op_modules(modules: tuple) -> None:
    """In a worker: import the modules that registered the run's operators outside avpipe."""
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - named: the operators it registers are missing
            raise ImportError(f"the operators' module {m!r} does not import in an extraction "
                              f"worker ({type(e).__name__}: {e})") from None


def _run_workers(todo, items, cfg, out_dir, fmt, total, workers, duplicated, report, blocked,
                 standby: Standby | None = None):
    """One worker (a :class:`~avpipe.pipeline.workers.Worker`) per ``(device, shards)`` (the
    first: ``standby`` when given), each given its shards as one request; returns ``(device,
    shards, why)`` for each, ``why`` None when it finished, ``"signal N"`` when a signal ended
    it, ``"stuck INDEX LIMIT"`` when its watchdog gave up an input, else the error."""
    usable = standby is not None and standby.proc.alive and not standby.used
    fresh = len(todo) - (1 if usable and standby.forked else 0)
    if fresh:
        _check_fresh_workers_can_run(cfg)
    modules = tuple(registry.modules())
    procs: list[tuple[str, list, Worker]] = []
    skip: list[int] = []  # answers to pass over before the work's (the standby's _prepare)
    try:
        _start_workers(todo, items, cfg, out_dir, fmt, total, workers, duplicated, blocked,
                       standby, modules, procs, skip)
        ended = _wait_workers(procs, skip, report)
    except BaseException:  # (Ctrl-C, a refused start): the workers still at work are killed
        for _d, _g, p in procs:
            p.stop()
        raise
    for _d, _g, p in procs:  # each has answered or ended: it leaves at once
        p.end()
    return ended


def _start_workers(todo, items, cfg, out_dir, fmt, total, workers, duplicated, blocked,
                   standby, modules, procs, skip) -> None:
    for dev, group in todo:
        full = {i: items[i].to_task() for s in group for i in range(s.start, s.end)}
        vis = _visible_for(dev)
        args = (dev, vis, group, full, cfg, out_dir, fmt, total, workers, duplicated, blocked,
                modules, time.time())
        if standby is not None and standby.start_work((_worker_main, args)):
            p, n = standby.proc, 1
        else:
            _check_fresh_workers_can_run(cfg)
            env = {"CUDA_VISIBLE_DEVICES": vis} if dev.startswith("cuda") else None
            p, n = Worker(env=env), 0
            p.send((_worker_main, args))
        standby = None
        procs.append((dev, group, p))
        skip.append(n)


def _wait_workers(procs, skip, report) -> list:
    """Each worker's messages (progress, "stuck"), answer or end, until every one is done."""
    why: dict[int, str | None] = {}
    index = {id(p): k for k, (_d, _g, p) in enumerate(procs)}

    def ended(p: Worker) -> str:
        p.join(timeout=10)  # its pipe closes as it dies: the exit code follows
        if p.signal is not None:
            return f"signal {p.signal}"
        return f"worker ended without finishing (exit code {p.exitcode})"

    while len(why) < len(procs):
        waiting = [p for k, (_d, _g, p) in enumerate(procs) if k not in why]
        ready = _workers.wait(waiting, timeout=1.0)
        if not ready:
            for p in waiting:
                if not p.alive:
                    why[index[id(p)]] = ended(p)
            continue
        for p in ready:
            k = index[id(p)]
            try:
                kind, value = p.recv()
            except (EOFError, OSError):
                why[k] = ended(p)
                continue
            if kind == "msg":
                tag, payload = value
                if tag == "p":
                    report(payload)
                elif tag == "stuck":
                    i, limit = payload
                    why[k] = f"stuck {i} {limit:g}"
                    p.join(timeout=10)
                    if p.alive:
                        p.kill()
            elif skip[k]:
                skip[k] -= 1
            elif kind == "ok":
                why[k] = None
            else:
                why[k] = str(value) if isinstance(value, _WorkFailed) else \
                    f"{type(value).__name__}: {value}"
    return [(d, g, why[k]) for k, (d, g, _p) in enumerate(procs)]


def _probe(dev, indices, items, cfg, workers, blocked) -> dict[int, str]:
    """The inputs among ``indices`` that end the process decoding them: ``{index: why}``. Groups are
    decoded in their own processes (nothing written), halving the groups that crash, so one
    culprit among n inputs costs about 2 log2(n) processes. A crash that does not come back when
    its group is decoded again (a flaky one) blocks nothing."""
    vis = _visible_for(dev)
    env = {"CUDA_VISIBLE_DEVICES": vis} if dev.startswith("cuda") else None
    modules = tuple(registry.modules())
    out: dict[int, str] = {}
    stack = [[i for i in indices if i not in blocked]]
    while stack:
        group = stack.pop()
        if not group:
            continue
        p = Worker(env=env)
        what = None
        try:
            p.send((_probe_decode, (dev, vis, {i: items[i].to_task() for i in group}, cfg,
                                    workers, modules)))
            if p.poll(600):
                p.recv()  # its answer: it decoded them (an error is fine here)
            else:
                what = "the decoder did not finish within 600 s"
        except (EOFError, OSError):
            p.join(timeout=10)
            if p.signal is not None:
                what = f"a native decoder crashed on it (signal {p.signal})"
        finally:
            if what is None:
                p.end()
            else:
                p.stop()
        if what is None:
            continue
        if len(group) == 1:
            out[group[0]] = f"{what}; the input was skipped"
        else:
            stack += [group[len(group) // 2 :], group[: len(group) // 2]]
    return out


def _probe_decode(device, visible, tasks, cfg, workers, modules=()):
    if device.startswith("cuda"):
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        device = "cuda:0"
    _import_op_modules(modules)
    items = {i: Item.from_task(t) for i, t in tasks.items()}
    dev = resolve_device(device)
    try:
        for _ in iter_shards([Shard(i, i + 1) for i in sorted(items)], items, cfg, dev,
                             workers=workers):
            pass
    except Exception:  # noqa: BLE001 - an error is fine here; only a crash counts
        pass


def _watch_inputs(limit: float | None) -> threading.Event:
    """Start this worker's watchdog: once its main thread has waited on one input
    (``_process.WAITING``) for more than ``limit`` seconds (a read that never returns: a
    stalled network mount, a device file with a media name), it tells the parent
    (``("stuck", (index, limit))``) and ends the process, whose threads cannot be stopped
    otherwise; the parent lists the input as a timeout and a new worker does the shards left.
    The first input of each kind gets ``_FIRST_WAIT_EXTRA_S`` more (its decoders start
    meanwhile). Setting the event it returns ends the watchdog (the work is over: the worker
    waits for the parent's next request)."""
    done = threading.Event()
    if not limit:
        return done

    def watch():
        while not done.wait(min(0.25, limit / 4)):
            i, since, first = WAITING["index"], WAITING["since"], WAITING["first"]
            allowed = limit + (_FIRST_WAIT_EXTRA_S if first else 0.0)
            if i is None or time.monotonic() - since <= allowed or WAITING["index"] != i:
                continue
            if done.is_set():
                return
            try:
                tell(("stuck", (i, limit)))  # written to the pipe when it returns
            finally:
                _workers.exit_now(_STUCK_EXIT)

    threading.Thread(target=watch, name="avpipe-extract-watchdog", daemon=True).start()
    return done


class _WorkFailed(RuntimeError):
    """A worker's run failed: ``"Type: message"`` of the exception that ended it (any
    exception, as text: it reaches the parent whether or not its class pickles)."""


def _worker_main(device, visible, shards, full, cfg, out_dir, fmt, total, workers, duplicated,
                 blocked=None, modules=(), sent=None):
    """A worker's work request: ``shards`` on ``device``, progress told to the parent as
    ``("p", payload)`` messages; returns None once every shard is written, raises
    :class:`_WorkFailed` else."""
    if sent is not None:  # the interpreter's start (a new worker) and the request's imports
        mark("start: process (spawn to running)", time.time() - sent)
    if device.startswith("cuda"):
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        device = "cuda:0"
    watchdog = None
    try:
        _import_op_modules(modules)
        items = {i: Item.from_task(t) for i, t in full.items()}
        watchdog = _watch_inputs(settings.extract_file_timeout())
        run_worker(device, shards, items, cfg, out_dir, fmt, total, workers, duplicated,
                   lambda p: tell(("p", p)), blocked=blocked)
    except BaseException as e:  # noqa: BLE001
        raise _WorkFailed(f"{type(e).__name__}: {e}") from None
    finally:
        if watchdog is not None:
            watchdog.set()
    # every shard and part is written, renamed and fsync'ed: the parent ends this process
    # with exit_now (no interpreter tear-down to wait for)
