#!/usr/bin/env bash
# The restart of the failure drill, alone (docs/PERFORMANCE.md, "Goodput under failures"): the drill's model
# (configs/bench_cpu.yaml, 4 ranks of 1 thread, the drill's settings) saves a checkpoint after 2 steps, then RUNS
# launches each resume a fresh copy of it and run one step. Printed per launch and as medians: the launch's wall
# time (mpirun to exit: start-up, one step, the final save, the exit), the trainer's set-up (the "start" record's
# setup_s and load_s) and, from a binary that writes it, the "setup" record's timeline (process start to the first
# step done, by part).
#   scripts/bench/bench_restart.sh [BUILD_DIR | MESHTRAIN_BINARY] [RUNS]
#   env: SET="--set k=v ..." (extra settings for every launch, e.g. SET="--set log.peak_cache=off")
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
mt=${1:-$root/build}
[ -d "$mt" ] && mt="$mt/meshtrain"
runs=${2:-5}
py=/usr/bin/python3
tmp=$(mktemp -d /tmp/mt-restart.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1

echo "machine : $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1), $(getconf _NPROCESSORS_ONLN) cores," \
  "load average $(cut -d' ' -f1-3 /proc/loadavg); $(date -u '+%F %H:%M UTC'); $mt"
"$py" "$root/scripts/bench/bench_data.py" "$tmp"
# shellcheck disable=SC2206
extra=(${SET:-})
common=(--config "$root/configs/bench_cpu.yaml" --set data.train="$tmp/bench_*.bin" --set data.val=""
  --set training.threads=1 --set log.interval=1 --set comm.timeout_s=60 --set checkpoint.keep=2
  --set checkpoint.async=true --set checkpoint.interval=100 --set checkpoint.resume=auto "${extra[@]}")
"$root/scripts/mpirun.sh" -np 4 "$mt" "${common[@]}" --set training.steps=2 --set checkpoint.dir="$tmp/base.ckpt" \
  --set log.metrics_file="$tmp/base.jsonl" train >"$tmp/base.log" 2>&1 || { tail -n 20 "$tmp/base.log"; exit 1; }
for i in $(seq "$runs"); do
  rm -rf "$tmp/run.ckpt" && cp -r "$tmp/base.ckpt" "$tmp/run.ckpt"
  t0=$(date +%s%N)
  "$root/scripts/mpirun.sh" -np 4 "$mt" "${common[@]}" --set training.steps=3 --set checkpoint.dir="$tmp/run.ckpt" \
    --set log.metrics_file="$tmp/run$i.jsonl" train >"$tmp/run$i.log" 2>&1 || { tail -n 20 "$tmp/run$i.log"; exit 1; }
  echo "{\"event\": \"launch\", \"wall_s\": $(( ($(date +%s%N) - t0) / 1000000 ))e-3}" >>"$tmp/run$i.jsonl"
  grep -m 1 -oE '(GEMM peak [^;]*|f32 GEMM peak .*)$' "$tmp/run$i.log" | sed "s/^/  launch $i: /" | head -n 1
done
"$py" - "$tmp" "$runs" <<'PY'
import json, statistics, sys
tmp, runs = sys.argv[1], int(sys.argv[2])
rows = {}
def add(k, v): rows.setdefault(k, []).append(v)
for i in range(1, runs + 1):
    recs = [json.loads(l) for l in open(f"{tmp}/run{i}.jsonl") if l.strip().startswith("{")]
    for r in recs:
        if r.get("event") == "launch": add("launch wall (mpirun to exit)", r["wall_s"])
        if r.get("event") == "start": add("trainer set-up (start record)", r["setup_s"]); add("  of it load_s", r["load_s"])
        if r.get("event") == "setup":
            add("timeline: process start to first step done", r["total_s"])
            for p in r["parts"]: add(f"  {p['part']}", p["s"])
print(f"{'':46} {'median':>8}  runs (s)")
for k, v in rows.items():
    print(f"{k:46} {statistics.median(v):8.2f}  " + " ".join(f"{x:.2f}" for x in v))
PY
