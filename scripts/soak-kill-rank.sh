#!/usr/bin/env bash
# Soak: `moe_serving --kill-rank` (host backend) N times in a loop, with every core kept busy by a
# spinning stressor, each run under a watchdog. A run that outlives the watchdog counts as a hang.
#
#   scripts/soak-kill-rank.sh [RUNS] [WATCHDOG_SECONDS]       (defaults: 200 runs, 60 s)
#
# Each run kills a rank (1..3 in turn) at 0.5 s of a 1.5 s run, with the mask timeout cycling
# through 100 / 200 / 500 ms so that live but slow ranks get masked too. Prints a progress line
# every 10 runs and ends with "N passed, N failed" (failures split into hangs and errors); exits
# 1 on any failure. Logs of failed runs are kept under $SOAK_LOGS (default /tmp/epflow-soak).
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-200}
watchdog=${2:-60}
logs=${SOAK_LOGS:-/tmp/epflow-soak}
mkdir -p "$logs"

cargo build -q --release --example moe_serving || exit 1
bin=target/release/examples/moe_serving

cores=$(nproc)
stressors=()
for _ in $(seq "$cores"); do
    (while :; do :; done) &
    stressors+=($!)
done
cleanup() { kill "${stressors[@]}" 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT
echo "soak: $runs runs of moe_serving --kill-rank under $cores spinning stressors, watchdog ${watchdog} s"

passed=0 hung=0 errored=0 masked_live=0
timeouts=(100 200 500)
start=$SECONDS
for i in $(seq "$runs"); do
    kill=$(( (i % 3) + 1 ))
    to=${timeouts[$(( i % 3 ))]}
    log="$logs/run-$i.log"
    timeout --kill-after=5 "$watchdog" "$bin" --backend host --kill-rank "$kill" --at 0.5 --seconds 1.5 \
        --rate 4000 --layers 2 --rounds 2 --kill-timeout "$to" --quiet >"$log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
        passed=$((passed + 1))
        grep -q "was masked by its peers" "$log" && masked_live=$((masked_live + 1))
        rm -f "$log"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        hung=$((hung + 1))
        echo "run $i (--kill-rank $kill --kill-timeout $to): HUNG past ${watchdog} s, log $log"
    else
        errored=$((errored + 1))
        echo "run $i (--kill-rank $kill --kill-timeout $to): exit $rc: $(tail -n 1 "$log")"
    fi
    if [ $((i % 10)) -eq 0 ]; then
        echo "soak: $i/$runs runs, $passed passed, $hung hung, $errored errors ($((SECONDS - start)) s)"
    fi
done
echo "soak: live ranks masked by their peers (stopped cleanly) in $masked_live runs"
echo "$passed passed, $((hung + errored)) failed ($hung hung, $errored errors)"
[ $((hung + errored)) -eq 0 ]
