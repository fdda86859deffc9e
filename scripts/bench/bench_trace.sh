#!/usr/bin/env bash
# What tracing costs (issue 40, docs/PERFORMANCE.md): configs/bench_cpu.yaml's model on 1 rank with 2 threads,
# runs interleaved (A B C A B C ...): a binary without the trace hooks (BASE_BIN, optional: e.g. main's build),
# this build with tracing off, and this build tracing steps 3 to the end (profile.steps, profile.dir). Prints each
# run's median step time over steps 3..STEPS and, per variant, the median of the runs and the fastest step (on a
# shared machine the least disturbed), each variant's CPU time (user + sys of the whole run: less sensitive than wall
# time to other processes sharing the cores, exact with THREADS=1, where no OpenMP thread spins), and the ratios.
# NP=N runs N ranks under scripts/mpirun.sh, MESH its --set options (e.g. the 4-rank pp 2 x tp 2 case: NP=4
# THREADS=1 MESH="parallel.pp=2 parallel.tp=2"); the step times are rank 0's, the CPU time the whole launch's.
# CONCURRENT=1 runs each pair's two variants at the same time instead of one after the other: both then share the
# same load from the rest of the machine (on a shared 2-core VM it swings step times 2x from one minute to the next,
# more than any effect measured here), and the pair's ratio compares like with like; the steps are slower (the
# two jobs share the cores). Each pair's ratio of medians is printed, and their median.
#   THREADS=1 scripts/bench/bench_trace.sh build 4 8
#   NP=4 THREADS=1 MESH="parallel.pp=2 parallel.tp=2" scripts/bench/bench_trace.sh build 3 8
#   scripts/bench/bench_trace.sh [BUILD_DIR] [PAIRS] [STEPS] [BASE_BIN]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
pairs=${2:-4}
steps=${3:-12}
base=${4:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
/usr/bin/python3 "$root/scripts/bench/bench_data.py" "$tmp"
threads=${THREADS:-2}
export OMP_NUM_THREADS=$threads
np=${NP:-1}
launcher=()
[ "$np" -gt 1 ] && launcher=("$root/scripts/mpirun.sh" -np "$np")
mesh=()
for m in ${MESH:-}; do mesh+=(--set "$m"); done
run() {  # run NAME BIN [--set ...]: the process's CPU seconds (user + sys) in NAME.time
  local name=$1 bin=$2
  shift 2
  /usr/bin/time -o "$tmp/$name.time" -f "%U %S" "${launcher[@]}" "$bin" --config "$root/configs/bench_cpu.yaml" "${mesh[@]}" --set data.train="$tmp/bench_*.bin" \
    --set data.val="" --set training.steps="$steps" --set training.threads="$threads" \
    --set log.metrics_file="$tmp/$name.jsonl" "$@" train >"$tmp/$name.log" 2>&1 || { tail "$tmp/$name.log"; exit 1; }
}
for i in $(seq 1 "$pairs"); do
  [ -n "$base" ] && run "base_$i" "$base"
  if [ "${CONCURRENT:-0}" = 1 ]; then
    run "off_$i" "$build/meshtrain" &
    run "on_$i" "$build/meshtrain" --set "profile.steps=[3, $steps]" --set profile.dir="$tmp/trace_$i" &
    wait %1 && wait %2
  else
    run "off_$i" "$build/meshtrain"
    run "on_$i" "$build/meshtrain" --set "profile.steps=[3, $steps]" --set profile.dir="$tmp/trace_$i"
  fi
done
/usr/bin/python3 - "$tmp" "$pairs" "$steps" <<'PY'
import glob, json, os, statistics, sys
tmp, pairs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def times(path):
    ms = [json.loads(l)["step_ms"] for l in open(path) if '"step_ms"' in l]
    return [m for s, m in enumerate(ms, 1) if s >= 3]
res, low = {}, {}
for v in ("base", "off", "on"):
    runs = [times(p) for p in sorted(glob.glob(f"{tmp}/{v}_*.jsonl"))]
    if runs:
        res[v] = statistics.median(statistics.median(r) for r in runs)
        low[v] = min(min(r) for r in runs)
        print(f"{v:5}: median step {res[v]:.2f} ms over {len(runs)} runs (each the median of steps 3..{steps}: "
              + " ".join(f"{statistics.median(r):.2f}" for r in runs) + f"); fastest step {low[v]:.2f} ms")
cpu = {}
for v in ("base", "off", "on"):
    c = [sum(map(float, open(p).read().split()[-2:])) for p in sorted(glob.glob(f"{tmp}/{v}_*.time"))]
    if c:
        cpu[v] = statistics.median(c)
        print(f"{v:5}: CPU time of the whole run (user + sys) {cpu[v]:.2f} s, median of " + " ".join(f"{x:.2f}" for x in c))
if "on" in cpu:
    print(f"CPU time, tracing on / off: {cpu['on'] / cpu['off']:.4f} (set-up included)")
ev = [json.load(open(p))["traceEvents"] for p in glob.glob(f"{tmp}/trace_*/trace_rank0.json")]
if ev:
    print(f"trace: {len(ev[0])} events for {steps - 2} steps ({len(ev[0]) / (steps - 2):.0f} per step)")
ends = [r for p in sorted(glob.glob(f"{tmp}/on_*.jsonl")) for r in map(json.loads, open(p))
        if r.get("event") == "trace_end"]
if ends:
    med = lambda k: statistics.median(r[k] for r in ends)
    print(f"range end (once per range, every rank waits): median {med('s'):.2f} s: files written {med('write_s'):.2f} s, "
          f"merged {med('merge_s'):.2f} s, memory beside estimate {med('compare_s'):.2f} s; "
          f"{ends[0]['events']} events in all ranks")
if "on" in res:
    print(f"tracing on / off: {res['on'] / res['off']:.4f} (medians), {low['on'] / low['off']:.4f} (fastest steps: the "
          "least disturbed on a shared machine)")
pr = [statistics.median(times(f"{tmp}/on_{i}.jsonl")) / statistics.median(times(f"{tmp}/off_{i}.jsonl"))
      for i in range(1, pairs + 1)]
print("pairs, on / off (each the ratio of the runs' medians): " + " ".join(f"{r:.3f}" for r in pr)
      + f"; median {statistics.median(pr):.4f}")
if "base" in res:
    print(f"off / without the hooks: {res['off'] / res['base']:.4f}")
PY
