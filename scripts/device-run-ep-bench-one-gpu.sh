#!/usr/bin/env bash
# On a one-GPU machine, from the repository root: NVIDIA's own NCCL EP programs on one rank,
# against NVIDIA's library and against epflow's libnccl_ep.so in the same call (issue 66's
# checks; the ratios of STATUS.md). Needs:
#   .device-pack/ (scripts/device-pack.sh): epflow's nccl-ep/libnccl_ep.so;
#   .nccl-pack/nccl-pack.tar.xz (git-ignored; carry it): NCCL 2.30.7, NCCL EP 0.1.0 (API v1,
#     NVIDIA/nccl contrib/nccl_ep) and NCCL EP of NVIDIA/nccl-extensions (API v2), with their
#     ep_bench and MPICH, built by hand for sm_90 as ../shared/DESIGN.md says (nothing of them
#     is committed); its README.txt says how.
# v1: ep_bench low-latency rank-major and expert-major (128 tokens, REPS rounds, libraries
# alternated) and high-throughput flat and expert-major (4096 tokens; zones unaligned and
# aligned to 64), each with --validate. v2: ep_bench's expert-major, rank-major with GLOBAL ids,
# DS_FP8E3M4 (dispatch only: the recipe has no combine), FWD (pre-quantized rows, five token and
# scale types, both layouts), int32 topk_idx and high-throughput flat and expert-major cases,
# BF16 and FWD (not yet run: the one call meant for them, 2026-12-06 sixth session, ran out of
# time without output). Then the `nccl_ep_backend` test of epflow's stream-ordered NCCL EP
# handles on NVIDIA's v1 library. ONLY=<regex> runs the matching cases alone. With
# .device-pack/base/libnccl_ep.so (a build of an earlier commit) the low-latency rounds also run
# it, as "base", between the two.
# Each run's ep_bench must load libnccl_ep.so.0 from the library path (see `bench` below: the
# ep_bench of the pack rebuilt in the fifth session of 2026-12-06 holds NVIDIA's library
# statically, so the "epflow" runs made with it ran NVIDIA's code). Logs in $OUT/ep-bench.tgz; one line per run here and in $OUT/ep-bench-summary.txt (with each
# run's log in $OUT) as the runs finish.
set -uo pipefail
cd "$(dirname "$0")/.."
P=$PWD/.nccl-pack
OUT=${OUT:-/tmp/epflow-out}
O=/tmp/ep-bench-logs
mkdir -p "$OUT" "$O" /tmp/epflow-abi
# The pack comes split (nccl-pack.tar.xz.aa, .ab, ...) when carried whole.
[ -e "$P/nccl-pack.tar.xz" ] || cat "$P"/nccl-pack.tar.xz.* >"$P/nccl-pack.tar.xz" 2>/dev/null || true
[ -x "$P/bin/ep_bench" ] || tar -xJf "$P/nccl-pack.tar.xz" -C "$P" ||
    python3 -c "import tarfile; tarfile.open('$P/nccl-pack.tar.xz').extractall('$P')"
ln -sf "$PWD/.device-pack/nccl-ep/libnccl_ep.so" /tmp/epflow-abi/libnccl_ep.so.0
# A baseline build of epflow's library (.device-pack/base/libnccl_ep.so, from an earlier commit:
# a performance change's before and after in one call) joins the low-latency rounds as "base".
libs="nvidia epflow"
if [ -e .device-pack/base/libnccl_ep.so ]; then
    mkdir -p /tmp/epflow-base
    ln -sf "$PWD/.device-pack/base/libnccl_ep.so" /tmp/epflow-base/libnccl_ep.so.0
    libs="nvidia base epflow"
fi
export CUDA_HOME=/usr/local/cuda NCCL_HOME=$P NCCL_NVLS_ENABLE=0
base=$P/lib:$P/mpi/lib:/usr/local/cuda/extras/CUPTI/lib64:/usr/local/cuda/lib64
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
# The ep_bench that the library path chooses a library for: one linked against libnccl_ep.so.0
# (bin/ep_bench_so, v2/bin/ep_bench_so, relinked on the device). An ep_bench that holds NCCL EP
# statically (as NVIDIA's Makefile may build it) would run NVIDIA's library in the "epflow" runs
# too: such a binary is refused for them.
bench() {
    local b=$P/bin/ep_bench_so
    [ "$1" = v2 ] && b=$P/v2/bin/ep_bench_so
    [ -x "$b" ] || b=${b%_so}
    echo "$b"
}
command -v readelf >/dev/null || echo "readelf is missing: every ep_bench counts as static, and the epflow runs are skipped" |
    tee -a "$OUT/ep-bench-summary.txt"
dynamic() { readelf -d "$1" 2>/dev/null | grep 'NEEDED.*libnccl_ep\.so' >/dev/null; }
for v in v1 v2; do
    b=$(bench $v)
    dynamic "$b" || echo "$b holds NCCL EP statically: its epflow runs are refused (relink it against libnccl_ep.so.0)" |
        tee -a "$OUT/ep-bench-summary.txt"
done
# run NAME nvidia|epflow v1|v2 ARGS...: one ep_bench on one rank.
run() {
    local name=$1 lib=$2 ver=$3 pre="" bin home=$P
    shift 3
    bin=$(bench "$ver")
    if [ "$ver" = v2 ]; then home=$P/v2 pre=$P/v2/lib:; fi
    if [ "$lib" != nvidia ] && ! dynamic "$bin"; then return 0; fi
    [ "$lib" = epflow ] && pre=/tmp/epflow-abi:
    [ "$lib" = base ] && pre=/tmp/epflow-base:
    if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then return 0; fi
    local log=$O/$name-$lib-$ver.log
    NCCL_EP_HOME=$home LD_LIBRARY_PATH=$pre$base timeout "${RUN_TIMEOUT:-150}" \
        "$P/mpi/bin/mpiexec" -n 1 "$bin" "$@" >"$log" 2>&1
    local rc=$?
    # Each line also goes to $OUT as it comes, so a call cut short still brings back the runs
    # that finished (and the log of the one it was in).
    echo "$name $lib $ver: rc=$rc $(grep -ciE 'passed' "$log") passed, $(grep -ciE 'fail|mismatch' "$log") fail lines" |
        tee -a "$OUT/ep-bench-summary.txt"
    cp "$log" "$OUT/" 2>/dev/null || true
}
for rep in $(seq "${REPS:-2}"); do
    for lib in $libs; do
        run "ll-rm-128-$rep" $lib v1 --algorithm ll --layout rm --tokens 128 --iters 300 --validate
        run "ll-em-128-$rep" $lib v1 --algorithm ll --layout em --tokens 128 --iters 300 --validate
    done
done
for lib in nvidia epflow; do
    run ht-4096 $lib v1 --algorithm ht --tokens 4096 --iters 100 --validate
    run ht-em-4096 $lib v1 --algorithm ht --layout em --tokens 4096 --iters 100 --validate
    run ht-em-4096-align64 $lib v1 --algorithm ht --layout em --tokens 4096 --iters 100 --validate \
        --expert-major-alignment 64
done
for lib in nvidia epflow; do
    run v2-ll-em $lib v2 --algorithm ll --tokens 128 --validate
    run v2-ll-rm-global $lib v2 --algorithm ll --layout rm --tokens 128 --validate --expert-id-kind global
    run v2-ll-fp8 $lib v2 --algorithm ll --tokens 128 --validate --dispatch-quantization ds-fp8e3m4 \
        --dispatch-only --iters 300
    run v2-ll-int32 $lib v2 --algorithm ll --tokens 128 --validate --topk-idx-int32
    # FWD (rows the caller quantized, forwarded as bytes): e4m3 + fp32, bf16 + fp16, MXFP8
    # (e4m3 + uint8 per 32), packed FP4 + uint8 per 16; both layouts.
    run v2-ll-fwd-em $lib v2 --algorithm ll --layout em --tokens 128 --validate --dispatch-only \
        --dispatch-quantization scales-forward --iters 300
    run v2-ll-fwd-rm $lib v2 --algorithm ll --layout rm --tokens 128 --validate --dispatch-only \
        --dispatch-quantization scales-forward --iters 300
    run v2-ll-fwd-bf16-fp16 $lib v2 --algorithm ll --layout em --tokens 128 --validate --dispatch-only \
        --dispatch-quantization scales-forward --scales-forward-token-dtype bf16 --scales-forward-scale-dtype fp16
    run v2-ll-fwd-mxfp8 $lib v2 --algorithm ll --layout em --tokens 128 --validate --dispatch-only --mxfp8
    run v2-ll-fwd-fp4 $lib v2 --algorithm ll --layout rm --tokens 128 --validate --dispatch-only \
        --dispatch-quantization scales-forward --scales-forward-token-dtype fp4x2 --scales-forward-scale-dtype uint8
    run v2-ht $lib v2 --algorithm ht --tokens 4096 --validate
    run v2-ht-em $lib v2 --algorithm ht --layout em --tokens 4096 --validate
    # FWD in high-throughput groups: e4m3 rows + fp32 scales (the default wire), flat and
    # expert-major.
    run v2-ht-fwd $lib v2 --algorithm ht --tokens 4096 --validate --dispatch-only \
        --dispatch-quantization scales-forward --iters 100
    run v2-ht-em-fwd $lib v2 --algorithm ht --layout em --tokens 4096 --validate --dispatch-only \
        --dispatch-quantization scales-forward --iters 100
done
if [ -z "${ONLY:-}" ] || [[ stream-handle =~ $ONLY ]]; then
    # epflow's NcclEpStreamHandle (moe_serving --backend nccl-ep) on NVIDIA's v1 library.
    NCCL_EP_LIB=$P/lib/libnccl_ep.so.0.1.0 LD_LIBRARY_PATH=$base timeout "${RUN_TIMEOUT:-150}" \
        .device-pack/nccl_ep_backend --test-threads=1 --nocapture stream_ordered >"$O/stream-handle.log" 2>&1
    echo "stream-handle (nccl_ep_backend stream_ordered_handles_match_the_reference): rc=$? $(grep -E '^test result' "$O/stream-handle.log")"
fi
tar czf "$OUT/ep-bench.tgz" -C "$O" .
