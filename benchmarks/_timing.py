"""Wall time of named calls while a workload runs: for the probes (``benchmarks/probes``) and
the profiled contenders, which wrap a module's functions or a class's methods by name and add up
the seconds and calls of each (the calls a filter accepts, e.g. those on one thread). A call
inside another counts in both. :func:`median_run`: the round of median value."""

from __future__ import annotations

import collections
import importlib
import threading
import time


def owner_of(path: str):
    """The module or class ``path`` names (``"pkg.mod"`` or ``"pkg.mod.Class"``)."""
    try:
        return importlib.import_module(path)
    except ImportError:
        mod, _, cls = path.rpartition(".")
        return getattr(importlib.import_module(mod), cls)


def time_calls(targets, accept=lambda: True):
    """Wrap each ``(owner path, attribute, label)`` of ``targets``; returns ``acc``:
    ``acc[label] = [seconds, calls]`` of the calls made while ``accept()`` holds."""
    acc = collections.defaultdict(lambda: [0.0, 0])
    for path, attr, label in targets:
        owner = owner_of(path)
        setattr(owner, attr, timed(getattr(owner, attr), label, acc, accept))
    return acc


def timed(f, label, acc, accept=lambda: True):
    """``f`` adding its wall time and a call to ``acc[label]`` when ``accept()`` holds."""

    def wrapped(*a, **k):
        if not accept():
            return f(*a, **k)
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            rec = acc[label]
            rec[0] += time.perf_counter() - t0
            rec[1] += 1

    return wrapped


def on_thread(prefix: str):
    """An ``accept`` for calls on threads whose name starts with ``prefix``."""
    return lambda: threading.current_thread().name.startswith(prefix)


def report(acc, per: int, unit: str) -> str:
    """Lines of ``ms per <unit>`` and ``calls per <unit>`` for each label, most time first."""
    lines = []
    for label, (sec, calls) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {1e3 * sec / max(per, 1):8.3f} ms  {calls / max(per, 1):7.2f} calls"
                     f"  per {unit}  {label}")
    return "\n".join(lines)


def median_run(runs, key="value"):
    """The round of median ``key`` among ``runs`` (dicts; those whose ``key`` is None left
    out), as a copy with ``runs``: every round's value in order. An even count gives the mean of
    the middle two as ``key``. No round with a value: a copy of the last round."""
    done = sorted((r for r in runs if r.get(key) is not None), key=lambda r: r[key])
    out = dict(done[(len(done) - 1) // 2]) if done else dict(runs[-1])
    if done and len(done) % 2 == 0:
        out[key] = (done[len(done) // 2 - 1][key] + done[len(done) // 2][key]) / 2
    out["runs"] = [r.get(key) for r in runs]
    return out
