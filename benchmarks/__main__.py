"""``python -m benchmarks``: run the suites, regenerate RESULTS.md, make the data.

    python -m benchmarks run --suite cpu|gpu|all [--only NAME,..] [--rounds N] [--quick]
        [--out DIR] [--data DIR] [--contenders NAME,..] [--baseline COMMIT] [--tests]
    python -m benchmarks report [--results DIR] [--out FILE]
    python -m benchmarks tests [--out DIR]     # pytest -m gpu and the GPU fuzz corpus
    python -m benchmarks list
    python -m benchmarks data [--data DIR] [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from benchmarks import harness
from benchmarks.harness import log


def _names(text: str) -> list[str]:
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def _params(items: list[str]) -> dict:
    """``KEY=VALUE`` pairs, each value read as JSON where it parses (numbers, true, null)."""
    import json

    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep:
            raise SystemExit(f"--param {it!r}: not KEY=VALUE")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def cmd_run(args, argv) -> int:
    if args.rounds < 3:
        raise SystemExit("--rounds must be at least 3 (interleaved rounds, ratio of medians)")
    names = harness.suite_of(args.suite)
    only = _names(args.only)
    unknown = [n for n in only if n not in harness.all_workloads()]
    if unknown:
        raise SystemExit(f"--only: unknown workload(s) {unknown}; known: "
                         f"{', '.join(harness.all_workloads())}")
    if only:
        names = [n for n in names if n in only] or [n for n in only]
    command = harness.command_line(argv)
    written, failed = [], 0
    for name in names:
        try:
            doc = harness.run_workload(name, rounds=args.rounds, quick=args.quick,
                                       data_dir=args.data,
                                       only_contenders=_names(args.contenders) or None,
                                       timeout=args.timeout, command=command,
                                       overrides=_params(args.param), out_dir=args.out,
                                       baseline=args.baseline)
        except Exception as e:  # noqa: BLE001 - one workload's failure must not stop the rest
            import traceback

            traceback.print_exc()
            log(f"{name}: failed: {type(e).__name__}: {e}")
            failed += 1
            continue
        if doc is None or doc.get("skipped"):
            continue
        written.append(harness.write_result(doc, args.out))
        log(f"{name}: {written[-1]}")
    if args.tests:
        failed += run_gpu_tests(args.out)
    if os.path.abspath(args.out) == os.path.abspath(harness.RESULTS) and written:
        from benchmarks import report

        report.write()
    log(f"{len(written)} result(s) written to {args.out}" + (f", {failed} failed" if failed else ""))
    return 1 if failed else 0


def run_gpu_tests(out: str, what: str = "pytest,fuzz", fuzz_args: str = "") -> int:
    """``pytest -m gpu`` and the GPU fuzz corpus (``what``), their logs in ``out``; the count
    failing. ``fuzz_args``: more options of ``tests.fuzz.run`` (e.g. ``--budget 480``)."""
    import shlex

    os.makedirs(out, exist_ok=True)
    failed = 0
    steps = {
        "pytest": ("gpu_tests.log", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE",
                                     "-p", "no:cacheprovider", "tests"]),
        "fuzz": ("fuzz_gpu.log", [sys.executable, "-m", "tests.fuzz.run", "--gpu",
                                  "--out", os.path.join(out, "fuzz_gpu"),
                                  *shlex.split(fuzz_args)]),
    }
    for fname, cmd in (steps[w] for w in _names(what)):
        log("$ " + " ".join(cmd))
        with open(os.path.join(out, fname), "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=harness.ROOT).returncode
        with open(os.path.join(out, fname)) as f:
            log("".join(f.readlines()[-15:]))
        failed += rc != 0
    return failed


def cmd_report(args) -> int:
    from benchmarks import report

    path = report.write(results_dir=args.results, out=args.out)
    log(f"wrote {path}")
    return 0


def cmd_list(args) -> int:
    for n in harness.all_workloads():
        mod = harness.workload(n)
        print(f"{n:16s} {mod.SUITE:4s} {mod.TITLE}")
        print(f"    params: {getattr(mod, 'PARAMS', {})}  (--quick: {getattr(mod, 'QUICK', {})})")
        for c, d in mod.CONTENDERS.items():
            print(f"    {c:26s} {d}")
    return 0


def cmd_data(args) -> int:
    from benchmarks import data

    data.anchor_data(args.data, quick=args.quick)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_child"]:
        return harness.child_main(*argv[1:4])
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a suite")
    r.add_argument("--suite", choices=["cpu", "gpu", "all"], default="cpu")
    r.add_argument("--only", default="", help="workloads, comma-separated")
    r.add_argument("--contenders", default="", help="contenders, comma-separated (default all)")
    r.add_argument("--rounds", type=int, default=3, help="interleaved rounds (at least 3)")
    r.add_argument("--quick", action="store_true", help="small data and budgets (a smoke test)")
    r.add_argument("--out", default=harness.RESULTS,
                   help="folder of the results JSON (default benchmarks/results: RESULTS.md "
                        "is regenerated)")
    r.add_argument("--data", default=harness.DEFAULT_DATA, help="folder of the generated data")
    r.add_argument("--timeout", type=float, default=900.0, help="seconds per child measurement")
    r.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a workload parameter (e.g. files=64, budget=5), over --quick's")
    r.add_argument("--baseline", default=None, metavar="COMMIT",
                   help="also measure every avpipe contender with this commit's avpipe, in the "
                        "same rounds (a before/after ratio; results keyed --vs-COMMIT)")
    r.add_argument("--tests", action="store_true",
                   help="then `pytest -m gpu` and the GPU fuzz corpus, logs in --out")
    p = sub.add_parser("report", help="regenerate RESULTS.md from the results JSON")
    p.add_argument("--results", default=harness.RESULTS)
    p.add_argument("--out", default=os.path.join(harness.HERE, "RESULTS.md"))
    t = sub.add_parser("tests", help="pytest -m gpu and the GPU fuzz corpus, logs in --out")
    t.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    t.add_argument("--what", default="pytest,fuzz", help="pytest, fuzz or both")
    t.add_argument("--fuzz-args", default="", help="more options of tests.fuzz.run")
    sub.add_parser("list", help="the workloads and their contenders")
    d = sub.add_parser("data", help="make the shared data (video, FLAC, images)")
    d.add_argument("--data", default=harness.DEFAULT_DATA)
    d.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        return cmd_run(args, argv)
    if args.cmd == "tests":
        return 1 if run_gpu_tests(args.out, args.what, args.fuzz_args) else 0
    return {"report": cmd_report, "list": cmd_list, "data": cmd_data}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
