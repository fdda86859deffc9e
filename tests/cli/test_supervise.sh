#!/usr/bin/env bash
# `meshtrain supervise` (runtime/supervise/), the short failure drill: 4 ranks of a tiny model under
# the supervisor, one random rank killed with SIGKILL at a random step and, in the relaunched run, another stopped
# with SIGSTOP (its peers' watchdog, comm.timeout_s 3, aborts the job); asynchronous checkpoints every 50 steps.
# The supervisor relaunches each time from the newest checkpoint (checkpoint.resume=auto), and at the end:
#   - it exits 0, and each failure line names the rank that was killed or stopped;
#   - the final checkpoint's weights and optimizer state equal an uninterrupted run's, byte for byte;
#   - after deduplication (the last record of a step wins) the metrics hold every step once, none missing, with the
#     uninterrupted run's losses bit for bit;
#   - the goodput is printed with its parts and recorded in the metrics file, with one record per failure; by
#     cause (productive, memory and disk saves, eval, lost, restart by set-up phase, detection, other) adding up to
#     the wall time, and plot_metrics.py draws it.
# Then what is not relaunched: a config error (one launch), SIGTERM to the supervisor (passed on: checkpoint,
# exit 143), a launch that exits 138 by itself (a preemption), --max-restarts used up (non-zero, "giving up", the
# back-off doubling), and --hang-timeout ending a launch whose steps stopped. SIGKILL to the supervisor ends its
# launch (mpirun and the ranks) too. Options that cannot be used (not an integer, negative, a --metrics file in a
# missing folder) are usage errors naming the option, before any launch. MT_TEST_SEED fixes the random choices.
# Prints "supervise: N passed, N failed" last.
#   tests/cli/test_supervise.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_supervise.sh BUILD_DIR}
source "$(dirname "$0")/common.sh"

seed=${MT_TEST_SEED:-$(date +%s)}
RANDOM=$seed
echo "supervise: MT_TEST_SEED=$seed"
dedup="$root/tests/cli/dedup_steps.py"
steps=1500
docs_data --val-fraction 0.1
cat >"$tmp/s.yaml" <<YAML
model: {dim: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 64, vocab_size: 256, max_seq_len: 32}
training: {steps: $steps, batch_size: 8, seq_len: 32, lr: 3.0e-3, warmup_steps: 3, lr_min: 3.0e-4, grad_clip: 1.0,
           weight_decay: 0.1, threads: 1}
data: {train: "$tmp/data/docs_train_*.bin", val: "$tmp/data/docs_val_*.bin"}
eval: {interval: 500, steps: 2}
sample: {interval: 0}
log: {interval: 1}
comm: {timeout_s: 3}
checkpoint: {interval: 50, keep: 2, async: true}
YAML
# launch NAME: the 4-rank launch of run NAME (its metrics $tmp/NAME.jsonl, its checkpoints $tmp/NAME.ckpt).
launch() {
  echo "$mpirun" -np 4 "$mt" --config "$tmp/s.yaml" --set log.metrics_file="$tmp/$1.jsonl" \
    --set checkpoint.dir="$tmp/$1.ckpt" --set checkpoint.resume=auto train
}
# rank_pid NAME RANK: the process of rank RANK of run NAME (Open MPI gives each rank OMPI_COMM_WORLD_RANK).
rank_pid() {
  local p
  for p in $(pgrep -f -- "^$mt .*checkpoint.dir=$tmp/$1.ckpt"); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then echo "$p"; return; fi
  done
}
# wait_steps FILE N SECONDS: until FILE has N more step records than now, or the time is up.
wait_steps() {
  local want=$(($(steps_in "$1") + $2)) end=$((SECONDS + $3))
  while [ "$(steps_in "$1")" -lt $want ] && [ $SECONDS -lt $end ]; do sleep 0.1; done
}
# same_weights A B: the final checkpoints' safetensors files of runs A and B are equal byte for byte.
same_weights() {
  local last
  last=$(printf 'step_%08d' $steps)
  same_safetensors "$tmp/$2.ckpt/$last" "$tmp/$1.ckpt/$last"
}

# The uninterrupted run.
start=$SECONDS
# shellcheck disable=SC2046
timeout 300 $(launch base) >"$tmp/base.log" 2>&1 || bad "the uninterrupted 4-rank run" "$(tail -n 10 "$tmp/base.log")"
echo "uninterrupted run: $((SECONDS - start)) s"

# The drill: a random rank killed at a random step of launch 1, another stopped at a random step of launch 2.
start=$SECONDS
# shellcheck disable=SC2046
timeout 600 "$mt" supervise --backoff 1 -- $(launch drill) >"$tmp/drill.log" 2>&1 &
sup=$!
kill_rank=$((RANDOM % 4))
wait_steps "$tmp/drill.jsonl" $((100 + RANDOM % 400)) 120
sleep "0.$((RANDOM % 10))"
pid=$(rank_pid drill $kill_rank)
echo "drill: SIGKILL to rank $kill_rank (pid ${pid:-none}) after $(steps_in "$tmp/drill.jsonl") step records"
killed=$(date +%s.%N)
[ -n "$pid" ] && kill -KILL "$pid"
# The launch is torn down at once: mpirun says at once that a rank failed, and the supervisor ends the other ranks
# then rather than after mpirun's grace (2 s here; runtime/supervise/launch.cpp, end_ranks). The bound is generous
# for a loaded machine (0.2 s typical) yet below the grace.
for _ in $(seq 600); do grep -q "\] failure 1 " "$tmp/drill.log" && break; sleep 0.02; done
took=$(echo "$(date +%s.%N) - $killed" | bc)
if grep -q "the launcher reports a failed rank and aborts the job: its ranks ended now" "$tmp/drill.log" &&
  [ "$(echo "$took < 1.5" | bc)" = 1 ]; then
  ok "drill: the killed rank's launch torn down and the failure recorded $(printf %.2f "$took") s after the SIGKILL (bound 1.5 s)"
else
  bad "drill: the launch torn down within 1.5 s of the SIGKILL" "the failure line after ${took}s" \
    "$(grep '^\[supervise' "$tmp/drill.log" | tail -n 3)"
fi
# Launch 2: its own steps begin after the "launch 2" line.
for _ in $(seq 600); do grep -q "launch 2 of" "$tmp/drill.log" && break; sleep 0.1; done
wait_steps "$tmp/drill.jsonl" $((100 + RANDOM % 300)) 120
stop_rank=$((RANDOM % 4))
pid=$(rank_pid drill $stop_rank)
echo "drill: SIGSTOP to rank $stop_rank (pid ${pid:-none}) after $(steps_in "$tmp/drill.jsonl") step records"
[ -n "$pid" ] && kill -STOP "$pid"
wait $sup
rc=$?
echo "drill: the supervised job took $((SECONDS - start)) s"
if [ $rc -eq 0 ] && [ "$(grep -c '^\[supervise.*\] launch [0-9]* of' "$tmp/drill.log")" -eq 3 ]; then
  ok "drill: exit 0 after 3 launches (2 failures relaunched)"
else
  bad "drill: exit 0 after 3 launches" "exit $rc, $(grep -c '^\[supervise.*\] launch' "$tmp/drill.log") launches" \
    "$(grep -v '^step\|^checkpoint step\|info\]' "$tmp/drill.log" | tail -n 20)"
fi
f1=$(grep -m 1 '\] failure 1 ' "$tmp/drill.log")
f2=$(grep -m 1 '\] failure 2 ' "$tmp/drill.log")
if [[ "$f1" == *"rank $kill_rank "*"exited on signal 9 (Killed)"*"last step recorded"*"last committed checkpoint"*"lost"* ]]; then
  ok "drill: the failure line names the killed rank $kill_rank, the signal, the steps and what was lost"
else
  bad "drill: the failure line names the killed rank $kill_rank" "${f1:-no failure 1 line}"
fi
if [[ "$f2" == *"rank $stop_rank "* ]] && [[ "$f2" == *"did not arrive"* || "$f2" == *"was stopped"* ]]; then
  ok "drill: the failure line names the stopped rank $stop_rank (the watchdog's timeout)"
else
  bad "drill: the failure line names the stopped rank $stop_rank" "${f2:-no failure 2 line}" \
    "$(grep '\[comm\]' "$tmp/drill.log" | head -n 3)"
fi
if out=$(same_weights base drill); then ok "drill: the final weights and optimizer state equal the uninterrupted run's ($out)"
else bad "drill: the final weights equal the uninterrupted run's" "$out"; fi
if out=$("$py" "$dedup" "$tmp/drill.jsonl" $steps --base "$tmp/base.jsonl" 2>&1); then ok "drill: metrics: $out"
else bad "drill: metrics after deduplication" "$out"; fi
g=$(grep -m 1 '\] goodput [0-9.]*% of' "$tmp/drill.log")
if [[ "$g" == *productive*"memory saves"*"disk saves"*eval*lost*restart*detection*other* ]] &&
  grep -q '"event": *"goodput".*"scope": *"job"' "$tmp/drill.jsonl" &&
  [ "$(grep -c '"event": *"failure"' "$tmp/drill.jsonl")" -eq 2 ]; then
  ok "drill: ${g#*] }"
else
  bad "drill: the goodput with its parts, and the failure records" "${g:-no goodput line}" \
    "$(grep -c '"event": *"failure"' "$tmp/drill.jsonl") failure records"
fi
# Goodput by cause (issue 54 part 5): the job's record carries every cause, adding up to the wall time; the restart
# split by the launches' set-up phases (read from the ranks' setup records), adding up to it; the detection of the
# two failures (the stopped rank's watchdog, comm.timeout_s 3) counted apart from the work lost.
if out=$("$py" - "$tmp/drill.jsonl" 2>&1 <<'PY'
import json, sys
g = [r for r in map(json.loads, open(sys.argv[1])) if r.get("event") == "goodput" and r.get("scope") == "job"][-1]
causes = ["productive_s", "memory_save_s", "disk_save_s", "eval_s", "lost_s", "restart_s", "detection_s", "other_s"]
missing = [c for c in causes if not isinstance(g.get(c), (int, float)) or g[c] < 0]
assert not missing, f"causes missing or negative: {missing}"
total = sum(g[c] for c in causes)
assert abs(total - g["wall_s"]) <= 0.01 * g["wall_s"] + 0.05, f"causes add up to {total:.2f} s, wall {g['wall_s']:.2f} s"
phases = {p["part"]: p["s"] for p in g["restart_parts"]}
assert abs(sum(phases.values()) - g["restart_s"]) < 1e-6 + 1e-6 * g["restart_s"], (phases, g["restart_s"])
for p in ("launcher", "mpi", "mesh", "model", "load", "peak", "report", "first_step"):
    assert p in phases, f"no restart phase {p}: {phases}"
for p in ("launcher", "mpi", "load"):  # each launch pays these (the others can be a few ms on a tiny model)
    assert phases[p] > 0, f"no time in the restart phase {p} (the ranks' setup records not read?): {phases}"
assert phases.get("not_timed", 0) < 0.1 * g["restart_s"], f"restart time outside the set-up's phases: {phases}"
assert phases.get("backoff", 0) >= 2 - 0.05, f"two back-offs of 1 s: {phases}"
fails = [r for r in map(json.loads, open(sys.argv[1])) if r.get("event") == "failure"]
assert g["detection_s"] >= 2, f"the stopped rank's detection (comm.timeout_s 3) not counted: {g['detection_s']:.2f} s; {fails}"
assert g["disk_save_s"] > 0 and g["memory_save_s"] == 0, (g["disk_save_s"], g["memory_save_s"])
# Each failure's record says its own detection and step in flight; they add up to the job's detection.
assert all(isinstance(f.get("detection_s"), (int, float)) and f["detection_s"] >= 0 and f.get("in_flight_s", -1) >= 0
           for f in fails), f"failure records without detection_s / in_flight_s: {fails}"
det = sum(f["detection_s"] for f in fails)
assert abs(det - g["detection_s"]) < 1e-6 + 1e-6 * g["detection_s"], f"failures' detection {det:.3f} s, job's {g['detection_s']:.3f} s"
assert max(f["detection_s"] for f in fails) >= 2, f"the stopped rank's detection (comm.timeout_s 3) not in its record: {fails}"
print(", ".join(f"{c[:-2]} {g[c]:.1f}" for c in causes), f"= {total:.1f} of {g['wall_s']:.1f} s; restart:",
      ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if v))
PY
); then ok "drill: goodput by cause: $out"
else bad "drill: goodput by cause adding up to the wall time, restart by phase" "$out"; fi
if grep -q '\] restart [0-9.]* s by phase: .*MPI start-up' "$tmp/drill.log"; then
  ok "drill: $(grep -m 1 '\] restart [0-9.]* s by phase' "$tmp/drill.log" | sed 's/^.*\] //')"
else bad "drill: the restart line by phase" "$(grep '^\[supervise' "$tmp/drill.log" | tail -n 3)"; fi
if out=$("$py" "$root/scripts/plot_metrics.py" "$tmp/drill.jsonl" --out "$tmp/drill.png" 2>&1) &&
  [ -s "$tmp/drill_goodput.png" ] && "$py" -c "
import sys; sys.exit(open('$tmp/drill_goodput.png', 'rb').read(8) != b'\x89PNG\r\n\x1a\n')"; then
  ok "drill: plot_metrics.py draws the goodput by cause and the restart by phase ($(basename "$tmp/drill_goodput.png"))"
else bad "drill: plot_metrics.py on the drill's metrics" "$out"; fi

# What is not relaunched.
# A config error: every rank fails before the first step; a relaunch would fail the same way.
# shellcheck disable=SC2046
timeout 120 "$mt" supervise --backoff 0 -- $(launch cfg) --set training.batch_size=3 >"$tmp/cfg.log" 2>&1
rc=$?
if [ $rc -ne 0 ] && [ "$(grep -c '\] launch [0-9]* of' "$tmp/cfg.log")" -eq 1 ] &&
  grep -q "before its first step, with no rank killed, stopped or timed out.*not relaunched" "$tmp/cfg.log"; then
  ok "a config error: one launch, exit $rc, not relaunched and why"
else
  bad "a config error is not relaunched" "exit $rc" "$(grep -v 'info\]' "$tmp/cfg.log" | tail -n 8)"
fi
# SIGTERM to the supervisor (a preemption): passed to mpirun, the ranks checkpoint and stop, exit 143, no relaunch.
rm -rf "$tmp/term.ckpt"
# shellcheck disable=SC2046
timeout 120 "$mt" supervise --backoff 0 -- $(launch term) --set checkpoint.interval=0 >"$tmp/term.log" 2>&1 &
sup=$!
wait_steps "$tmp/term.jsonl" 30 60
kill -TERM $sup
wait $sup
rc=$?
if [ $rc -eq 143 ] && [ "$(grep -c '\] launch [0-9]* of' "$tmp/term.log")" -eq 1 ] &&
  grep -q "received: stopped after step" "$tmp/term.log" && ls -d "$tmp"/term.ckpt/step_* >/dev/null 2>&1; then
  ok "SIGTERM to the supervisor: passed on, the ranks checkpoint, exit 143, not relaunched"
else
  bad "SIGTERM to the supervisor" "exit $rc" "$(grep -v '^step\|info\]' "$tmp/term.log" | tail -n 8)"
fi
# A launch that exits 128 + SIGUSR1 by itself: its ranks stopped for a preemption; passed on.
timeout 30 "$mt" supervise --backoff 0 -- bash -c 'exit 138' >"$tmp/usr1.log" 2>&1
rc=$?
if [ $rc -eq 138 ] && [ "$(grep -c '\] launch [0-9]* of' "$tmp/usr1.log")" -eq 1 ]; then
  ok "a launch exiting 138 (stopped by SIGUSR1 after a checkpoint) is passed on, not relaunched"
else
  bad "a launch exiting 138 is passed on" "exit $rc" "$(tail -n 5 "$tmp/usr1.log")"
fi
# --max-restarts used up: a launch whose rank always dies (Open MPI's line, printed by a stand-in); no progress, so
# the back-off doubles.
timeout 60 "$mt" supervise --max-restarts 2 --backoff 0.1 -- bash -c \
  'echo "mpirun noticed that process rank 1 with PID 0 on node n1 exited on signal 9 (Killed)."; exit 137' \
  >"$tmp/max.log" 2>&1
rc=$?
if [ $rc -eq 137 ] && [ "$(grep -c '\] launch [0-9]* of' "$tmp/max.log")" -eq 3 ] &&
  grep -q "giving up: 2 relaunches (--max-restarts 2) used; the last launch exited 137" "$tmp/max.log" &&
  grep -q "relaunch 2 of 2 in 0.2 s (2 failures in a row without progress)" "$tmp/max.log" &&
  grep -q "rank 1 on n1 exited on signal 9 (Killed)" "$tmp/max.log"; then
  ok "--max-restarts 2 used up: 3 launches, exit 137, a clear message, the back-off doubled"
else
  bad "--max-restarts used up" "exit $rc" "$(tail -n 8 "$tmp/max.log")"
fi
# A real launch that hangs (rank 1 stopped, the watchdog's timeout far away) is killed whole, mpirun with its ranks:
# nobody is left to remove Open MPI's shared-memory files (vader_segment.*, here in a folder of the test's own) but
# the supervisor, which does.
mkdir -p "$tmp/mpishm"
# shellcheck disable=SC2046
OMPI_MCA_btl_vader_backing_directory="$tmp/mpishm" MT_FAULT_STOP_AT="evaluation:1" timeout 120 "$mt" supervise \
  --max-restarts 0 --hang-timeout 3 -- $(launch hungmpi) --set comm.timeout_s=60 --set eval.interval=5 >"$tmp/hungmpi.log" 2>&1
left=$(ls "$tmp/mpishm" | grep -c 'segment\.')
if grep -q "the launch hangs; killing it" "$tmp/hungmpi.log" && [ "$left" -eq 0 ] &&
  grep -q "removed [0-9]* Open MPI shared-memory file" "$tmp/hungmpi.log"; then
  ok "a hung launch killed whole: $(grep -m 1 -o "removed [0-9]* Open MPI shared-memory files*" "$tmp/hungmpi.log") its ranks left, none left"
else
  bad "a hung launch killed whole: Open MPI's shared-memory files removed" "$left left: $(ls "$tmp/mpishm")" \
    "$(grep '^\[supervise' "$tmp/hungmpi.log" | tail -n 4)"
fi
# --hang-timeout: a launch that recorded a step and then went silent is ended.
timeout 60 "$mt" supervise --max-restarts 0 --hang-timeout 2 --metrics "$tmp/hang.jsonl" -- bash -c \
  "echo '{\"step\": 1, \"loss\": 1.0, \"step_ms\": 5}' >>'$tmp/hang.jsonl'; sleep 100" >"$tmp/hang.log" 2>&1
rc=$?
if [ $rc -ne 0 ] && grep -q "no new step in the metrics for [0-9]* s (--hang-timeout): the launch hangs; killing it" "$tmp/hang.log" &&
  grep -q "hung: no new step for 2 s" "$tmp/hang.log"; then
  ok "--hang-timeout 2: a launch silent after its first step is killed and counted as a failure"
else
  bad "--hang-timeout" "exit $rc" "$(tail -n 6 "$tmp/hang.log")"
fi

# SIGKILL to the supervisor (it can pass nothing on): its launch dies with it (the launcher's parent-death signal,
# passed on to the ranks by mpirun). The launch is quiet (--log-level error, no step lines, no evaluation: its
# ranks write nothing into the supervisor's closed pipes, which would end them); its processes, mpirun and the 2
# ranks, are found by the run's checkpoint folder in their command lines. Any left behind are killed here.
launch_procs() { pgrep -f -- "checkpoint.dir=$tmp/orphan.ckpt" | tr '\n' ' '; }
"$mt" supervise --backoff 0 -- "$mpirun" -np 2 "$mt" --config "$tmp/s.yaml" --log-level error \
  --set log.metrics_file="$tmp/orphan.jsonl" --set checkpoint.dir="$tmp/orphan.ckpt" --set checkpoint.interval=0 \
  --set training.steps=1000000 --set log.interval=1000000 --set eval.interval=0 train >"$tmp/orphan.log" 2>&1 &
sup=$!
wait_steps "$tmp/orphan.jsonl" 20 60
procs=$(launch_procs | tr ' ' '\n' | grep -vx "$sup" | tr '\n' ' ')  # mpirun and the ranks
kill -KILL $sup
{ wait $sup; } 2>/dev/null
killed_at=$SECONDS
for _ in $(seq 100); do [ -z "$(launch_procs)" ] && break; sleep 0.1; done
left=$(launch_procs)
if [ "$(steps_in "$tmp/orphan.jsonl")" -ge 20 ] && [ "$(wc -w <<<"$procs")" -eq 3 ] && [ -z "$left" ]; then
  took=$((SECONDS - killed_at))
  ok "SIGKILL to the supervisor: its quiet launch (mpirun and 2 ranks, pids ${procs% }) ended with it within $took s"
else
  bad "SIGKILL to the supervisor ends its quiet launch" \
    "$(steps_in "$tmp/orphan.jsonl") steps recorded; the launch's processes before the kill: ${procs:-none}; 10 s after: ${left:-none}" \
    "$(ps -o pid,ppid,etime,args -p "$(echo $left | tr ' ' ,)" 2>/dev/null | cut -c1-160)" "$(tail -n 5 "$tmp/orphan.log")"
  # shellcheck disable=SC2086
  [ -n "$left" ] && kill -KILL $left 2>/dev/null
fi

# The command line: an option's value that cannot be used is a usage error (exit 2) that says what is wanted, and
# nothing is launched.
# usage_error NAME TEXT ARGS...: `supervise ARGS -- true` exits 2, prints TEXT, launches nothing.
usage_error() {
  local name=$1 text=$2 rc
  shift 2
  timeout 30 "$mt" supervise "$@" -- true >"$tmp/usage.log" 2>&1
  rc=$?
  if [ $rc -eq 2 ] && grep -qF -- "$text" "$tmp/usage.log" && ! grep -q '\] launch [0-9]* of' "$tmp/usage.log"; then
    ok "$name: $(head -n 1 "$tmp/usage.log")"
  else
    bad "$name" "exit $rc, expected 2 and '$text'" "$(head -n 5 "$tmp/usage.log")"
  fi
}
usage_error "--max-restarts abc" "--max-restarts: must be an integer, got 'abc'" --max-restarts abc
usage_error "--max-restarts 1.5" "--max-restarts: must be an integer, got '1.5'" --max-restarts 1.5
usage_error "--max-restarts -1" "--max-restarts: must be at least 0, got -1" --max-restarts -1
grep -qE '[0-9]{20}' "$tmp/usage.log" && bad "--max-restarts -1: no 309-digit range" "$(head -n 2 "$tmp/usage.log")"
usage_error "--exclude-after 99999999999" "--exclude-after: must be at most 2147483647, got 99999999999" \
  --exclude-after 99999999999
usage_error "--backoff abc" "--backoff: must be a number, got 'abc'" --backoff abc
usage_error "--hang-timeout -2" "--hang-timeout: must be at least 0, got -2" --hang-timeout -2
usage_error "--metrics in a folder that does not exist" \
  "--metrics $tmp/nowhere/m.jsonl: its folder $tmp/nowhere does not exist" --metrics "$tmp/nowhere/m.jsonl"
usage_error "--metrics under a file" "--metrics $tmp/s.yaml/m.jsonl: $tmp/s.yaml is not a folder" \
  --metrics "$tmp/s.yaml/m.jsonl"
if [ "$(id -u)" -ne 0 ]; then
  mkdir -p "$tmp/readonly" && chmod a-w "$tmp/readonly"
  usage_error "--metrics in a folder that is not writable" "its folder $tmp/readonly is not writable" \
    --metrics "$tmp/readonly/m.jsonl"
  chmod u+w "$tmp/readonly"
else
  skip "--metrics in a folder that is not writable" "root writes anywhere"
fi

summary supervise
[ $failed -eq 0 ]
