#!/usr/bin/env bash
# On a GPU machine, from the repository root: rank masking and rejoin over NCCL (issue 68), in
# one process (`gpu_masking`): `masking_over_nccl_revokes_and_a_newcomer_rejoins` (two ranks
# over `Transport::Nccl`; each cycle rank 1 dies, rank 0 revokes its pair communicators with it,
# a new rank rejoins and makes new pairs) and
# `masking_over_nvlink_and_nccl_revokes_and_a_newcomer_rejoins` (three ranks, 0 and 1 on NVLink,
# rank 2 across NCCL), and `masking_over_nccl_at_eight_ranks` (EIGHT, the GPU of each of its
# eight ranks: default all on GPU 0; "" skips it). DEVICES="0 0 0" (default) puts every rank on
# GPU 0, which needs NCCL 2.30: the pack's (.nccl-pack/, git-ignored; carry it) goes first on
# the library path when present, with NCCL_MULTI_RANK_GPU_ENABLE=1. "0 1 2" runs on three GPUs
# (the two-rank test on the first two). Then the same between processes: `gpu_masking rejoin_over_tcp` with
# EPFLOW_TEST_TRANSPORT=nccl (survivor, victim that exits, newcomer; the first two ranks'
# devices). ITERS rounds per phase (default 20), CYCLES kill-and-rejoin cycles (default 2),
# TEST_TIMEOUT seconds per test (default 400). Logs in $OUT/<test>.log; one line per test.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-env.sh
nccl_pack_on_path
ITERS=${ITERS:-20}
read -r d0 d1 d2 <<<"${DEVICES:-0 0 0}"
run() { # test, devices
    NCCL_MULTI_RANK_GPU_ENABLE=1 EPFLOW_TEST_DEVICES=$2 EPFLOW_GPU_ITERS=$ITERS \
        EPFLOW_TEST_REJOIN_CYCLES=${CYCLES:-2} timeout ${TEST_TIMEOUT:-400} $P/gpu_masking "$1" --exact \
        --nocapture --test-threads=1 >"$OUT/$1.log" 2>&1
    echo "$1 rc=$? $(grep -E 'ranks made in|cycle .*rank [02]:|rejoined|^ok:|SKIPPED|panicked|test result' "$OUT/$1.log" | tr '\n' ' ')"
}
run masking_over_nccl_revokes_and_a_newcomer_rejoins $d0,$d1
run masking_over_nvlink_and_nccl_revokes_and_a_newcomer_rejoins $d0,$d1,$d2
# Eight ranks over NCCL (3 x 7 pairs each): set-up time and memory, the survivors' first masked
# operation and admit. EIGHT="0,1,...,7" on eight GPUs; "" skips it.
[ -n "${EIGHT-0,0,0,0,0,0,0,0}" ] && run masking_over_nccl_at_eight_ranks "${EIGHT-0,0,0,0,0,0,0,0}"
# Processes: rank 1's process exits; the survivor revokes its pairs with it; a new process
# rejoins over the meeting port and makes new pairs.
rejoin_processes nccl-processes $d0 $d1 29651 ${TEST_TIMEOUT:-400} NCCL_MULTI_RANK_GPU_ENABLE=1 \
    EPFLOW_TEST_TRANSPORT=nccl
