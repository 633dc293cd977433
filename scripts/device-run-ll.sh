#!/usr/bin/env bash
# Runs on a GPU machine from the repository root (after scripts/device-pack.sh here): the GPU
# correctness tests, compute-sanitizer, and the low-latency benchmark table. Logs go to $OUT.
set -u
source "$(dirname "$0")/device-env.sh"
n=$(nvidia-smi -L | wc -l)
echo "== $n GPUs"
$P/epflow kernels | tail -2
echo "== GPU tests"
timeout 400 $P/gpu_ll --test-threads=1 --nocapture >"$OUT/gpu_ll.log" 2>&1; echo "gpu_ll rc=$?"
grep -E "^(test |ok: |seed|[0-9]+ staged|rank [0-9]+:)|FAILED|panicked" "$OUT/gpu_ll.log" | tail -25
timeout 120 $P/gpu_async --nocapture >"$OUT/gpu_async.log" 2>&1; echo "gpu_async rc=$?"; grep -E "^test " "$OUT/gpu_async.log"
echo "== compute-sanitizer (2 GPUs)"
sanitize ll
echo "== benchmarks (the eager loop's device time, the host clock, and --queued: the pair queued ahead of the device)"
bench() { echo "-- epflow bench $*"; timeout 90 $P/epflow bench --validate "$@" 2>&1 | grep -E "^(Dispatch|Combine|Total|Device memory|Validation|---)|send half|warning" ; }
for tokens in 1 32 128; do
  bench --ranks "$n" --tokens $tokens --queued
  bench --ranks "$n" --tokens $tokens --queued --layout rank-major
done
bench --ranks "$n" --staged
bench --ranks "$n" --dtype fp8 --queued
bench --ranks "$n" --dtype fp8 --round-scales
bench --ranks "$n" --tokens 256
