#!/usr/bin/env bash
# Everything CUDA in one device call (at most 8 minutes of wall time), run on the GPU machine from the repository
# root, parts in order, each under its own time limit so that a hang or failure in one leaves the others' results:
#   0. the machine: the GPU, the toolkit's libraries found (LD_LIBRARY_PATH), no library missing for the bundle;
#   1. the functional list (scripts/gpu_check.sh --quick): the GPU suite at 1 and 2 ranks, the op table's CUDA
#      cases, fp32 against the CPU (1 rank and the 2-rank meshes), bf16 within 2% of fp32, one host sync per step;
#   2. the benchmarks (scripts/bench/bench_gpu.sh): the 1B Llama step's tokens/s and MFU beside PyTorch eager and
#      torch.compile, attention beside SDPA's flash and cuDNN backends, redistribution, the top 10 kernels, memory
#      against the expected bytes and estimate's prediction;
#   3. `meshtrain estimate --calibrate` on the GPU (comm.device=cuda), written as a cluster file (a rank per GPU; on
#      one GPU the links are taken from configs/clusters/h100_ib.yaml, --links-from);
#   4. with --compare OLD (another build's bundle, at least its meshtrain and libmeshtrain_cuda.so): the 1B step of
#      OLD, then of this bundle and torch.compile, one after the other on the same GPU (a change's effect);
#   5. with --tilings "1,1,1 2,2,1 ..." (MT_FLASH_MT values): the flash kernel under each tiling, and OLD's
#      (OLD/scripts/bench/bench_attention_gpu, which loads OLD's library), on the step's and the benchmark shapes;
#   6. issue 50's options on the 1B step, each alone and all together (bench_gpu.sh --step-only --mt-set):
#      attention.kernel flash and cudnn, training.cuda_graph, training.fp8 tensorwise and rowwise, then cudnn + graph
#      + fp8; beside torch.compile's step (part 2's, else timed here);
#   7. 200 steps of FP8 (tensorwise) against bf16 on the same model, data and seed: the loss curves, the last 20
#      steps' mean loss within 1% (docs text at byte level);
#   8. a Mixtral-style step (dim 1024, 8 layers, 8 experts, top 2) against PyTorch: transformers' per-expert loop
#      and torch._grouped_mm (scripts/bench/torch_moe_bench.py).
# Parts 6-8 are issue 50's measurements: --parts 6,7,8 (about 6 minutes on an H200; part 2 before them gives
# torch.compile's step for part 6's ratios).
# First call on an H200 (2026-11-28): parts 1 and 2 in 262 s; part 3 took 7 s. Exits 1 when a part failed.
# $OUT gets gpu_run.log (all of the output), gpu_run_logs.tar.gz (every part's logs and raw results),
# gpu_cluster.yaml (part 3's file) and gpu_clocks.csv (GPU 0's clock and power every 500 ms); the summary table
# comes last.
#
# Here, before the call (the GPU machine has CUDA and PyTorch but no Open MPI and no package access):
#   bash ../shared/gpu/pack-deps.sh .gpu-deps libpcre2-8-0 libsentencepiece0 libxxhash0
#   scripts/gpu_bundle.sh build .gpu-bundle && mkdir -p .gpu-carry && tar cJf .gpu-carry/bundle.tar.xz .gpu-bundle .gpu-deps
#   (an old bundle for --compare goes into the same archive; .gpu-deps, .gpu-bundle* and .gpu-carry in
#   .git/info/exclude), then the device call with carry [".gpu-carry"]:
#   bash scripts/gpu_run.sh
# Options: --parts 1,2,3 (which parts; 4 is added by --compare, 5 by --tilings; 6, 7, 8 by name), --quick
# (bench_gpu.sh --quick and small models in parts 6-8: a dry run of the plumbing, also on a CPU).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
parts=1,2,3
quick=0
old=
tilings=
while [ $# -gt 0 ]; do
  case $1 in
    --parts) parts=$2; shift ;;
    --quick) quick=1 ;;
    --compare) old=$2; parts="$parts,4"; shift ;;
    --tilings) tilings=$2; parts="$parts,5"; shift ;;
    *) echo "gpu_run.sh: unknown argument $1 (options: --parts LIST, --compare OLD, --tilings LIST, --quick)" >&2; exit 2 ;;
  esac
  shift
done
out=${OUT:-$root/runs/gpu_run}
mkdir -p "$out"
work=$(mktemp -d)
exec > >(tee "$out/gpu_run.log") 2>&1
t0=$(date +%s)
since() { echo $(( $(date +%s) - t0 )); }
rows=()

# 0. The machine and the bundle.
echo "== 0. $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname): scripts/gpu_run.sh --parts $parts$([ $quick = 1 ] && echo ' --quick')"
if [ ! -d .gpu-bundle ] && [ -f .gpu-carry/bundle.tar.xz ]; then tar xJf .gpu-carry/bundle.tar.xz; fi
[ -f .gpu-deps/env.sh ] && source .gpu-deps/env.sh
bundle=$root/.gpu-bundle
[ -x "$bundle/meshtrain" ] || bundle=$root/build
# The toolkit's libraries where this machine has them (the image's toolkit, or PyTorch's nvidia wheels).
for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  d=$(find /usr/local /usr/lib /opt -name "$lib" -not -path '*/stubs/*' 2>/dev/null | head -n 1)
  [ -n "$d" ] && export LD_LIBRARY_PATH="$(dirname "$d"):${LD_LIBRARY_PATH:-}" && echo "$lib: $d"
done
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null ||
  echo "nvidia-smi: no GPU"
# GPU 0's SM clock, power, temperature and throttle reasons every 500 ms for the whole call ($out/gpu_clocks.csv),
# summarised per part last: a kernel slower in the step than alone at the same clock is the kernel's doing; at a
# lower clock, the power limit's (attention ran 1.18-1.21x longer in the step than alone on the first H200 calls).
clock_query=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active
clock_pid=
if nvidia-smi -i 0 --query-gpu=$clock_query --format=csv,noheader >/dev/null 2>&1; then
  nvidia-smi -i 0 --query-gpu=$clock_query --format=csv,noheader,nounits -lms 500 >"$out/gpu_clocks.csv" 2>/dev/null &
  clock_pid=$!
fi
missing=$(for f in "$bundle/meshtrain" "$bundle/libmeshtrain_cuda.so" "$bundle/tests/test_gpu"; do
  ldd "$f" 2>/dev/null | grep 'not found' | sed "s|^|$(basename "$f"): |"; done)
if [ -n "$missing" ]; then
  echo "$missing"
  rows+=("FAIL  0. libraries: $(echo "$missing" | tr '\n' ';')")
else
  rows+=("ok    0. libraries: every one found ($bundle)")
fi
echo "MPIRUN=${MPIRUN:-scripts/mpirun.sh}; python3 $(python3 -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -n 1)"

part() {  # part N NAME LIMIT_S COMMAND...: runs COMMAND under LIMIT_S, one summary row
  local n=$1 name=$2 limit=$3 start rc
  shift 3
  case ",$parts," in *",$n,"*) ;; *) return ;; esac
  start=$(date +%s)
  echo
  echo "== $n. $name (limit $limit s; at $(since) s)"
  timeout -k 10 "$limit" "$@"
  rc=$?
  local verdict=ok
  [ $rc = 0 ] || verdict=FAIL
  [ $rc = 124 ] && verdict="FAIL (time limit $limit s)"
  rows+=("$(printf '%-5s %s. %s: exit %s in %s s' "${verdict%% *}" "$n" "$name" "$rc" $(( $(date +%s) - start )))$(
    [ $rc = 124 ] && echo ", cut at its limit")")
  echo "$n $start $(date +%s)" >>"$work/part_times"
}

# 1. The functional list: logs and summary to $work/check.
part 1 "functional list (gpu_check.sh --quick)" 200 env OUT="$work/check" bash scripts/gpu_check.sh "$bundle" --quick
# 2. The benchmarks.
bench_args=(--steps 12 --limit 110)
[ $quick = 1 ] && bench_args=(--quick --limit 110)
part 2 "benchmarks (bench_gpu.sh ${bench_args[*]})" 230 env OUT="$work/bench" bash scripts/bench/bench_gpu.sh "$bundle" \
  "${bench_args[@]}"
# 3. Calibration on the GPU: a rank per GPU measures the links too; one GPU has none, so its file takes them from
# configs/clusters/h100_ib.yaml (said in the file).
cal_args=()
[ $quick = 1 ] && cal_args=(--quick)
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${ngpu:-0}" -ge 2 ]; then
  part 3 "estimate --calibrate on $ngpu GPUs" 120 ${MPIRUN:-scripts/mpirun.sh} -np "$ngpu" "$bundle/meshtrain" \
    --set comm.device=cuda estimate --calibrate "${cal_args[@]}" --out "$out/gpu_cluster.yaml"
else
  part 3 "estimate --calibrate on the GPU (one GPU: links from h100_ib.yaml)" 90 "$bundle/meshtrain" \
    --set comm.device=cuda estimate --calibrate --links-from configs/clusters/h100_ib.yaml "${cal_args[@]}" \
    --out "$out/gpu_cluster.yaml"
fi
[ -f "$out/gpu_cluster.yaml" ] && cat "$out/gpu_cluster.yaml"
# 4. The step of another build, then of this one (and torch.compile), on the same GPU.
if [ -n "$old" ]; then
  # bench_gpu.sh takes a build without its GPU benchmark programs for a CPU-only one: an old bundle of meshtrain
  # and its library alone borrows this bundle's (the step is meshtrain's own).
  [ -x "$old/scripts/bench/bench_attention_gpu" ] || cp -r "$bundle/scripts" "$old/"
  step_args=(--step-only --steps 12 --limit 110)
  [ $quick = 1 ] && step_args=(--step-only --quick --limit 110)
  part 4 "the 1B step of $old" 120 env OUT="$work/step_old" bash scripts/bench/bench_gpu.sh "$old" "${step_args[@]}" \
    --torch ""
  part 4 "the 1B step of $bundle, then torch.compile" 200 env OUT="$work/step_new" bash scripts/bench/bench_gpu.sh \
    "$bundle" "${step_args[@]}" --torch "${COMPARE_TORCH-compile}"
fi

# 5. The flash kernel's tilings (--tilings LIST: MT_FLASH_MT values, runtime/kernels/cuda/flash_attention.cu), each
# timed by bench_attention_gpu on the 1B step's shape (B 16, H 16, KV 8, T 2048, hd 128) and FlashAttention-2's
# benchmark shapes, then OLD's kernel on the same shapes (with --compare): which tiling is fastest, and by how much.
attention_shapes() {  # attention_shapes BENCH: one JSON line per shape
  "$1" --B 16 --H 16 --KV 8 --T 2048 --hd 128 --iters 10
  "$1" --B 2 --H 16 --KV 16 --T 8192 --hd 128 --iters 10
  "$1" --B 8 --H 32 --KV 32 --T 2048 --hd 64 --iters 10
}
tiling_runs() {
  local t
  for t in $tilings; do
    echo "-- MT_FLASH_MT=$t"
    MT_FLASH_MT=$t attention_shapes "$bundle/scripts/bench/bench_attention_gpu" | sed "s/^{/{\"tiling\":\"$t\",/"
  done
  if [ -n "$old" ] && [ -x "$old/scripts/bench/bench_attention_gpu" ]; then
    echo "-- OLD ($old)"
    attention_shapes "$old/scripts/bench/bench_attention_gpu" | sed 's/^{/{"tiling":"old",/'
  fi
}
if [ -n "$tilings" ]; then
  export -f attention_shapes tiling_runs
  export tilings old bundle
  part 5 "flash kernel tilings ($tilings)" 150 bash -c tiling_runs
fi

# 6. Issue 50's options on the 1B step, one bench_gpu.sh run each (no kernel profile: CUDA graphs cannot hold it).
opt_steps=(--steps 10 --limit 100)
[ $quick = 1 ] && opt_steps=(--quick --limit 100)
options=("flash:attention.kernel=flash" "cudnn:attention.kernel=cudnn" "graph:training.cuda_graph=true"
  "fp8:training.fp8=tensorwise" "fp8_rowwise:training.fp8=rowwise"
  "all:attention.kernel=cudnn training.cuda_graph=true training.fp8=tensorwise")
option_runs() {
  local o name sets s args torch_mode
  for o in "${options[@]}"; do
    name=${o%%:*} sets=${o#*:}
    args=()
    for s in $sets; do args+=(--mt-set "$s"); done
    torch_mode=""  # torch.compile once, beside the first, when part 2 did not time it
    [ "$name" = flash ] && [ ! -f "$work/bench/bench_gpu.jsonl" ] && torch_mode=compile
    echo "-- $name: $sets"
    env OUT="$work/opt_$name" bash scripts/bench/bench_gpu.sh "$bundle" --step-only --no-profile --torch "$torch_mode" \
      "${opt_steps[@]}" "${args[@]}" 2>&1 | grep -a '"impl"\|error' | tail -n 3
  done
}
if case ",$parts," in *",6,"*) true ;; *) false ;; esac; then
  export -f option_runs
  export work bundle
  part 6 "issue 50's options on the 1B step" 420 bash -c "$(declare -p options opt_steps); option_runs"
fi
# 7. FP8 against bf16 over 200 steps: the loss curves (docs/*.md at byte level, the 1B's layers, vocab 256).
fp8_curves() {
  local steps=200 dims="dim: 2048, n_layers: 16, n_heads: 16, n_kv_heads: 8, ffn_dim: 5632" seq=2048 batch=8
  [ "$quick" = 1 ] && steps=20 dims="dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 128" seq=64 batch=4
  python3 scripts/prepare_data --out "$work/fp8_data" --name docs docs/*.md >/dev/null || return 1
  local dev=cuda
  nvidia-smi -L >/dev/null 2>&1 || dev=cpu
  cat >"$work/fp8.yaml" <<YAML
model: {$dims, vocab_size: 256, max_seq_len: $seq}
training: {steps: $steps, batch_size: $batch, seq_len: $seq, dtype: bf16, lr: 1.0e-3, warmup_steps: 20, lr_min: 1.0e-4, seed: 1}
data: {train: "$work/fp8_data/docs_train_*.bin", val: ""}
eval: {interval: 0}
sample: {interval: 0}
checkpoint: {dir: ""}
comm: {device: $dev}
log: {interval: 10}
YAML
  local r
  for r in none tensorwise; do
    ${MPIRUN:-scripts/mpirun.sh} -np 1 "$bundle/meshtrain" --config "$work/fp8.yaml" --set training.fp8=$r \
      --set log.metrics_file="$work/fp8_$r.jsonl" train >"$work/fp8_$r.log" 2>&1 || { tail -n 5 "$work/fp8_$r.log"; return 1; }
  done
  python3 - "$work/fp8_none.jsonl" "$work/fp8_tensorwise.jsonl" <<'PY'
import json, sys
def losses(f):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f)) if r.get("kind", "step") == "step" and "loss" in r}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
steps = sorted(set(a) & set(b))
for s in steps[:: max(1, len(steps) // 10)] + steps[-1:]:
    print(f"step {s:4d}  bf16 {a[s]:.4f}  fp8 {b[s]:.4f}  ratio {b[s] / a[s]:.4f}")
tail = steps[-20:]
ma, mb = sum(a[s] for s in tail) / len(tail), sum(b[s] for s in tail) / len(tail)
print(json.dumps({"part": "fp8_curves", "steps": steps[-1], "bf16_last20": round(ma, 4), "fp8_last20": round(mb, 4),
                  "ratio": round(mb / ma, 4), "goal": "within 1%"}))
sys.exit(0 if abs(mb / ma - 1) <= 0.01 else 1)
PY
}
if case ",$parts," in *",7,"*) true ;; *) false ;; esac; then
  export -f fp8_curves
  export work bundle quick
  part 7 "FP8 against bf16, 200 steps" 240 bash -c fp8_curves
fi
# 8. A Mixtral-style step: meshtrain against PyTorch's per-expert loop (transformers') and torch._grouped_mm.
moe_step() {
  local m=(1024 8 16 8 3584 8 2 32000 2048 8) steps=8
  [ "$quick" = 1 ] && m=(64 2 4 2 128 4 2 256 64 2) steps=4
  local dim=${m[0]} layers=${m[1]} heads=${m[2]} kv=${m[3]} ffn=${m[4]} experts=${m[5]} topk=${m[6]} vocab=${m[7]}
  local seq=${m[8]} batch=${m[9]} dev=cuda
  nvidia-smi -L >/dev/null 2>&1 || dev=cpu
  python3 scripts/prepare_data --out "$work/moe_data" --name docs docs/*.md >/dev/null || return 1
  cat >"$work/moe.yaml" <<YAML
model: {type: mixtral, dim: $dim, n_layers: $layers, n_heads: $heads, n_kv_heads: $kv, ffn_dim: $ffn, vocab_size: $vocab, max_seq_len: $seq,
        moe: {n_experts: $experts, experts_per_token: $topk, ffn_dim: $ffn}}
training: {steps: $((steps + 3)), batch_size: $batch, seq_len: $seq, dtype: bf16, warmup_steps: 2}
data: {train: "$work/moe_data/docs_train_*.bin", val: ""}
eval: {interval: 0}
sample: {interval: 0}
checkpoint: {dir: ""}
comm: {device: $dev}
log: {interval: 1, metrics_file: "$work/moe.jsonl"}
YAML
  ${MPIRUN:-scripts/mpirun.sh} -np 1 "$bundle/meshtrain" --config "$work/moe.yaml" train >"$work/moe.log" 2>&1 ||
    { tail -n 5 "$work/moe.log"; return 1; }
  python3 scripts/bench/torch_moe_bench.py --device $dev --dim $dim --n-layers $layers --n-heads $heads \
    --n-kv-heads $kv --ffn-dim $ffn --n-experts $experts --top-k $topk --vocab-size $vocab --seq-len $seq \
    --batch-size $batch --steps $steps >"$work/moe_torch.jsonl" 2>"$work/moe_torch.err"
  python3 - "$work/moe.jsonl" "$work/moe_torch.jsonl" "$batch" "$seq" <<'PY'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r.get("kind", "step") == "step" and "step_ms" in r]
times = sorted(r["step_ms"] / 1e3 for r in rows[3:]) or [float("nan")]
mt = int(sys.argv[3]) * int(sys.argv[4]) / times[len(times) // 2]
print(f"meshtrain: {mt:,.0f} tokens/s (median of {len(times)} steps after 3)")
for line in open(sys.argv[2]):
    t = json.loads(line)
    if "tokens_per_s" in t:
        print(f"{t['impl']}: {t['tokens_per_s']:,.0f} tokens/s; meshtrain / it = {mt / t['tokens_per_s']:.2f}x"
              + (" (goal >= 2x)" if t["impl"].endswith("loop") else ""))
    else:
        print(f"{t['impl']}: {t.get('error')}")
PY
}
if case ",$parts," in *",8,"*) true ;; *) false ;; esac; then
  export -f moe_step
  export work bundle quick
  part 8 "Mixtral-style step against PyTorch" 240 bash -c moe_step
fi

(cd "$work" && tar czf "$out/gpu_run_logs.tar.gz" .) 2>/dev/null
# The tables again, last (a device call's reply carries the end of the output).
echo
[ -f "$work/check/gpu_check_summary.txt" ] && cat "$work/check/gpu_check_summary.txt"
for b in bench step_old step_new opt_flash opt_cudnn opt_graph opt_fp8 opt_fp8_rowwise opt_all; do
  if [ -f "$work/$b/bench_gpu.jsonl" ]; then
    echo
    echo "-- $b"
    python3 scripts/bench/bench_gpu_report.py summary "$work/$b/bench_gpu.jsonl" 2>&1 | tail -n 40
  fi
done
if [ -n "$clock_pid" ]; then
  kill "$clock_pid" 2>/dev/null
  echo
  echo "-- GPU 0's clock and power per part ($out/gpu_clocks.csv)"
  python3 scripts/gpu_clocks.py "$out/gpu_clocks.csv" "$work/part_times" 2>&1 | tail -n 20
fi
rm -rf "$work"
echo
echo "== gpu_run summary ($(since) s in all; $(date -u '+%Y-%m-%d %H:%M UTC'))"
printf '%s\n' "${rows[@]}"
printf '%s\n' "${rows[@]}" | grep -q '^FAIL' && exit 1
exit 0
