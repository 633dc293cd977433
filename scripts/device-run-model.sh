#!/usr/bin/env bash
# The MoE layer on one GPU (issue 65), run on a device machine from the packed binaries
# (scripts/device-pack.sh): the GPU layer tests (one rank; then two ranks sharing GPU 0, a
# functional check), `moe_serving --model` over a batch sweep with --check, JSON and SVG, and
# compute-sanitizer memcheck and racecheck on a 2-layer pipeline. Logs and figures go to $OUT.
#   MODEL (default qwen3-30b-a3b), LAYERS (8), SWEEP (8,16,32,64,128,256,512), STEPS (64);
#   TESTS=0 skips the tests, SANITIZE=0 the sanitizers; NAME names the figures' files.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-env.sh
MODEL=${MODEL:-qwen3-30b-a3b} LAYERS=${LAYERS:-8} SWEEP=${SWEEP:-8,16,32,64,128,256,512} STEPS=${STEPS:-64}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step() { echo "== $*"; }
if [ "${TESTS:-1}" = 1 ]; then
step "gpu_layer, one rank (1,000 layer steps of two lanes against one)"
EPFLOW_GPU_ITERS=500 timeout 300 $P/gpu_layer --test-threads=1 --nocapture >"$OUT/gpu_layer.log" 2>&1
echo "rc=$? $(grep -E '^ok:|test result|panicked|SKIPPED' "$OUT/gpu_layer.log" | tr '\n' ' ')"
step "gpu_layer, two ranks sharing GPU 0 (functional)"
EPFLOW_TEST_DEVICES=0,0 EPFLOW_GPU_ITERS=50 timeout 300 $P/gpu_layer --test-threads=1 --nocapture >"$OUT/gpu_layer_shared.log" 2>&1
echo "rc=$? $(grep -E '^ok:|test result|panicked|SKIPPED' "$OUT/gpu_layer_shared.log" | tr '\n' ' ')"
fi
step "moe_serving --model $MODEL --layers $LAYERS --sweep-batch $SWEEP"
timeout 420 $P/moe_serving --model "$MODEL" --layers "$LAYERS" --micro-batches 1,2,3 --sweep-batch "$SWEEP" \
    --steps "$STEPS" --check --json "$OUT/${NAME:-model}.json" --svg "$OUT/${NAME:-model}.svg" 2>&1 | tee "$OUT/${NAME:-model}.log" | grep -v '^\[moe_serving\]'
echo "rc=${PIPESTATUS[0]}"
if [ "${SANITIZE:-1}" = 1 ]; then
    for tool in memcheck racecheck; do
        step "compute-sanitizer $tool: 2 layers, 2 in flight"
        # racecheck instruments epflow's kernels (ep_*) and the layer's (moe_*) in two runs:
        # cuBLAS's sm90 kernels use TMA and asynchronous barriers, which it does not model (it
        # reports hazards in them, or fails); memcheck covers every kernel.
        filters=("");  [ $tool = racecheck ] && filters=(kns=ep_ kns=moe_)
        for f in "${filters[@]}"; do
            only=(); [ -n "$f" ] && only=(--kernel-name "$f")
            log="$OUT/sanitizer-model-$tool${f:+-${f#kns=}}.log"
            timeout 240 compute-sanitizer --tool $tool "${only[@]}" --print-limit 5 $P/moe_serving --model "$MODEL" --layers 2 \
                --micro-batches 2 --batch 16 --steps 4 >"$log" 2>&1
            echo "rc=$? ${f:-all kernels}: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tr '\n' ' ')"
        done
    done
fi
