#!/usr/bin/env bash
# Runs on a 2-GPU machine from the repository root (after scripts/device-pack.sh here): epflow
# against NCCL EP in one session, as benches/NOTES.md item 27 did. NCCL 2.30.7 and NCCL EP 0.1
# must already be built on the machine (shared/DESIGN.md, "Measuring against NCCL EP": by hand;
# this script builds nothing). Inputs, by environment:
#   NCCL_BUILD   the NCCL build folder: lib/libnccl.so, lib/libnccl_ep.so.0, and NVIDIA's
#                test/nccl_ep/ep_bench (its Makefile links NCCL EP statically).
#   MPI_HOME     the MPI the tools were built with (bin/mpiexec, lib/libmpi.so).
#   EP_BENCH_SO, EP_TEST_SO (the `abi` part): NVIDIA's ep_bench / ep_test linked against
#                libnccl_ep.so.0, so that the library path picks NVIDIA's or ours.
# Parts ($1): ll, graph, ht, abi, or all (default). Every epflow run is `--validate`; runs of
# the two libraries alternate, twice each. One summary line per run; full logs in $OUT.
set -u
source "$(dirname "$0")/device-env.sh"
part=${1:-all}
: "${NCCL_BUILD:?set NCCL_BUILD to the NCCL build folder}" "${MPI_HOME:?set MPI_HOME}"
export PATH=$MPI_HOME/bin:$PATH
NV_LD=$NCCL_BUILD/lib:$MPI_HOME/lib:$LD_LIBRARY_PATH
OURS_LD=$PWD/$P/nccl-ep:$NCCL_BUILD/lib:$MPI_HOME/lib:$LD_LIBRARY_PATH
EP_BENCH=${EP_BENCH:-$NCCL_BUILD/test/nccl_ep/ep_bench}
echo "== $(nvidia-smi -L | wc -l) GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
# The lines of a run's output that carry its figures, on one line.
summary() {
  grep -E "^(Dispatch|Combine|Total)|^---|^Handle|^Training|^ +avg=|^Validation|^Device memory|send half|replay median|kernel=|validation" |
    grep -v throughput | sed -E 's/, min=[^,]*, max=[^,]*//' | tr -s ' ' | tr '\n' '|'
}
n=0
# `mine ARGS`: epflow bench on 2 ranks; `theirs ARGS`: NVIDIA's ep_bench on 2 ranks.
mine() {
  n=$((n + 1))
  timeout 120 $P/epflow bench --ranks 2 --validate "$@" >"$OUT/compare-$n.log" 2>&1
  echo "epflow bench $* (rc=$?): $(summary <"$OUT/compare-$n.log")"
}
theirs() {
  n=$((n + 1))
  LD_LIBRARY_PATH=$NV_LD timeout 120 mpiexec -n 2 "$EP_BENCH" "$@" >"$OUT/compare-$n.log" 2>&1
  echo "ep_bench $* (rc=$?): $(summary <"$OUT/compare-$n.log")"
}
if [ "$part" = all ] || [ "$part" = ll ]; then
  echo "== low-latency: ep_bench and epflow bench alternated (H=7168, K=8, E=256)"
  for rep in 1 2; do
    for t in 128 32 1; do
      theirs -a ll -t $t --iters 500
      mine --tokens $t --iters 500
      theirs -a ll -L rm -t $t --iters 500
      mine --tokens $t --iters 500 --layout rank-major
    done
  done
  echo "== low-latency: per half (staged), FP8, top-k beyond 8"
  for layout in expert-major rank-major; do
    mine --tokens 128 --iters 500 --layout $layout --staged
    mine --tokens 128 --iters 500 --layout $layout --dtype fp8
  done
  mine --tokens 1 --iters 500 --dtype fp8
  mine --tokens 128 --top-k 10 --experts 10
  mine --tokens 128 --top-k 16 --experts 32 --layout rank-major
fi
if [ "$part" = all ] || [ "$part" = graph ]; then
  echo "== captured steps"
  for t in 1 128; do
    for layout in expert-major rank-major; do mine --tokens $t --iters 500 --graph --layout $layout; done
  done
  for b in 8 32; do
    timeout 150 $P/moe_serving --graph --layers 16 --batch $b --rounds 200 >"$OUT/compare-serving-$b.log" 2>&1
    echo "moe_serving --graph --layers 16 --batch $b (rc=$?): $(grep -iE 'median|identical' "$OUT/compare-serving-$b.log" | tr '\n' '|')"
  done
fi
if [ "$part" = all ] || [ "$part" = ht ]; then
  echo "== high-throughput: ep_bench and epflow bench alternated"
  for rep in 1 2; do
    theirs -a ht -t 4096 --iters 100
    mine --algorithm ht --tokens 4096 --iters 100
  done
  mine --algorithm ht --tokens 4096 --iters 100 --dtype fp8
  mine --algorithm ht --tokens 4096 --iters 50 --fresh-routing
  mine --algorithm ht --tokens 16384 --iters 50
  mine --algorithm ht --tokens 16384 --iters 20 --fresh-routing
  mine --algorithm ht --tokens 1 --iters 200
  mine --algorithm ht --tokens 100 --iters 200
fi
if [ "$part" = all ] || [ "$part" = abi ]; then
  : "${EP_BENCH_SO:?set EP_BENCH_SO (ep_bench linked against libnccl_ep.so.0)}"
  : "${EP_TEST_SO:?set EP_TEST_SO (ep_test linked against libnccl_ep.so.0)}"
  echo "== NCCL EP's C API: NVIDIA's ep_bench with NVIDIA's libnccl_ep.so, then with ours"
  echo "ours resolves to: $(LD_LIBRARY_PATH=$OURS_LD ldd "$EP_BENCH_SO" | grep -E 'nccl_ep' | tr -s ' ')"
  abi_bench() { # which(nvidia|epflow) args
    local which=$1 ld=$NV_LD; shift
    [ "$which" = epflow ] && ld=$OURS_LD
    n=$((n + 1))
    LD_LIBRARY_PATH=$ld timeout 120 mpiexec -n 2 "$EP_BENCH_SO" "$@" >"$OUT/compare-$n.log" 2>&1
    echo "ep_bench [$which's library] $* (rc=$?): $(summary <"$OUT/compare-$n.log")"
  }
  for args in "-a ll -t 128" "-a ll -t 1" "-a ll -L rm -t 128" "-a ll -L rm -t 1" "-a ht -t 4096"; do
    for v in --validate ""; do
      for which in nvidia epflow; do abi_bench $which $args --iters 300 $v; done
    done
  done
  echo "== NCCL EP's active-mask test (rank 1 skips an operation), each library"
  gpus=$(nvidia-smi -L | wc -l)
  [ "$gpus" -ge 4 ] || echo "ep_bench --mask-test: skipped (it simulates failures on ranks 1 and 3: 4 ranks or more; $gpus GPUs here)"
  [ "$gpus" -ge 4 ] && for which in nvidia epflow; do
    ld=$NV_LD; [ $which = epflow ] && ld=$OURS_LD
    n=$((n + 1))
    LD_LIBRARY_PATH=$ld NCCL_EP_TIMEOUT_MS=2000 timeout 120 mpiexec -n 4 "$EP_BENCH_SO" -a ll -t 128 --mask-test >"$OUT/compare-$n.log" 2>&1
    echo "ep_bench --mask-test [$which's library] (rc=$?): $(grep -E 'PASSED|FAILED|mask after' "$OUT/compare-$n.log" | tr -s ' ' | tr '\n' '|')"
  done
  echo "== NVIDIA's ep_test with our libnccl_ep.so"
  abi_test() {
    n=$((n + 1))
    LD_LIBRARY_PATH=$OURS_LD timeout 90 mpiexec -n 2 "$EP_TEST_SO" "$@" >"$OUT/compare-$n.log" 2>&1
    local rc=$?
    echo "ep_test $* (rc=$rc): $(grep -ciE 'passed' "$OUT/compare-$n.log") PASSED lines, $(grep -ciE 'fail|error' "$OUT/compare-$n.log") failure lines"
    [ $rc = 0 ] || grep -iE 'fail|error|WARN' "$OUT/compare-$n.log" | head -3
  }
  for t in 1 50 128 4096; do
    for s in none dispatch combine both; do abi_test -a ll -s $s -t $t; done
    abi_test -a ll -r -t $t
    for ht in "" "-c" "-r" "-L em"; do abi_test -a ht $ht -t $t; done
  done
fi
