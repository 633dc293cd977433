#!/usr/bin/env bash
# Runs on a GPU machine from the repository root (after scripts/device-pack.sh here): the
# high-throughput correctness tests and benchmarks. Logs go to $OUT. `quick` skips the long tests.
set -u
source "$(dirname "$0")/device-env.sh"
n=$(nvidia-smi -L | wc -l)
echo "== $n GPUs"
echo "== HT tests"
timeout 300 $P/gpu_ht ht_matches_reference --nocapture >"$OUT/gpu_ht.log" 2>&1; echo "gpu_ht rc=$?"
grep -E "^(test |ok: |seed)|FAILED|panicked|mismatch" "$OUT/gpu_ht.log" | tail -40
if [ "${1:-}" != quick ]; then
    timeout 200 $P/gpu_ht ht_many_iterations --nocapture >"$OUT/gpu_ht_iters.log" 2>&1; echo "gpu_ht iterations rc=$?"
    grep -E "iterations|FAILED|panicked" "$OUT/gpu_ht_iters.log" | tail -5
fi
echo "== HT benchmarks"
bench() { echo "-- epflow bench $*"; timeout 120 $P/epflow bench --validate "$@" 2>&1 | grep -E "^(Dispatch|Combine|Total|Device memory|Validation|error)" ; }
bench --algorithm ht --ranks 4
bench --algorithm ht --ranks 2
