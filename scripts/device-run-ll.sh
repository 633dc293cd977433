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
echo "== benchmarks"
bench() { echo "-- epflow bench $*"; timeout 90 $P/epflow bench --validate "$@" 2>&1 | grep -E "^(Dispatch|Combine|Total|Device memory|Validation|  *throughput)|send half" ; }
bench --ranks 4
bench --ranks 4 --staged
bench --ranks 4 --tokens 32
bench --ranks 4 --tokens 1
bench --ranks 4 --dtype fp8
bench --ranks 4 --dtype fp8 --round-scales
bench --ranks 2
bench --ranks 2 --tokens 32
bench --ranks 4 --tokens 256
