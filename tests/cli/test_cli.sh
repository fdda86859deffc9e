#!/usr/bin/env bash
# End-to-end tests of the meshtrain command line under mpirun: every bad
# input gives its message and a non-zero exit on every rank count, the
# self-check passes on 1-D, 2-D and 3-D meshes, and the fault tests end the
# job within the timeout. Prints "cli: N passed, N failed" last.
#   tests/cli/test_cli.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_cli.sh BUILD_DIR}

source "$(dirname "$0")/common.sh"

# Bad input: each kind, on 1 and 2 ranks.
for np in 1 2; do
  expect "np=$np unknown key" nonzero "[config] unknown key 'comm.timout_s'" -- \
    "$mpirun" -np $np "$mt" --set comm.timout_s=5 check --sizes 1K
  expect "np=$np wrong type" nonzero "comm.timeout_s" -- \
    "$mpirun" -np $np "$mt" --set comm.timeout_s=abc check --sizes 1K
  expect "np=$np mesh product" nonzero "[mesh] mesh tp=3 has 3 ranks but the job has $np" -- \
    "$mpirun" -np $np "$mt" check --mesh tp=3 --sizes 1K
  expect "np=$np config mesh product" nonzero "but the job has $np ranks" -- \
    "$mpirun" -np $np "$mt" --set parallel.dp_replicate=1 --set parallel.tp=4 check --sizes 1K
  expect "np=$np missing config file" nonzero "$tmp/nope.yaml" -- \
    "$mpirun" -np $np "$mt" --config "$tmp/nope.yaml" check
  expect "np=$np bad size" nonzero "[check] bad size '3X'" -- \
    "$mpirun" -np $np "$mt" check --sizes 3X
done
# Ranks that read different configs are stopped at the first collective.
expect "config differs across ranks" nonzero "read a different config than rank 0" -- \
  "$mpirun" -np 1 "$mt" --set comm.timeout_s=30 check --sizes 1K : -np 1 "$mt" --set comm.timeout_s=31 check --sizes 1K

# The self-check passes on 1-D, 2-D and 3-D meshes and prints bus bandwidth.
expect "check np=1" zero "check passed" -- "$mpirun" -np 1 "$mt" check --sizes 1K:4K --iters 2
expect "check np=2 1-D" zero "check passed" -- "$mpirun" -np 2 "$mt" check --sizes 1K:8K --iters 2
expect "check np=4 2-D" zero "busbw_GB/s" -- "$mpirun" -np 4 "$mt" check --mesh dp_shard=2,tp=2 --sizes 4K --iters 2
expect "check np=8 3-D" zero "check passed" -- \
  "$mpirun" -np 8 "$mt" check --mesh dp_replicate=2,dp_shard=2,tp=-1 --sizes 1K --iters 1 --warmup 0
expect "check json" zero "check passed" -- "$mpirun" -np 2 "$mt" check --sizes 1K --iters 1 --json "$tmp/c.json"
if [ -f "$tmp/c.json" ] && grep -q '"op":"all_reduce"' "$tmp/c.json" && grep -q '"ok":true' "$tmp/c.json"; then
  ok "check json content"
else
  bad "check json content" "missing or wrong: $tmp/c.json"
fi

# meshtrain layout: printing on one rank, executing and dumping under mpirun, errors.
expect "layout prints shards and plan" zero "plan: S(0)R -> S(0)S(1) -> RS(1)" -- \
  "$mt" layout --mesh dp_shard=2,tp=2 --shape 7,5 --from "S(0),R" --to "R,S(1)"
expect "layout executes on 4 ranks" zero "every rank's shard is correct" -- \
  "$mpirun" -np 4 "$mt" layout --mesh dp_shard=2,tp=2 --shape 7,5 --from "S(0)[1]S(0)[0]" --to "P(sum),S(1)" --dump "$tmp/dump"
expect "layout 3-D greedy" zero "every rank's shard is correct" -- \
  "$mpirun" -np 8 "$mt" layout --mesh dp_replicate=2,dp_shard=2,tp=2 --shape 5,3,4 --from "S(0),S(2),P(sum)" --to "R,S(0),S(1)" --planner greedy
if /usr/bin/python3 - "$tmp/dump" <<'PY'
import sys, numpy as np
d = sys.argv[1]
x = np.arange(35, dtype=np.float32).reshape(7, 5)
# S(0)[1]S(0)[0]: tp splits rows first (0-3 | 4-6), then dp_shard splits each piece.
src = {0: x[0:2], 1: x[4:6], 2: x[2:4], 3: x[6:7]}
for r in range(4):
    assert np.array_equal(np.load(f"{d}/rank{r}_src.npy"), src[r]), r
    cols = x[:, 0:3] if r % 2 == 0 else x[:, 3:5]
    assert np.allclose(np.load(f"{d}/rank{r}_dst.npy"), cols / 2), r
PY
then ok "layout dump matches numpy"; else bad "layout dump matches numpy"; fi
expect "layout bad placements" nonzero "[placement] cannot parse placements 'S(0),Q'" -- \
  "$mt" layout --mesh dp_shard=2 --shape 4 --from "S(0),Q"
expect "layout partial to partial" nonzero "P(sum) -> P(max) on mesh dim 0" -- \
  "$mt" layout --mesh dp_shard=2 --shape 4 --from "P(sum)" --to "P(max)"

# No hangs: a rank that never joins the collective, and a rank that dies.
start=$(date +%s)
expect "fault: stalled rank times out with the collective named" nonzero "[comm] timeout: all_reduce on group 'dp_replicate' (world ranks 0,1,2) did not finish within 3 s" -- \
  "$mpirun" -np 3 "$build/tests/test_fault" stall 3
took=$(( $(date +%s) - start ))
if [ $took -le 30 ]; then ok "fault: stall ends within timeout + margin (${took}s)"; else bad "fault: stall took ${took}s"; fi
expect "fault: stalled group creation times out" nonzero "[comm] timeout: MPI_Comm_split on making group 'world'" -- \
  "$mpirun" -np 3 "$build/tests/test_fault" split 3
start=$(date +%s)
expect "fault: dead rank ends the job non-zero" nonzero "" -- "$mpirun" -np 3 "$build/tests/test_fault" exit 3
took=$(( $(date +%s) - start ))
if [ $took -le 30 ]; then ok "fault: dead rank ends within timeout + margin (${took}s)"; else bad "fault: exit took ${took}s"; fi

# The GPU benchmark script end to end on tiny shapes (on a machine without a GPU every part runs on the CPU).
OUT="$tmp/bench" bash "$root/scripts/bench/bench_gpu.sh" "$build" --quick >"$tmp/bench.out" 2>&1
# Summary rows: meshtrain and PyTorch eager each with a tokens/s figure, meshtrain's attention with TFLOP/s, both
# redistributions timed, memory and the kernel profile present.
if grep -qE "^1B: meshtrain vs PyTorch eager.*\| [0-9]+ tok/s +\| [0-9]+ tok/s" "$tmp/bench.out" &&
  [ "$(grep -cE "^attention T [0-9]+ hd [0-9]+ fwd\+bwd.*\| [0-9.]+ TFLOP/s" "$tmp/bench.out")" -eq 2 ] &&
  grep -qE "^all-gather S\(1\)->R, 2 rank.*\| [0-9.]+ ms" "$tmp/bench.out" &&
  grep -qE "^reduce-scatter P->S\(1\), 2 rank.*\| [0-9.]+ ms" "$tmp/bench.out" &&
  grep -qE "^peak memory vs expected +\| [0-9.]+ GiB" "$tmp/bench.out" && grep -qE "^kernel #1: " "$tmp/bench.out" &&
  [ "$(wc -l <"$tmp/bench/bench_gpu.jsonl")" -ge 5 ]; then
  ok "bench_gpu.sh --quick: every part ran and the table has figures"
else
  bad "bench_gpu.sh --quick" "$(tail -n 12 "$tmp/bench.out")"
fi

echo "cli: $passed passed, $failed failed"
[ $failed -eq 0 ]
