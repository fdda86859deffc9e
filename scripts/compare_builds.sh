#!/usr/bin/env bash
# Two builds of meshtrain give the same numbers: `plan`, `estimate` and a short training run (losses, grad norms,
# validation losses, samples, memory figures, and the checkpoint's files byte for byte) on six meshes, for a
# refactor that must change no number.
#   scripts/compare_builds.sh OLD_MESHTRAIN NEW_MESHTRAIN [WORK_DIR]
# Prints one line per mesh and output ("same" or the first differing lines) and ends with "N same, N different".
# What depends on the clock (times, rates, MFU, pids, dates) is left out of the comparison; nothing else is.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
old=$(realpath "$1")
new=$(realpath "$2")
work=${3:-$(mktemp -d)}
mkdir -p "$work"
mpirun="$root/scripts/mpirun.sh"
export OMP_NUM_THREADS=1
cd "$root"

# The six meshes (ranks, then --set overrides) and a MoE model on the last.
meshes=(
  "one|1|"
  "dp2|2|--set parallel.dp_replicate=2"
  "fsdp2_tp2|4|--set parallel.dp_replicate=1 --set parallel.dp_shard=2 --set parallel.tp=2"
  "cp2_tp2|4|--set parallel.dp_replicate=1 --set parallel.cp=2 --set parallel.tp=2"
  "pp2_1f1b_dp2|4|--set parallel.pp=2 --set parallel.dp_replicate=2 --set training.micro_batch_size=2"
  "moe_ep2_tp2|4|--set parallel.dp_replicate=1 --set parallel.ep=2 --set parallel.tp=2 --set model.type=mixtral --set model.moe.n_experts=4 --set model.moe.experts_per_token=2 --set model.moe.ffn_dim=96 --set model.moe.output_router_logits=true"
)
common=(--config configs/tiny.yaml --set training.steps=6 --set training.batch_size=8 --set training.seq_len=64
        --set eval.interval=3 --set eval.steps=2 --set sample.interval=6 --set sample.tokens=16
        --set sample.temperature=0 --set log.interval=1 --set checkpoint.interval=3 --set log.progress=off)

# Drops what the clock decides from a training run's metrics records. Under pipeline parallel (a second argument
# "pp") the step's allocator peak too: a stage's receive buffer is allocated before or after the peak as the
# neighbour's message arrives (the same binary gives either from run to run).
strip_metrics() {
  /usr/bin/python3 - "$1" "${2:-}" <<'PY'
import json, sys
clock = {"time", "pid", "step_ms", "tokens_per_s", "mfu", "setup_s", "load_s", "wall_s", "eval_s", "stall_s",
         "write_s", "dispatch_s", "productive_s", "checkpoint_s", "other_s", "goodput", "compute_s", "wait_s",
         "resumed_from", "spread", "tflops", "peak_mem_bytes", "pp_bubble", "pp_compute_s", "pp_step_s", "pp_wait_s", "pp_peak_bytes"}
if sys.argv[2] == "pp":
    clock |= {"alloc_peak_bytes", "alloc_peak_block_bytes"}
def clean(x):
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items() if k not in clock and not k.endswith("_ms")}
    if isinstance(x, list):
        return [clean(v) for v in x]
    return x
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("event") in ("goodput", "ranks"):
        continue
    print(json.dumps(clean(r), sort_keys=True))
PY
}
# Drops the clock from printed lines: the log's time stamps, and lines that report times or rates.
strip_text() {
  sed -E 's/^\[[0-9:. -]+\] //; s/\[r[0-9]+\] //; s/ \| [0-9]+ tok\/s \|.*//' "$1" |
    grep -a -v -E 'tokens/s|GFLOP/s|TFLOP/s| in [0-9.]+ s|[0-9.]+ ms|goodput|wall|threads per rank|MiB/s|GB/s|took|bubble|MiB resident' || true
}

same=0
different=0
verdict() {  # verdict NAME FILE_OLD FILE_NEW
  if cmp -s "$2" "$3"; then same=$((same + 1)); echo "same       $1"
  else different=$((different + 1)); echo "DIFFERENT  $1"; diff "$2" "$3" | head -n 12 | sed 's/^/    /'; fi
}

for m in "${meshes[@]}"; do
  IFS='|' read -r name np sets <<<"$m"
  read -r -a extra <<<"$sets"
  for which in old new; do
    bin=$old
    [ "$which" = new ] && bin=$new
    d="$work/$name/$which"
    rm -rf "$d"
    mkdir -p "$d"
    "$bin" "${common[@]}" "${extra[@]}" estimate --world "$np" >"$d/estimate.txt" 2>&1
    "$mpirun" -np "$np" "$bin" "${common[@]}" "${extra[@]}" plan >"$d/plan.raw" 2>&1
    "$mpirun" -np "$np" "$bin" "${common[@]}" "${extra[@]}" --set log.metrics_file="$d/metrics.jsonl" \
      --set checkpoint.dir="$d/ckpt" train >"$d/train.raw" 2>&1
    echo "exit $?" >>"$d/train.raw"
    strip_text "$d/plan.raw" >"$d/plan.txt"
    strip_text "$d/train.raw" | sed "s#$d#DIR#g" >"$d/train.txt"
    strip_metrics "$d/metrics.jsonl" "$([[ $name == pp* ]] && echo pp)" >"$d/metrics.txt" 2>&1
    (cd "$d/ckpt" && for f in */*.safetensors; do echo "$f $(sha256sum <"$f" | cut -c1-16)"; done) >"$d/ckpt.txt" 2>&1
  done
  for out in estimate plan metrics train ckpt; do
    verdict "$name $out" "$work/$name/old/$out.txt" "$work/$name/new/$out.txt"
  done
done
echo "outputs in $work"
echo "$same same, $different different"
[ "$different" -eq 0 ]
