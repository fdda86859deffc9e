#!/usr/bin/env bash
# Sets up, builds and runs every test suite; ends with "N passed, N failed".
#   scripts/test.sh [--full] [--no-setup]
#     --full      longer variants (MT_TEST_FULL=1: larger sizes in the suites that have them)
#     --no-setup  reuse build/ as it is
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build="$root/build"
setup=1
for a in "$@"; do
  case "$a" in
    --full) export MT_TEST_FULL=1 ;;
    --no-setup) setup=0 ;;
    *) echo "usage: scripts/test.sh [--full] [--no-setup]" >&2; exit 2 ;;
  esac
done
if [ $setup -eq 1 ]; then
  scripts/setup.sh "$build" || { echo "setup failed"; echo "0 passed, 1 failed"; exit 1; }
fi

passed=0
failed=0
add() {  # add PASSED FAILED SUITE
  passed=$((passed + $1))
  failed=$((failed + $2))
  printf '%-28s %4d passed, %d failed\n' "$3" "$1" "$2"
}
log_dir="$build/test-logs"
mkdir -p "$log_dir"

# Single-process doctest suites, counted from doctest's own summary line.
run_doctest_suite() {  # run_doctest_suite BINARY NAME TIMEOUT_S
  local out="$log_dir/$2.log"
  timeout "$3" "$1" >"$out" 2>&1
  local line
  line=$(grep -E '^\[doctest\] test cases:' "$out" | tail -n 1)
  if [ -n "$line" ]; then
    local p f
    p=$(echo "$line" | sed -E 's/.*\| *([0-9]+) passed.*/\1/')
    f=$(echo "$line" | sed -E 's/.*\| *([0-9]+) failed.*/\1/')
    add "$p" "$f" "$2"
    [ "$f" -gt 0 ] && cat "$out"
  else
    tail -n 40 "$out"
    add 0 1 "$2 (crashed)"
  fi
}
run_doctest_suite "$build/tests/test_unit" unit 600
# The flash attention kernels run by the warp emulator on the CPU (built where the CUDA headers are; fast
# selection of shapes, all of them with --full).
if [ -x "$build/tests/test_flash_emulated" ]; then
  run_doctest_suite "$build/tests/test_flash_emulated" flash-emulated 900
else
  echo "flash-emulated: not built (no CUDA headers)"
fi

# Multi-rank suite on 1, 2, 4, 6 (2x3 meshes) and 8 ranks.
run_mpi_suite() {  # run_mpi_suite BINARY NAME NP
  local out="$log_dir/$2-np$3.log"
  MT_SUITE_NAME=$2 timeout 900 scripts/mpirun.sh -np "$3" "$1" >"$out" 2>&1
  local line
  line=$(grep -E "^\[$2 np=$3\] [0-9]+ passed, [0-9]+ failed" "$out" | tail -n 1)
  if [ -n "$line" ]; then
    local p f
    p=$(echo "$line" | sed -E 's/.*\] ([0-9]+) passed.*/\1/')
    f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
    add "$p" "$f" "$2 np=$3"
    [ "$f" -gt 0 ] && tail -n 60 "$out"
  else
    tail -n 40 "$out"
    add 0 1 "$2 np=$3 (crashed or hung)"
  fi
}
for np in 1 2 4 6 8; do run_mpi_suite "$build/tests/test_mpi" test_mpi $np; done

# The command line end to end: config errors, the self-check, fault tests.
out="$log_dir/cli.log"
bash tests/cli/test_cli.sh "$build" >"$out" 2>&1
line=$(grep -E '^cli: [0-9]+ passed, [0-9]+ failed' "$out" | tail -n 1)
if [ -n "$line" ]; then
  p=$(echo "$line" | sed -E 's/cli: ([0-9]+) passed.*/\1/')
  f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
  add "$p" "$f" "cli"
  [ "$f" -gt 0 ] && grep -E '^(FAIL|  )' "$out"
else
  tail -n 40 "$out"
  add 0 1 "cli (crashed)"
fi

# End-to-end scripts, each ending with "NAME: N passed, N failed".
run_script_suite() {  # run_script_suite NAME SCRIPT [ARGS...]
  local name=$1 script=$2
  shift 2
  local out="$log_dir/$name.log"
  bash "$script" "$build" "$@" >"$out" 2>&1
  local line
  line=$(grep -E "^$name: [0-9]+ passed, [0-9]+ failed" "$out" | tail -n 1)
  if [ -n "$line" ]; then
    local p f
    p=$(echo "$line" | sed -E "s/$name: ([0-9]+) passed.*/\\1/")
    f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
    add "$p" "$f" "$name"
    [ "$f" -gt 0 ] && grep -E '^(FAIL|  )' "$out"
  else
    tail -n 40 "$out"
    add 0 1 "$name (crashed)"
  fi
}
# Training: invariance over dp, the PyTorch reference, resume, checkpoint faults, bad input.
run_script_suite train tests/cli/test_train.sh
# Tensor and sequence parallel: invariance over tp and dp x tp, plans, `meshtrain plan`.
run_script_suite tp tests/cli/test_tp.sh ${MT_TEST_FULL:+--full}
# Context parallel: invariance over cp, dp x cp, cp x tp, both methods, packed documents, `meshtrain plan`.
run_script_suite cp tests/cli/test_cp.sh ${MT_TEST_FULL:+--full}
# Activation recompute: full, selective, every N-th and MLP-only give the same losses bit for bit (1 rank, tp, cp).
run_script_suite recompute tests/cli/test_recompute.sh
# Fully sharded data parallel: invariance over dp_shard, HSDP, with tp and cp, layouts, memory, bytes, checkpoints.
run_script_suite fsdp tests/cli/test_fsdp.sh ${MT_TEST_FULL:+--full}

# The PyTorch reference model's own checks (RoPE, GQA, gradients, safetensors).
out="$log_dir/reference.log"
/usr/bin/python3 tests/reference/test_reference.py >"$out" 2>&1
line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$out" | tail -n 1)
if [ -n "$line" ]; then
  add "$(echo "$line" | sed -E 's/([0-9]+) passed.*/\1/')" "$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')" "reference"
else
  tail -n 20 "$out"
  add 0 1 "reference (crashed)"
fi

# GPU suite, whenever a GPU is present.
if [ -x "$build/tests/test_gpu" ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  run_mpi_suite "$build/tests/test_gpu" test_gpu 1
  run_mpi_suite "$build/tests/test_gpu" test_gpu 2
else
  echo "gpu suite: skipped (no GPU here)"
fi

echo "logs: $log_dir"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
