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

# NCCL 2.30 (several ranks per GPU with NCCL_MULTI_RANK_GPU_ENABLE=1, ncclCommRevoke) from the
# NCCL pack (.nccl-pack/, git-ignored; carry it) first on the library path, when present:
# unpacked from nccl-pack.tar.xz(.*) if need be, or built there by its build.sh beforehand.
nccl_pack_on_path() {
  local n=$PWD/.nccl-pack
  if [ -d "$n" ] && [ ! -e "$n/lib/libnccl.so" ]; then
    [ -e "$n/nccl-pack.tar.xz" ] || cat "$n"/nccl-pack.tar.xz.* >"$n/nccl-pack.tar.xz" 2>/dev/null || true
    tar -xJf "$n/nccl-pack.tar.xz" -C "$n" 2>/dev/null ||
      python3 -c "import tarfile; tarfile.open('$n/nccl-pack.tar.xz').extractall('$n')" 2>/dev/null || true
  fi
  if [ -e "$n/lib/libnccl.so" ]; then export LD_LIBRARY_PATH=$n/lib:$LD_LIBRARY_PATH; fi
}

# Issue 68's rejoin between processes (`gpu_masking rejoin_over_tcp`): a survivor (rank 0, on
# GPU $2) and a victim (rank 1, on GPU $3) join a group over the TCP bootstrap on ports $4 and
# $4+1; the victim's process exits after its full rounds; a newcomer process takes rank 1's
# place while the survivor goes on. $1 names the logs ($OUT/$1-<role>.log) and the lines; $5 the
# survivor's and newcomer's timeout in seconds; extra `VAR=value` words after it go into every
# process's environment (EPFLOW_TEST_TRANSPORT=nccl, say). ITERS rounds per phase (default 50).
# One line per process.
rejoin_processes() {
  local name=$1 d0=$2 d1=$3 port=$4 limit=$5
  shift 5
  local common=(MASTER_ADDR=127.0.0.1 MASTER_PORT=$port EPFLOW_TEST_REJOIN_PORT=$((port + 1)) WORLD_SIZE=2
    EPFLOW_TEST_SEED=${EPFLOW_TEST_SEED:-$RANDOM} EPFLOW_GPU_ITERS=${ITERS:-50} "$@")
  proc() { # role, rank, device, timeout
    env "${common[@]}" RANK=$2 LOCAL_RANK=$3 EPFLOW_TEST_REJOIN=$1 timeout $4 $P/gpu_masking rejoin_over_tcp \
      --nocapture --test-threads=1 >"$OUT/$name-$1.log" 2>&1
  }
  proc survivor 0 $d0 $limit &
  local survivor=$!
  proc victim 1 $d1 120
  echo "$name: victim rc=$? $(grep -E 'exits now|panicked' "$OUT/$name-victim.log" | head -2 | tr '\n' ' ')"
  proc newcomer 1 $d1 $limit
  echo "$name: newcomer rc=$? $(grep -E '^ok:|panicked|test result' "$OUT/$name-newcomer.log" | head -3 | tr '\n' ' ')"
  wait $survivor
  echo "$name: survivor rc=$? $(grep -E 'first operation|^ok:|panicked|test result' "$OUT/$name-survivor.log" | head -4 | tr '\n' ' ')"
}
