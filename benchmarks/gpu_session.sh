#!/usr/bin/env bash
# The GPU machine's session through the harness, each step one device call or less:
#   bash benchmarks/gpu_session.sh suite      # python -m benchmarks run --suite gpu -> $OUT/results
#   bash benchmarks/gpu_session.sh tests      # avpipe info, pytest -m gpu, the GPU fuzz corpus -> $OUT
#                                             # (TESTS=pytest or TESTS=fuzz: one of them;
#                                             #  FUZZ_ARGS="--budget 480": options of the fuzz run)
#   bash benchmarks/gpu_session.sh report     # $OUT/results/*.json into benchmarks/results, RESULTS.md
#                                             # regenerated from them all -> $OUT/RESULTS.md
# Options go through to the harness: ARGS="--only video,image --quick" bash ... suite
# Extra wheels in /tmp/site are found through PYTHONPATH. Nothing outside the repository is needed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
rc=0
for step in "${@:-suite}"; do
  case $step in
    suite) python3 -m benchmarks run --suite gpu --out "$OUT/results" ${ARGS:-} 2>&1 \
             | tee "$OUT/suite.log" | grep -E "ratio of medians|skipped|failed|written"
           [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    tests) python3 -m avpipe info >"$OUT/info.txt" 2>&1
           python3 -m benchmarks tests --out "$OUT" --what "${TESTS:-pytest,fuzz}" \
             --fuzz-args "${FUZZ_ARGS:-}" || rc=1 ;;
    report) cp "$OUT"/results/*.json benchmarks/results/ && python3 -m benchmarks report \
              && cp benchmarks/RESULTS.md "$OUT/RESULTS.md" ;;
    *) echo "unknown step $step (suite, tests, report)" >&2; exit 2 ;;
  esac
done
exit $rc
