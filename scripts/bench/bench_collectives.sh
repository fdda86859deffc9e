#!/usr/bin/env bash
# Issue-2 benchmark: `meshtrain check` on 2, 4 and 8 CPU ranks, sizes 1 MiB to
# 64 MiB, each of our collectives beside Open MPI's own call on the same
# buffers in the same run; prints a markdown table of busbw and the ratio
# (ours / Open MPI's; target >= 0.9 at every size).
#   scripts/bench/bench_collectives.sh [BUILD_DIR] [ITERS]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
iters=${2:-20}
out=$(mktemp -d)
for np in 2 4 8; do
  "$root/scripts/mpirun.sh" -np $np "$build/meshtrain" --log-level warn check --mesh dp_replicate=$np \
    --sizes 1M:64M --iters "$iters" --ops all_reduce,all_gather,reduce_scatter --json "$out/np$np.json" >/dev/null
done
python3 - "$out" <<'PY'
import json, sys, glob, os
rows = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "np*.json"))):
    for line in open(f):
        rows.append(json.loads(line))
print("| ranks | collective | size | ours busbw GB/s | Open MPI busbw GB/s | ratio | check |")
print("|---:|---|---:|---:|---:|---:|---|")
worst = 10.0
for r in rows:
    worst = min(worst, r["ratio"])
    print(f'| {r["ranks"]} | {r["op"]} | {r["bytes"] >> 20} MiB | {r["busbw_gbps"]:.3f} | {r["mpi_busbw_gbps"]:.3f} | {r["ratio"]:.3f} | {"ok" if r["ok"] else "WRONG"} |')
print(f"\nworst ratio: {worst:.3f} (target >= 0.9)")
PY
