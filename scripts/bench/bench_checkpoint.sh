#!/usr/bin/env bash
# What checkpoints cost training (docs/PERFORMANCE.md, "Goodput under failures"): the CPU benchmark model
# (configs/bench_cpu.yaml) on 2 ranks x 1 thread, STEPS steps, with no checkpoint, with synchronous and with
# asynchronous saves, each at the interval `checkpoint.interval: auto` picks for an MTBF of 1 hour and at a fixed
# 10 steps. Rounds interleave the modes (A B C ... A B C ...) so a drifting machine hits them alike; per mode the
# median over rounds of the loop's seconds per step (wall time after set-up / steps, from the run's goodput
# record), its ratio to no checkpoint, the saves, their mean stall, the write time behind training and the
# snapshot's host memory per rank.
#   scripts/bench/bench_checkpoint.sh [BUILD_DIR] [STEPS] [ROUNDS]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
steps=${2:-200}
rounds=${3:-2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1

/usr/bin/python3 "$root/scripts/bench/bench_data.py" "$tmp" 400000
modes=(none sync_auto async_auto sync_10 async_10)
args_of() {
  case $1 in
    none) echo "--set checkpoint.dir=" ;;
    sync_auto) echo "--set checkpoint.interval=auto --set checkpoint.mtbf_s=3600" ;;
    async_auto) echo "--set checkpoint.interval=auto --set checkpoint.mtbf_s=3600 --set checkpoint.async=true" ;;
    sync_10) echo "--set checkpoint.interval=10" ;;
    async_10) echo "--set checkpoint.interval=10 --set checkpoint.async=true" ;;
  esac
}
for r in $(seq 1 "$rounds"); do
  for m in "${modes[@]}"; do
    rm -rf "$tmp/ckpt"
    # shellcheck disable=SC2046
    "$root/scripts/mpirun.sh" -np 2 "$build/meshtrain" --config "$root/configs/bench_cpu.yaml" \
      --set data.train="$tmp/bench_*.bin" --set data.val="" --set training.steps="$steps" --set training.threads=1 \
      --set log.interval=50 --set log.metrics_file="$tmp/$m.$r.jsonl" --set checkpoint.dir="$tmp/ckpt" \
      --set checkpoint.keep=2 $(args_of "$m") train >"$tmp/$m.$r.log" 2>&1 || { tail -n 20 "$tmp/$m.$r.log"; exit 1; }
    echo "round $r $m: $(grep -a '^goodput' "$tmp/$m.$r.log")"
    grep -a "checkpoint.interval auto" "$tmp/$m.$r.log" | head -n 1 || true
  done
done
/usr/bin/python3 - "$tmp" "$steps" "$rounds" "${modes[@]}" <<'PY'
import json, statistics, sys
tmp, steps, rounds, modes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
def run(m, r):
    recs = [json.loads(l) for l in open(f"{tmp}/{m}.{r}.jsonl")]
    g = [e for e in recs if e.get("event") == "goodput"][-1]
    saves = [e for e in recs if e.get("event") == "checkpoint"]
    commits = [e for e in recs if e.get("event") == "checkpoint_committed"]
    return {"per_step": (g["wall_s"] - g["setup_s"]) / steps, "step": statistics.median(e["step_ms"] for e in recs if "loss" in e) / 1e3,
            "saves": len(saves), "stall": statistics.mean(e["stall_s"] for e in saves) if saves else 0,
            "write": statistics.mean(e["write_s"] for e in commits) if commits else 0,
            "snap": max((e["snapshot_bytes"] for e in saves), default=0) / 2**20, "goodput": g["goodput"]}
res = {m: [run(m, r) for r in range(1, rounds + 1)] for m in modes}
med = lambda m, k: statistics.median(x[k] for x in res[m])
base = med("none", "per_step")
print(f"\n{steps} steps, 2 ranks x 1 thread, configs/bench_cpu.yaml; median of {rounds} interleaved rounds")
print(f"{'mode':12s} {'s/step':>8s} {'vs none':>8s} {'median step':>11s} {'saves':>5s} {'stall s':>8s} {'write s':>8s} {'snapshot MiB':>12s} {'goodput':>8s}")
for m in modes:
    print(f"{m:12s} {med(m, 'per_step'):8.4f} {med(m, 'per_step') / base:8.3f} {med(m, 'step'):11.4f} {med(m, 'saves'):5.0f} "
          f"{med(m, 'stall'):8.3f} {med(m, 'write'):8.3f} {med(m, 'snap'):12.1f} {100 * med(m, 'goodput'):7.1f}%")
print(f"goal: async at the auto interval within 5% of none: {med('async_auto', 'per_step') / base:.3f}x")
PY
