#!/usr/bin/env bash
# The MoE layer on one GPU (issue 65), run on a device machine from the packed binaries
# (scripts/device-pack.sh): the GPU layer tests (one rank; then two ranks sharing GPU 0, a
# functional check), `moe_serving --model` over a batch sweep with --check, JSON and SVG, and
# compute-sanitizer memcheck and racecheck on a 2-layer pipeline. Logs and figures go to $OUT.
#   MODEL (default qwen3-30b-a3b), LAYERS (8), SWEEP (8,16,32,64,128,256,512), STEPS (64);
#   PREFILL (e.g. 1024,4096) also measures prefill at those tokens per rank (PREFILL_STEPS, 16);
#   SWEEP=0 skips the decode sweep;
#   TESTS=0 skips the tests, SANITIZE=0 the sanitizers; NAME names the figures' files.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-env.sh
MODEL=${MODEL:-qwen3-30b-a3b} LAYERS=${LAYERS:-8} SWEEP=${SWEEP:-8,16,32,64,128,256,512} STEPS=${STEPS:-64}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step() { echo "== $*"; }
if [ "${TESTS:-1}" = 1 ]; then
step "gpu_layer, one rank (1,000 layer steps of two lanes against one)"
EPFLOW_GPU_ITERS=${EPFLOW_GPU_ITERS:-500} timeout 300 $P/gpu_layer --test-threads=1 --nocapture >"$OUT/gpu_layer.log" 2>&1
echo "rc=$? $(grep -E '^ok:|test result|panicked|SKIPPED' "$OUT/gpu_layer.log" | tr '\n' ' ')"
step "gpu_layer, two ranks sharing GPU 0 (functional)"
EPFLOW_TEST_DEVICES=0,0 EPFLOW_GPU_ITERS=${EPFLOW_GPU_ITERS:-100} timeout 300 $P/gpu_layer --test-threads=1 --nocapture >"$OUT/gpu_layer_shared.log" 2>&1
echo "rc=$? $(grep -E '^ok:|test result|panicked|SKIPPED' "$OUT/gpu_layer_shared.log" | tr '\n' ' ')"
fi
if [ -n "${PREFILL:-}" ]; then
step "moe_serving --model $MODEL --layers $LAYERS --prefill-tokens $PREFILL"
timeout 420 $P/moe_serving --model "$MODEL" --layers "$LAYERS" --micro-batches 1,2,3 --prefill-tokens "$PREFILL" \
    --steps "${PREFILL_STEPS:-16}" --check --json "$OUT/${NAME:-model}-prefill.json" 2>&1 | tee "$OUT/${NAME:-model}-prefill.log" | grep -v '^\[moe_serving\]'
echo "rc=${PIPESTATUS[0]}"
fi
if [ "$SWEEP" != 0 ]; then
step "moe_serving --model $MODEL --layers $LAYERS --sweep-batch $SWEEP"
timeout 420 $P/moe_serving --model "$MODEL" --layers "$LAYERS" --micro-batches 1,2,3 --sweep-batch "$SWEEP" \
    --steps "$STEPS" --check --json "$OUT/${NAME:-model}.json" --svg "$OUT/${NAME:-model}.svg" 2>&1 | tee "$OUT/${NAME:-model}.log" | grep -v '^\[moe_serving\]'
echo "rc=${PIPESTATUS[0]}"
fi
if [ "${SANITIZE:-1}" = 1 ]; then
    for tool in memcheck racecheck; do
        step "compute-sanitizer $tool"
        # cuBLAS's sm90 kernels (TMA, asynchronous barriers) make racecheck fail with an internal
        # error even when only other kernels are instrumented: racecheck runs the router test
        # (the layer's kernels without cuBLAS) instead; memcheck runs the whole pipeline.
        log="$OUT/sanitizer-model-$tool.log"
        if [ $tool = racecheck ]; then
            timeout 240 compute-sanitizer --tool racecheck --print-limit 5 $P/gpu_layer router_top_k --test-threads=1 >"$log" 2>&1
        else
            timeout 240 compute-sanitizer --tool memcheck --print-limit 5 $P/moe_serving --model "$MODEL" --layers 2 \
                --micro-batches 2 --batch 16 --steps 4 >"$log" 2>&1
        fi
        echo "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$log" | tr '\n' ' ')"
    done
fi
