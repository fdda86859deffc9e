#!/usr/bin/env bash
# GPU check, on a machine with an NVIDIA GPU: every check prints one row of a summary table (PASS, FAIL or
# SKIP), and the script exits 1 when any row failed (2 on bad usage), 0 otherwise.
#  - the GPU suite (tests/gpu) at 1 rank (NCCL) and 2 ranks sharing the GPU (staged MPI): NCCL, the pack
#    kernels, the flash kernel and ring attention on the device;
#  - the op table (tests/test_ops): every kernel on cuda f32 and bf16 against the CPU, value and gradient, on
#    fresh random inputs with NaN-poisoned outputs; no case may be skipped on a GPU;
#  - 20 fp32 steps of a small model on the GPU against the same on the CPU, within 1e-4: 1 rank and the 2-rank
#    meshes dp = 2, tp = 2, dp_shard = 2, cp = 2 (ring) and pp = 2 (2 ranks sharing the GPU); bf16 against fp32 within 2% at step 20 (1 rank, tp = 2, and dp = 2
#    with gradients reduced in bf16);
#  - one host synchronisation per training step on the GPU, 1 rank (log.level: debug counts them);
#  - attention through cuDNN (attention.kernel: cudnn) against the flash kernel: op level, bf16 training on 1 rank,
#    cp = 2 and with packed documents (SKIP where no cuDNN loads);
#  - Hugging Face interoperability (tests/reference/test_hf_interop.py, run on the GPU), where present;
#  - with --bench, then the benchmarks (scripts/bench/bench_gpu.sh).
# --quick (scripts/gpu_run.sh's part 1): the list above less the emulated device's list and the Hugging Face
# check, each run limited to 90 s instead of 300.
# Logs: $OUT (or runs/gpu_check) holds gpu_check.log (this output), gpu_check_logs.tar.gz (every run's log)
# and the summary table.
#   scripts/gpu_check.sh [BUILD_DIR] [--bench] [--quick]        ($MPIRUN may name the launcher; default scripts/mpirun.sh)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build
bench=0
quick=0
while [ $# -gt 0 ]; do
  case $1 in
    --bench) bench=1 ;;
    --no-bench) bench=0 ;;
    --quick) quick=1 ;;
    -h | --help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1 (options: --bench, --quick)" >&2; exit 2 ;;
    *) build=$(cd "$1" 2>/dev/null && pwd) || { echo "gpu_check.sh: no build directory $1" >&2; exit 2; } ;;
  esac
  shift
done
cd "$root"
mpirun=${MPIRUN:-$root/scripts/mpirun.sh}
lim=300  # each run's limit (s)
[ $quick = 1 ] && lim=90
out=${OUT:-$root/runs/gpu_check}
mkdir -p "$out"
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
exec > >(tee "$out/gpu_check.log") 2>&1
# Python with torch (the GPU machine's python3; Debian's /usr/bin/python3 elsewhere) for the scripts that need it.
py=python3
for c in python3 /usr/bin/python3; do
  if "$c" -c "import torch" 2>/dev/null; then py=$c; break; fi
done

rows=()
failures=0
row() {  # row PASS|FAIL|SKIP NAME DETAIL
  rows+=("$(printf '%-4s  %-52s %s' "$1" "$2" "$3")")
  [ "$1" = FAIL ] && failures=$((failures + 1))
  printf '%-4s  %-52s %s\n' "$1" "$2" "$3"
}
finish() {
  (cd "$logs" && tar czf "$out/gpu_check_logs.tar.gz" .) 2>/dev/null
  {
    echo
    echo "== gpu_check summary ($(date -u '+%Y-%m-%d %H:%M UTC'), build $build)"
    printf '%s\n' "${rows[@]}"
    echo "$failures failed"
  } | tee "$out/gpu_check_summary.txt"
  [ "$failures" -eq 0 ] && exit 0 || exit 1
}

echo "== $(date -u '+%Y-%m-%d %H:%M UTC'): scripts/gpu_check.sh $build"
if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null; then
  row FAIL "a GPU is present (nvidia-smi)" "nvidia-smi lists no GPU"
  finish
fi
for bin in meshtrain tests/test_gpu tests/test_ops; do
  [ -x "$build/$bin" ] || { row FAIL "built: $bin" "missing in $build (meson setup with CUDA, then ninja)"; }
done
[ "$failures" -eq 0 ] || finish

# A suite's own last line "[NAME] N passed, N failed, N skipped" (or doctest's), judged: no failure, a clean
# exit and at most MAX_SKIPPED skipped.
suite() {  # suite NAME MAX_SKIPPED LOG EXIT_CODE
  local name=$1 max_skipped=$2 log=$3 code=$4 line p f s
  line=$(grep -aE '[0-9]+ passed, [0-9]+ failed' "$log" | tail -n 1)
  if [[ "$line" =~ ([0-9]+)\ passed,\ ([0-9]+)\ failed(,\ ([0-9]+)\ skipped)? ]]; then
    p=${BASH_REMATCH[1]} f=${BASH_REMATCH[2]} s=${BASH_REMATCH[4]:-0}
    if [ "$f" -gt 0 ] || [ "$code" -ne 0 ] || [ "$p" -eq 0 ]; then
      row FAIL "$name" "$p passed, $f failed, $s skipped (exit $code)"
      grep -aE '^(FAIL|  )|ERROR|FAILED|error' "$log" | head -n 40
    elif [ "$s" -gt "$max_skipped" ]; then
      row FAIL "$name" "$p passed, $s skipped (no more than $max_skipped may skip on a GPU)"
      grep -a "skipped" "$log" | head -n 20
    else
      row PASS "$name" "$p passed, $f failed, $s skipped"
    fi
  else
    row FAIL "$name" "no summary line (crashed or hung, exit $code)"
    tail -n 30 "$log"
  fi
}

# 1. The GPU suite and the op table.
MT_SUITE_NAME=test_gpu timeout $lim $mpirun -np 1 "$build/tests/test_gpu" >"$logs/test_gpu_np1.log" 2>&1
suite "GPU suite, 1 rank (NCCL)" 0 "$logs/test_gpu_np1.log" $?
MT_SUITE_NAME=test_gpu timeout $lim $mpirun -np 2 "$build/tests/test_gpu" >"$logs/test_gpu_np2.log" 2>&1
suite "GPU suite, 2 ranks on one GPU (staged MPI)" 1000 "$logs/test_gpu_np2.log" $?
MT_SUITE_NAME=ops timeout $lim "$build/tests/test_ops" >"$logs/test_ops.log" 2>&1
suite "op table, cuda f32 and bf16 against the CPU" 0 "$logs/test_ops.log" $?

# 2. Training: the GPU against the CPU.
"$py" scripts/prepare_data --out "$logs/data" --name docs docs/*.md >/dev/null
# Head dim 64: the bf16 attention kernel takes 64 and 128.
cat >"$logs/t.yaml" <<YAML
model: {dim: 256, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 512, vocab_size: 256, max_seq_len: 64}
training: {steps: 20, batch_size: 8, seq_len: 64, lr: 3.0e-3, warmup_steps: 3, lr_min: 3.0e-4, grad_clip: 1.0, threads: 4}
data: {train: "$logs/data/docs_train_*.bin", val: "$logs/data/docs_val_*.bin"}
eval: {interval: 10, steps: 2}
sample: {interval: 20, tokens: 32}
checkpoint: {dir: ""}
log: {interval: 1}
YAML
train() {  # train NAME NP [--set ...]: 0 when the run succeeded
  local name=$1 np=$2
  shift 2
  timeout $lim $mpirun -np "$np" "$build/meshtrain" --config "$logs/t.yaml" --set log.metrics_file="$logs/$name.jsonl" \
    "$@" train >"$logs/$name.log" 2>&1 && return 0
  echo "-- $name failed:"
  grep -a -m 5 -E "error|\[cuda\]" "$logs/$name.log" || tail -n 10 "$logs/$name.log"
  return 1
}
first_error() { grep -a -m 1 -E "error|\[cuda\]" "$logs/$1.log" | sed 's/^.*\] //' | cut -c1-100; }
# The losses of two runs within 1e-4 (relative at step 1, absolute on every step).
within_1e4() {  # within_1e4 NAME BASE TITLE
  local verdict
  if verdict=$("$py" tests/cli/compare_runs.py "$logs/$1.jsonl" "$logs/$2.jsonl" --steps 20 --rel0 1e-4 --abs 1e-4 \
    2>&1); then
    row PASS "$3" "$(tail -n 1 <<<"$verdict")"
  else
    row FAIL "$3" "$(tail -n 1 <<<"$verdict")"
  fi
}
# Step-20 losses within 2% (the bf16 criterion).
within_2pct() {  # within_2pct NAME BASE TITLE
  local verdict
  if verdict=$("$py" - "$logs/$1.jsonl" "$logs/$2.jsonl" 2>&1 <<'PY'
import json, sys
def last(p): return [json.loads(l) for l in open(p) if '"loss"' in l][-1]
a, b = last(sys.argv[1]), last(sys.argv[2])
d = abs(a["loss"] - b["loss"]) / b["loss"]
print("step %d loss %.5f vs %.5f, relative difference %.4f (< 0.02)" % (a["step"], a["loss"], b["loss"], d))
sys.exit(0 if a["step"] == b["step"] == 20 and d < 0.02 else 1)
PY
  ); then
    row PASS "$3" "$verdict"
  else
    row FAIL "$3" "$(tail -n 1 <<<"$verdict")"
  fi
}
gpu=(--set comm.device=cuda)
tp2=(--set parallel.dp_replicate=1 --set parallel.tp=2)
bf16=(--set training.dtype=bf16)
if train cpu 1; then
  train gpu 1 "${gpu[@]}" && within_1e4 gpu cpu "fp32 20 steps, 1 GPU vs CPU" ||
    row FAIL "fp32 20 steps, 1 GPU vs CPU" "$(first_error gpu)"
  train gpu_dp 2 "${gpu[@]}" && within_1e4 gpu_dp cpu "fp32 20 steps, dp=2 on one GPU vs CPU" ||
    row FAIL "fp32 20 steps, dp=2 on one GPU vs CPU" "$(first_error gpu_dp)"
  train gpu_tp 2 "${gpu[@]}" "${tp2[@]}" && within_1e4 gpu_tp cpu "fp32 20 steps, tp=2 on one GPU vs CPU" ||
    row FAIL "fp32 20 steps, tp=2 on one GPU vs CPU" "$(first_error gpu_tp)"
  # The other 2-rank meshes: fully sharded, context parallel (ring), pipeline (1f1b over 4 micro-batches).
  for m in "dp_shard=2:--set parallel.dp_replicate=1 --set parallel.dp_shard=2" \
           "cp=2 (ring):--set parallel.dp_replicate=1 --set parallel.cp=2" \
           "pp=2 (1f1b):--set parallel.dp_replicate=1 --set parallel.pp=2 --set training.micro_batch_size=2"; do
    name=${m%%:*} tag=gpu_$(echo "${m%%:*}" | tr -dc 'a-z0-9')
    read -r -a extra <<<"${m#*:}"
    train "$tag" 2 "${gpu[@]}" "${extra[@]}" && within_1e4 "$tag" cpu "fp32 20 steps, $name on one GPU vs CPU" ||
      row FAIL "fp32 20 steps, $name on one GPU vs CPU" "$(first_error "$tag")"
  done
else
  row FAIL "fp32 20 steps on the CPU (the baseline)" "$(first_error cpu)"
fi
if [ -f "$logs/gpu.jsonl" ] && train bf16 1 "${gpu[@]}" "${bf16[@]}"; then
  within_2pct bf16 gpu "bf16 20 steps, 1 GPU vs fp32 GPU"
  train bf16_tp 2 "${gpu[@]}" "${bf16[@]}" "${tp2[@]}" && within_2pct bf16_tp gpu "bf16 20 steps, tp=2 on one GPU vs fp32" ||
    row FAIL "bf16 20 steps, tp=2 on one GPU vs fp32" "$(first_error bf16_tp)"
  train bf16_dp 2 "${gpu[@]}" "${bf16[@]}" --set training.grad_reduce_dtype=bf16 &&
    within_2pct bf16_dp gpu "bf16, dp=2, gradients reduced in bf16, vs fp32" ||
    row FAIL "bf16, dp=2, gradients reduced in bf16, vs fp32" "$(first_error bf16_dp)"
else
  row FAIL "bf16 20 steps, 1 GPU vs fp32 GPU" "$( [ -f "$logs/bf16.log" ] && first_error bf16 || echo "no fp32 GPU run to compare with")"
fi

# 2a. Attention through cuDNN against the flash kernel (issue 50; docs/design/cudnn-attention.md): the op-level
# comparison (values, log-sum-exp and gradients; causal, GQA, ring offsets, dk/dv accumulated; the fallbacks), bf16
# training with attention.kernel cudnn against flash on 1 rank, cp=2 (the ring's blocks and merge) and packed
# documents (1 rank: the document starts as a per-query bound in cuDNN's mask). All SKIP where no cuDNN loads.
MT_SUITE_NAME=test_gpu timeout $lim $mpirun -np 1 "$build/tests/test_gpu" -tc='cudnn*' >"$logs/test_gpu_cudnn.log" 2>&1
code=$?
if grep -aq "cuDNN not loadable" "$logs/test_gpu_cudnn.log"; then
  row SKIP "cuDNN attention vs the flash kernel" "$(grep -a -m 1 -o 'cuDNN not loadable.*' "$logs/test_gpu_cudnn.log" | cut -c1-80)"
else
  suite "cuDNN attention vs the flash kernel (op level)" 0 "$logs/test_gpu_cudnn.log" $code
  cudnn_vs_flash() {  # cudnn_vs_flash TAG NP TITLE [--set ...]
    local tag=$1 np=$2 title=$3
    shift 3
    if train "${tag}_flash" "$np" "${gpu[@]}" "${bf16[@]}" --set attention.kernel=flash "$@" &&
      train "${tag}_cudnn" "$np" "${gpu[@]}" "${bf16[@]}" --set attention.kernel=cudnn "$@"; then
      within_2pct "${tag}_cudnn" "${tag}_flash" "$title"
    else
      row FAIL "$title" "$(first_error "${tag}_cudnn")"
    fi
  }
  cudnn_vs_flash cudnn1 1 "bf16 20 steps, attention.kernel cudnn vs flash"
  cudnn_vs_flash cudnn_cp 2 "bf16, cp=2 ring, attention.kernel cudnn vs flash" \
    --set parallel.dp_replicate=1 --set parallel.cp=2
  cudnn_vs_flash cudnn_docs 1 "bf16, packed documents, attention.kernel cudnn vs flash" \
    --set data.document_separator=10
fi

# 2b. The emulated device's list (tests/cli/test_emulated.sh) on this GPU: the same cases CI runs on the emulated
# CUDA device and those it runs with --full only, here with this build's meshtrain for both the CPU and the GPU
# runs.
if [ $quick = 1 ]; then
  row SKIP "the emulated device's list on the GPU (tests/cli/test_emulated.sh)" "--quick"
else
  MT_TEST_FULL=1 bash tests/cli/test_emulated.sh "$build" "$build" >"$logs/emulated_list.log" 2>&1
  suite "the emulated device's list on the GPU (tests/cli/test_emulated.sh)" 1000 "$logs/emulated_list.log" $?
fi

# 3. Host synchronisations: one per step on the GPU (the loss and grad norm read once). One rank: ranks sharing
# a GPU go through the staged MPI path, whose copies back to the device count as syncs by design
# (tests/cli/test_host_sync.sh checks the multi-rank layouts on the CPU backend, which counts the same points).
if train sync 1 "${gpu[@]}" "${bf16[@]}" --set training.steps=5 --set log.level=debug; then
  counts=$(grep -a "host syncs this step:" "$logs/sync.log" | sed 's/.*host syncs this step: //' | sort -u | tr '\n' ' ')
  lines=$(grep -a -c "host syncs this step:" "$logs/sync.log")
  if [ "$counts" = "1 " ] && [ "$lines" -eq 5 ]; then
    row PASS "host syncs per bf16 step on the GPU, 1 rank" "1 on each of $lines steps"
  else
    row FAIL "host syncs per bf16 step on the GPU, 1 rank" "counts seen: ${counts:-none} over $lines steps (want 1 on each of 5)"
  fi
else
  row FAIL "host syncs per bf16 step on the GPU, 1 rank" "$(first_error sync)"
fi

# 4. Hugging Face interoperability on the GPU: a meshtrain checkpoint loads in transformers with the same logits,
# and a transformers model trains in meshtrain.
if [ $quick = 1 ]; then
  row SKIP "Hugging Face interoperability (transformers)" "--quick"
elif [ -f tests/reference/test_hf_interop.py ]; then
  "$py" tests/reference/test_hf_interop.py --meshtrain "$build/meshtrain" --mpirun "$mpirun" --device cuda \
    >"$logs/hf_interop.log" 2>&1
  suite "Hugging Face interoperability (transformers)" 0 "$logs/hf_interop.log" $?
else
  row FAIL "Hugging Face interoperability (transformers)" "tests/reference/test_hf_interop.py is missing"
fi

# 5. The benchmarks, with --bench.
if [ $bench = 1 ]; then
  if bash scripts/bench/bench_gpu.sh "$build" >"$logs/bench.log" 2>&1; then
    row PASS "benchmarks (scripts/bench/bench_gpu.sh)" "tables in gpu_check.log"
  else
    row FAIL "benchmarks (scripts/bench/bench_gpu.sh)" "exit $?; see gpu_check.log"
  fi
  cat "$logs/bench.log"
fi
finish
