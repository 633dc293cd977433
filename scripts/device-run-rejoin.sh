#!/usr/bin/env bash
# On a GPU machine, from the repository root: issue 68's rejoin with processes. Rank 0
# (`survivor`) and rank 1 (`victim`) join a low-latency group with rank masking over the TCP
# bootstrap; after four full rounds the victim's process exits; the survivor masks it and goes
# on; then a new process (`newcomer`) takes rank 1's place (`GpuWorld::rejoin`; the survivor's
# async `Group::admit` over its meeting source) and both run full rounds against the reference (`gpu_masking rejoin_over_tcp`). DEVICES="0 0"
# (default) puts both ranks on GPU 0 (the processes time-slice it: a functional check); "0 1" on
# two GPUs. ITERS rounds per phase (default 50). Logs in $OUT/rejoin-*.log; one line per process.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-env.sh
read -r d0 d1 <<<"${DEVICES:-0 0}"
common=(MASTER_ADDR=127.0.0.1 MASTER_PORT=29631 EPFLOW_TEST_REJOIN_PORT=29632 WORLD_SIZE=2
    EPFLOW_TEST_SEED=${EPFLOW_TEST_SEED:-$RANDOM} EPFLOW_GPU_ITERS=${ITERS:-50})
env "${common[@]}" RANK=0 LOCAL_RANK=$d0 EPFLOW_TEST_REJOIN=survivor timeout 300 \
    $P/gpu_masking rejoin_over_tcp --nocapture --test-threads=1 >"$OUT/rejoin-survivor.log" 2>&1 &
survivor=$!
env "${common[@]}" RANK=1 LOCAL_RANK=$d1 EPFLOW_TEST_REJOIN=victim timeout 120 \
    $P/gpu_masking rejoin_over_tcp --nocapture --test-threads=1 >"$OUT/rejoin-victim.log" 2>&1
echo "victim rc=$? $(grep -E 'exits now|panicked' "$OUT/rejoin-victim.log" | head -2 | tr '\n' ' ')"
env "${common[@]}" RANK=1 LOCAL_RANK=$d1 EPFLOW_TEST_REJOIN=newcomer timeout 240 \
    $P/gpu_masking rejoin_over_tcp --nocapture --test-threads=1 >"$OUT/rejoin-newcomer.log" 2>&1
echo "newcomer rc=$? $(grep -E '^ok:|panicked|test result' "$OUT/rejoin-newcomer.log" | head -3 | tr '\n' ' ')"
wait $survivor
echo "survivor rc=$? $(grep -E 'first operation|^ok:|panicked|test result' "$OUT/rejoin-survivor.log" | head -4 | tr '\n' ' ')"
