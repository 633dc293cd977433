#!/usr/bin/env bash
# On a GPU machine, from the repository root: NVIDIA's own NCCL EP tests on NVIDIA's library and
# on epflow's libnccl_ep.so, in the same call (issue 66's checks). Several ranks share one GPU:
# NCCL 2.30 takes them with NCCL_MULTI_RANK_GPU_ENABLE=1, and both libraries then join their
# processes over CUDA IPC, so the multi-rank cases run on a one-GPU machine too (functional
# checks only: the processes time-slice the GPU). Needs:
#   .device-pack/ (scripts/device-pack.sh): epflow's nccl-ep/libnccl_ep.so;
#   .nccl-pack/ (git-ignored; carry it): NVIDIA's NCCL, NCCL EP v1 (bin/ep_test) and NCCL EP v2
#     (NVIDIA/nccl-extensions: v2/test/test_* gtest binaries, which bootstrap themselves and set
#     their device to rank % GPUs, and v2/bin/ep_test), with MPICH, built
#     by hand for sm_90 as ../shared/DESIGN.md says (nothing of them is committed), either laid
#     out or as nccl-pack.tar.xz.
# RANKS (default "4"): the rank counts each gtest suite runs with; SUITES (regex, default all);
# LIBS (default "nvidia epflow"); SUITE_TIMEOUT seconds per run (default 150).
# Prints one line per suite, library and rank count (passed / failed / skipped, and the failed
# tests' names); logs in $OUT/nvidia-tests.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
P=$PWD/.nccl-pack
OUT=${OUT:-/tmp/epflow-out}
O=/tmp/nvidia-test-logs
mkdir -p "$OUT" "$O" /tmp/epflow-abi
if [ ! -d "$P/v2/test" ]; then
    cat "$P"/nccl-pack.tar.xz.* >"$P/nccl-pack.tar.xz" 2>/dev/null || true
    tar -xJf "$P/nccl-pack.tar.xz" -C "$P" || exit 1
fi
ln -sf "$PWD/.device-pack/nccl-ep/libnccl_ep.so" /tmp/epflow-abi/libnccl_ep.so.0
export CUDA_HOME=/usr/local/cuda NCCL_HOME=$P NCCL_NVLS_ENABLE=0 NCCL_MULTI_RANK_GPU_ENABLE=1
base=$P/lib:$P/mpi/lib:/usr/local/cuda/lib64
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
# libpath LIB VER: the library path that picks NVIDIA's (v1 or v2) or epflow's libnccl_ep.
libpath() {
    case "$1:$2" in
        epflow:*) echo "/tmp/epflow-abi:$base" ;;
        nvidia:v2) echo "$P/v2/lib:$base" ;;
        *) echo "$base" ;;
    esac
}
# suite BIN LIB N: one gtest binary on N processes sharing the GPU (its own bootstrap).
suite() {
    local bin=$1 lib=$2 n=$3 name log uid pids=() rc=0
    name=$(basename "$bin")
    log=$O/$name-$lib-$n
    uid=/tmp/uid-$name-$lib-$n-$$
    rm -f "$uid" "$log".*
    for r in $(seq 0 $((n - 1))); do
        NCCL_EP_HOME=$P/v2 LD_LIBRARY_PATH=$(libpath "$lib" v2) timeout "${SUITE_TIMEOUT:-150}" \
            "$bin" --rank=$r --nranks=$n --uid-file="$uid" >"$log.$r" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    local passed failed skipped names
    passed=$(sed -n 's/.*\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$log.0" | tail -1)
    failed=$(grep -c '^\[  FAILED  \] [A-Za-z]' "$log.0")
    skipped=$(sed -n 's/.*\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$log.0" | tail -1)
    names=$(sed -n 's/^\[  FAILED  \] \([A-Za-z0-9_./]*\).*/\1/p' "$log.0" | sort -u | tr '\n' ' ')
    echo "$name $lib n=$n: rc=$rc passed=${passed:-0} failed=$failed skipped=${skipped:-0} ${names:+[$names]}"
}
for n in ${RANKS:-4}; do
    for bin in "$P"/v2/test/test_*; do
        [ -x "$bin" ] || continue
        if [ -n "${SUITES:-}" ] && ! [[ $(basename "$bin") =~ $SUITES ]]; then continue; fi
        for lib in ${LIBS:-nvidia epflow}; do suite "$bin" "$lib" "$n"; done
    done
done
# NVIDIA's ep_test (v1 and v2) on two ranks, through MPICH: it sets its device to the local
# rank, so it needs two GPUs (ranks cannot share one there).
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -lt 2 ]; then
    echo "ep_test: skipped on $gpus GPU (it runs rank r on GPU r)"
elif [ -z "${SUITES:-}" ] || [[ ep_test =~ $SUITES ]]; then
    for ver in v1 v2; do
        # An ep_test linked against libnccl_ep.so.0 (ep_test_so, relinked on the device): the
        # pack's own holds NCCL EP statically, and would run NVIDIA's library for "epflow" too.
        bin=$P/bin/ep_test_so home=$P
        [ "$ver" = v2 ] && bin=$P/v2/bin/ep_test_so home=$P/v2
        [ -x "$bin" ] || bin=${bin%_so}
        [ -x "$bin" ] || continue
        for lib in ${LIBS:-nvidia epflow}; do
            if [ "$lib" != nvidia ] && ! readelf -d "$bin" 2>/dev/null | grep 'NEEDED.*libnccl_ep\.so' >/dev/null; then
                echo "ep_test $ver $lib: skipped ($bin holds NCCL EP statically: relink it against libnccl_ep.so.0)"
                continue
            fi
            for algo in ll ht; do
                log=$O/ep_test-$ver-$algo-$lib.log
                NCCL_EP_HOME=$home LD_LIBRARY_PATH=$(libpath "$lib" "$ver") timeout "${SUITE_TIMEOUT:-150}" \
                    "$P/mpi/bin/mpiexec" -n 2 "$bin" -a $algo >"$log" 2>&1
                echo "ep_test $ver -a $algo $lib n=2: rc=$? $(grep -ciE 'passed' "$log") passed lines, $(grep -ciE 'fail|mismatch' "$log") fail lines"
            done
        done
    done
fi
tar -czf "$OUT/nvidia-tests.tgz" -C "$O" . 2>/dev/null
