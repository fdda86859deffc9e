#!/usr/bin/env bash
# The failure drill as a benchmark (docs/PERFORMANCE.md, "Goodput under failures"): the CPU benchmark model
# (configs/bench_cpu.yaml: dim 256, 4 layers, seq 256, batch 8, fp32) on 4 ranks of 1 thread under
# `meshtrain supervise`, for about MINUTES of training, while a random rank is killed with SIGKILL (every
# STOP_EVERY-th round stopped with SIGSTOP instead, which the ranks' watchdog, comm.timeout_s, turns into an abort)
# every MTBF/2 to 3 MTBF/2 seconds (uniform) at a random moment; every SAVE_EVERY-th round waits for a checkpoint
# to be in progress (its step_N.tmp directory) and kills then. Afterwards the same steps run uninterrupted, and:
#   - the final checkpoint's safetensors files (weights, AdamW state) are compared byte for byte;
#   - the metrics file, deduplicated (the last record of a step wins), must hold every step once with the
#     uninterrupted run's losses bit for bit;
#   - the supervisor's goodput is printed with its parts beside the 85% goal, with what bounds it: the time per
#     relaunch (the ranks' start-up and the checkpoint load), the work lost per failure, the saves.
# Checkpoints with checkpoint.interval: auto and checkpoint.mtbf_s = MTBF (Young/Daly: every sqrt(2 x stall x
# MTBF) seconds, the stall measured by the trainer), asynchronous (checkpoint.async: true; ASYNC=0 for synchronous
# saves); CKPT_INTERVAL=N for a fixed interval of N steps.
#   scripts/bench/bench_failure_drill.sh [BUILD_DIR] [MINUTES]
#   env: MTBF (s, default 60), STOP_EVERY (default 3), SAVE_EVERY (default 4), SEED, TIMEOUT_S (comm.timeout_s,
#        default 5), BACKOFF (s, default 0), CKPT_INTERVAL, KEEP=1 (keep the work directory, printed);
#        MEMORY=N: in-memory checkpoints every N steps with a peer's copy (checkpoint.memory); then also
#        LOSS_EVERY=k: every k-th round the killed rank's machine "loses its memory" (its own segment and the copy it
#        holds for its peer deleted: the restart loads that rank from its peer's copy), TWO_EVERY=k: every k-th round
#        two neighbouring ranks are killed and lose their memory (the peer's copy gone too: every rank back to disk);
#        RESTART_EVERY=k: every k-th round a second SIGKILL strikes during the relaunch (0.5 s after its ranks exist)
#        SKIP_BASE=1: no uninterrupted run afterwards (goodput only; the weights and losses not compared)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
minutes=${2:-10}
mtbf=${MTBF:-60}
stop_every=${STOP_EVERY:-3}
save_every=${SAVE_EVERY:-4}
seed=${SEED:-$(date +%s)}
RANDOM=$seed
timeout_s=${TIMEOUT_S:-5}
backoff=${BACKOFF:-0}
mt="$build/meshtrain"
py=/usr/bin/python3
tmp=$(mktemp -d /tmp/mt-drill.XXXXXX)
if [ "${KEEP:-0}" = 1 ]; then echo "work directory: $tmp (kept)"; else trap 'rm -rf "$tmp"' EXIT; fi
export OMP_NUM_THREADS=1

echo "machine    : $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1), $(getconf _NPROCESSORS_ONLN) cores," \
  "load average $(cut -d' ' -f1-3 /proc/loadavg); $(date -u '+%F %H:%M UTC'); SEED=$seed"
"$py" "$root/scripts/bench/bench_data.py" "$tmp"
common=(--config "$root/configs/bench_cpu.yaml" --set data.train="$tmp/bench_*.bin" --set data.val=""
  --set training.threads=1 --set log.interval=1 --set comm.timeout_s="$timeout_s" --set checkpoint.keep=2)
async=()
if [ "${ASYNC:-1}" = 1 ]; then async=(--set checkpoint.async=true); fi
interval=${CKPT_INTERVAL:-auto}
memory=()
if [ -n "${MEMORY:-}" ]; then memory=(--set checkpoint.memory.interval="$MEMORY" --set checkpoint.memory.peer=true); fi
loss_every=${LOSS_EVERY:-0} two_every=${TWO_EVERY:-0} restart_every=${RESTART_EVERY:-0}
# forget RANK: the memory of RANK's machine lost: its own segment and the peer copy it holds, in /dev/shm.
forget() { rm -f /dev/shm/meshtrain-*-r"$1" /dev/shm/meshtrain-*-r"$1".* /dev/shm/meshtrain-*-peer"$1" /dev/shm/meshtrain-*-peer"$1".* 2>/dev/null; }
# launch NAME STEPS INTERVAL: the 4-rank launch of run NAME.
launch() {
  echo "$root/scripts/mpirun.sh" -np 4 "$mt" "${common[@]}" "${async[@]}" "${memory[@]}" --set training.steps="$2" \
    --set checkpoint.interval="$3" --set checkpoint.mtbf_s="$mtbf" --set log.metrics_file="$tmp/$1.jsonl" \
    --set checkpoint.dir="$tmp/$1.ckpt" --set checkpoint.resume=auto train
}

# A probe: the step time on this machine now, for the step count.
# shellcheck disable=SC2046
$(launch probe 10 0) >"$tmp/probe.log" 2>&1 || { tail -n 20 "$tmp/probe.log"; exit 1; }
step_s=$("$py" - "$tmp/probe.jsonl" <<'PY'
import json, statistics, sys
ms = [json.loads(l)["step_ms"] for l in open(sys.argv[1]) if '"step_ms"' in l][2:]
print(round(statistics.median(ms) / 1e3, 3))
PY
)
steps=$("$py" -c "print(max(50, int($minutes * 60 / $step_s)))")
echo "probe      : $step_s s per step: $steps steps; checkpoint.interval $interval (mtbf_s $mtbf)," \
  "${async[*]:-synchronous saves}; comm.timeout_s $timeout_s, back-off $backoff s"

# rank_pid RANK: the process of rank RANK of the drill (Open MPI gives each rank OMPI_COMM_WORLD_RANK).
rank_pid() {
  local p
  for p in $(pgrep -f -- "^$mt .*checkpoint.dir=$tmp/drill.ckpt"); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1"; then echo "$p"; return; fi
  done
}

# The drill.
start=$(date +%s)
# shellcheck disable=SC2046
"$mt" supervise --max-restarts 1000 --backoff "$backoff" -- $(launch drill "$steps" "$interval") \
  >"$tmp/drill.log" 2>&1 &
sup=$!
round=0
kills=0 stops=0 in_save=0
while kill -0 $sup 2>/dev/null; do
  wait_s=$("$py" -c "import random; random.seed($seed * 1000 + $round); print(round(random.uniform($mtbf / 2, 1.5 * $mtbf), 1))")
  end=$(($(date +%s%N) / 1000000 + ${wait_s%.*} * 1000 + ${wait_s#*.} * 100))
  while [ $(($(date +%s%N) / 1000000)) -lt $end ] && kill -0 $sup 2>/dev/null; do sleep 0.2; done
  kill -0 $sup 2>/dev/null || break
  round=$((round + 1))
  rank=$((RANDOM % 4))
  what=KILL
  [ $((round % stop_every)) -eq 0 ] && what=STOP
  during=""
  if [ $((round % save_every)) -eq 0 ]; then
    # Wait (up to 30 s) for a save in progress, and strike then.
    for _ in $(seq 600); do
      ls -d "$tmp"/drill.ckpt/step_*.tmp >/dev/null 2>&1 && { during=" during the save of $(basename "$(ls -d "$tmp"/drill.ckpt/step_*.tmp | head -n 1)")"; break; }
      sleep 0.05
    done
  fi
  pid=$(rank_pid $rank)
  if [ -z "$pid" ]; then echo "round $round: rank $rank not running (between launches): skipped"; continue; fi
  extra=""
  if [ "$two_every" -gt 0 ] && [ $((round % two_every)) -eq 0 ]; then
    what=KILL
    other=$(((rank + 1) % 4))
    opid=$(rank_pid $other)
    [ -n "$opid" ] && kill -KILL "$opid" 2>/dev/null && kills=$((kills + 1))
    forget "$rank"; forget "$other"
    extra=" and rank $other (pid $opid), both machines' memory lost"
  elif [ "$loss_every" -gt 0 ] && [ $((round % loss_every)) -eq 0 ]; then
    what=KILL
    forget "$rank"
    extra=", its machine's memory lost"
  fi
  kill -$what "$pid" 2>/dev/null && {
    [ $what = KILL ] && kills=$((kills + 1)) || stops=$((stops + 1))
    [ -n "$during" ] && in_save=$((in_save + 1))
    echo "round $round at $(($(date +%s) - start)) s: SIG$what to rank $rank (pid $pid)$during$extra"
  }
  if [ "$restart_every" -gt 0 ] && [ $((round % restart_every)) -eq 0 ] && [ "$what" = KILL ]; then
    # The relaunch: wait (up to 60 s) for a new process of some rank, then strike it 0.5 s later.
    for _ in $(seq 600); do
      npid=$(rank_pid $(((rank + 2) % 4)))
      age=$( [ -n "$npid" ] && ps -o etimes= -p "$npid" 2>/dev/null | tr -d ' ')
      [ -n "$age" ] && [ "$age" -le 2 ] && break  # a new process: the relaunch's
      npid=""
      sleep 0.1
    done
    if [ -n "$npid" ]; then
      sleep 0.5
      kill -KILL "$npid" 2>/dev/null && kills=$((kills + 1)) &&
        echo "round $round at $(($(date +%s) - start)) s: SIGKILL to rank $(((rank + 2) % 4)) (pid $npid) during the restart"
    fi
  fi
done
wait $sup
rc=$?
drill_s=$(($(date +%s) - start))
echo "drill      : exit $rc after $drill_s s; $kills SIGKILL, $stops SIGSTOP ($in_save during a save)"
grep -E '^\[supervise.*\] (failure|giving up|goodput)' "$tmp/drill.log" | sed 's/^\[supervise [0-9:]*\] /  /'
grep -m 1 'checkpoint.interval auto:' "$tmp/drill.log" | sed 's/^\[[^]]*\] \[r0\] \[[a-z]*\] /  /'

status=0
if [ "${SKIP_BASE:-0}" = 1 ]; then
  echo "weights    : not compared (SKIP_BASE=1: no uninterrupted run)"
else
# The same steps uninterrupted.
start=$(date +%s)
# shellcheck disable=SC2046
$(launch base "$steps" "$interval") >"$tmp/base.log" 2>&1 || { echo "the uninterrupted run failed"; tail -n 10 "$tmp/base.log"; }
echo "uninterrupted: $(($(date +%s) - start)) s"

last=$(printf 'step_%08d' "$steps")
n=0 differ=0
for f in "$tmp/base.ckpt/$last"/*.safetensors; do
  n=$((n + 1))
  cmp -s "$f" "$tmp/drill.ckpt/$last/$(basename "$f")" || differ=$((differ + 1))
done
if [ $n -gt 0 ] && [ $differ -eq 0 ]; then echo "weights    : the final checkpoint's $n safetensors files equal the uninterrupted run's byte for byte"
else echo "weights    : $differ of $n safetensors files DIFFER from the uninterrupted run's"; status=1; fi
echo "metrics    : $("$py" "$root/tests/cli/dedup_steps.py" "$tmp/drill.jsonl" "$steps" --base "$tmp/base.jsonl" || echo FAILED)"
fi
"$py" - "$tmp/drill.jsonl" "$mtbf" <<'PY' || status=1
import json, re, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
g = [r for r in recs if r.get("event") == "goodput" and r.get("scope") == "job"]
if not g:
    print("goodput    : none recorded"); sys.exit(1)
g = g[-1]
mtbf = float(sys.argv[2])
saves = [r for r in recs if r.get("event") == "checkpoint"]
starts = [r for r in recs if r.get("event") == "start"]
w = g["wall_s"]
g["checkpoint_s"] = g.get("checkpoint_s", g.get("memory_save_s", 0) + g.get("disk_save_s", 0))
causes = ("productive", "memory_save", "disk_save", "eval", "lost", "restart", "detection", "other")
parts = ", ".join(f"{k} {g.get(k + '_s', 0):.1f} s ({100 * g.get(k + '_s', 0) / w:.1f}%)" for k in causes)
print(f"goodput    : {100 * g['goodput']:.1f}% (goal {'97' if mtbf >= 600 else '85'}%) of {w:.0f} s: {parts}")
f = max(g["failures"], 1)
launches = g["attempts"]
n = max(len(saves), 1)
period = g["productive_s"] / n
setup = sum(r.get("setup_s", 0) for r in starts) / max(len(starts), 1)
load = sum(r.get("load_s", 0) for r in starts) / max(len(starts), 1)
modes = sorted({r.get("mode", "?") for r in saves})
phases = ", ".join(f"{p['part']} {p['s'] / launches:.2f}" for p in g.get("restart_parts", []) if p["s"] > 0)
print(f"restart    : per launch by phase (s): {phases}")
print(f"per failure: {g['failures']} failures, one every {w / f:.0f} s; restart {g['restart_s'] / launches:.1f} s per "
      f"launch (of which the trainer's set-up {setup:.1f} s, its checkpoint load {load:.2f} s; the rest mpirun "
      f"starting 4 ranks); lost {g['lost_s'] / f:.1f} s per failure ({g['redone_steps'] / f:.1f} steps redone and the "
      f"step it died in), detection {g.get('detection_s', 0) / f:.1f} s per failure; checkpoint stall {g['checkpoint_s'] / n:.2f} s per save ({len(saves)} "
      f"{'/'.join(modes)} saves, one every {period:.1f} s of steps)")
bound = 1 - (g["restart_s"] / launches + (g["lost_s"] + g.get("detection_s", 0)) / f) / mtbf - (g["checkpoint_s"] / n) / period
print(f"bound      : at one failure per {mtbf:.0f} s, 1 - (restart + lost + detection) / MTBF - save / interval = {100 * bound:.1f}%")
PY
exit $status
