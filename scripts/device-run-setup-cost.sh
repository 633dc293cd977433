#!/usr/bin/env bash
# On a GPU machine, from the repository root: what rank masking costs a group
# (`epflow bench --rank-masking`, no rank masked, against the same group without): its set-up
# time and device memory (with NCCL peers masking takes a communicator per pair of ranks and
# channel, 3 x (R - 1) per rank, instead of 3 of the whole group) and its operations' times.
# For each backend of BACKENDS (default "nccl gpu") and rank count of RANKS (default "2 4 8"),
# the group is made without masking, then with it once per value of PAIR_CTAS (the pairs'
# EPFLOW_NCCL_PAIR_CTAS, default "0": NCCL's own channel count; e.g. "0 1 2 4"; the gpu
# backend has no pairs and takes the first value only), REPS rounds alternated (default 1).
# Every rank on GPU 0 by default (a functional check, which still measures set-up costs; NCCL
# 2.30 from .nccl-pack/ with NCCL_MULTI_RANK_GPU_ENABLE=1); SPREAD=1 puts rank r on GPU r.
# TOKENS per rank (default 32), ITERS timed iterations (default 20), RUN_TIMEOUT seconds per run
# (default 150). One line per run; the logs in $OUT/setup-cost.tgz (one file: a call returns a
# few files only).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-env.sh
nccl_pack_on_path
export NCCL_MULTI_RANK_GPU_ENABLE=1
logs=$(mktemp -d)
for rep in $(seq 1 "${REPS:-1}"); do
    for backend in ${BACKENDS:-nccl gpu}; do
        ctas=(${PAIR_CTAS:-0})
        [ "$backend" = nccl ] || ctas=("${ctas[0]}")
        for r in ${RANKS:-2 4 8}; do
            if [ "${SPREAD:-0}" = 1 ]; then devices=$(seq -s, 0 $((r - 1))); else devices=$(printf '0%.0s,' $(seq "$r")); devices=${devices%,}; fi
            for run in plain ${ctas[@]/#/masking-}; do
                masking=() cap=0
                [ "$run" = plain ] || { masking=(--rank-masking); cap=${run#masking-}; }
                log=$logs/$backend-$r-$run-$rep.log
                EPFLOW_NCCL_PAIR_CTAS=$cap timeout "${RUN_TIMEOUT:-150}" $P/epflow bench --backend "$backend" \
                    --devices "$devices" --tokens "${TOKENS:-32}" --iters "${ITERS:-20}" --validate "${masking[@]}" >"$log" 2>&1
                echo "$backend $r ranks $run (round $rep) rc=$? $(grep -E '^Group set-up|^(Dispatch|Combine) \(BF16\)|^Validation|^note|^error' "$log" | head -5 | tr '\n' ' ')"
            done
        done
    done
done
tar -czf "$OUT/setup-cost.tgz" -C "$logs" .
