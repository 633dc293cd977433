#!/usr/bin/env bash
# Builds what the GPU machines run (they have no Rust toolchain) into .device-pack/ (git-ignored):
# the epflow binary, epflow's libnccl_ep.so (in nccl-ep/, with its SONAME link libnccl_ep.so.0),
# the GPU test executables (and epflow-kernels' unit tests, `epflow_kernels`, some of which need
# a GPU), the examples and the reactor benchmark.
# `EPFLOW_PACK_EXAMPLES` (space-separated) overrides the examples packed.
# Then, on the device machine (see docs/running-on-gpus.md):
#   export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH NCCL_NVLS_ENABLE=0
#   .device-pack/gpu_ll --test-threads=1 --nocapture
#   .device-pack/epflow bench --validate
set -euo pipefail
cd "$(dirname "$0")/.."
out=.device-pack
rm -rf "$out"
mkdir -p "$out"
cargo build --release --bin epflow --examples
cargo build --release -p epflow-nccl-ep-abi
cp target/release/epflow "$out/"
mkdir -p "$out/nccl-ep"
cp target/release/libnccl_ep.so "$out/nccl-ep/"
ln -s libnccl_ep.so "$out/nccl-ep/libnccl_ep.so.0"
for ex in ${EPFLOW_PACK_EXAMPLES:-two_batch_overlap nvlink_ceiling moe_serving training_step}; do
    [ -f "target/release/examples/$ex" ] && cp "target/release/examples/$ex" "$out/"
done
# Test and bench executables: cargo prints their paths as JSON.
list() { cargo "$@" --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] != ["bin"]:
        print(m["target"]["name"], m["executable"])'; }
{
    list test --release -p epflow-kernels --lib
    list test --release -p epflow-kernels --test gpu_ll
    list test --release -p epflow-kernels --test gpu_ht
    list test --release -p epflow-kernels --test gpu_disagreement
    list test --release -p epflow-kernels --test gpu_rank_major
    list test --release -p epflow-kernels --test gpu_graph
    list test --release -p epflow-kernels --test gpu_numbered
    list test --release -p epflow-kernels --test gpu_processes
    list test --release -p epflow-kernels --test gpu_masking
    list test --release -p epflow --test gpu_async
    list test --release -p epflow --test gpu_stream_order
    list test --release -p epflow-moe --test gpu_layer
    list test --release -p epflow-nccl-ep --test nccl_ep_backend
    list bench -p epflow --bench reactor
} |
    while read -r name exe; do cp "$exe" "$out/$name"; done
strip "$out"/* "$out"/nccl-ep/libnccl_ep.so 2>/dev/null || true
du -sh "$out"
ls -la "$out"
