#!/usr/bin/env bash
# One GPU-machine session, after the bundle is installed (../shared/gpu/README.md):
#   bash benchmarks/gpu_session.sh tests      # info + every gpu test            -> $OUT/gpu_tests.log
#   bash benchmarks/gpu_session.sh video      # data (if missing) + clip bench    -> $OUT/bench_video*
#   bash benchmarks/gpu_session.sh audio|image
#   bash benchmarks/gpu_session.sh anchors    # the anchors, same data            -> $OUT/anchors
#   bash benchmarks/gpu_session.sh fuzz       # the full fuzz corpus, GPU backends -> $OUT/fuzz*
#   bash benchmarks/gpu_session.sh profile    # each step of the RNN-T collate and the video train
#                                             # transform, timed alone      -> $OUT/profile_stages.json
#   bash benchmarks/gpu_session.sh feedprof   # the RNN-T and video feeds run synchronously under
#                                             # cProfile              -> $OUT/profile_feeds_*.txt
#   bash benchmarks/gpu_session.sh vprobe     # a warm clip's steps timed by name, 16 threads and
#                                             # 1 (where the clip rate goes) -> $OUT/probe_video_clips.txt
#   bash benchmarks/gpu_session.sh quicktests # the gpu tests without the fuzz runs (first: fast)
#   bash benchmarks/gpu_session.sh fuzztests  # the fuzz-marked gpu tests (quicktests + fuzztests
#                                             # = every gpu test, in two calls) -> $OUT/gpu_fuzz_tests.log
#   bash benchmarks/gpu_session.sh reliability  # gpu tests, the full GPU fuzz corpus and a GPU
#                                             # soak (SOAK_MIN minutes), all three at once (on
#                                             # 2026-12-01 this took 590 s and finished none)
#   bash benchmarks/gpu_session.sh feeds|augment|extract   # feeds / augmentation / extraction
#                                             # vs DALI (+ the RNN-T anchor)      -> $OUT/bench_*
#   EXTRACT_ARGS="--dtype float16 --only avpipe_nemo,dali_nemo" bash ... extract  # options
#   bash benchmarks/gpu_session.sh targets    # the video and augmentation targets in one call
#                                             # (~5 min with the data): the feeds with and without
#                                             # their augmentation (its share of the feed's
#                                             # time; FEED_REPEAT interleaved rounds, 3, medians;
#                                             # the RNN-T one also paired in one process)
#                                             # and DALI's RNN-T feed, the augmentation stacks
#                                             # against DALI, the clip benchmark warm and cold
#                                             # against plain PyNvVideoCodec and DALI (warm also
#                                             # pass by pass, and ClipFeed iterated) -> $OUT/...
#   bash benchmarks/gpu_session.sh clips      # the clip benchmark alone (~3 min after the data):
#                                             # avpipe warm (NVDEC utilisation) and cold, plain
#                                             # PyNvVideoCodec and DALI, CLIP_REPEAT interleaved
#                                             # rounds (3), medians -> $OUT/bench_video.json
#   bash benchmarks/gpu_session.sh xtargets   # the extraction targets (~4 min after the data):
#                                             # float16 extraction on 16,384 and 65,536 files and
#                                             # frames at 1 fps, each against DALI -> $OUT/x*
# Each step fits one device call (10 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
BUDGET=${BUDGET:-10}
ANCHORS=/tmp/gpu-parts/anchors.py
mkdir -p "$OUT"
data() { [ -f /tmp/bench/.avpipe-gen-done ] || { python3 "$ANCHORS" --gen-only --data /tmp/bench --out "$OUT/anchors" >"$OUT/gen.log" 2>&1 && touch /tmp/bench/.avpipe-gen-done; }; }
anchors_only() { python3 "$ANCHORS" --only "$1" --data /tmp/bench --out "$OUT/anchors" --budget "$BUDGET" 2>&1 | tail -12; }
for step in "$@"; do
  case $step in
    tests)
      python3 -m avpipe info 2>&1 | tee "$OUT/info.txt"
      python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    # each step then runs anchors.py's own benchmarks for that workload, in the same call
    video) data; python3 benchmarks/bench_video.py --data /tmp/bench --out "$OUT" --budget "$BUDGET" 2>&1 | tail -25
           anchors_only pynvc_clip_cps,dali_video_reader_cps ;;
    audio) data; python3 benchmarks/bench_audio.py --data /tmp/bench --out "$OUT" --budget "$BUDGET" 2>&1 | tail -25
           anchors_only soundfile_decode_aps,dali_logmel_aps,torch_logmel_aps ;;
    image) data; python3 benchmarks/bench_image.py --data /tmp/bench --out "$OUT" --budget "$BUDGET" 2>&1 | tail -25
           anchors_only dali_jpeg_ips,dali_png_ips,dali_tiff_ips,dali_jp2_ips,pil_jpeg_ips ;;
    fuzz) python3 -m tests.fuzz.run --gpu --out /tmp/fuzz_gpu --budget "${FUZZ_BUDGET:-540}" 2>&1 \
            | tail -40 | tee "$OUT/fuzz_gpu.txt"
          cp /tmp/fuzz_gpu/logs/records.jsonl "$OUT/fuzz_gpu_records.jsonl" 2>/dev/null
          cp /tmp/fuzz_gpu/summary.json "$OUT/fuzz_gpu_summary.json" 2>/dev/null ;;
    quicktests)
      python3 -m avpipe info 2>&1 | tee "$OUT/info.txt"
      python3 -m pytest -m "gpu and not fuzz" -v -rfE --durations=15 -p no:cacheprovider tests \
        >"$OUT/gpu_tests.log" 2>&1; grep -E "^(FAILED|ERROR)| passed| failed" "$OUT/gpu_tests.log" | tail -30 ;;
    fuzztests)
      python3 -m pytest -m "gpu and fuzz" -v -rfE --durations=5 -p no:cacheprovider tests \
        >"$OUT/gpu_fuzz_tests.log" 2>&1; grep -E "^(FAILED|ERROR)| passed| failed" "$OUT/gpu_fuzz_tests.log" | tail -30 ;;
    reliability)
      python3 -m avpipe info >"$OUT/info.txt" 2>&1
      python3 benchmarks/soak.py --out "$OUT/soak" --device cuda --parallel --minutes "${SOAK_MIN:-6}" \
        --interval 5 >"$OUT/soak.log" 2>&1 &
      python3 -m pytest -m gpu -q -rf --durations=10 -p no:cacheprovider tests >"$OUT/gpu_tests.log" 2>&1 &
      python3 -m tests.fuzz.run --gpu --out /tmp/fuzz_gpu --budget "${FUZZ_BUDGET:-480}" \
        >"$OUT/fuzz_gpu.txt" 2>&1
      cp /tmp/fuzz_gpu/logs/records.jsonl "$OUT/fuzz_gpu_records.jsonl" 2>/dev/null
      cp /tmp/fuzz_gpu/summary.json "$OUT/fuzz_gpu_summary.json" 2>/dev/null
      wait
      tail -n 25 "$OUT/fuzz_gpu.txt"; tail -n 30 "$OUT/gpu_tests.log"; tail -n 15 "$OUT/soak.log" ;;
    feeds) data; python3 benchmarks/bench_feeds.py --data /tmp/bench --out "$OUT" --budget "$BUDGET" 2>&1 | tail -25
           anchors_only dali_rnnt_feed_aps,dali_video_reader_cps ;;
    profile) data; python3 benchmarks/profile_stages.py --data /tmp/bench --out "$OUT" \
               --parts "${PARTS:-rnnt,video,chain,image}" 2>&1 | tail -24 ;;
    vprobe) data; python3 benchmarks/probe_video_clips.py --data /tmp/bench --out "$OUT" 2>&1 | tail -24 ;;
    feedprof) data; python3 benchmarks/profile_stages.py --feeds --data /tmp/bench --out "$OUT" 2>&1 | tail -6 ;;
    augment) python3 benchmarks/bench_augment.py --out "$OUT" --budget "$BUDGET" 2>&1 | tail -25 ;;
    extract) data; python3 benchmarks/bench_extract.py --data /tmp/bench --out "$OUT" --profile \
               ${EXTRACT_ARGS:-} 2>&1 | tail -25 ;;
    targets) data
      # (BUDGET is 10 unless set: the feeds' budget is FEED_BUDGET, 5 s; a 3 s budget leaves
      # DALI's RNN-T feed mostly warming up, and the cold video feed its scan processes starting)
      python3 benchmarks/bench_feeds.py --data /tmp/bench --out "$OUT" --budget "${FEED_BUDGET:-5}" \
        --repeat "${FEED_REPEAT:-3}" \
        --only avpipe_rnnt,avpipe_rnnt_noaug,avpipe_rnnt_paired,avpipe_video,avpipe_video_noaug \
        2>&1 | tail -14
      anchors_only dali_rnnt_feed_aps
      python3 benchmarks/bench_augment.py --out "$OUT" --budget 2 --repeat "${AUG_REPEAT:-3}" 2>&1 | tail -16
      python3 benchmarks/bench_video.py --data /tmp/bench --out "$OUT" --budget "${FEED_BUDGET:-5}" \
        --only avpipe_clip_cps,avpipe_cold_clip_cps,pynvc_clip_cps,avpipe_clip_passes_cps,pynvc_clip_passes_cps,avpipe_feed_iter_cps,dali_video_reader_cps \
        2>&1 | tail -11 ;;
    clips) data
      python3 benchmarks/bench_video.py --data /tmp/bench --out "$OUT" --budget "${FEED_BUDGET:-5}" \
        --repeat "${CLIP_REPEAT:-3}" \
        --only avpipe_clip_cps,avpipe_cold_clip_cps,pynvc_clip_cps,dali_video_reader_cps 2>&1 | tail -8 ;;
    xtargets) data
      python3 benchmarks/bench_extract.py --data /tmp/bench --out "$OUT/x32" --profile \
        --dtype float16 --only avpipe_nemo,dali_nemo,avpipe_frames,dali_frames 2>&1 | tail -5
      python3 benchmarks/bench_extract.py --data /tmp/bench --out "$OUT/x128" --repeat 128 \
        --profile --dtype float16 --only avpipe_nemo,dali_nemo 2>&1 | tail -3
      rm -rf "$OUT/x32/work" "$OUT/x128/work" ;;  # (thousands of files: only the results come back)
    anchors) data; python3 "$ANCHORS" --data /tmp/bench --out "$OUT/anchors" --budget "$BUDGET" 2>&1 | tail -25 ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
