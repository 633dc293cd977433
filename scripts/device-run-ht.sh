#!/usr/bin/env bash
# Runs on a GPU machine from the repository root (after scripts/device-pack.sh here): the
# high-throughput correctness tests and benchmarks, and the low-latency/high-throughput
# crossover behind `--algorithm auto`. Logs go to $OUT. `quick` skips the long tests.
set -u
source "$(dirname "$0")/device-env.sh"
n=$(nvidia-smi -L | wc -l)
echo "== $n GPUs"
echo "== HT tests"
timeout 300 $P/gpu_ht ht_matches_reference --nocapture >"$OUT/gpu_ht.log" 2>&1; echo "gpu_ht rc=$?"
grep -E "^(test |seed)|FAILED|panicked|mismatch" "$OUT/gpu_ht.log" | tail -8; grep -c "^ok: " "$OUT/gpu_ht.log"
if [ "${1:-}" != quick ]; then
    timeout 200 $P/gpu_ht ht_many_iterations --nocapture >"$OUT/gpu_ht_iters.log" 2>&1; echo "gpu_ht iterations rc=$?"
    grep -E "iterations|FAILED|panicked" "$OUT/gpu_ht_iters.log" | tail -5
fi
echo "== HT benchmarks"
bench() { echo "-- epflow bench $*"; timeout 120 $P/epflow bench "$@" 2>&1 | grep -E "^(Dispatch|Combine) \(|^Handle|^Validation|Device memory|error|note" | sed 's/, min=.*, median/, median/'; }
bench --algorithm ht --ranks 4 --validate
bench --algorithm ht --ranks 4 --max-sms 128
bench --algorithm ht --ranks 4 --max-sms 32
bench --algorithm ht --ranks 4 --dtype fp8 --validate
bench --algorithm ht --ranks 4 --tokens 16384 --validate
bench --algorithm ht --ranks 2 --validate
bench --algorithm ht --ranks 2 --tokens 16384
echo "-- one process per GPU"
timeout 120 $P/epflow launch -n 4 -- $P/epflow bench --algorithm ht --validate 2>&1 | grep -E "^(Dispatch|Combine) \(|^Validation|error" | sed 's/, min=.*, median/, median/'
echo "== crossover (4 GPUs)"
for t in 1 32 128 256 512 1024; do bench --algorithm ll --ranks 4 --tokens $t; bench --algorithm ht --ranks 4 --tokens $t; done
bench --algorithm auto --ranks 4 --tokens 2048 --validate
echo "== compute-sanitizer (2 GPUs)"
sanitize ht
