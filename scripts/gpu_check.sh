#!/usr/bin/env bash
# GPU check: build with CUDA, run the GPU test suite, then train the
# same small model 20 steps on the CPU and on the GPU and compare the losses:
# fp32 within 1e-4 of the CPU on 1 rank, dp = 2 and tp = 2 (2 ranks sharing the
# GPU, staged MPI); bf16 within 2% of fp32 at step 20 (1 rank, tp = 2, dp = 2
# with gradients reduced in bf16). Then the benchmarks (scripts/bench/bench_gpu.sh).
# Prints a summary table.
#   scripts/gpu_check.sh [BUILD_DIR] [--no-bench]      (MPIRUN may name the launcher)
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
# Head dim 64: the bf16 attention kernel takes 64 and 128.
cat >"$tmp/t.yaml" <<YAML
model: {dim: 256, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 512, vocab_size: 256, max_seq_len: 64}
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
compare() { /usr/bin/python3 tests/cli/compare_runs.py "$tmp/$1.jsonl" "$tmp/$2.jsonl" --steps 20 2>&1 | tail -n 1; }
# Step-20 losses within 2% (the bf16 criterion).
within_2pct() {
  /usr/bin/python3 -c "
import json, sys
def last(p): return [json.loads(l) for l in open(p) if '\"loss\"' in l][-1]
a, b = last('$tmp/$1.jsonl'), last('$tmp/$2.jsonl'); d = abs(a['loss'] - b['loss']) / b['loss']
print(('ok' if d < 0.02 else 'FAIL'), 'step 20 loss %.5f vs %.5f, relative difference %.4f (< 0.02)' % (a['loss'], b['loss'], d))" 2>&1
}
tp2=(--set parallel.dp_replicate=1 --set parallel.tp=2)
train cpu 1
train gpu 1 --set comm.device=cuda && row "fp32 20 steps, 1 GPU vs CPU" "$(compare gpu cpu)"
train gpu_dp 2 --set comm.device=cuda && row "fp32 20 steps, dp=2 on one GPU vs CPU" "$(compare gpu_dp cpu)"
train gpu_tp 2 --set comm.device=cuda "${tp2[@]}" && row "fp32 20 steps, tp=2 (loss parallel) on one GPU vs CPU" "$(compare gpu_tp cpu)"
train bf16 1 --set comm.device=cuda --set training.dtype=bf16 && row "bf16 20 steps, 1 GPU vs fp32 GPU" "$(within_2pct bf16 gpu)"
train bf16_tp 2 --set comm.device=cuda --set training.dtype=bf16 "${tp2[@]}" &&
  row "bf16 20 steps, tp=2 on one GPU vs bf16 1 rank" "$(within_2pct bf16_tp bf16)"
train bf16_dp 2 --set comm.device=cuda --set training.dtype=bf16 --set training.grad_reduce_dtype=bf16 &&
  row "bf16, dp=2, gradients reduced in bf16 vs fp32 GPU" "$(within_2pct bf16_dp gpu)"
grep -h "gradient sync:" "$tmp/bf16_dp.log" | head -n 1
# The benchmarks (1B model vs PyTorch eager and compiled, attention vs SDPA), unless --no-bench.
if [ "${2:-}" != "--no-bench" ] && [ -f scripts/bench/bench_gpu.sh ]; then
  bash scripts/bench/bench_gpu.sh "$build" 2>&1 | tee "$tmp/bench.log"
  row "benchmarks" "see the table above (scripts/bench/bench_gpu.sh)"
fi
echo
echo "== gpu_check summary"
printf '%s\n' "${summary[@]}"
