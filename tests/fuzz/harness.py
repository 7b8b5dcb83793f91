"""Run fuzz cases through every public decoder in replaceable worker processes.

Work goes out in *units*: one backend and a list of cases (damaged files, with clean seed files
interleaved so that a good file decoded after bad ones is checked in the same process). Each
worker process is long-lived (one Python start and one import per worker, not per case) and
reports every case as it starts and ends. A worker that dies (a signal, a native abort) or
that exceeds the per-case time limit is killed and replaced; the case it was on is run again
alone in a fresh worker to confirm, and the rest of its unit goes back in the queue.

Outcomes per case and backend:

* ``decoded`` / ``decoded_damaged`` (the result carries a damage flag) / ``typed_error``
  (:class:`avpipe.DecodeError` or FileNotFoundError) / ``skipped`` (a batch API reported the
  item in its errors) — all fine;
* ``hang``, ``crash`` (confirmed alone), ``hang_in_sequence`` / ``crash_in_sequence`` (only
  after other cases), ``untyped_error``, ``good_failed`` (a clean file that did not decode
  cleanly, e.g. after bad ones) — failures.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections import Counter, deque
from multiprocessing.connection import wait

FAILING = ("hang", "crash", "hang_in_sequence", "crash_in_sequence", "untyped_error", "good_failed")
OK = ("decoded", "decoded_damaged", "typed_error", "skipped")

# backend -> the case kinds it takes
CPU_BACKENDS = {
    "video_cpu": "video",
    "audio_cpu": "audio",
    "image_cpu": "image",
    "image_stream_cpu": "image",
    "audio_batch_cpu": "audio",
}
GPU_BACKENDS = {
    "video_cuda": "video",
    "audio_cuda": "audio",
    "image_cuda": "image",
    "image_stream_cuda": "image",
    "audio_batch_gpu": "audio",
}


def entry_points():
    """The batch APIs that are not top-level names of ``avpipe``: the one place that imports
    them, ``(decode_image_stream, AudioBatchLoader)``."""
    from avpipe.pipeline.audio_loader import AudioBatchLoader
    from avpipe.pipeline.image_stream import decode_image_stream

    return decode_image_stream, AudioBatchLoader


# --- one case in the worker ----------------------------------------------------------------------


def _host(a):
    return a.get() if hasattr(a, "get") and not hasattr(a, "__array_interface__") else a


def _video(path, device):
    import numpy as np

    import avpipe

    with avpipe.VideoDecoder(path, device=device) as dec:
        m = dec.metadata
        n = len(dec)
        b = dec.get_frames(sorted({0, n // 2, n - 1}))
        assert _host(b.data).shape[0] == len({0, n // 2, n - 1})
        b2 = dec.get_frames_at([m.begin_seconds, (m.begin_seconds + m.end_seconds) / 2])
        assert np.asarray(_host(b2.data)).ndim == 4
        damaged = getattr(m, "damaged", None) or getattr(b, "damaged", None)
        damaged = damaged or getattr(b2, "damaged", None) or getattr(dec, "damaged", None)
        return {"damaged": damaged, "info": f"{dec.backend} n={n}"}


def _audio(path, device):
    import avpipe

    a = avpipe.load_audio(path, device=device)
    return {"damaged": getattr(a, "damaged", None), "info": f"n={a.num_samples}"}


def _image(path, device):
    import avpipe

    im = avpipe.decode_images([path], device=device)[0]
    return {"damaged": None, "info": f"{tuple(im.shape)}"}


def _in_batch(errors, images_ok, bad_index=1):
    """A batch API's view of [good, bad, good]: the good ones must come back."""
    import avpipe

    if not all(images_ok[i] for i in range(len(images_ok)) if i != bad_index):
        raise _GoodFailed(f"a good item around the bad one failed: {errors!r}")
    if bad_index in errors:
        e = errors[bad_index]
        if isinstance(e, BaseException) and not isinstance(e, avpipe.DecodeError):
            raise e
        return {"skipped": True, "damaged": None, "info": str(e)[:300]}
    return {"damaged": None, "info": "decoded in a batch"}


def _image_stream(path, device, good):
    stream, _ = entry_points()
    errors, ok = {}, []
    for b in stream([good, path, good], batch_size=3, device=device):
        k0 = len(ok)
        errors.update({k0 + i: e for i, e in b.errors})
        ok.extend(im is not None for im in b.images)
    return _in_batch(errors, ok)


def _audio_batch(path, device, good):
    _, Loader = entry_points()
    gpu = device != "cpu"
    loader = Loader([good, path, good], batch_size=3, device=device, num_workers=1,
                    decoder="gpu" if gpu else "cpu", timeout=20.0)  # fmt: skip
    try:
        errors, ok = {}, []
        for _x, lengths, _p, errs in loader.batches():
            errors.update(errs)
            ok.extend(int(n) > 0 for n in lengths)
    finally:
        loader.close()
    r = _in_batch(errors, ok)
    if not r.get("skipped"):
        r["damaged"] = getattr(loader, "damaged", {}).get(path)
    return r


class _GoodFailed(Exception):
    pass


def run_case(backend: str, case: dict, goods: dict) -> dict:
    """Decode one case with one backend; never raises."""
    import avpipe

    path = case["path"]
    dev = "cpu" if backend.endswith("_cpu") else "cuda"
    good = goods.get(case["family"])
    t0 = time.perf_counter()
    try:
        if backend.startswith("video"):
            r = _video(path, dev)
        elif backend.startswith("audio_batch"):
            r = _audio_batch(path, dev, good)
        elif backend.startswith("audio"):
            r = _audio(path, dev)
        elif backend.startswith("image_stream"):
            r = _image_stream(path, dev, good)
        else:
            r = _image(path, dev)
        out = "skipped" if r.pop("skipped", False) else (
            "decoded_damaged" if r.get("damaged") else "decoded")  # fmt: skip
    except _GoodFailed as e:
        r, out = {"error": str(e)}, "good_failed"
    except (avpipe.DecodeError, FileNotFoundError) as e:
        r, out = {"error": f"{type(e).__name__}: {e}"[:500]}, "typed_error"
    except Exception as e:  # noqa: BLE001 - what the fuzz run looks for
        tb = traceback.format_exc(limit=6)
        r, out = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": tb[-2000:]}, "untyped_error"
    if case.get("expect") == "good" and out not in ("decoded", "skipped"):
        r.setdefault("error", f"clean file gave {out}: {r.get('damaged')}")
        out = "good_failed"
    r["outcome"] = out
    r["seconds"] = round(time.perf_counter() - t0, 4)
    return r


def _worker(conn, log_path):
    """Worker loop: units in, ("start", i) / ("done", i, result) / ("end",) out."""
    if log_path:  # native libraries' chatter goes to the worker's log, not the console
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    import avpipe  # noqa: F401 - import once per worker

    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        backend, cases, goods = msg
        for i, case in enumerate(cases):
            conn.send(("start", i))
            conn.send(("done", i, run_case(backend, case, goods)))
        conn.send(("end",))


# --- the scheduler ----------------------------------------------------------------------------


class _Slot:
    def __init__(self, ctx, log_dir, k):
        self.parent, child = ctx.Pipe()
        log = os.path.join(log_dir, f"worker{k}.log") if log_dir else None
        self.proc = ctx.Process(target=_worker, args=(child, log), daemon=False)
        self.proc.start()
        child.close()
        self.unit = None
        self.current = None
        self.started = 0.0
        self.backend = None  # a worker serves one backend (DALI's memory makes forks fail)

    def kill(self):
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.join(5)
        self.parent.close()


def make_units(cases, backends: dict, seeds: dict, chunk: int = 16, sequences=()):
    """Units ``(backend, [cases], goods)``: each backend's cases of its kind in chunks of
    ``chunk``, each chunk followed by the clean seed of every family it touched; plus the given
    ``sequences`` (``(backend, [cases])``, run in order in one worker)."""
    units = []
    for backend, kind in backends.items():
        mine = [c for c in cases if c["kind"] == kind]
        goods = {c["family"]: seeds[c["family"]] for c in mine}
        for s in range(0, len(mine), chunk):
            part = list(mine[s : s + chunk])
            fams = sorted({c["family"] for c in part})
            part += [good_case(f, seeds, kind) for f in fams]
            units.append((backend, part, goods))
    for backend, seq in sequences:
        goods = {c["family"]: seeds.get(c["family"]) for c in seq}
        units.append((backend, list(seq), goods))
    return units


def good_case(family, seeds, kind):
    return dict(id=f"good:{family}", family=family, kind=kind, path=seeds[family],
                damage="good_after_bad", detail="", expect="good")  # fmt: skip


def run_units(units, *, workers=None, case_timeout=30.0, log_dir=None, progress=True):
    """Run the units; returns one record per (backend, case) run."""
    ctx = mp.get_context("spawn")
    workers = max(1, int(workers or os.cpu_count() or 1))
    queue = deque(units)
    confirm = deque()  # (backend, case, goods, how, reason) to re-run alone
    records = []
    slots: list[_Slot] = []
    counter = itertools.count(10_000)
    k = 0
    total = sum(len(u[1]) for u in units)
    done = 0
    t0 = time.monotonic()
    last_print = 0.0

    def record(backend, case, r):
        nonlocal done
        done += 1
        rec = dict(backend=backend, id=case["id"], family=case["family"], damage=case["damage"],
                   detail=case.get("detail", ""), path=case["path"], **r)  # fmt: skip
        records.append(rec)

    def assign(slot):
        if confirm:
            backend, case, goods, how, reason = confirm.popleft()
            slot.unit = (backend, [case], goods, ("confirm", how, reason))
        elif queue:
            pick = next((i for i, u in enumerate(queue) if u[0] == slot.backend), None)
            if pick is None and slot.backend is not None:  # a fresh worker for another backend
                slot.parent.send(None)
                slot.proc.join(5)
                slot.kill()
                slot.__init__(ctx, log_dir, next(counter))
            backend, cases, goods = queue[pick or 0]
            del queue[pick or 0]
            slot.unit = (backend, cases, goods, None)
            slot.backend = backend
        else:
            return False
        slot.current, slot.started = None, time.monotonic()
        slot.parent.send(slot.unit[:3])
        return True

    def fail(slot, how):
        """The slot's worker died or hung on its current case."""
        backend, cases, goods, conf = slot.unit
        i = slot.current if slot.current is not None else 0
        case = cases[i]
        code = slot.proc.exitcode
        slot.kill()
        reason = f"{how} (exit code {code})" if how == "crash" else f"{how} (> {case_timeout:g} s)"
        if conf is not None:  # already alone: confirmed
            record(backend, case, {"outcome": how, "error": reason})
        elif len(cases) == 1 and i == 0:
            record(backend, case, {"outcome": how, "error": reason + ", alone"})
        else:
            confirm.append((backend, case, goods, how, f"{reason} after {i} other cases"))
        rest = cases[i + 1 :]
        if rest:
            queue.appendleft((backend, rest, goods))

    def finish_confirm(backend, case, r, conf):
        _, how, reason = conf
        if r["outcome"] in FAILING:
            return r
        return {"outcome": f"{how}_in_sequence", "error": reason,
                "alone": r.get("outcome")}  # fmt: skip

    for _ in range(min(workers, len(units))):
        slots.append(_Slot(ctx, log_dir, k))
        k += 1
    for s in slots:
        if not assign(s):
            s.unit = None
    while any(s.unit is not None for s in slots):
        busy = [s for s in slots if s.unit is not None]
        now = time.monotonic()
        nearest = min(case_timeout - (now - s.started) for s in busy)
        ready = wait([s.parent for s in busy] + [s.proc.sentinel for s in busy],
                     timeout=max(0.05, nearest))  # fmt: skip
        for s in busy:
            dead = False
            try:
                while s.parent.poll():
                    msg = s.parent.recv()
                    if msg[0] == "start":
                        s.current, s.started = msg[1], time.monotonic()
                    elif msg[0] == "done":
                        backend, cases, goods, conf = s.unit
                        r = msg[2]
                        if conf is not None:
                            r = finish_confirm(backend, cases[msg[1]], r, conf)
                        record(backend, cases[msg[1]], r)
                        s.current = None
                        s.started = time.monotonic()
                    elif msg[0] == "end":
                        conf = s.unit[3]
                        s.unit = None
                        if conf is not None:  # a confirmation worker is not reused
                            s.parent.send(None)
                            s.proc.join(5)
                            s.kill()
                            s.__init__(ctx, log_dir, k)
                            k += 1
                        break
            except (EOFError, OSError):
                dead = True
            if s.unit is None:
                if not assign(s):
                    pass
                continue
            if dead or (s.proc.sentinel in ready and not s.proc.is_alive()):
                fail(s, "crash")
            elif time.monotonic() - s.started > case_timeout:
                fail(s, "hang")
            else:
                continue
            s.__init__(ctx, log_dir, k)
            k += 1
            assign(s)
        if progress and time.monotonic() - last_print > 10:
            last_print = time.monotonic()
            print(f"  {done}/{total} cases, {time.monotonic() - t0:.0f} s", file=sys.stderr,
                  flush=True)  # fmt: skip
    for s in slots:
        try:
            s.parent.send(None)
        except OSError:
            pass
        s.proc.join(2)
        if s.proc.is_alive():
            s.kill()
    return records


# --- the extract recipe over a folder -----------------------------------------------------------


def run_extract_folder(folder, out_dir, device="cpu", timeout=600.0, cases=(), max_crashes=50):
    """``avpipe extract`` (preset quickstart) over a folder of the cases' files, in a subprocess;
    one record per case: ``decoded`` when written, ``typed_error`` / ``untyped_error`` from
    errors.jsonl. When the run dies (a signal) or hangs, the file it was on (the first one in the
    recipe's order with no record) is recorded as ``crash`` / ``hang``, taken out of the folder,
    and the run resumes (the recipe skips what it wrote), so one bad file costs only itself."""
    import json
    import shutil
    import subprocess

    import avpipe.errors as E
    from avpipe.recipes.extract import resolve_inputs, resolve_preset
    from avpipe.recipes.extract._presets import extensions_of

    out_dir = os.fspath(out_dir)
    inp = out_dir + "_input"  # hard links to the cases' files (the recipe would walk seeds/)
    shutil.rmtree(inp, ignore_errors=True)
    by_rel = {}
    for c in cases:
        rel = f"{c['family']}/{os.path.basename(c['path'])}"
        os.makedirs(os.path.join(inp, c["family"]), exist_ok=True)
        try:
            os.link(c["path"], os.path.join(inp, rel))
        except OSError:
            shutil.copyfile(c["path"], os.path.join(inp, rel))
        by_rel[rel] = c
    backend = f"extract_{'cpu' if device == 'cpu' else 'cuda'}"
    typed = {n for n in dir(E) if isinstance(getattr(E, n), type)} | {"FileNotFoundError"}
    cmd = [sys.executable, "-m", "avpipe", "extract", inp, "--preset", "quickstart",
           "--out", out_dir, "--device", device]  # fmt: skip
    recs: dict = {}

    def rec(c, outcome, error=""):
        r = dict(backend=backend, id=c["id"], family=c["family"], damage=c["damage"],
                 detail=c.get("detail", ""), path=c["path"], outcome=outcome, error=error[:500])
        if c.get("expect") == "good" and outcome != "decoded":
            r["outcome"] = "good_failed"
        recs[c["id"]] = r

    def collect():
        for name, written in (("errors.jsonl", False), ("index.jsonl", True)):
            try:
                f = open(os.path.join(out_dir, name))
            except OSError:
                continue
            with f:
                for line in f:
                    e = json.loads(line)
                    c = by_rel.get(e["source"])
                    if c is None:
                        continue
                    if written:
                        rec(c, "decoded")
                    else:
                        ok = e["error"] in typed
                        rec(c, "typed_error" if ok else "untyped_error",
                            f"{e['error']}: {e['message']}")  # fmt: skip

    for _ in range(max_crashes + 1):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            how = "crash" if p.returncode < 0 else None
            err = f"exit code {p.returncode}: {p.stderr[-300:]}"
        except subprocess.TimeoutExpired:
            how, err = "hang", f"> {timeout:g} s"
        collect()  # errors.jsonl holds only the latest run's errors: gather after each run
        if how is None:
            if p.returncode != 0:
                base = dict(backend=backend, family="*", damage="*", detail="", path=inp)
                return [*recs.values(), dict(base, id="extract", outcome="untyped_error",
                                             error=p.stderr[-2000:])]  # fmt: skip
            break
        order = resolve_inputs(inp, extensions_of(resolve_preset("quickstart")), exclude=out_dir)
        culprit = next((it.source for it in order.items if by_rel[it.source]["id"] not in recs),
                       None)  # fmt: skip
        if culprit is None:
            break
        rec(by_rel[culprit], how, f"the extract run died on it ({err})")
        os.unlink(os.path.join(inp, culprit))
    return list(recs.values())


# --- reports ----------------------------------------------------------------------------------


def counts(records):
    """{(family, backend): Counter(outcome)}"""
    out: dict = {}
    for r in records:
        out.setdefault((r["family"], r["backend"]), Counter())[r["outcome"]] += 1
    return out


def table(records) -> str:
    c = counts(records)
    outcomes = [o for o in OK + FAILING if any(o in v for v in c.values())]
    outcomes += sorted({o for v in c.values() for o in v} - set(outcomes))
    head = f"{'family':12s} {'backend':18s} " + " ".join(f"{o[:16]:>16s}" for o in outcomes)
    lines = [head, "-" * len(head)]
    for (fam, be) in sorted(c):
        v = c[(fam, be)]
        lines.append(f"{fam:12s} {be:18s} " + " ".join(f"{v.get(o, 0):16d}" for o in outcomes))
    tot = Counter()
    for v in c.values():
        tot.update(v)
    lines.append(f"{'total':12s} {'':18s} " + " ".join(f"{tot.get(o, 0):16d}" for o in outcomes))
    return "\n".join(lines)


def failures(records):
    return [r for r in records if r["outcome"] in FAILING]
