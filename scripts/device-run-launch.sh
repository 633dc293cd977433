#!/usr/bin/env bash
# Runs on a GPU machine from the repository root (after scripts/device-pack.sh here): where the
# host time of a low-latency operation goes (benches/NOTES.md items 38, 39 and 42). `epflow diag launch`
# times each LL kernel's launch alone (a device no-op), `epflow diag ops` real operations' launches
# in sequences on one GPU, then `EPFLOW_HOST_STEPS=1` splits real
# operations' sends, one launch and two, and `EPFLOW_LL_TRACE=1` stamps one operation's phases on
# the GPU. Needs 1 GPU (2 for the operations). Logs go to $OUT.
set -u
source "$(dirname "$0")/device-env.sh"
n=$(nvidia-smi -L | wc -l)
echo "== $n GPUs"
echo "== kernels launched alone (host us per launch call)"
for t in 1 128; do timeout 120 $P/epflow diag launch --tokens "$t"; done
echo "== real operations on one GPU, in sequences (host us per launch call)"
timeout 200 $P/epflow diag ops --tokens 1
timeout 120 $P/gpu_ll ll_launch_costs --test-threads=1 --nocapture >"$OUT/gpu_ll-launch.log" 2>&1
echo "gpu_ll ll_launch_costs rc=$?: $(grep -E '^test result' "$OUT/gpu_ll-launch.log")"
[ "$n" -ge 2 ] || exit 0
steps() { echo "-- $*"; timeout 120 env EPFLOW_HOST_STEPS=1 "$@" 2>&1 | grep -E "^(Dispatch|Combine) \(|EPFLOW_HOST_STEPS" | sed -E 's/, min=[^,]*, max=[^,]*//'; }
echo "== host steps inside operations (2 GPUs)"
for t in 1 128; do
  steps $P/epflow bench --ranks 2 --tokens "$t" --iters 300
  steps env EPFLOW_ONE_LAUNCH=0 $P/epflow bench --ranks 2 --tokens "$t" --iters 300
done
echo "== device phases of one operation (block 0, every 64th)"
EPFLOW_LL_TRACE=1 timeout 120 $P/epflow bench --ranks 2 --tokens 1 --iters 300 2>&1 | grep EPFLOW_LL_TRACE | tail -4
