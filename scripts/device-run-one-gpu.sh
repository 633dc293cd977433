#!/usr/bin/env bash
# Runs on a one-GPU machine (nvidia-h100-x1 or nvidia-h200) from the repository root, after
# scripts/device-pack.sh here: every GPU test suite with two ranks sharing GPU 0
# (EPFLOW_TEST_DEVICES=0,0; tests written for another number of devices skip, saying so),
# ROUNDS times in a row (default 3), while a CPU stressor keeps every core busy (STRESS=0 turns
# it off). Logs go to $OUT; one line per suite and round, then "N passed, N failed" over all of
# them.
#
#   scripts/device-run-one-gpu.sh [ROUNDS] [SUITE ...]
#
# EPFLOW_GPU_ITERS (default 300) sets the iterations of the suites that read it; SUITE_TIMEOUT
# (default 480 s) bounds each suite.
set -u
source "$(dirname "$0")/device-env.sh"
rounds=${1:-3}
shift || true
suites=("$@")
if [ ${#suites[@]} -eq 0 ]; then
  suites=(epflow_kernels gpu_ll gpu_rank_major gpu_graph gpu_numbered gpu_disagreement gpu_ht gpu_stream_order gpu_masking gpu_async gpu_layer)
fi
export EPFLOW_TEST_DEVICES=0,0 EPFLOW_GPU_ITERS=${EPFLOW_GPU_ITERS:-300}
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), ranks on devices $EPFLOW_TEST_DEVICES," \
  "$EPFLOW_GPU_ITERS iterations, CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-unset}"
stress=()
if [ "${STRESS:-1}" != 0 ]; then
  for _ in $(seq "$(nproc)"); do
    (while :; do :; done) &
    stress+=($!)
  done
  echo "== CPU stressor: ${#stress[@]} spinning processes"
fi
cleanup() { [ ${#stress[@]} -gt 0 ] && kill "${stress[@]}" 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT
passed=0 failed=0
for round in $(seq "$rounds"); do
  for suite in "${suites[@]}"; do
    log="$OUT/one-gpu-$suite-$round.log"
    start=$SECONDS
    timeout "${SUITE_TIMEOUT:-480}" "$P/$suite" --test-threads=1 --nocapture >"$log" 2>&1
    rc=$?
    # --nocapture interleaves the tests' output with their verdicts: count from the summary.
    ok=$(grep -E '^test result' "$log" | tail -1 | sed -E 's/.* ([0-9]+) passed.*/\1/')
    bad=$(grep -E '^test result' "$log" | tail -1 | sed -E 's/.* ([0-9]+) failed.*/\1/')
    skipped=$(grep -c 'SKIPPED' "$log")
    echo "round $round $suite: rc=$rc, ${ok:-0} passed, ${bad:-?} failed, $skipped skip notes ($((SECONDS - start)) s)"
    if [ $rc -eq 0 ]; then passed=$((passed + 1)); else
      failed=$((failed + 1))
      grep -E "^test .* FAILED$|panicked|Timeout|timed out" "$log" | head -6 | sed 's/^/    /'
    fi
  done
done
echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
