#!/usr/bin/env bash
# On a GPU machine, from the repository root: `moe_serving --backend nccl-ep`, the decode sweep
# with the layer's dispatch and combine on NVIDIA's NCCL EP beside epflow's, in one process and
# one call (docs/serving.md, "Against NCCL EP"). Needs `.nvidia-ep/` (git-ignored; carry it):
#   libnccl.so.2.30.7 (or libnccl.so.2.30.7.xz) and libnccl_ep.so.0.1.0: NVIDIA's NCCL 2.30.7 and
#     NCCL EP 0.1.0, built by hand for sm_90 as ../shared/DESIGN.md says (nothing of them is
#     committed); the image's NCCL (2.28) lacks the device API NCCL EP needs;
#   moe_serving: target/release/examples/moe_serving (cargo build --release --example moe_serving).
# Extra arguments go to moe_serving (default: qwen3-30b-a3b, 8 layers, batches 8, 64 and 512,
# 1-3 in flight, --check --layer-graphs). Writes $OUT/nccl-ep-serving.{json,log}.
set -euo pipefail
cd "$(dirname "$0")/.."
d=.nvidia-ep
OUT=${OUT:-/tmp/epflow-out}
mkdir -p "$OUT"
if [ ! -e "$d/libnccl.so.2.30.7" ] && [ -e "$d/libnccl.so.2.30.7.xz" ]; then
    python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
        "$d/libnccl.so.2.30.7.xz" "$d/libnccl.so.2.30.7"
fi
for f in libnccl.so.2.30.7 libnccl_ep.so.0.1.0 moe_serving; do
    [ -e "$d/$f" ] || { echo "missing $d/$f (see this script's header)" >&2; exit 2; }
done
ln -sf libnccl.so.2.30.7 "$d/libnccl.so.2"
ln -sf libnccl.so.2 "$d/libnccl.so"
ln -sf libnccl_ep.so.0.1.0 "$d/libnccl_ep.so.0"
ln -sf libnccl_ep.so.0 "$d/libnccl_ep.so"
export LD_LIBRARY_PATH=$PWD/$d:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 \
    EPFLOW_KERNEL_CACHE=/tmp/epflow-kernels NCCL_EP_LIB=$PWD/$d/libnccl_ep.so.0.1.0
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
    args=(--model qwen3-30b-a3b --layers 8 --micro-batches 1,2,3 --sweep-batch 8,64,512 --steps 32 --check --layer-graphs)
fi
timeout "${TIMEOUT:-420}" "$d/moe_serving" --backend nccl-ep "${args[@]}" --json "$OUT/nccl-ep-serving.json" \
    >"$OUT/nccl-ep-serving.log" 2>&1
rc=$?
grep -v '^\[moe' "$OUT/nccl-ep-serving.log" | grep -E "NCCL EP|epflow /|in flight|identical|rror" | cut -c1-220
exit $rc
