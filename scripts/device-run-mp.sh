#!/usr/bin/env bash
# Runs on a GPU machine (after scripts/device-pack.sh): one process per GPU (epflow launch),
# compute-sanitizer on the final kernels, the GPU two-batch-overlap example and the reactor
# benchmark. Logs go to $OUT.
set -u
source "$(dirname "$0")/device-env.sh"
seed=$(date +%s%N)
for n in 4 2; do
  EPFLOW_TEST_SEED=$seed timeout 240 $P/epflow launch -n $n -- $P/gpu_ll ll_one_process_per_gpu --nocapture --test-threads=1 >"$OUT/mp$n.log" 2>&1
  echo "one process per GPU, $n GPUs: rc=$? ($(grep -c '^ok: ' "$OUT/mp$n.log") ok lines)"; grep -E "panicked|FAILED|error" "$OUT/mp$n.log" | head -3
done
echo "== compute-sanitizer (2 GPUs, final kernels)"
sanitize
echo "== benchmarks, one process per GPU"
bench() { echo "-- epflow launch -n $1 -- epflow bench ${*:2}"; timeout 120 $P/epflow launch -n "$1" -- $P/epflow bench --validate "${@:2}" 2>&1 | grep -E "^(epflow bench|Dispatch|Combine|Device memory|Validation|---)|send half|error" ; }
bench 4
bench 4 --tokens 1
bench 4 --tokens 32
bench 4 --dtype fp8
bench 2
echo "== two-batch overlap on GPUs"
timeout 240 $P/two_batch_overlap --backend gpu 2>&1 | tail -8
echo "== reactor"
timeout 90 $P/reactor --warm-up-time 1 --measurement-time 2 2>&1 | grep -E "latency|reactor saw|idle CPU|time:"
