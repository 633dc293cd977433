#!/usr/bin/env bash
# On a GPU machine, from the repository root: a change's before and after in one call.
# `epflow bench --validate` of every build under .device-pack/base*/epflow (earlier commits,
# copied there after scripts/device-pack.sh, which wipes .device-pack) and of .device-pack/epflow
# (this checkout), alternated build by build for REPS rounds (default 3), for each case of CASES
# (`;`-separated argument lists, default: low-latency rank-major and expert-major at 128 tokens,
# 300 iterations, on RANKS ranks, default 1). One summary line per run; full logs in
# $OUT/before-after.tgz. Compare figures of one call only: the machines are shared and noisy.
set -u
source "$(dirname "$0")/device-env.sh"
RANKS=${RANKS:-1}
CASES=${CASES:-"--layout rank-major --tokens 128 --iters 300;--layout expert-major --tokens 128 --iters 300"}
L=/tmp/before-after
mkdir -p "$L"
builds=""
for d in "$P"/base*/; do [ -x "$d/epflow" ] && builds="$builds ${d%/}"; done
builds="$builds $P"
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); builds:$builds; $RANKS rank(s)"
# The lines of a run's output that carry its figures, on one line.
summary() {
    grep -E "^(Dispatch|Combine|Total)|^Validation" | grep -v throughput |
        sed -E 's/, min=[^,]*, max=[^,]*//' | tr -s ' ' | tr '\n' '|'
}
n=0
IFS=';' read -r -a cases <<<"$CASES"
for rep in $(seq "${REPS:-3}"); do
    for args in "${cases[@]}"; do
        for b in $builds; do
            n=$((n + 1))
            # shellcheck disable=SC2086 # the case's arguments are words
            timeout 120 "$b/epflow" bench --ranks "$RANKS" --validate $args >"$L/run-$n.log" 2>&1
            echo "round $rep, $(basename "$b"), $args (rc=$?): $(summary <"$L/run-$n.log")"
        done
    done
done
tar -czf "$OUT/before-after.tgz" -C "$L" .
