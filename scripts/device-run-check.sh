#!/usr/bin/env bash
# Runs on a 2-GPU machine from the repository root, after scripts/device-pack.sh here (and,
# for the A/B part, the previous commit's `epflow` packed into .device-base/epflow): every GPU
# test suite on 2 GPUs in both process models, compute-sanitizer, and `epflow bench --validate`
# of this build against the baseline binary, alternated in one session. Logs go to $OUT.
# Parts: perf (the overlap examples and the reactor benchmark), ab, tests, sanitize (default:
# all, in that order); shared (not in all: the suites with two ranks per GPU, four ranks on two
# GPUs, `EPFLOW_TEST_DEVICES=0,0,1,1`; the NCCL tests skip there).
set -u
source "$(dirname "$0")/device-env.sh"
part=${1:-all}
echo "== $(nvidia-smi -L | wc -l) GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
run() { # name timeout binary args...: runs a test binary, prints its verdicts
  local name=$1 t=$2; shift 2
  timeout "$t" "$@" --test-threads=1 --nocapture >"$OUT/$name.log" 2>&1
  echo "-- $name rc=$? ($(grep -c '^test .* ok$' "$OUT/$name.log") ok, $(grep -c 'SKIPPED' "$OUT/$name.log") skipped)"
  grep -E "FAILED|panicked|^test .*(FAILED|ignored)|staged iterations|iterations in|mismatch" "$OUT/$name.log" | head -8
}
if [ "$part" = all ] || [ "$part" = perf ]; then
  echo "== two_batch_overlap (stream-ordered pipeline vs serial), 5 runs per placement"
  for order in on-stream ordered; do
    timeout 120 $P/two_batch_overlap --backend gpu --runs 5 --order $order --awaited >"$OUT/tbo-$order.log" 2>&1
    echo "-- --order $order rc=$?"; grep -E "communication per step|pipelined|efficiency|identical|WARNING" "$OUT/tbo-$order.log" | tail -6
  done
  timeout 120 $P/two_batch_overlap --backend gpu --micro-batches 3 --runs 2 >"$OUT/tbo-3.log" 2>&1
  echo "-- --micro-batches 3 rc=$?"; grep -E "efficiency|identical" "$OUT/tbo-3.log" | tail -3
  echo "== moe_serving"
  timeout 150 $P/moe_serving --backend gpu --micro-batches 1,2,3 --seconds 4 --rate 400000 >"$OUT/serving-gpu.log" 2>&1
  echo "-- gpu rc=$?"; grep -E "tokens/s|throughput|communication" "$OUT/serving-gpu.log"
  timeout 150 $P/moe_serving --backend gpu --micro-batches 2 --seconds 2 --rate 400000 --check >"$OUT/serving-gpu-check.log" 2>&1
  echo "-- gpu --check rc=$?"; grep -E "identical|tokens/s|differ" "$OUT/serving-gpu-check.log"
  timeout 150 $P/moe_serving --backend host --micro-batches 1,2 --seconds 3 --rate 100000 >"$OUT/serving-host.log" 2>&1
  echo "-- host rc=$?"; grep -E "tokens/s|throughput|communication" "$OUT/serving-host.log"
  echo "== reactor wake latency"
  timeout 120 $P/reactor --warm-up-time 1 --measurement-time 2 >"$OUT/reactor.log" 2>&1
  echo "-- rc=$?"; grep -E "p50|CPU" "$OUT/reactor.log"
fi
if [ "$part" = all ] || [ "$part" = tests ]; then
  echo "== GPU test suites"
  run kernels_unit 120 $P/epflow_kernels
  run gpu_stream_order 300 $P/gpu_stream_order
  seed=$(date +%s%N)
  EPFLOW_TEST_SEED=$seed timeout 120 $P/epflow launch -n 2 -- $P/gpu_stream_order stream_order_one_process_per_gpu --nocapture --test-threads=1 >"$OUT/mp2-stream.log" 2>&1
  echo "-- one process per GPU (gpu_stream_order): rc=$? ($(grep -c '^ok: ' "$OUT/mp2-stream.log") ok lines)"; grep -E "panicked|FAILED" "$OUT/mp2-stream.log" | head -3
  EPFLOW_GPU_ITERS=${EPFLOW_LL_ITERS:-10000} run gpu_ll 300 $P/gpu_ll
  run gpu_ht 300 $P/gpu_ht
  EPFLOW_GPU_ITERS=${EPFLOW_LL_ITERS:-10000} run gpu_rank_major 400 $P/gpu_rank_major
  run gpu_disagreement 120 $P/gpu_disagreement
  EPFLOW_GPU_ITERS=${EPFLOW_LL_ITERS:-10000} run gpu_graph 400 $P/gpu_graph
  run gpu_async 180 $P/gpu_async
  seed=$(date +%s%N)
  EPFLOW_TEST_SEED=$seed timeout 120 $P/epflow launch -n 2 -- $P/gpu_ll ll_one_process_per_gpu --nocapture --test-threads=1 >"$OUT/mp2.log" 2>&1
  echo "-- one process per GPU (gpu_ll): rc=$? ($(grep -c '^ok: ' "$OUT/mp2.log") ok lines)"; grep -E "panicked|FAILED" "$OUT/mp2.log" | head -3
  EPFLOW_TEST_SEED=$seed timeout 120 $P/epflow launch -n 2 -- $P/gpu_rank_major rank_major_one_process_per_gpu --nocapture --test-threads=1 >"$OUT/mp2-rm.log" 2>&1
  echo "-- one process per GPU (gpu_rank_major): rc=$? ($(grep -c '^ok: ' "$OUT/mp2-rm.log") ok lines)"; grep -E "panicked|FAILED" "$OUT/mp2-rm.log" | head -3
  EPFLOW_GPU_ITERS=1000 run gpu_masking 240 $P/gpu_masking
  EPFLOW_TEST_SEED=$seed EPFLOW_GPU_ITERS=1000 timeout 240 $P/epflow launch -n 2 -- $P/gpu_masking masking_one_process_per_gpu --nocapture --test-threads=1 >"$OUT/mp2-masking.log" 2>&1
  echo "-- one process per GPU, a process exits (gpu_masking): rc=$? ($(grep -c '^ok: ' "$OUT/mp2-masking.log") ok lines)"; grep -E "panicked|FAILED|took" "$OUT/mp2-masking.log" | head -3
  EPFLOW_TEST_SEED=$seed timeout 120 $P/epflow launch -n 2 -- $P/gpu_graph graph_one_process_per_gpu --nocapture --test-threads=1 >"$OUT/mp2-graph.log" 2>&1
  echo "-- one process per GPU (gpu_graph): rc=$? ($(grep -c '^ok: ' "$OUT/mp2-graph.log") ok lines)"; grep -E "panicked|FAILED" "$OUT/mp2-graph.log" | head -3
fi
if [ "$part" = shared ]; then
  echo "== two ranks per GPU (EPFLOW_TEST_DEVICES=0,0,1,1; gpu_stream_order on 0,0)"
  for suite in gpu_ll gpu_rank_major gpu_ht gpu_graph; do
    EPFLOW_GPU_ITERS=10 EPFLOW_TEST_DEVICES=0,0,1,1 run "shared-$suite" 400 $P/$suite
  done
  EPFLOW_TEST_DEVICES=0,0 run shared-gpu_stream_order 300 $P/gpu_stream_order
fi
if [ "$part" = all ] || [ "$part" = sanitize ]; then
  echo "== compute-sanitizer (2 GPUs)"
  sanitize stream
  sanitize graph
  sanitize ll
  sanitize rank-major
  sanitize ht
  sanitize mask
fi
if [ "$part" = all ] || [ "$part" = ab ]; then
  echo "== epflow bench --validate: baseline (.device-base) vs this build, alternated"
  summary() { grep -E "^(Dispatch|Combine) \(|^--- [A-Z][a-z]+|^Handle|^Validation" | sed -E 's/^--- ([^(,]*[^(, ]).*/[\1]/; s/, min=[^,]*, max=[^,]*//; s/ *\(.*avg=/ avg=/' | tr '\n' ' '; }
  ab=("" "--tokens 32" "--tokens 1" "--staged" "--dtype fp8" "--algorithm ht" "--algorithm ht --dtype fp8"
      "--layout rank-major" "--layout rank-major --tokens 1" "--layout rank-major --dtype fp8")
  # EPFLOW_AB_SHORT=1: the regression targets only (low-latency 128 tokens, staged, high-throughput).
  if [ -n "${EPFLOW_AB_SHORT:-}" ]; then ab=("" "--staged" "--algorithm ht"); fi
  for args in "${ab[@]}"; do
    for rep in 1 2; do
      for b in .device-base/epflow $P/epflow; do
        [ -x "$b" ] || continue
        echo "$(basename $(dirname $b)) [$args] #$rep: $(timeout 120 $b bench --validate $args 2>&1 | summary)"
      done
    done
  done
fi
