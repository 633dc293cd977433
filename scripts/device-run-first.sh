#!/usr/bin/env bash
# The first call of a session on one GPU (`nvidia-h100-x1` or `nvidia-h200`), from the packed
# binaries (scripts/device-pack.sh): the checks that are owed, in order of value, each under a
# hard time limit so that the whole call ends before BUDGET seconds (default 540). Logs go to
# a scratch folder and come back packed as $OUT/first.tgz, with the figures' JSON beside it
# (a device call returns at most 8 files). Skips what would not fit in the time left.
#
#   scripts/device-run-first.sh            # then: tar xzf .../first.tgz
#
# In order of value (a short call still brings the first ones back):
# 0. what was built but never run on a GPU: the high-throughput expert-major layout's GPU test,
#    then (with .nccl-pack/ present) NVIDIA's `ep_bench --layout em` on both libraries;
# 1. the decode sweep at 8, 64 and 512 tokens, stream-ordered and with layers captured whole
#    (`--layer-graphs`), both checked bit-identical to serial;
# 2. the MoE layer's GPU tests with two ranks sharing GPU 0, then on one rank;
# 3. the late masked peer in stream order (two ranks on GPU 0);
# 4. the `nccl_ep` Python package's round trip (needs PyTorch only for its last case);
# 5. `moe_serving --model qwen3-30b-a3b` prefill at 1024 and 4096 tokens per rank, 1-3 in flight;
# 6. the GPU suites with two ranks on GPU 0 under a CPU stressor, one round (issue 70);
# 7. `epflow bench --validate` against a baseline build in .device-pack/base/epflow, if present.
set -uo pipefail
cd "$(dirname "$0")/.."
REAL=${OUT:-/tmp/epflow-out}
export OUT=/tmp/epflow-first
rm -rf "$OUT"
mkdir -p "$OUT" "$REAL"
finish() {
    tar czf "$REAL/first.tgz" -C "$OUT" . 2>/dev/null
    cp "$OUT"/*.json "$REAL/" 2>/dev/null
}
trap finish EXIT
source scripts/device-env.sh
BUDGET=${BUDGET:-540}
T0=$SECONDS
left() { echo $((BUDGET - SECONDS + T0)); }
# Runs "$@" under `timeout` of at most $1 seconds and the time left; skips it when under 15 s are left.
bounded() {
    local want=$1 l
    shift
    l=$(left)
    if [ "$l" -lt 15 ]; then
        echo "skipped (${l} s left): $*"
        return 124
    fi
    timeout $((want < l ? want : l)) "$@"
}
step() { echo "== $* ($((SECONDS - T0)) s)"; }
# The MoE layer's GPU tests with ranks on devices $1 (e.g. 0, or 0,0), for at most $2 seconds.
layer_tests() {
    step "gpu_layer, devices $1"
    EPFLOW_TEST_DEVICES=$1 EPFLOW_GPU_ITERS=30 bounded "$2" $P/gpu_layer --test-threads=1 --nocapture >"$OUT/gpu_layer-$1.log" 2>&1
    echo "rc=$? $(grep -E '^test result' "$OUT/gpu_layer-$1.log")"
    grep -E "panicked|called .Result" "$OUT/gpu_layer-$1.log" | head -4
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

step "gpu_ht expert-major layout, one GPU"
EPFLOW_TEST_DEVICES=0 bounded 60 $P/gpu_ht --test-threads=1 --nocapture expert_major >"$OUT/expert-major.log" 2>&1
echo "rc=$? $(grep -E '^test result|ok: expert|panicked' "$OUT/expert-major.log" | tr '\n' ' ' | cut -c1-400)"
if [ -e .nccl-pack/nccl-pack.tar.xz ] || [ -x .nccl-pack/bin/ep_bench ]; then
    step "ep_bench high-throughput expert-major, NVIDIA's library and epflow's"
    OUT=$OUT/ep-bench ONLY=ht-em REPS=1 RUN_TIMEOUT=90 bounded 300 bash scripts/device-run-ep-bench-one-gpu.sh 2>&1 | tail -8
fi

step "moe_serving decode sweep"
bounded 150 $P/moe_serving --model qwen3-30b-a3b --layers 8 --micro-batches 1,2,3 --sweep-batch 8,64,512 \
    --steps 32 --check --layer-graphs --json "$OUT/qwen3-decode.json" >"$OUT/qwen3-decode.log" 2>&1
echo "rc=$?"
grep -v '^\[' "$OUT/qwen3-decode.log" | grep -E "in flight|crossover|error|identical" | sed -E 's/comm [^;]*; //; s/latency [^;]*; //' | cut -c1-300 | tail -24

layer_tests 0,0 60

layer_tests 0 45

step "late masked peer, two ranks on GPU 0"
EPFLOW_TEST_DEVICES=0,0 bounded 40 $P/gpu_stream_order --test-threads=1 --nocapture a_late_masked_peer \
    >"$OUT/late-masked-peer.log" 2>&1
echo "rc=$? $(grep -E '^test result|late masked peer' "$OUT/late-masked-peer.log" | tr '\n' ' ')"
grep -E "panicked|assert" "$OUT/late-masked-peer.log" | head -4

step "python round trip"
EPFLOW_LIB=$P/nccl-ep/libnccl_ep.so PYTHONUNBUFFERED=1 bounded 60 python3 python/tests/gpu_roundtrip.py --require-gpu \
    >"$OUT/python.log" 2>&1
echo "rc=$? $(tail -1 "$OUT/python.log")"

step "moe_serving prefill"
bounded 90 $P/moe_serving --model qwen3-30b-a3b --layers 8 --micro-batches 1,2,3 --prefill-tokens 1024,4096 \
    --steps 8 --check --json "$OUT/qwen3-prefill.json" >"$OUT/qwen3-prefill.log" 2>&1
echo "rc=$?"
grep -v '^\[' "$OUT/qwen3-prefill.log" | grep -E "tokens|error|unsupported|identical" | tail -12

step "suites, two ranks on GPU 0, CPU stressor"
l=$(left)
if [ "$l" -gt 60 ]; then
    EPFLOW_GPU_ITERS=${EPFLOW_GPU_ITERS:-100} SUITE_TIMEOUT=$(((l - 40) / 4)) OUT=$OUT/suites \
        bounded $((l - 30)) bash scripts/device-run-one-gpu.sh 1 gpu_ll gpu_rank_major gpu_graph gpu_stream_order 2>&1 | tail -14
else
    echo "skipped (${l} s left)"
fi

if [ -x "$P/base/epflow" ]; then
    step "bench --validate: baseline against this build"
    for b in base cur; do
        bin=$P/epflow
        [ $b = base ] && bin=$P/base/epflow
        bounded 40 "$bin" bench --ranks 1 --tokens 128 --iters 300 --validate >"$OUT/bench-$b.log" 2>&1
        echo "$b rc=$?"
        grep -E "median|Validation" "$OUT/bench-$b.log" | head -4
    done
fi
step "done"
