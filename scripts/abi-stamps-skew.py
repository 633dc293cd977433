#!/usr/bin/env python3
"""How far apart the ranks entered and launched each low-latency call of libnccl_ep.so.

Reads the files that `EPFLOW_ABI_PROFILE=1 EPFLOW_ABI_STAMPS=<folder>` writes (one per rank,
`abi-stamps-rank<r>.tsv`: channel, call, entry_ns, launched_ns by the wall clock the processes
of a host share) and prints per channel, in microseconds: each rank's host time from entry to
launch, each rank's entry and launch against the first rank's of the same call (positive:
later), and the difference of the two (how much longer that rank's own host path took).
A kernel timer (ep_bench's CUPTI column) sees the earlier rank's kernel wait for the later one.

    python3 scripts/abi-stamps-skew.py <folder>
"""
import statistics
import sys
from pathlib import Path


def quantiles(xs):
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]
    return f"median {statistics.median(xs):7.2f}  p10 {pick(0.1):7.2f}  p90 {pick(0.9):7.2f}  mean {statistics.fmean(xs):7.2f}"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    files = sorted(Path(sys.argv[1]).glob("abi-stamps-rank*.tsv"), key=lambda p: int(p.stem.split("rank")[1]))
    if len(files) < 2:
        sys.exit(f"need the files of at least two ranks in {sys.argv[1]}, found {len(files)}")
    ranks = []
    for f in files:
        rows = [line.split("\t") for line in f.read_text().splitlines()[1:] if line]
        ranks.append({(int(c), int(n)): (int(e), int(l)) for c, n, e, l in rows})
    for channel, name in [(0, "dispatch"), (1, "combine")]:
        calls = sorted(k for k in ranks[0] if k[0] == channel and all(k in r for r in ranks))
        if not calls:
            continue
        print(f"{name}: {len(calls)} calls every rank timed")
        for i, r in enumerate(ranks):
            print(f"  rank {i} entry -> launch        {quantiles([(r[k][1] - r[k][0]) / 1e3 for k in calls])}")
        for i, r in enumerate(ranks[1:], 1):
            entry = [(r[k][0] - ranks[0][k][0]) / 1e3 for k in calls]
            launch = [(r[k][1] - ranks[0][k][1]) / 1e3 for k in calls]
            print(f"  rank {i} - rank 0 at entry      {quantiles(entry)}")
            print(f"  rank {i} - rank 0 at launch     {quantiles(launch)}")
            print(f"  |rank {i} - rank 0| at launch   {quantiles([abs(x) for x in launch])}")
            # Each call's launch gap less its entry gap: how much longer rank i's own host path
            # (entry to launch) took. A median far from 0 for a whole run is one slow process
            # (benches/NOTES.md item 138), which the earlier rank's kernels wait for.
            own = [l - e for l, e in zip(launch, entry)]
            print(f"  rank {i} - rank 0 own host path {quantiles(own)}")


if __name__ == "__main__":
    main()
