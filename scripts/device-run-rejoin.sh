#!/usr/bin/env bash
# On a GPU machine, from the repository root: issue 68's rejoin.
# 1. Processes: rank 0 (`survivor`) and rank 1 (`victim`) join a low-latency group with rank
#    masking over the TCP bootstrap; after four full rounds the victim's process exits (status
#    3); the survivor masks it and goes on; then a new process (`newcomer`) takes rank 1's place
#    (`GpuWorld::rejoin`; the survivor's async `Group::admit` over its meeting source) and both
#    run full rounds against the reference (`gpu_masking rejoin_over_tcp`).
# 2. The same under `epflow launch -n 2 --restarts 1`: the launcher starts the failed victim
#    again as the newcomer (`EPFLOW_REJOIN=1`).
# 3. One process, the replacement a new rank of it: `gpu_masking rejoin_in_one_process` (3
#    kill-and-rejoin cycles), `bad_rejoins_in_one_process_change_nothing`, and `moe_serving
#    --kill-rank 1 --at 2 --rejoin-at 4 --check` on the GPU backend (needs
#    .device-pack/moe_serving).
# DEVICES="0 0" (default) puts both ranks on GPU 0 (processes time-slice it: a functional
# check); "0 1" on two GPUs. ITERS rounds per phase (default 50). Logs in $OUT/rejoin-*.log; one
# line per run.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-env.sh
read -r d0 d1 <<<"${DEVICES:-0 0}"
rejoin_processes rejoin $d0 $d1 29631 300
devices=$d0,$d1
# The same under `epflow launch --restarts 1`: the launcher starts rank 1 again when its victim
# process fails, with EPFLOW_REJOIN=1 (the newcomer); meetings on the launch's port.
EPFLOW_TEST_DEVICES=$devices EPFLOW_TEST_SEED=${EPFLOW_TEST_SEED:-$RANDOM} EPFLOW_GPU_ITERS=${ITERS:-50} timeout 300 \
    $P/epflow launch -n 2 --restarts 1 --master-addr 127.0.0.1 --master-port 29641 -- \
    $P/gpu_masking rejoin_over_tcp --nocapture --test-threads=1 >"$OUT/rejoin-launch.log" 2>&1
echo "epflow launch --restarts 1 rc=$? $(grep -E 'exits now|starting it again|first operation|^ok:|panicked' "$OUT/rejoin-launch.log" | tr '\n' ' ')"
EPFLOW_TEST_DEVICES=$devices EPFLOW_GPU_ITERS=${ITERS:-50} timeout 300 $P/gpu_masking rejoin_in_one_process \
    bad_rejoins_in_one_process_change_nothing --nocapture --test-threads=1 >"$OUT/rejoin-one-process.log" 2>&1
echo "one process rc=$? $(grep -E 'cycle .*rank 0|died at|^ok:|panicked|test result' "$OUT/rejoin-one-process.log" | tr '\n' ' ')"
if [ -x $P/moe_serving ]; then
    timeout 150 $P/moe_serving --backend gpu --devices "$devices" --kill-rank 1 --at 2 --rejoin-at 4 --seconds 7 \
        --check >"$OUT/rejoin-serving.log" 2>&1
    echo "moe_serving rc=$? $(grep -E 'stopped at|bit-identical|micro-batches [0-9]+:|error' "$OUT/rejoin-serving.log" | tr '\n' ' ')"
fi
