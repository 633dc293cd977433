#!/usr/bin/env bash
# Runs on a 4-GPU machine from the repository root (after scripts/device-pack.sh here): the NCCL
# transport against the CPU reference (every exchange over NCCL; two declared "hosts" of 2 GPUs
# with NCCL forced onto its socket transport between them), then `epflow bench` for the gpu and
# nccl backends side by side, and one process per GPU. `$1` picks a part: tests, hier, bench, mp
# (default: all), or ep: the NCCL EP backend and all three backends side by side in one session,
# for which NCCL 2.30.7 and NCCL EP 0.1 must already be built (this script builds nothing):
# NCCL_HOME=<build dir with lib/libnccl.so> NCCL_EP_LIB=<path of libnccl_ep.so>. NCCL EP compiles
# its high-throughput kernels at run time (nvcc on PATH) from the headers its `make lib` stages
# in <build dir>/include/nccl_ep (or NCCL_EP_JIT_SOURCE_DIR). Logs in $OUT.
set -u
source "$(dirname "$0")/device-env.sh"
part=${1:-all}
nccl_version() { python3 -c "import nvidia.nccl, glob, os; print(sorted(glob.glob(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so*'))))" 2>/dev/null; }
echo "== $(nvidia-smi -L | wc -l) GPUs; NCCL: $(nccl_version)"
if [ "$part" = all ] || [ "$part" = tests ]; then
  echo "== NCCL transport vs the CPU reference"
  timeout 280 $P/gpu_ll over_nccl --test-threads=1 --nocapture >"$OUT/gpu_ll_nccl.log" 2>&1; echo "gpu_ll over_nccl rc=$?"
  grep -E "^(test |ok: |seed)|FAILED|panicked|SKIPPED" "$OUT/gpu_ll_nccl.log" | tail -12
  timeout 280 $P/gpu_ht over_nccl --test-threads=1 --nocapture >"$OUT/gpu_ht_nccl.log" 2>&1; echo "gpu_ht over_nccl rc=$?"
  grep -E "^(test |ok: |seed)|FAILED|panicked|SKIPPED" "$OUT/gpu_ht_nccl.log" | tail -30
  timeout 100 $P/gpu_ll absent --test-threads=1 --nocapture >"$OUT/gpu_ll_absent.log" 2>&1; echo "gpu_ll absent rc=$?"
  grep -E "^(test |rank [0-9]+:)|FAILED|panicked" "$OUT/gpu_ll_absent.log"
  timeout 120 $P/gpu_async --test-threads=1 --nocapture >"$OUT/gpu_async.log" 2>&1; echo "gpu_async rc=$?"
  grep -E "^test |FAILED|panicked" "$OUT/gpu_async.log"
fi
if [ "$part" = all ] || [ "$part" = hier ]; then
  echo "== two hosts of 2 GPUs, NCCL on sockets between them"
  export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1
  timeout 200 $P/gpu_ll hierarchical --test-threads=1 --nocapture >"$OUT/gpu_ll_hier.log" 2>&1; echo "gpu_ll hierarchical rc=$?"
  grep -E "^(test |ok: |seed)|FAILED|panicked|SKIPPED" "$OUT/gpu_ll_hier.log" | tail -8
  grep -oE "NET/Socket|Using network [A-Za-z]+|via NET/[A-Za-z]+" "$OUT/gpu_ll_hier.log" | sort | uniq -c
  timeout 200 $P/gpu_ht hierarchical --test-threads=1 --nocapture >"$OUT/gpu_ht_hier.log" 2>&1; echo "gpu_ht hierarchical rc=$?"
  grep -E "^(test |ok: |seed)|FAILED|panicked|SKIPPED" "$OUT/gpu_ht_hier.log" | tail -8
  grep -oE "Using network [A-Za-z]+|via NET/[A-Za-z]+" "$OUT/gpu_ht_hier.log" | sort | uniq -c
  unset NCCL_DEBUG NCCL_DEBUG_SUBSYS NCCL_P2P_DISABLE NCCL_SHM_DISABLE NCCL_IB_DISABLE
fi
if [ "$part" = all ] || [ "$part" = bench ]; then
  echo "== epflow bench, side by side"
  bench() { echo "-- epflow bench $*"; timeout 120 $P/epflow bench --validate "$@" 2>&1 | grep -iE "^(epflow bench|dispatch|combine|handle|validation)|error" ; }
  for b in gpu nccl; do
    bench --backend $b
    bench --backend $b --algorithm ht
  done
  bench --backend gpu --hosts 2
  bench --backend gpu --hosts 2 --algorithm ht
  bench --backend nccl --dtype fp8
  bench --backend nccl --algorithm ht --dtype fp8
  bench --backend nccl --staged
fi
if [ "$part" = all ] || [ "$part" = mp ]; then
  echo "== one process per GPU (epflow launch)"
  mp() { echo "-- epflow launch -n 4 -- epflow bench --validate $*"; timeout 150 $P/epflow launch -n 4 -- $P/epflow bench --validate "$@" 2>&1 | grep -iE "^(epflow bench|dispatch|combine|handle|validation)|error" ; }
  mp --backend nccl
  mp --backend nccl --algorithm ht
  mp --hosts 2
fi
if [ "$part" = ep ]; then
  : "${NCCL_HOME:?set NCCL_HOME to an NCCL 2.30.7 build}" "${NCCL_EP_LIB:?set NCCL_EP_LIB to libnccl_ep.so}"
  export LD_LIBRARY_PATH=$NCCL_HOME/lib:$(dirname "$NCCL_EP_LIB"):$LD_LIBRARY_PATH
  echo "== NCCL EP through epflow's futures (low-latency staged, high-throughput)"
  timeout 120 $P/nccl_ep_backend --test-threads=1 --nocapture >"$OUT/nccl_ep_backend.log" 2>&1; echo "nccl_ep_backend rc=$?"
  grep -E "^test|round 9|panicked|SKIPPED" "$OUT/nccl_ep_backend.log"
  n=0
  bench() {
    n=$((n + 1)); echo "-- epflow bench $*"
    timeout 120 $P/epflow bench --validate "$@" >"$OUT/bench-ep-$n.log" 2>&1; local rc=$?
    grep -iE "^(epflow bench|dispatch|combine|handle|validation)|error" "$OUT/bench-ep-$n.log"
    [ $rc = 0 ] || { echo "rc=$rc; last lines:"; tail -5 "$OUT/bench-ep-$n.log"; }
  }
  for b in gpu nccl nccl-ep; do bench --backend $b; done
  bench --backend nccl-ep --tokens 1
  bench --backend nccl-ep --staged
  for b in gpu nccl nccl-ep; do bench --backend $b --algorithm ht; done
fi
