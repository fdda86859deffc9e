#!/usr/bin/env bash
# GPU check (issue 6, first part): build with CUDA, run the GPU test suite, then
# train the same tiny model 20 steps on the CPU and on the GPU (fp32) and
# compare the losses (DESIGN.md: within 1e-4), on 1 rank, dp = 2 and tp = 2
# (2 ranks sharing the GPU). Prints a summary table. The benchmarks of issue 6
# (1B model MFU, attention TFLOP/s, PyTorch comparison) are not written yet.
#   scripts/gpu_check.sh [BUILD_DIR]       (MPIRUN may name the launcher)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
cd "$root"
mpirun=${MPIRUN:-$root/scripts/mpirun.sh}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ ! -x "$build/tests/test_gpu" ]; then
  scripts/setup.sh "$build" || exit 1
fi
summary=()
row() { summary+=("$(printf '%-44s %s' "$1" "$2")"); }

$mpirun -np 1 "$build/tests/test_gpu" >"$tmp/gpu1.log" 2>&1
row "GPU suite, 1 rank (NCCL)" "$(grep -E '^\[test_gpu|passed' "$tmp/gpu1.log" | tail -n 1)"
$mpirun -np 2 "$build/tests/test_gpu" >"$tmp/gpu2.log" 2>&1
row "GPU suite, 2 ranks on one GPU (staged MPI)" "$(grep -E 'passed' "$tmp/gpu2.log" | tail -n 1)"

/usr/bin/python3 scripts/prepare_data --out "$tmp/data" --name docs docs/*.md >/dev/null
cat >"$tmp/t.yaml" <<YAML
model: {dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 128, vocab_size: 256, max_seq_len: 64}
training: {steps: 20, batch_size: 8, seq_len: 64, lr: 3.0e-3, warmup_steps: 3, lr_min: 3.0e-4, grad_clip: 1.0, threads: 4}
data: {train: "$tmp/data/docs_train_*.bin", val: "$tmp/data/docs_val_*.bin"}
eval: {interval: 10, steps: 2}
sample: {interval: 20, tokens: 32}
log: {interval: 1}
YAML
train() {  # train NAME NP [--set ...]
  local name=$1 np=$2
  shift 2
  $mpirun -np "$np" "$build/meshtrain" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/$name.jsonl" "$@" train \
    >"$tmp/$name.log" 2>&1 || { tail -n 5 "$tmp/$name.log"; return 1; }
}
compare() { /usr/bin/python3 tests/cli/compare_runs.py "$tmp/$1.jsonl" "$tmp/cpu.jsonl" --steps 20 2>&1 | tail -n 1; }
train cpu 1
train gpu 1 --set comm.device=cuda && row "fp32 20 steps, 1 GPU vs CPU" "$(compare gpu)"
train gpu_dp 2 --set comm.device=cuda && row "fp32 20 steps, dp=2 on one GPU vs CPU" "$(compare gpu_dp)"
train gpu_tp 2 --set comm.device=cuda --set parallel.dp_replicate=1 --set parallel.tp=2 --set parallel.loss_parallel=false &&
  row "fp32 20 steps, tp=2 on one GPU vs CPU" "$(compare gpu_tp)"
echo
echo "== gpu_check summary"
printf '%s\n' "${summary[@]}"
