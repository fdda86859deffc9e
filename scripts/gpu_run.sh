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
#      (OLD/scripts/bench/bench_attention_gpu, which loads OLD's library), on the step's and the benchmark shapes.
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
# Options: --parts 1,2,3 (which parts; 4 is added by --compare, 5 by --tilings), --quick (bench_gpu.sh --quick: a dry run of the
# plumbing, also on a CPU).
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

(cd "$work" && tar czf "$out/gpu_run_logs.tar.gz" .) 2>/dev/null
# The tables again, last (a device call's reply carries the end of the output).
echo
[ -f "$work/check/gpu_check_summary.txt" ] && cat "$work/check/gpu_check_summary.txt"
for b in bench step_old step_new; do
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
