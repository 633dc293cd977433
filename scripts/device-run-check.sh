#!/usr/bin/env bash
# Runs on a 2-GPU machine from the repository root, after scripts/device-pack.sh here (and,
# for the A/B part, the previous commit's `epflow` packed into .device-base/epflow): every GPU
# test suite on 2 GPUs in both process models, compute-sanitizer, and `epflow bench --validate`
# of this build against the baseline binary, alternated in one session. Logs go to $OUT.
# Parts: tests, sanitize, ab (default: all).
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
if [ "$part" = all ] || [ "$part" = tests ]; then
  echo "== GPU test suites"
  run gpu_ll 300 $P/gpu_ll
  run gpu_ht 300 $P/gpu_ht
  run gpu_disagreement 120 $P/gpu_disagreement
  run gpu_async 180 $P/gpu_async
  seed=$(date +%s%N)
  EPFLOW_TEST_SEED=$seed timeout 120 $P/epflow launch -n 2 -- $P/gpu_ll ll_one_process_per_gpu --nocapture --test-threads=1 >"$OUT/mp2.log" 2>&1
  echo "-- one process per GPU (gpu_ll): rc=$? ($(grep -c '^ok: ' "$OUT/mp2.log") ok lines)"; grep -E "panicked|FAILED" "$OUT/mp2.log" | head -3
fi
if [ "$part" = all ] || [ "$part" = sanitize ]; then
  echo "== compute-sanitizer (2 GPUs)"
  sanitize ll
  sanitize ht
fi
if [ "$part" = all ] || [ "$part" = ab ]; then
  echo "== epflow bench --validate: baseline (.device-base) vs this build, alternated"
  summary() { grep -E "^(Dispatch|Combine) \(|^Handle|^Validation" | sed -E 's/, min=[^,]*, max=[^,]*//; s/ *\(.*avg=/ avg=/' | tr '\n' ' '; }
  for args in "" "--tokens 32" "--tokens 1" "--staged" "--dtype fp8" "--algorithm ht" "--algorithm ht --dtype fp8"; do
    for rep in 1 2; do
      for b in .device-base/epflow $P/epflow; do
        [ -x "$b" ] || continue
        echo "$(basename $(dirname $b)) [$args] #$rep: $(timeout 120 $b bench --validate $args 2>&1 | summary)"
      done
    done
  done
fi
