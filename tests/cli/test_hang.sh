#!/usr/bin/env bash
# Stuck-rank drills: one rank is stopped (SIGSTOP) at each moment of a run
# (start-up, a training step, evaluation, sampling, a checkpoint, the exit,
# `meshtrain check`) and
# the job must end non-zero within comm.timeout_s plus a margin, with the
# message naming the call and the rank that did not arrive. The stop comes
# from the MT_FAULT_STOP_AT hook (deterministic) or from outside with kill
# (wherever the rank happens to be). A stopped rank resumed after the abort
# must not blame its peers. Prints each drill's seconds, then
# "hang: N passed, N failed" last.
#   tests/cli/test_hang.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_hang.sh BUILD_DIR}

source "$(dirname "$0")/common.sh"

limit=3     # comm.timeout_s
margin=15   # start-up of the ranks on a loaded machine, the peer query, the abort

docs_data --val-fraction 0.1
cat >"$tmp/h.yaml" <<YAML
model: {dim: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 64, vocab_size: 256, max_seq_len: 32}
training: {steps: 3, batch_size: 4, seq_len: 32, warmup_steps: 1, threads: 1}
data: {train: "$tmp/data/docs_train_*.bin", val: "$tmp/data/docs_val_*.bin"}
eval: {interval: 0}
sample: {interval: 0}
log: {interval: 1, metrics_file: ""}
comm: {timeout_s: $limit}
checkpoint: {interval: 1, keep: 1, dir: "$tmp/ckpt", resume: never}
YAML

# drill NAME TEXT... -- COMMAND...: the command must end non-zero within the limit + margin with every TEXT in its output.
drill() {
  local name=$1
  shift
  local texts=()
  while [ "$1" != -- ]; do texts+=("$1"); shift; done
  shift
  rm -rf "$tmp/ckpt"
  local start rc took
  start=$(date +%s.%N)
  timeout -k 5 120 "$@" >"$tmp/out" 2>&1
  rc=$?
  took=$(echo "$(date +%s.%N) - $start" | bc)
  echo "drill $name: exit $rc after ${took}s"
  if [ $rc -eq 0 ]; then bad "$name" "exit 0, expected non-zero" "$(tail -n 8 "$tmp/out")"; return; fi
  if [ "$(echo "$took > $limit + $margin" | bc)" = 1 ]; then bad "$name" "took ${took}s (limit $limit s + $margin s)"; return; fi
  for t in "${texts[@]}"; do
    if ! grep -qF -- "$t" "$tmp/out"; then bad "$name" "output lacks: $t" "$(grep -v '^step\|info' "$tmp/out" | tail -n 8)"; return; fi
  done
  ok "$name (${took}s)"
}

run2=("$mpirun" -np 2 "$mt" --config "$tmp/h.yaml")
timeout_of() { echo "[comm] timeout: $1 did not finish within $limit s (comm.timeout_s) on rank 0"; }
stopped1="world rank 1 did not arrive"

# The same run with no fault finishes: the watched barriers and the exit do not disturb it.
expect "no fault: 2 ranks train, checkpoint and exit" zero "checkpoint step 3" -- "${run2[@]}" train

# Each moment, rank 1 stopping itself there.
# MPI_Init: the config's timeout is read from the command line before it (no peer can be named yet).
MT_FAULT_STOP_AT="MPI_Init:1" drill "start-up: MPI_Init" "[comm] timeout: MPI_Init on the job's start-up did not finish within $limit s" -- \
  "${run2[@]}" train
MT_FAULT_STOP_AT="config agreement:1" drill "start-up: config agreement" \
  "$(timeout_of "config agreement on the world (2 ranks)")" "$stopped1" -- "${run2[@]}" train
MT_FAULT_STOP_AT="mesh creation:1" drill "start-up: mesh creation" \
  "$(timeout_of "mesh creation on the world (2 ranks)")" "$stopped1" -- "${run2[@]}" train
MT_FAULT_STOP_AT="stop-signal all_reduce:1" drill "a step: stop-signal all_reduce" \
  "$(timeout_of "stop-signal all_reduce on the world (2 ranks)")" "$stopped1" -- "${run2[@]}" train
MT_FAULT_STOP_AT="errors in the checkpoint of step 1:1" drill "checkpoint write: the ranks' agreement" \
  "$(timeout_of "errors in the checkpoint of step 1 on the world (2 ranks)")" "$stopped1" -- "${run2[@]}" train
MT_FAULT_STOP_AT="exit barrier:1" drill "end of the run: exit barrier" \
  "$(timeout_of "exit barrier on the world (2 ranks)")" "$stopped1" -- "${run2[@]}" train
MT_FAULT_STOP_AT="check timing barrier:1" drill "meshtrain check: timing barrier" \
  "$(timeout_of "check timing barrier (all_reduce) on group 'dp_replicate' (world ranks 0,1)")" "$stopped1" -- \
  "${run2[@]}" check --sizes 1K --iters 2
MT_FAULT_STOP_AT="check failure count:1" drill "meshtrain check: failure count" \
  "$(timeout_of "check failure count on the world (2 ranks)")" "$stopped1" -- "${run2[@]}" check --sizes 1K --iters 1
# Inside Group collectives (no arrival messages): the waiting rank asks its peers where they are.
MT_FAULT_STOP_AT="evaluation:1" drill "evaluation: rank 1 stopped before it" \
  "[comm] timeout" "$stopped1" -- "${run2[@]}" --set eval.interval=1 train
MT_FAULT_STOP_AT="sampling:1" drill "sampling: rank 1 stopped in it" \
  "[comm] timeout" "$stopped1" -- "${run2[@]}" --set sample.interval=1 --set sample.tokens=4 train
# On 3 ranks only the stopped one is named.
MT_FAULT_STOP_AT="stop-signal all_reduce:2" drill "3 ranks: rank 2 stopped at a step" \
  "world rank 2 did not arrive" -- "$mpirun" -np 3 "$mt" --config "$tmp/h.yaml" --set training.batch_size=6 train
if ! grep -q "\[comm\] timeout" "$tmp/out" || grep -q "world ranks\? [0-9,]*1[0-9,]* did not arrive" "$tmp/out"; then bad "3 ranks: rank 1 is not blamed" "$(grep '\[comm\]' "$tmp/out")"; else ok "3 ranks: rank 1 is not blamed"; fi

# From outside, wherever rank 1 is: stop it mid-run, and resume it once rank 0 has aborted.
rm -rf "$tmp/ckpt"
start=$(date +%s.%N)
timeout -k 5 120 "$mpirun" -np 2 "$mt" --config "$tmp/h.yaml" --set training.steps=1000000 --set checkpoint.interval=0 \
  train >"$tmp/ext" 2>&1 &
job=$!
pid=""
for _ in $(seq 100); do
  for p in $(pgrep -f -- "$tmp/h.yaml"); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx OMPI_COMM_WORLD_RANK=1 && pid=$p
  done
  [ -n "$pid" ] && grep -q "^step 2" "$tmp/ext" && break
  sleep 0.2
done
if [ -z "$pid" ]; then
  bad "external stop: find rank 1" "$(tail -n 5 "$tmp/ext")"
  wait $job
else
  stopped=$(date +%s.%N)
  kill -STOP "$pid"
  for _ in $(seq 300); do grep -q "\[comm\] timeout" "$tmp/ext" && break; sleep 0.1; done
  kill -CONT "$pid" 2>/dev/null
  wait $job
  rc=$?
  took=$(echo "$(date +%s.%N) - $stopped" | bc)
  echo "drill external stop mid-run: exit $rc after ${took}s"
  if [ $rc -ne 0 ] && [ "$(echo "$took < $limit + $margin" | bc)" = 1 ] && grep -q "\[comm\] timeout: .* on rank 0 .*world rank 1 did not arrive" "$tmp/ext"; then
    ok "external stop mid-run: rank 0 names rank 1 (${took}s)"
  else
    bad "external stop mid-run" "exit $rc after ${took}s" "$(grep '\[comm\]' "$tmp/ext")"
  fi
  if grep -q "\[comm\] timeout: .* on rank 1 " "$tmp/ext"; then
    bad "resumed rank does not blame its peers" "$(grep '\[comm\]' "$tmp/ext")"
  else
    ok "resumed rank does not blame its peers"
  fi
fi
if pgrep -f -- "$tmp/h.yaml" >/dev/null; then bad "no rank left behind" "$(pgrep -af -- "$tmp/h.yaml")"; else ok "no rank left behind"; fi

echo "hang: $passed passed, $failed failed"
[ $failed -eq 0 ]
