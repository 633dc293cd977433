# Sourced by the scripts/device-run-*.sh scripts on a GPU machine: the library paths (CUDA and
# the NCCL wheel), NVLink multicast off, the packed binaries in $P, the log folder $OUT, and
# `sanitize`, which runs the GPU tests' sanitizer configuration under compute-sanitizer.
P=.device-pack
OUT=${OUT:-/tmp/epflow-out}
mkdir -p "$OUT"
# cudarc loads NCCL as `libnccl.so`; the NCCL wheel of the image ships only libnccl.so.2.
nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null || true)
mkdir -p /tmp/epflow-nccl
if ! ldconfig -p | grep -q "libnccl.so " && [ -n "$nccl" ]; then ln -sf "$nccl/libnccl.so.2" /tmp/epflow-nccl/libnccl.so; fi
export LD_LIBRARY_PATH=/tmp/epflow-nccl:/usr/local/cuda/lib64:$nccl:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 EPFLOW_KERNEL_CACHE=/tmp/epflow-kernels

# memcheck and racecheck over a 1- and 2-GPU sanitizer test (`sanitize` low-latency, `sanitize ht`
# high-throughput, `sanitize rank-major` the rank-major kernels, `sanitize stream` stream-ordered completion with delayed consumers, `sanitize graph` captured replays (10 per layout), `sanitize mask` rank masking (a rank
# stops, 6 masked iterations, unmask_all); otherwise 20
# iterations); one summary line per tool.
sanitize() {
  local bin=gpu_ll test=ll_sanitizer_config
  if [ "${1:-}" = ht ]; then bin=gpu_ht test=ht_sanitizer_config; fi
  if [ "${1:-}" = rank-major ]; then bin=gpu_rank_major test=rank_major_sanitizer_config; fi
  if [ "${1:-}" = stream ]; then bin=gpu_stream_order test=delayed_consumers_never_see_a_reused_buffer_set; export EPFLOW_GPU_ITERS=20; fi
  if [ "${1:-}" = graph ]; then bin=gpu_graph test=graph_many_replays; export EPFLOW_GPU_ITERS=10; fi
  if [ "${1:-}" = mask ]; then bin=gpu_masking test=survivors_of_two_go_on; export EPFLOW_GPU_ITERS=6 EPFLOW_MASK_TIMEOUT_MS=30000; fi
  if [ "${1:-}" = mask-racecheck ]; then bin=gpu_masking test=survivors_of_two_go_on; export EPFLOW_GPU_ITERS=6 EPFLOW_MASK_TIMEOUT_MS=30000 EPFLOW_MASK_REJOIN=0; fi
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool $tool --print-limit 5 $P/$bin $test --test-threads=1 >"$OUT/sanitizer-$bin-$tool.log" 2>&1
    echo "$bin $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$OUT/sanitizer-$bin-$tool.log" | tr '\n' ' ')"
  done
  unset EPFLOW_GPU_ITERS EPFLOW_MASK_TIMEOUT_MS EPFLOW_MASK_REJOIN
}
