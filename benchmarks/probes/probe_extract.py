"""Where an extraction worker's time goes: one worker run in this process, several ways.

    python -m benchmarks.probes.probe_extract --out DIR [--repeat 64]
        [--variants full,nofsync,nowrite,cprofile] [--dtype float16]

The same job as ``benchmarks/workloads/extract.py``'s ``avpipe_nemo`` (the 512 FLAC files ``--repeat`` times,
preset ``nemo``, tar shards of 512), but the worker (``_engine_local.run_worker``) runs in this
process, so that parts of it can be replaced:

* ``full``: as it is;
* ``nofsync``: the writers' ``os.fsync`` does nothing (the cost of durability);
* ``nowrite``: shards are not written at all (the compute side's own rate);
* ``cprofile``: ``full`` under cProfile (Python 3.12 profiles every thread): the top functions
  by own time and by cumulative time.

A variant may add settings after ``+``: ``w8`` (``AVPIPE_EXTRACT_WRITERS=8``), ``wb0``
(``AVPIPE_EXTRACT_WRITEBACK_MB=0``), e.g. ``full+w8+wb32``.

Each prints audio-s/s over the whole worker run (no process spawn: the start-up is lower than a
real run's) and the worker's stage profile (``AVPIPE_EXTRACT_PROFILE``). A diagnosis tool, not a
contender: ``benchmarks/workloads/extract.py`` is the measurement.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import time

from benchmarks.harness import DEFAULT_DATA


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--out", default=".")
    ap.add_argument("--files", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=64)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--variants", default="full,nofsync,nowrite,cprofile")
    args = ap.parse_args()
    os.environ["AVPIPE_EXTRACT_PROFILE"] = "1"

    from avpipe.recipes.extract import _engine_local, _process, _writers
    from avpipe.recipes.extract._inputs import resolve_inputs
    from avpipe.recipes.extract._presets import extensions_of, resolve_preset
    from benchmarks.workloads import extract as bench_extract

    args.cpu = args.device == "cpu"
    files, durs, _ = bench_extract.audio_data(args)
    work = os.path.join(args.out, "probe_work")
    os.makedirs(work, exist_ok=True)
    lst = bench_extract._list_file(files, args.repeat, os.path.join(work, "files.txt"))
    cfg = resolve_preset("nemo", dtype=args.dtype)
    inp = resolve_inputs(lst, extensions_of(cfg), exclude=work)
    total = len(inp.items)
    shards = _writers.make_shards(total, 512)
    audio_s = sum(durs) * args.repeat
    results = {}
    real_fsync, real_write = os.fsync, _engine_local.write_shard
    env0 = dict(os.environ)
    for v in [x for x in args.variants.split(",") if x]:
        os.environ.clear()
        os.environ.update(env0)
        base, *opts = v.split("+")
        for o in opts:
            if o.startswith("wb"):
                os.environ["AVPIPE_EXTRACT_WRITEBACK_MB"] = o[2:]
            elif o.startswith("w"):
                os.environ["AVPIPE_EXTRACT_WRITERS"] = o[1:]
            else:
                raise SystemExit(f"unknown option {o!r} in variant {v!r}")
        out = os.path.join(work, v)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        _process._times.clear()
        os.fsync = (lambda fd: None) if base == "nofsync" else real_fsync
        _engine_local.write_shard = ((lambda *a, **k: []) if base == "nowrite" else real_write)
        prof = cProfile.Profile() if base == "cprofile" else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        _engine_local.run_worker(args.device, shards, inp.items, cfg, out, "tar", total,
                                 max(1, os.cpu_count() or 1), frozenset(), lambda p: None)
        if prof is not None:
            prof.disable()
        secs = time.perf_counter() - t0
        res = {"audio_s/s": round(audio_s / secs, 1), "seconds": round(secs, 3),
               "files": total, "profile": {k: round(x, 3) for k, x in _process._times.items()}}
        if prof is not None:
            for key in ("tottime", "cumulative"):
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats(key).print_stats(28)
                res[f"top_{key}"] = s.getvalue()[-6000:]
        results[v] = res
        print(f"--- {v}: {res['audio_s/s']:,.1f} audio-s/s in {secs:.2f} s", flush=True)
        print(json.dumps(res["profile"]), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    os.fsync, _engine_local.write_shard = real_fsync, real_write
    os.environ.clear()
    os.environ.update(env0)
    with open(os.path.join(args.out, "probe_extract.json"), "w") as f:
        json.dump(results, f, indent=1)
    for r in results.values():
        if "top_tottime" in r:
            print(r["top_tottime"][-3500:])


if __name__ == "__main__":
    main()
