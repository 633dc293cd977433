#!/usr/bin/env bash
# On a GPU machine, from the repository root: rank masking and rejoin over NCCL (issue 68), in
# one process (`gpu_masking`): `masking_over_nccl_revokes_and_a_newcomer_rejoins` (two ranks
# over `Transport::Nccl`; each cycle rank 1 dies, rank 0 revokes its pair communicators with it,
# a new rank rejoins and makes new pairs) and
# `masking_over_nvlink_and_nccl_revokes_and_a_newcomer_rejoins` (three ranks, 0 and 1 on NVLink,
# rank 2 across NCCL). DEVICES="0 0 0" (default) puts every rank on GPU 0, which needs NCCL
# 2.30: the pack's (.nccl-pack/, git-ignored; carry it) goes first on the library path when
# present, with NCCL_MULTI_RANK_GPU_ENABLE=1. "0 1 2" runs on three GPUs (the two-rank test on
# the first two). Then the same between processes: `gpu_masking rejoin_over_tcp` with
# EPFLOW_TEST_TRANSPORT=nccl (survivor, victim that exits, newcomer; the first two ranks'
# devices). ITERS rounds per phase (default 20), CYCLES kill-and-rejoin cycles (default 2),
# TEST_TIMEOUT seconds per test (default 400). Logs in $OUT/<test>.log; one line per test.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-env.sh
N=$PWD/.nccl-pack
if [ -d "$N" ] && [ ! -e "$N/lib/libnccl.so" ]; then
    [ -e "$N/nccl-pack.tar.xz" ] || cat "$N"/nccl-pack.tar.xz.* >"$N/nccl-pack.tar.xz" 2>/dev/null || true
    tar -xJf "$N/nccl-pack.tar.xz" -C "$N" 2>/dev/null ||
        python3 -c "import tarfile; tarfile.open('$N/nccl-pack.tar.xz').extractall('$N')"
fi
[ -e "$N/lib/libnccl.so" ] && export LD_LIBRARY_PATH=$N/lib:$LD_LIBRARY_PATH
read -r d0 d1 d2 <<<"${DEVICES:-0 0 0}"
run() { # test, devices
    NCCL_MULTI_RANK_GPU_ENABLE=1 EPFLOW_TEST_DEVICES=$2 EPFLOW_GPU_ITERS=${ITERS:-20} \
        EPFLOW_TEST_REJOIN_CYCLES=${CYCLES:-2} timeout ${TEST_TIMEOUT:-400} $P/gpu_masking "$1" --exact \
        --nocapture --test-threads=1 >"$OUT/$1.log" 2>&1
    echo "$1 rc=$? $(grep -E 'cycle .*rank [02]:|rejoined|^ok:|SKIPPED|panicked|test result' "$OUT/$1.log" | tr '\n' ' ')"
}
run masking_over_nccl_revokes_and_a_newcomer_rejoins $d0,$d1
run masking_over_nvlink_and_nccl_revokes_and_a_newcomer_rejoins $d0,$d1,$d2
# Processes: rank 1's process exits; the survivor revokes its pairs with it; a new process
# rejoins over the meeting port and makes new pairs.
common=(NCCL_MULTI_RANK_GPU_ENABLE=1 EPFLOW_TEST_TRANSPORT=nccl MASTER_ADDR=127.0.0.1 MASTER_PORT=29651
    EPFLOW_TEST_REJOIN_PORT=29652 WORLD_SIZE=2 EPFLOW_TEST_SEED=${EPFLOW_TEST_SEED:-$RANDOM}
    EPFLOW_GPU_ITERS=${ITERS:-20})
proc() { # role, rank, device, timeout
    env "${common[@]}" RANK=$2 LOCAL_RANK=$3 EPFLOW_TEST_REJOIN=$1 timeout $4 $P/gpu_masking rejoin_over_tcp \
        --nocapture --test-threads=1 >"$OUT/nccl-processes-$1.log" 2>&1
}
proc survivor 0 $d0 ${TEST_TIMEOUT:-400} &
survivor=$!
proc victim 1 $d1 120
echo "processes over NCCL: victim rc=$? $(grep -E 'exits now|panicked' "$OUT/nccl-processes-victim.log" | head -2 | tr '\n' ' ')"
proc newcomer 1 $d1 ${TEST_TIMEOUT:-400}
echo "processes over NCCL: newcomer rc=$? $(grep -E '^ok:|panicked|test result' "$OUT/nccl-processes-newcomer.log" | head -3 | tr '\n' ' ')"
wait $survivor
echo "processes over NCCL: survivor rc=$? $(grep -E 'first operation|^ok:|panicked|test result' "$OUT/nccl-processes-survivor.log" | head -4 | tr '\n' ' ')"
