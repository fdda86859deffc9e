#!/usr/bin/env bash
# What in-memory checkpoints cost training (docs/PERFORMANCE.md, "In-memory checkpoints"): the CPU benchmark model
# (configs/bench_cpu.yaml) on 2 ranks x 1 thread, STEPS steps, with no in-memory checkpoint, and with one every step
# (with and without the peer's copy) and every 10 steps; the disk saves only at the end in every mode. Rounds
# interleave the modes so a drifting machine hits them alike; per mode the median over rounds of the loop's
# seconds per step (wall time after set-up, less the final disk save, / steps) and its ratio to none, the median
# step's own time (the in-memory save comes after it), the in-memory saves' time per save and, within each run (so
# that the machine's drift between runs cancels), that time over the steps' time: the overhead.
#   scripts/bench/bench_memory_checkpoint.sh [BUILD_DIR] [STEPS] [ROUNDS]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
steps=${2:-100}
rounds=${3:-3}
tmp=$(mktemp -d)
export MT_SHM_DIR=${MT_SHM_DIR:-/dev/shm}
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1

/usr/bin/python3 "$root/scripts/bench/bench_data.py" "$tmp" 400000
modes=(none mem_1 mem_1_nopeer mem_10)
args_of() {
  case $1 in
    none) echo "--set checkpoint.memory.interval=0" ;;
    mem_1) echo "--set checkpoint.memory.interval=1" ;;
    mem_1_nopeer) echo "--set checkpoint.memory.interval=1 --set checkpoint.memory.peer=false" ;;
    mem_10) echo "--set checkpoint.memory.interval=10" ;;
  esac
}
for r in $(seq 1 "$rounds"); do
  for m in "${modes[@]}"; do
    rm -rf "$tmp/ckpt"
    # shellcheck disable=SC2046
    "$root/scripts/mpirun.sh" -np 2 "$build/meshtrain" --config "$root/configs/bench_cpu.yaml" \
      --set data.train="$tmp/bench_*.bin" --set data.val="" --set training.steps="$steps" --set training.threads=1 \
      --set log.interval=50 --set log.metrics_file="$tmp/$m.$r.jsonl" --set checkpoint.dir="$tmp/ckpt" \
      --set checkpoint.interval=0 --set checkpoint.resume=auto $(args_of "$m") train >"$tmp/$m.$r.log" 2>&1 ||
      { tail -n 20 "$tmp/$m.$r.log"; exit 1; }
    echo "round $r $m: $(grep -a '^goodput' "$tmp/$m.$r.log")"
    grep -a "in-memory checkpoint of step" "$tmp/$m.$r.log" | head -n 1 || true
  done
done
/usr/bin/python3 - "$tmp" "$steps" "$rounds" "${modes[@]}" <<'PY'
import json, statistics, sys
tmp, steps, rounds, modes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
def run(m, r):
    recs = [json.loads(l) for l in open(f"{tmp}/{m}.{r}.jsonl")]
    g = [e for e in recs if e.get("event") == "goodput"][-1]
    final = sum(e["stall_s"] for e in recs if e.get("event") == "checkpoint")
    every = {"mem_1": 1, "mem_1_nopeer": 1, "mem_10": 10}.get(m, 0)
    saves = (steps - 1) // every if every else 0  # not at the last step: the disk's final save is there
    mem = g["checkpoint_s"] - final
    return {"per_step": (g["wall_s"] - g["setup_s"] - final) / steps,
            "step": statistics.median(e["step_ms"] for e in recs if "loss" in e) / 1e3,
            "save": mem / saves if saves else 0, "overhead": mem / g["productive_s"]}
res = {m: [run(m, r) for r in range(1, rounds + 1)] for m in modes}
med = lambda m, k: statistics.median(x[k] for x in res[m])
base = med("none", "per_step")
print(f"\n{steps} steps, 2 ranks x 1 thread, configs/bench_cpu.yaml; median of {rounds} interleaved rounds")
print(f"{'mode':14s} {'s/step':>8s} {'vs none':>8s} {'median step s':>13s} {'s per save':>10s} {'overhead in-run':>15s}")
for m in modes:
    print(f"{m:14s} {med(m, 'per_step'):8.4f} {med(m, 'per_step') / base:8.3f} {med(m, 'step'):13.4f} "
          f"{med(m, 'save'):10.4f} {100 * med(m, 'overhead'):14.1f}%")
print(f"goal: in-memory saves every step within 2% of none: {med('mem_1', 'per_step') / base:.3f}x between runs, "
      f"{100 * med('mem_1', 'overhead'):.1f}% within runs")
PY
