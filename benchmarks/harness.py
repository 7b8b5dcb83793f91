"""The pieces every workload shares: one :func:`log`, the run context, interleaved rounds, the
ratio of medians, a fresh child process per measurement, and the results JSON.

A workload is a module of :mod:`benchmarks.workloads` holding:

* ``NAME``, ``SUITE`` (``"cpu"`` or ``"gpu"``), ``UNIT``, ``TITLE`` (one line: the work done);
* ``CONTENDERS``: ``{name: description}``, the description naming the contender's settings;
* ``RATIOS``: ``[(subject, anchor), ...]``, the first one the headline;
* ``PARAMS`` (and ``QUICK``, the overrides of ``--quick``): the workload's own settings;
* ``prepare(ctx)``: makes the data (in the parent, before any round) and returns what the
  measurements need (JSON-able: it travels to the child processes);
* either ``measure(ctx, name)`` -> ``(value, extra)``, run in a fresh child process per
  measurement, or ``session(ctx)`` -> an object with ``measure(name)`` -> ``(value, extra)``
  and ``close()``, measured in this process (its contenders keep their state across rounds);
* optionally ``ROUNDS``: a fixed number of rounds (the soak: one long round);
* optionally ``OPTIONAL``: contenders run only when named (``--contenders``); ``BEST_OF``:
  ``{name: [contenders]}``, a contender standing for the one of those with the best median
  (its rounds, e.g. an anchor's best thread or pipeline count); ``REQUIRES``: modules without which the workload is skipped (``"gpu"`` for a CUDA
  device), and ``check(ctx)``, run once after ``prepare``, returning facts kept in the JSON
  (outputs agreeing, the disk's write ceiling, ...), and ``finish(ctx)``, run after the
  rounds, whose facts join them.

Rounds interleave the contenders, the order rotated each round, so that load from elsewhere on
the machine falls on all of them alike. A ratio is the median of the subject's rounds over the
median of the anchor's rounds (never a median of per-round ratios).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import io
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
SCHEMA = 2
DEFAULT_DATA = os.path.join(os.environ.get("TMPDIR", "/tmp"), "avpipe_bench")


def log(*a) -> None:
    """One line on stdout, flushed (child processes' logs interleave with the parent's)."""
    print(*a, flush=True)


@dataclass
class Context:
    """What a measurement knows: the data folder, ``--quick``, the workload's parameters (its
    ``PARAMS`` with ``QUICK`` applied) and what ``prepare`` returned (``data``)."""

    data_dir: str = DEFAULT_DATA
    quick: bool = False
    rounds: int = 3
    params: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    round: int = 0
    contenders: list = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, default=str)

    @classmethod
    def from_json(cls, text: str) -> Context:
        return cls(**json.loads(text))


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------


def median(values) -> float | None:
    """The median of the rounds that gave a value (None where none did)."""
    got = [v for v in values if v is not None]
    return float(statistics.median(got)) if got else None


def ratio_of_medians(subject_values, anchor_values) -> float | None:
    """``median(subject) / median(anchor)``: the ratio of the two medians of the rounds."""
    a, b = median(subject_values), median(anchor_values)
    if a is None or not b:
        return None
    return a / b


def rotated(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: ``names`` rotated by ``r``."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


# ---------------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------------

VERSIONED = {  # key in the JSON: (distribution names tried in turn)
    "avpipe": ("avpipe",),
    "dali": ("nvidia-dali-cuda120", "nvidia-dali-cuda130", "nvidia-dali-cuda110", "nvidia-dali"),
    "pynvvideocodec": ("pynvvideocodec", "PyNvVideoCodec"),
    "cupy": ("cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy"),
    "torch": ("torch",),
    "torchaudio": ("torchaudio",),
    "numpy": ("numpy",),
    "av": ("av",),
    "soundfile": ("soundfile",),
    "librosa": ("librosa",),
    "lhotse": ("lhotse",),
    "torchcodec": ("torchcodec",),
}


def _version(dists) -> str | None:
    from importlib import metadata

    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict:
    out = {k: _version(d) for k, d in VERSIONED.items()}
    if out["avpipe"] is None:  # run from a checkout without installing it
        try:
            from avpipe._version import __version__

            out["avpipe"] = __version__
        except Exception:  # noqa: BLE001 - reported as absent
            pass
    return out


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (every thread) and of its waited-for
    children (worker processes, once joined)."""
    import resource

    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def git_state() -> tuple[str | None, bool | None]:
    """HEAD's commit and whether tracked files differ from it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=ROOT, capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return commit, dirty


def host() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "system": platform.system()}


def gpu() -> dict:
    """The GPU's name, the driver and the CUDA version (None each where no GPU answers)."""
    out = {"name": None, "driver": None, "cuda": None}
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        line = p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else ""
        if line:
            out["name"], out["driver"] = (s.strip() for s in line.split(",", 1))
        p = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
        for tok in p.stdout.split("CUDA Version:")[1:2]:
            out["cuda"] = tok.split()[0].strip(" |")
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        pass
    return out


def has_gpu() -> bool:
    return gpu()["name"] is not None


def missing(requires) -> list[str]:
    """Which of ``requires`` this machine lacks (``"gpu"``: a GPU that nvidia-smi sees)."""
    out = []
    for r in requires:
        if r == "gpu":
            if not has_gpu():
                out.append("a CUDA GPU")
        else:
            try:
                found = importlib.util.find_spec(r) is not None
            except (ImportError, ValueError):  # a dotted name whose parent is absent
                found = False
            if not found:
                out.append(r)
    return out


# ---------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------


def workload(name: str):
    return importlib.import_module(f"benchmarks.workloads.{name}")


def all_workloads() -> list[str]:
    from benchmarks.workloads import NAMES

    return list(NAMES)


def suite_of(suite: str) -> list[str]:
    from benchmarks.workloads import SUITES

    return [n for n, s in SUITES.items() if suite in ("all", s)]


def params_of(mod, quick: bool, overrides: dict | None = None) -> dict:
    p = dict(getattr(mod, "PARAMS", {}))
    if quick:
        p.update(getattr(mod, "QUICK", {}))
    p.update(overrides or {})
    return p


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------

CHILD_MARK = "AVPIPE_BENCH_RESULT "


def child_main(workload_name: str, contender: str, ctx_json: str) -> int:
    """Entry point of a child process: one measurement, printed as one marked JSON line."""
    mod = workload(workload_name)
    ctx = Context.from_json(sys.stdin.read() if ctx_json == "-" else ctx_json)
    try:
        if hasattr(mod, "measure"):
            value, extra = mod.measure(ctx, contender)
        else:  # a session's workload, one contender to a process (--baseline): set up, measure
            ctx.contenders = [contender]
            sess = mod.session(ctx)
            try:
                value, extra = sess.measure(contender)
            finally:
                sess.close()
        out = {"value": value, "extra": extra}
        where = avpipe_folder()
        if where is not None and where != ROOT:  # another avpipe measured (--baseline): proof
            out["avpipe_from"] = where
    except Exception as e:  # noqa: BLE001 - reported as the measurement's error
        traceback.print_exc()
        out = {"value": None, "error": f"{type(e).__name__}: {e}"[:500]}
    print(CHILD_MARK + json.dumps(out, default=str), flush=True)
    return 0


def avpipe_folder() -> str | None:
    """The folder this process imported ``avpipe`` from (None: not imported)."""
    mod = sys.modules.get("avpipe")
    path = getattr(mod, "__file__", None)
    return os.path.dirname(os.path.dirname(os.path.abspath(path))) if path else None


def child_env(avpipe_from: str | None = None) -> tuple[dict, str]:
    """``(environment, working directory)`` of a measuring child. With ``avpipe_from`` (a
    folder holding another ``avpipe``, :func:`baseline_tree`) the child runs in that folder:
    ``python -m`` and ``python -c`` put the working directory first on the path, so the child
    and the processes it starts import that avpipe, while this checkout's workload code comes
    through PYTHONPATH."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    # compiled bytecode kept, as an installed package has it, in a folder of its own (a
    # machine set to write none would compile every imported module in every child: a cost
    # that grows with the source's size, in the measure of workloads timed from the start)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = PYCACHE
    return env, avpipe_from or ROOT


def measure_in_child(workload_name: str, contender: str, ctx: Context,
                     timeout: float, log_path: str | None = None,
                     avpipe_from: str | None = None) -> dict:
    """One measurement in a fresh ``python -m benchmarks _child`` process (the context on its
    stdin: a data list can outgrow a command-line argument); its output kept in ``log_path``.
    ``avpipe_from``: a folder holding another ``avpipe`` package, imported instead of this
    checkout's (:func:`child_env`); the workload's code stays this checkout's."""
    cmd = [sys.executable, "-m", "benchmarks", "_child", workload_name, contender, "-"]
    env, cwd = child_env(avpipe_from)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                           cwd=cwd, input=ctx.to_json())
    except subprocess.TimeoutExpired as e:
        p = subprocess.CompletedProcess(cmd, None, _text(e.stdout), _text(e.stderr))
    if log_path:
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "w") as f:
            f.write((p.stdout or "") + "\n--- stderr\n" + (p.stderr or ""))
    if p.returncode is None:
        return {"value": None, "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(CHILD_MARK):
            return json.loads(line[len(CHILD_MARK):])
    tail = (p.stderr or p.stdout)[-800:]
    return {"value": None, "error": f"child exited {p.returncode} without a result: {tail}"}


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


BASELINE_SUFFIX = "@baseline"
PYCACHE = os.path.join(tempfile.gettempdir(), "avpipe-bench-pycache")


def baseline_tree(commit: str, root: str | None = None) -> tuple[str, str]:
    """``(folder, full commit)``: the ``avpipe`` package of ``commit`` (any name git knows),
    extracted with ``git archive`` into a folder of its own under the temporary directory (made
    once per commit). A child run in that folder (:func:`child_env`) imports that avpipe, with
    this checkout's workload code and data: the same measurement of two versions of avpipe,
    side by side in one run."""
    root = root or ROOT
    full = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=root,
                          capture_output=True, text=True, check=True).stdout.strip()
    folder = os.path.join(tempfile.gettempdir(), f"avpipe-baseline-{full[:12]}")
    if not os.path.isdir(os.path.join(folder, "avpipe")):
        tmp = folder + f".tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        archive = subprocess.run(["git", "archive", "--format=tar", full, "avpipe"], cwd=root,
                                 capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as t:
            t.extractall(tmp, filter="data")
        try:
            os.rename(tmp, folder)
        except OSError:  # another run made it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return folder, full


def run_workload(name: str, *, rounds: int = 3, quick: bool = False, data_dir: str = DEFAULT_DATA,
                 only_contenders: list[str] | None = None, timeout: float = 900.0,
                 command: str = "", overrides: dict | None = None,
                 out_dir: str | None = None, baseline: str | None = None) -> dict | None:
    """Every contender of workload ``name`` in ``rounds`` interleaved rounds: the result dict
    (:func:`result_doc`), a skipped one where the machine lacks what it needs, or None where
    ``only_contenders`` names none of its contenders. ``overrides``: parameters set over the
    workload's own (those it does not have are ignored). With ``out_dir`` the results so far are
    written after every round (``"complete": false`` until the last), so that a run cut short
    keeps its finished rounds. Each child process's output is kept in ``out_dir/logs`` (in
    ``data_dir/logs`` when ``out_dir`` is the repository's results folder).

    ``baseline``: a commit; every avpipe contender (named ``avpipe...``, or listed in the
    workload's ``OURS``) is also measured with
    that commit's avpipe (:func:`baseline_tree`) as ``NAME@baseline``, in the same interleaved
    rounds, and each is given its ratio to its baseline twin (a before/after comparison of the
    same work). A workload measured in one session process then measures each contender in a
    child of its own (set up, one measurement), both versions alike. The result's key names the
    commit, so it is kept beside the workload's own."""
    mod = workload(name)
    rounds = getattr(mod, "ROUNDS", rounds)  # a soak is one long round
    lacking = missing(getattr(mod, "REQUIRES", ()))
    optional = set(getattr(mod, "OPTIONAL", ()))
    contenders = [c for c in mod.CONTENDERS
                  if (c in only_contenders if only_contenders else c not in optional)]
    variant = None if set(contenders) == set(mod.CONTENDERS) - optional else ",".join(contenders)
    if not contenders:
        return None
    base = None
    if baseline:
        folder, full = baseline_tree(baseline)
        ours = getattr(mod, "OURS", None)  # a workload whose avpipe contenders have other names
        twins = [c + BASELINE_SUFFIX for c in contenders
                 if (c in ours if ours is not None else c.startswith("avpipe"))]
        if not twins:
            return None
        base = {"commit": full, "folder": folder}
        contenders = contenders + twins
    params = params_of(mod, quick, {k: v for k, v in (overrides or {}).items()
                                    if k in getattr(mod, "PARAMS", {})})
    ctx = Context(data_dir=data_dir, quick=quick, rounds=rounds, params=params,
                  contenders=contenders)
    if lacking:
        log(f"{name}: skipped (needs {', '.join(lacking)})")
        return result_doc(mod, ctx, {}, command=command, skipped=f"needs {', '.join(lacking)}")
    log(f"{name}: {mod.TITLE}")
    t0 = time.time()
    ctx.data = mod.prepare(ctx) or {}
    log(f"{name}: data ready in {time.time() - t0:.0f} s")
    checks = mod.check(ctx) if hasattr(mod, "check") else {}
    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    in_repo = not out_dir or os.path.abspath(out_dir) == os.path.abspath(RESULTS)
    logs = os.path.join(data_dir if in_repo else out_dir, "logs")
    # a session measures every contender in this process; against a baseline every contender
    # runs in a child of its own instead (its avpipe is chosen by the child's path)
    sess = mod.session(ctx) if hasattr(mod, "session") and base is None else None
    try:
        for r in range(rounds):
            ctx.round = r
            for c in rotated(contenders, r):
                t1 = time.perf_counter()
                if sess is not None:
                    try:
                        value, extra = sess.measure(c)
                        m = {"value": value, "extra": extra}
                    except Exception as e:  # noqa: BLE001 - kept as the round's error
                        traceback.print_exc()
                        m = {"value": None, "error": f"{type(e).__name__}: {e}"[:500]}
                else:
                    twin = base is not None and c.endswith(BASELINE_SUFFIX)
                    m = measure_in_child(name, c[: -len(BASELINE_SUFFIX)] if twin else c, ctx,
                                         timeout, os.path.join(logs, f"{name}-{c}-r{r}.log"),
                                         avpipe_from=base["folder"] if twin else None)
                m["wall_s"] = round(time.perf_counter() - t1, 2)
                runs[c].append(m)
                v = m.get("value")
                log(f"{name} round {r} {c:28s} "
                    + (f"{v:10.2f} {mod.UNIT}" if v is not None else f"error: {m.get('error')}"))
            if out_dir and r < rounds - 1:
                part = result_doc(mod, ctx, runs, command=command, checks=checks, variant=variant,
                                  baseline=base)
                part["complete"] = False
                write_result(part, out_dir)
    finally:
        if sess is not None:
            sess.close()
    if hasattr(mod, "finish"):
        checks = {**checks, **(mod.finish(ctx) or {})}
    doc = result_doc(mod, ctx, runs, command=command, checks=checks, variant=variant,
                     baseline=base)
    for rt in doc["ratios"]:
        if rt["ratio"] is not None:
            log(f"{name}: {rt['subject']} / {rt['anchor']} = {rt['ratio']:.3f} (ratio of medians)")
    return doc


# ---------------------------------------------------------------------------------------------
# results JSON
# ---------------------------------------------------------------------------------------------


def _round(v, nd=4):
    return None if v is None else float(f"{v:.{nd}g}")


def result_doc(mod, ctx: Context, runs: dict, *, command: str, checks: dict | None = None,
               skipped: str | None = None, variant: str | None = None,
               baseline: dict | None = None) -> dict:
    """The results JSON of one workload run (see benchmarks/README.md for the fields)."""
    commit, dirty = git_state()
    contenders = {}
    for c, ms in runs.items():
        values = [m.get("value") for m in ms]
        own = c[: -len(BASELINE_SUFFIX)] if baseline and c.endswith(BASELINE_SUFFIX) else c
        desc = mod.CONTENDERS.get(own, "")
        if own != c:
            desc = f"{own} with avpipe at {baseline['commit'][:7]} ({desc})"
        contenders[c] = {
            "description": desc,
            "values": [_round(v, 6) for v in values],
            "median": _round(median(values), 6),
            "errors": [m.get("error") for m in ms if m.get("error")],
            "extra": [m.get("extra") for m in ms],
            **({"avpipe_from": sorted({m["avpipe_from"] for m in ms if m.get("avpipe_from")})}
               if any(m.get("avpipe_from") for m in ms) else {}),
            "wall_s": [m.get("wall_s") for m in ms],
        }
    for best, members in getattr(mod, "BEST_OF", {}).items():
        got = [m for m in members if m in contenders and contenders[m]["median"] is not None]
        if got:
            top = max(got, key=lambda m: contenders[m]["median"])
            contenders[best] = {**contenders[top], "best_of": members, "chosen": top,
                                "description": f"the best of {', '.join(members)}: {top} "
                                               f"({contenders[top]['description']})"}
    ratios = []
    for i, (s, a) in enumerate(getattr(mod, "RATIOS", [])):
        if s in contenders and a in contenders:
            ratios.append({"subject": s, "anchor": a,
                           "anchor_settings": contenders[a]["description"],
                           "ratio": _round(ratio_of_medians(contenders[s]["values"],
                                                            contenders[a]["values"])),
                           "headline": i == 0})
    if baseline:  # each avpipe contender over its twin at the baseline commit, first
        twins = [{"subject": c[: -len(BASELINE_SUFFIX)], "anchor": c,
                  "anchor_settings": contenders[c]["description"],
                  "ratio": _round(ratio_of_medians(contenders[c[: -len(BASELINE_SUFFIX)]]["values"],
                                                   contenders[c]["values"])),
                  "headline": False}
                 for c in contenders if c.endswith(BASELINE_SUFFIX)]
        for r in ratios:
            r["headline"] = False
        ratios = twins + ratios
        if ratios:
            ratios[0]["headline"] = True
    if ratios and not any(r["headline"] for r in ratios):
        ratios[0]["headline"] = True
    return {
        "schema": SCHEMA,
        "workload": mod.NAME,
        "variant": variant,
        "suite": mod.SUITE,
        "title": mod.TITLE,
        "unit": mod.UNIT,
        "commit": commit,
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "reproduce": reproduce_command(mod, variant,
                                       baseline["commit"][:12] if baseline else None),
        "baseline": {"commit": baseline["commit"]} if baseline else None,
        "host": host(),
        "gpu": gpu(),
        "versions": versions(),
        "rounds": ctx.rounds,
        "quick": ctx.quick,
        "params": ctx.params,
        "contenders": contenders,
        "ratios": ratios,
        "checks": checks or {},
        "skipped": skipped,
        "complete": True,
        "notes": list(getattr(mod, "NOTES", [])),
    }


def reproduce_command(mod, variant: str | None = None, baseline: str | None = None) -> str:
    """The command that measures this workload (``variant``: only those contenders;
    ``baseline``: against that commit's avpipe)."""
    cmd = f"python -m benchmarks run --suite {mod.SUITE} --only {mod.NAME}"
    return (cmd + (f" --contenders {variant}" if variant else "")
            + (f" --baseline {baseline}" if baseline else ""))


def validate(doc: dict) -> list[str]:
    """What a results JSON lacks or gets wrong ([] when it is valid)."""
    problems = []
    need = {"schema": int, "workload": str, "suite": str, "unit": str, "date": str,
            "command": str, "reproduce": str, "host": dict, "gpu": dict, "versions": dict,
            "rounds": int, "contenders": dict, "ratios": list}
    for k, t in need.items():
        if not isinstance(doc.get(k), t):
            problems.append(f"{k}: {type(doc.get(k)).__name__}, not {t.__name__}")
    if "commit" not in doc or "dirty" not in doc:
        problems.append("commit/dirty missing")
    for k in ("cpu", "cores"):
        if k not in doc.get("host", {}):
            problems.append(f"host.{k} missing")
    for k in ("name", "driver", "cuda"):
        if k not in doc.get("gpu", {}):
            problems.append(f"gpu.{k} missing")
    for k in ("avpipe", "dali", "pynvvideocodec", "cupy", "torch", "numpy", "av", "soundfile"):
        if k not in doc.get("versions", {}):
            problems.append(f"versions.{k} missing")
    for c, e in doc.get("contenders", {}).items():
        if not isinstance(e.get("values"), list) or "median" not in e:
            problems.append(f"contenders.{c}: values/median missing")
    for r in doc.get("ratios", []):
        for k in ("subject", "anchor", "ratio", "headline"):
            if k not in r:
                problems.append(f"ratio {r}: {k} missing")
    return problems


def result_key(doc: dict) -> str:
    """``workload`` or ``workload--contenders`` (a run of chosen contenders only), then
    ``--vs-COMMIT`` for a run against a baseline commit's avpipe."""
    key = doc["workload"] + (f"--{doc['variant']}" if doc.get("variant") else "")
    base = (doc.get("baseline") or {}).get("commit")
    return key + (f"--vs-{base[:7]}" if base else "")


def write_result(doc: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{result_key(doc).replace(',', '+')}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def command_line(argv: list[str]) -> str:
    return "python -m benchmarks " + " ".join(shlex.quote(a) for a in argv)
