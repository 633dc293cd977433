#!/usr/bin/env bash
# On a GPU machine, from the repository root: rank masking and rejoin over NCCL (issue 68), in
# one process: `gpu_masking masking_over_nccl_shrinks_and_a_newcomer_rejoins` (two ranks over
# `Transport::Nccl`; each cycle rank 1 dies, rank 0's communicators are revoked and shrunk, a
# new rank rejoins with a communicator of the whole group) and
# `masking_is_refused_over_nvlink_and_nccl_at_once`. DEVICES="0 0" (default) puts both ranks on
# GPU 0, which needs NCCL 2.30: the pack's (.nccl-pack/, git-ignored; carry it) goes first on
# the library path when present, with NCCL_MULTI_RANK_GPU_ENABLE=1. "0 1" runs on two GPUs.
# ITERS rounds per phase (default 20), CYCLES kill-and-rejoin cycles (default 2). Log in
# $OUT/nccl-masking.log; one line per run.
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
read -r d0 d1 <<<"${DEVICES:-0 0}"
NCCL_MULTI_RANK_GPU_ENABLE=1 EPFLOW_TEST_DEVICES=$d0,$d1 EPFLOW_GPU_ITERS=${ITERS:-20} \
    EPFLOW_TEST_REJOIN_CYCLES=${CYCLES:-2} timeout 400 $P/gpu_masking masking_over_nccl masking_is_refused \
    --nocapture --test-threads=1 >"$OUT/nccl-masking.log" 2>&1
echo "masking over NCCL rc=$? $(grep -E 'cycle .*rank 0|rejoined|^ok:|SKIPPED|panicked|test result' "$OUT/nccl-masking.log" | tr '\n' ' ')"
