#!/usr/bin/env bash
# The GPU benchmarks in one run (167 s on an H200 with --steps 12, 2026-11-28), parts in order,
# a summary table at the end:
#  1. the ~1B Llama (dim 2048, 16 layers, 16 heads, 8 kv heads, ffn 5632, vocab 32000, seq 2048, bf16, batch 16 on
#     a GPU of >= 120 GiB, else 8): meshtrain's median tokens/s after 5 steps and MFU (989 TFLOP/s, 6N + 12LdT
#     FLOPs per token), beside PyTorch eager (SDPA) and torch.compile on the same model, batch and sequence
#     (scripts/bench/torch_llama_bench.py); the ratio meshtrain / torch.compile (target >= 1.1);
#  2. attention alone, causal, fwd+bwd TFLOP/s counting the causal half, at (T 8192, hd 128: B 2, H 16) and
#     (T 2048, hd 64: B 8, H 32), 16k tokens of dim 2048 each (FlashAttention-2's benchmark shapes): meshtrain's
#     flash kernel (bench_attention_gpu, CUDA events) beside SDPA's flash and cuDNN backends (attention_torch.py
#     --backend); the ratio meshtrain / SDPA flash (target >= 1);
#  3. redistribution of the 1B model's tp activation (B x 2048 x 2048 bf16): all-gather S(1)->R and reduce-scatter
#     P->S(1) through `redistribute` on device buffers (1 rank, NCCL: the device-side work of tp = 2), its parts
#     alone, a host-staged baseline, and 2 ranks sharing the GPU through the staged MPI backend; time, bytes, GB/s,
#     share of part 1's step (bench_redistribute --shape);
#  4. peak device memory beside the expected bytes (bench_gpu_report.py: how it is computed), and the top 10 ops
#     by time with MT_PROFILE_KERNELS=1 (CUDA events per op; what bounds each, estimated) over 4 more steps of
#     part 1's run (MT_PROFILE_STEPS=4: the steps before run unprofiled and give part 1's figures).
# A part that fails prints its error row and the script goes on. Raw JSON lines: $OUT/bench_gpu.jsonl (or
# runs/bench_gpu/bench_gpu.jsonl), the runs' logs beside it.
#   scripts/bench/bench_gpu.sh [BUILD_DIR] [--batch-size N] [--steps 20] [--limit 300] [--step-only] [--torch MODES] [--quick]
# --step-only: parts 1 and 4 only (the step, its memory and profile); --torch MODES: PyTorch's modes in part 1
# (default "eager compile"; "" for none), e.g. to time another build's step beside this one's in one call.
# --mt-set KEY=VALUE (repeatable): meshtrain's step with this setting (training.cuda_graph=true, training.fp8=...,
# attention.kernel=...); --no-profile: no profiled steps after the timed ones (MT_PROFILE_KERNELS times every op
# with events the host reads, which CUDA graphs cannot hold).
# --limit S: each run's time limit in seconds (meshtrain's, each PyTorch mode's; attention and redistribution runs
# get the smaller of S and 120).
# --quick: a tiny model, short sequences and small tensors, end to end in a minute or two; on a machine without a
# GPU meshtrain trains on the CPU, PyTorch runs on the CPU, and what needs CUDA reports its error row.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$root/build
batch=
steps=20
quick=0
limit=300
step_only=0
torch_modes="eager compile"
mt_set=()     # --mt-set KEY=VALUE (repeatable): meshtrain's step with these settings (issue 50's options)
profile=1     # --no-profile: no kernel profile after the timed steps (a profiled run cannot use CUDA graphs)
command_line="$0 $*"
while [ $# -gt 0 ]; do
  case $1 in
    --batch-size) batch=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --limit) limit=$2; shift 2 ;;
    --step-only) step_only=1; shift ;;
    --torch) torch_modes=$2; shift 2 ;;
    --mt-set) mt_set+=(--set "$2"); shift 2 ;;
    --no-profile) profile=0; shift ;;
    -*) echo "bench_gpu.sh: unknown option $1" >&2; exit 2 ;;
    *) build=$1; shift ;;
  esac
done
build=$(cd "$build" 2>/dev/null && pwd || echo "$build")
small_limit=$((limit < 120 ? limit : 120))
py=python3  # the one that has torch (Debian's on the CI VM, the GPU machine's own there)
for c in python3 /usr/bin/python3; do
  if "$c" -c "import torch" 2>/dev/null; then py=$c; break; fi
done
report="$py $root/scripts/bench/bench_gpu_report.py"
mpirun=$root/scripts/mpirun.sh  # uses $MPIRUN when set
device=cuda
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || device=cpu
out_dir=${OUT:-$root/runs/bench_gpu}
mkdir -p "$out_dir"
results=$out_dir/bench_gpu.jsonl
logs=$out_dir/bench_gpu_logs
mkdir -p "$logs"
: >"$results"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
t_start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - t_start )) s"; }
err() { $report error "$@" >>"$results"; tail -n 1 "$results"; }
last_error() {  # the first error-looking line of a log, else its last line
  local l
  l=$(grep -a -m1 -E "error|Error|\[cuda\]|\[nccl\]|out of memory|Traceback" "$1" 2>/dev/null)
  [ -n "$l" ] || l=$(tail -n 1 "$1" 2>/dev/null)
  echo "${l:-no output}" | cut -c1-300
}

echo "== bench_gpu.sh, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "command: $command_line"
echo "host: $(hostname), commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')$(
  git -C "$root" diff --quiet 2>/dev/null || echo ' (with local changes)'), build $build"
if [ $device = cuda ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | sed 's/^/gpu: /'
  gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1 | tr -dc 0-9)
else
  echo "gpu: none (nvidia-smi finds no GPU): meshtrain and PyTorch run on the CPU, CUDA parts report errors"
  gpu_mib=0
fi
"$py" - 2>&1 <<'PY' | tail -n 1
import sys
try:
    import torch
except Exception as e:
    print(f"python {sys.version.split()[0]}: no torch ({e})"); sys.exit(0)
try:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
except Exception as e:  # seen on the H200 image: the one-line form of this failed there, cause not kept
    cudnn = f"unknown ({e})"
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuDNN", cudnn)
PY
cuda_build=0
[ -x "$build/scripts/bench/bench_attention_gpu" ] && cuda_build=1
echo "meshtrain build: $([ $cuda_build = 1 ] && echo CUDA || echo 'CPU only (no bench_attention_gpu)')"

if [ $quick = 1 ]; then
  model=(64 2 4 2 128 256) seq=64 batch=${batch:-2} steps=6 skip=2 prof_steps=3
  att_shapes=("1 4 256 128" "2 4 128 64")  # head dims the flash kernel takes
  red_shape=2x64x64 iters=5
  torch_steps=3 torch_warmup=1
else
  model=(2048 16 16 8 5632 32000) seq=2048 skip=5 prof_steps=4
  [ -z "$batch" ] && { [ "${gpu_mib:-0}" -ge 120000 ] && batch=16 || batch=8; }
  att_shapes=("2 16 8192 128" "8 32 2048 64") iters=20
  torch_steps=6 torch_warmup=2
fi
[ $profile = 0 ] && prof_steps=0
read -r dim layers heads kv ffn vocab <<<"${model[*]}"
dtype=bf16
[ $device = cpu ] && dtype=fp32
mt_device=$device
[ $cuda_build = 0 ] && mt_device=cpu && dtype=fp32

# ---- 1. The 1B model: meshtrain, then PyTorch eager and torch.compile on the same batch ----
echo
echo "== 1. Llama dim $dim, $layers layers, $heads heads ($kv kv), ffn $ffn, vocab $vocab, seq $seq, $dtype, batch $batch on $mt_device ($(elapsed))"
# Random tokens in an llm.c shard (the data does not change the speed).
make_data() {
  "$py" - "$tmp/rand_train_000.bin" "$vocab" "$1" <<'PY'
import array, random, struct, sys
path, vocab, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(0)
with open(path, "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
    array.array("H", (rng.randrange(vocab) for _ in range(n))).tofile(f)
PY
}
write_config() {  # write_config FILE BATCH STEPS METRICS
  cat >"$1" <<YAML
model: {dim: $dim, n_layers: $layers, n_heads: $heads, n_kv_heads: $kv, ffn_dim: $ffn, vocab_size: $vocab, max_seq_len: $seq}
training: {steps: $3, batch_size: $2, seq_len: $seq, dtype: $([ $dtype = fp32 ] && echo fp32 || echo bf16), warmup_steps: 5, lr: 3.0e-4, lr_min: 3.0e-5}
data: {train: "$tmp/rand_train_*.bin", val: ""}
eval: {interval: 0}
sample: {interval: 0}
checkpoint: {dir: ""}
comm: {device: $mt_device}
log: {interval: 1, metrics_file: "$4"}
YAML
}
make_data $(( (steps + prof_steps + 2) * batch * seq + 1 ))
mt_ok=0
run_meshtrain() {  # run_meshtrain BATCH: the timed steps, then the profiled ones; nvidia-smi samples the memory
  local b=$1
  write_config "$tmp/bench.yaml" "$b" $((steps + prof_steps)) "$tmp/mt.jsonl"
  rm -f "$tmp/mt.jsonl"
  local smi_pid=
  if [ $device = cuda ]; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$tmp/smi.txt" 2>/dev/null &
    smi_pid=$!
  fi
  local prof=(env MT_PROFILE_KERNELS=1 MT_PROFILE_STEPS=$prof_steps)
  [ $profile = 0 ] && prof=(env)
  "${prof[@]}" timeout "$limit" "$mpirun" -np 1 "$build/meshtrain" \
    --config "$tmp/bench.yaml" "${mt_set[@]}" train >"$logs/meshtrain.log" 2>&1
  local rc=$?
  [ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null && wait "$smi_pid" 2>/dev/null
  return $rc
}
if run_meshtrain "$batch"; then
  mt_ok=1
elif grep -q "out of memory" "$logs/meshtrain.log" && [ "$batch" -gt 1 ]; then
  echo "meshtrain: out of memory at batch $batch; again at batch $((batch / 2))"
  batch=$((batch / 2))
  run_meshtrain "$batch" && mt_ok=1
fi
if [ $mt_ok = 1 ]; then
  $report meshtrain "$tmp/mt.jsonl" "$logs/meshtrain.log" --batch "$batch" --seq "$seq" \
    --model "$dim,$layers,$heads,$kv,$ffn,$vocab" --skip $skip --until "$steps" --smi "$tmp/smi.txt" $([ $mt_device = cpu ] && echo --cpu) \
    >>"$results" 2>"$tmp/rep.err" || err part=1b impl=meshtrain "report: $(tail -n 1 "$tmp/rep.err")"
  grep -h '"impl": "meshtrain"' "$results" | tail -n 1
  grep -h "model state on rank 0\|device memory on rank 0" "$logs/meshtrain.log" | sed 's/.*\] //'
else
  err part=1b impl=meshtrain "$(last_error "$logs/meshtrain.log")"
  err part=memory "no meshtrain run"
fi
step_ms=$(grep -h '"impl": "meshtrain"' "$results" | "$py" -c "import json,sys
r=[json.loads(l) for l in sys.stdin]; print(r[-1].get('step_ms', 0) if r else 0)" 2>/dev/null || echo 0)

for mode in $torch_modes; do
  targs=(--device "$device" --dim "$dim" --n-layers "$layers" --n-heads "$heads" --n-kv-heads "$kv" --ffn-dim "$ffn"
    --vocab-size "$vocab" --seq-len "$seq" --batch-size "$batch" --steps $torch_steps --warmup $torch_warmup
    --mode $mode --dtype $([ $device = cpu ] && echo fp32 || echo bf16))
  timeout "$limit" "$py" "$root/scripts/bench/torch_llama_bench.py" "${targs[@]}" >"$tmp/torch.out" 2>"$logs/torch_$mode.err"
  rc=$?
  if grep -q '"error": "oom"' "$tmp/torch.out" && [ "$batch" -gt 1 ]; then  # the same batch in two micro-batches
    echo "torch $mode: out of memory at batch $batch; again with micro-batches of $((batch / 2))"
    timeout "$limit" "$py" "$root/scripts/bench/torch_llama_bench.py" "${targs[@]}" --micro-batch-size $((batch / 2)) \
      >"$tmp/torch.out" 2>"$logs/torch_$mode.err"
    rc=$?
  fi
  if grep -q '^{' "$tmp/torch.out"; then
    $report tag 1b <"$tmp/torch.out" | tee -a "$results"
  else
    err part=1b impl=torch_$mode "$([ $rc = 124 ] && echo "timeout after $limit s" || tail -n 1 "$logs/torch_$mode.err")"
  fi
done

if [ $step_only = 0 ]; then
# ---- 2. Attention alone: meshtrain's kernel beside SDPA's flash and cuDNN backends ----
echo
echo "== 2. attention alone, causal, fwd+bwd, $([ $device = cuda ] && echo bf16 || echo fp32) ($(elapsed))"
for shape in "${att_shapes[@]}"; do
  read -r aB aH aT ahd <<<"$shape"
  if [ $cuda_build = 1 ] && [ $device = cuda ]; then
    timeout $small_limit "$build/scripts/bench/bench_attention_gpu" --B "$aB" --H "$aH" --KV "$aH" --T "$aT" --hd "$ahd" \
      --iters $iters >"$tmp/att.out" 2>"$tmp/att.err"
  else  # the CPU build: local attention on the CPU, as training calls it
    timeout $small_limit "$build/scripts/bench/bench_attention" --device cpu --dtype f32 --B "$aB" --H "$aH" --KV "$aH" \
      --T "$aT" --hd "$ahd" --iters 2 >"$tmp/att.out" 2>"$tmp/att.err"
  fi
  if grep -q '"fwdbwd_tflops"' "$tmp/att.out"; then
    $report tag attention <"$tmp/att.out" | tee -a "$results"
  else
    err part=attention kernel=meshtrain T=$aT hd=$ahd "$(cat "$tmp/att.out" "$tmp/att.err" | tail -n 1)"
  fi
  if [ $cuda_build = 1 ] && [ $device = cuda ]; then  # the same through cuDNN (attention.kernel: cudnn)
    timeout $small_limit "$build/scripts/bench/bench_attention_gpu" --kernel cudnn --B "$aB" --H "$aH" --KV "$aH" \
      --T "$aT" --hd "$ahd" --iters $iters >"$tmp/att.out" 2>"$tmp/att.err"
    if grep -q '"fwdbwd_tflops"' "$tmp/att.out"; then
      $report tag attention <"$tmp/att.out" | tee -a "$results"
    else
      err part=attention kernel=meshtrain_cudnn T=$aT hd=$ahd "$(cat "$tmp/att.out" "$tmp/att.err" | tail -n 1)"
    fi
  fi
  for backend in flash cudnn; do
    timeout $small_limit "$py" "$root/scripts/bench/attention_torch.py" --device "$device" --dtype \
      "$([ $device = cuda ] && echo bf16 || echo fp32)" --B "$aB" --H "$aH" --T "$aT" --hd "$ahd" \
      --iters $([ $device = cuda ] && echo $iters || echo 2) --backend $backend >"$tmp/att_t.out" 2>"$tmp/att_t.err"
    if grep -q '^{' "$tmp/att_t.out"; then
      $report tag attention <"$tmp/att_t.out" | tee -a "$results"
    else
      err part=attention kernel=torch_sdpa_$backend T=$aT hd=$ahd "$(tail -n 1 "$tmp/att_t.err")"
    fi
  done
done

# ---- 3. Redistribution of the tp activation: device path, parts, host-staged; 1 rank and 2 sharing the GPU ----
echo
echo "== 3. redistribution of the tp activation, part 1's step $step_ms ms ($(elapsed))"
red_shape=${red_shape:-${batch}x${seq}x${dim}}  # the batch part 1 ran with
red_dev=$([ $cuda_build = 1 ] && [ $device = cuda ] && echo cuda || echo cpu)
red_dtype=$([ $red_dev = cuda ] && echo bf16 || echo f32)
for np in 1 2; do
  backend=$([ $red_dev = cuda ] && { [ $np = 1 ] && echo nccl || echo mpi; } || echo mpi)
  timeout $small_limit "$mpirun" -np $np "$build/scripts/bench/bench_redistribute" --device $red_dev --shape "$red_shape" \
    --dtype $red_dtype --backend "$backend" --iters $iters --step-ms "$step_ms" --layers "$layers" \
    --json "$results" >"$tmp/red.out" 2>"$tmp/red.err"
  rc=$?
  cat "$tmp/red.out"
  if [ $rc != 0 ] && ! grep -q '"error"' "$tmp/red.out"; then
    err bench=redistribute ranks=$np "$([ $rc = 124 ] && echo "timeout after $small_limit s" || last_error "$tmp/red.err")"
  fi
done

fi  # --step-only

# ---- 4. Memory against the expected bytes; the top 10 ops of a profiled run ----
echo
echo "== 4. peak memory against the expected bytes; top 10 ops (MT_PROFILE_KERNELS=1, the last $prof_steps steps of part 1's run) ($(elapsed))"
grep -h '"part": "memory"' "$results" | "$py" -c "import json,sys
for l in sys.stdin:
    r = json.loads(l)
    if 'error' in r: print('memory: error:', r['error']); continue
    print(f\"measured peak {r['measured_bytes'] / 2**30:.3f} GiB, expected {r['expected_bytes'] / 2**30:.3f} GiB, ratio {r['ratio']:.3f}\"
          + (f\"; reserved {r['reserved_bytes'] / 2**30:.3f} GiB\" if 'reserved_bytes' in r else '')
          + (f\"; nvidia-smi peak {r['nvidia_smi_peak_mib'] / 1024:.3f} GiB\" if 'nvidia_smi_peak_mib' in r else ''))
    for k, v in r['terms_gib'].items(): print(f'  expected: {k:34s} {v:9.3f} GiB')
    print('  ' + r['how'] + '.' + (' ' + r['note'] if 'note' in r else ''))"
# meshtrain's own prediction for the same config (estimate, one rank; no cluster: memory only) beside the peak.
if "$build/meshtrain" --config "$tmp/bench.yaml" estimate --world 1 --json "$tmp/est.json" >"$logs/estimate.log" 2>&1; then
  grep -h '"part": "memory"' "$results" | tail -n 1 | "$py" -c "import json,sys
est = json.load(open('$tmp/est.json'))['stages'][0]
lines = sys.stdin.read().strip()
r = json.loads(lines) if lines else {}
measured = r.get('measured_bytes')
out = {'part': 'memory_estimate', 'estimate_peak_bytes': est['peak_bytes'], 'estimate_where': est['peak_where'],
       'estimate_parts_gib': {m['part']: round(m['bytes'] / 2**30, 3) for m in est['memory']}}
if measured: out['measured_bytes'] = measured; out['ratio_measured_over_estimate'] = measured / est['peak_bytes']
print(json.dumps(out))
print(f\"estimate: peak {est['peak_bytes'] / 2**30:.3f} GiB at {est['peak_where']}\"
      + (f\"; measured / estimate = {measured / est['peak_bytes']:.3f}\" if measured else ''), file=sys.stderr)
for m in est['memory']: print(f\"  estimate: {m['part'][:48]:48s} {m['bytes'] / 2**30:9.3f} GiB\", file=sys.stderr)
" >>"$results" || err part=memory_estimate "report failed"
else
  err part=memory_estimate "$(last_error "$logs/estimate.log")"
fi
if [ $mt_ok = 1 ]; then
  sed -n '/kernel profile (/,/^ *10 /p' "$logs/meshtrain.log"
  $report profile "$tmp/mt.jsonl" $([ $mt_device = cpu ] && echo --cpu) >>"$results" 2>"$tmp/rep.err" ||
    err part=profile "$(tail -n 1 "$tmp/rep.err")"
else
  err part=profile "no meshtrain run"
fi

echo
echo "== summary ($(elapsed); $([ $quick = 1 ] && echo 'QUICK: tiny shapes, not the figures' || echo "batch $batch x $seq"))"
$report summary "$results"
echo "raw results: $results; logs: $logs"
