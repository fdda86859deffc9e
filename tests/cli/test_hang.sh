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
# On 4 and 8 ranks over pairs of mesh dims, a rank stopped from outside mid-run
# must be the one the FIRST timeout line names (never a healthy rank waiting
# on it); --full runs every pair (4 ranks) and 2x2x2 meshes (8 ranks).
#   tests/cli/test_hang.sh BUILD_DIR [--full]
set -uo pipefail
build=${1:?usage: test_hang.sh BUILD_DIR [--full]}
full=0
[ "${2:-}" = --full ] && full=1

source "$(dirname "$0")/common.sh"

limit=3     # comm.timeout_s
margin=15   # start-up of the ranks on a loaded machine, the peer query, the abort

docs_data --val-fraction 0.1
fault_yaml "$tmp/h.yaml" 3 "$limit"

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
  "[comm] timeout: errors in the checkpoint of step 1 on the world (2 ranks) while saving the checkpoint of step 1" \
  "on rank 0" "$stopped1" -- "${run2[@]}" train
# Inside a sharded save (rank 1 stops before sending its shard to the one writer): named as part of the checkpoint.
MT_FAULT_STOP_AT="send on group 'world':1" drill "checkpoint write: rank 1 stopped before sending its shard" \
  "[comm] timeout: recv from world rank 1 on group 'world' (world ranks 0,1) while saving the checkpoint of step 1" \
  "$stopped1" -- "${run2[@]}" --set parallel.dp_shard=2 --set parallel.dp_replicate=1 \
  --set parallel.fsdp.min_weight_size=1 --set checkpoint.writers=1 train
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

# rank_pid CONFIG RANK: the process id of world rank RANK of the run launched with CONFIG ("" while there is none).
rank_pid() {
  local p
  for p in $(pgrep -f -- "$1"); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" && echo "$p"
  done | tail -n 1
}
# stop_rank PID JOB LOG: stops the rank PID until LOG has a timeout line (30 s at most), resumes it and waits for
# the launch JOB; sets rc (its exit status) and took (the seconds from the stop to its end).
stop_rank() {
  local stopped
  stopped=$(date +%s.%N)
  kill -STOP "$1"
  for _ in $(seq 300); do grep -q "\[comm\] timeout" "$3" && break; sleep 0.1; done
  kill -CONT "$1" 2>/dev/null
  wait "$2"
  rc=$?
  took=$(echo "$(date +%s.%N) - $stopped" | bc)
}

# From outside, wherever rank 1 is: stop it mid-run, and resume it once rank 0 has aborted.
rm -rf "$tmp/ckpt"
start=$(date +%s.%N)
timeout -k 5 120 "$mpirun" -np 2 "$mt" --config "$tmp/h.yaml" --set training.steps=1000000 --set checkpoint.interval=0 \
  train >"$tmp/ext" 2>&1 &
job=$!
pid=""
for _ in $(seq 100); do
  pid=$(rank_pid "$tmp/h.yaml" 1)
  [ -n "$pid" ] && grep -qE "^step +2/" "$tmp/ext" && break
  sleep 0.2
done
if [ -z "$pid" ]; then
  bad "external stop: find rank 1" "$(tail -n 5 "$tmp/ext")"
  wait $job
else
  stop_rank "$pid" $job "$tmp/ext"
  echo "drill external stop mid-run: exit $rc after ${took}s"
  if [ $rc -ne 0 ] && [ "$(echo "$took < $limit + $margin" | bc)" = 1 ] && grep -q "\[comm\] timeout: .* on rank 0 .*world rank 1 did not arrive" "$tmp/ext"; then
    ok "external stop mid-run: rank 0 names rank 1 (${took}s)"
  else
    bad "external stop mid-run" "exit $rc after ${took}s" "$(grep '\[comm\]' "$tmp/ext")"
  fi
  # The detection bound: the culprit search runs during the timeout's last second (comm/watchdog.cpp,
  # search_early), so the stopped rank is named within comm.timeout_s + 1 s of waiting (the watchdog's own figure),
  # and the job is over within comm.timeout_s + 3 s of the stop (the rest of a step, the abort; a loaded machine).
  found=$(grep -m1 "\[comm\] timeout: .*world rank 1 did not arrive" "$tmp/ext" | sed -n 's/.*aborting the job after \([0-9.]*\) s$/\1/p')
  if [ -n "$found" ] && [ "$(echo "$found <= $limit + 1" | bc)" = 1 ] && [ "$(echo "$took <= $limit + 3" | bc)" = 1 ]; then
    ok "external stop: named after ${found}s of waiting (bound $limit + 1 s), the job over ${took}s after the stop (bound $limit + 3 s)"
  else
    bad "external stop: named within $limit + 1 s, over within $limit + 3 s" "named after ${found:-?} s, over after ${took}s" \
      "$(grep '\[comm\] timeout' "$tmp/ext" | head -n 1)"
  fi
  if grep -q "\[comm\] timeout: .* on rank 1 " "$tmp/ext"; then
    bad "resumed rank does not blame its peers" "$(grep '\[comm\]' "$tmp/ext")"
  else
    ok "resumed rank does not blame its peers"
  fi
fi
if pgrep -f -- "$tmp/h.yaml" >/dev/null; then bad "no rank left behind" "$(pgrep -af -- "$tmp/h.yaml")"; else ok "no rank left behind"; fi

# Meshes of two (and three) dims: rank S stopped from outside after step 2; the first timeout line printed must
# name S (the ranks waiting on it, directly or through other waiting ranks, are never named first).
# mesh_drill NAME NP S [--set ...]. The limit is a little longer than the others': 4 or 8 ranks on 2 cores make the
# first step's start uneven (each rank's GEMM probe), which must not time out before the stop.
mesh_limit=5
sed -e 's/batch_size: 4,/batch_size: 8, micro_batch_size: 1,/' "$tmp/h.yaml" >"$tmp/m.yaml"
mesh_drill() {
  local name=$1 np=$2 s=$3
  shift 3
  rm -rf "$tmp/ckpt"
  timeout -k 5 120 "$mpirun" -np "$np" "$mt" --config "$tmp/m.yaml" --set training.steps=1000000 --set comm.timeout_s=$mesh_limit \
    --set checkpoint.interval=0 --set parallel.dp_replicate=1 "$@" train >"$tmp/mesh" 2>&1 &
  local job=$! pid=""
  for _ in $(seq 300); do
    pid=$(rank_pid "$tmp/m.yaml" "$s")
    [ -n "$pid" ] && grep -qE "^step +2/" "$tmp/mesh" && break
    kill -0 $job 2>/dev/null || break
    sleep 0.2
  done
  if [ -z "$pid" ] || ! grep -qE "^step +2/" "$tmp/mesh"; then
    bad "$name: start" "$(grep -v '^step\|info' "$tmp/mesh" | tail -n 5)"
    kill $job 2>/dev/null
    wait $job
    return
  fi
  local took rc first
  stop_rank "$pid" $job "$tmp/mesh"
  first=$(grep -m1 "\[comm\] timeout" "$tmp/mesh")
  echo "drill $name: exit $rc after ${took}s"
  if [ $rc -eq 0 ] || [ "$(echo "$took > $mesh_limit + $margin" | bc)" = 1 ]; then
    bad "$name" "exit $rc after ${took}s" "$(grep '\[comm\]' "$tmp/mesh")"
  elif ! grep -q "world rank $s did not" <<<"$first" ||
    grep -oE "world ranks? [0-9,]+ did not" <<<"$first" | grep -vq "world rank $s did not"; then
    bad "$name: the first timeout line names rank $s" "$first"
  else
    ok "$name: the first line names rank $s (${took}s; $(sed -n 's/.*aborting the job after \([0-9.]*\) s$/named after \1 s of waiting/p' <<<"$first"))"
  fi
}
moe=(--set model.type=mixtral --set model.moe.n_experts=4 --set model.moe.ffn_dim=48)
# 4 ranks, 2 x 2: the meshes the issue found wrong by default, every pair with --full.
mesh_drill "4 ranks pp x dp_shard, rank 1 stopped" 4 1 --set parallel.pp=2 --set parallel.dp_shard=2
mesh_drill "4 ranks pp x tp, rank 1 stopped" 4 1 --set parallel.pp=2 --set parallel.tp=2
mesh_drill "4 ranks 2-D cp (cp_ring x cp_ulysses), rank 1 stopped" 4 1 --set parallel.cp=4 \
  --set parallel.cp_ring=2 --set parallel.cp_ulysses=2
mesh_drill "4 ranks dp_shard x tp, rank 2 stopped" 4 2 --set parallel.dp_shard=2 --set parallel.tp=2
if [ $full -eq 1 ]; then
  mesh_drill "4 ranks pp x dp_replicate" 4 1 --set parallel.pp=2 --set parallel.dp_replicate=2
  mesh_drill "4 ranks pp x cp" 4 1 --set parallel.pp=2 --set parallel.cp=2
  mesh_drill "4 ranks pp x ep" 4 1 --set parallel.pp=2 --set parallel.ep=2 "${moe[@]}"
  mesh_drill "4 ranks dp_replicate x dp_shard" 4 1 --set parallel.dp_replicate=2 --set parallel.dp_shard=2
  mesh_drill "4 ranks dp_replicate x tp" 4 1 --set parallel.dp_replicate=2 --set parallel.tp=2
  mesh_drill "4 ranks dp_replicate x cp" 4 1 --set parallel.dp_replicate=2 --set parallel.cp=2
  mesh_drill "4 ranks dp_replicate x ep" 4 1 --set parallel.dp_replicate=2 --set parallel.ep=2 "${moe[@]}"
  mesh_drill "4 ranks dp_shard x cp" 4 1 --set parallel.dp_shard=2 --set parallel.cp=2
  mesh_drill "4 ranks dp_shard x ep" 4 1 --set parallel.dp_shard=2 --set parallel.ep=2 "${moe[@]}"
  mesh_drill "4 ranks tp x cp" 4 1 --set parallel.tp=2 --set parallel.cp=2
  mesh_drill "4 ranks tp x ep" 4 1 --set parallel.tp=2 --set parallel.ep=2 "${moe[@]}"
  mesh_drill "4 ranks cp x ep" 4 1 --set parallel.cp=2 --set parallel.ep=2 "${moe[@]}"
  mesh_drill "4 ranks pp x dp_shard, rank 2 stopped" 4 2 --set parallel.pp=2 --set parallel.dp_shard=2
fi
# 8 ranks, 2 x 2 x 2: one by default, the others with --full.
mesh_drill "8 ranks pp x dp_shard x tp, rank 5 stopped" 8 5 --set parallel.pp=2 --set parallel.dp_shard=2 \
  --set parallel.tp=2
if [ $full -eq 1 ]; then
  mesh_drill "8 ranks pp x dp_replicate x cp" 8 3 --set parallel.pp=2 --set parallel.dp_replicate=2 --set parallel.cp=2
  mesh_drill "8 ranks dp_shard x cp x tp" 8 6 --set parallel.dp_shard=2 --set parallel.cp=2 --set parallel.tp=2
  mesh_drill "8 ranks pp x ep x dp_shard" 8 2 --set parallel.pp=2 --set parallel.ep=2 --set parallel.dp_shard=2 \
    "${moe[@]}"
  mesh_drill "8 ranks dp_replicate x tp x ep" 8 7 --set parallel.dp_replicate=2 --set parallel.tp=2 \
    --set parallel.ep=2 "${moe[@]}"
  mesh_drill "8 ranks pp x 2-D cp" 8 1 --set parallel.pp=2 --set parallel.cp=4 --set parallel.cp_ring=2 \
    --set parallel.cp_ulysses=2
fi
if pgrep -f -- "$tmp/m.yaml" >/dev/null; then bad "no rank left behind (meshes)" "$(pgrep -af -- "$tmp/m.yaml")"; else ok "no rank left behind (meshes)"; fi

echo "hang: $passed passed, $failed failed"
[ $failed -eq 0 ]
