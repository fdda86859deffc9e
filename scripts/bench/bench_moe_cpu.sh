#!/usr/bin/env bash
# Mixture-of-experts step benchmark on CPU ranks (docs/PERFORMANCE.md, "Mixture of experts"):
#  1. A Mixtral-style model (dim 256, 4 layers, 8 heads, 4 kv heads, 8 experts top-2, expert ffn 768, vocab 256,
#     seq 256, batch 8, f32, balance loss on) on 1 rank with 2 threads, against the PyTorch reference
#     (scripts/reference/llama_ref.py bench: transformers' per-expert loop) on the same model and threads:
#     tokens/s of both and the ratio (goal: >= 2x).
#  2. The same model on ep 1, 2, 4, 8 (one rank per expert group, 1 thread each; the global batch fixed): step time,
#     the all-to-alls' wall time (moe_dispatch_ms in the metrics) and their share of the step. With more ranks than
#     cores the ranks share cores: the figures show the dispatch's cost, not a scaling curve.
#   scripts/bench/bench_moe_cpu.sh [BUILD_DIR] [STEPS] [EP_LIST]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
steps=${2:-12}
eps=${3:-1 2 4 8}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=/usr/bin/python3
ref="$root/scripts/reference/llama_ref.py"

"$py" "$ref" init --out "$tmp/mixtral" --model-type mixtral --dim 256 --n-layers 4 --n-heads 8 --n-kv-heads 4 \
  --ffn-dim 768 --moe-ffn-dim 768 --n-experts 8 --experts-per-token 2 --vocab-size 256 --max-seq-len 256 --seed 1 \
  --output-router-logits >/dev/null
"$py" "$root/scripts/bench/bench_data.py" "$tmp"
cat >"$tmp/b.yaml" <<YAML
training: {steps: $steps, batch_size: 8, seq_len: 256, lr: 3.0e-4, threads: 2, dtype: fp32}
data: {train: "$tmp/bench_*.bin", val: ""}
eval: {interval: 0}
sample: {interval: 0}
log: {interval: 1}
checkpoint: {interval: 0}
YAML

# summary FILE: median step ms (warm-up steps left out), median dispatch ms, tokens/s.
summary() {
  "$py" - "$1" <<'PY'
import json, sys, statistics
recs = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l][2:]
step = statistics.median(r["step_ms"] for r in recs)
disp = statistics.median(r.get("moe_dispatch_ms", 0.0) for r in recs)
print(f"{step:.1f} {disp:.1f} {8 * 256 / step * 1e3:.0f}")
PY
}

"$root/scripts/mpirun.sh" -np 1 "$build/meshtrain" --config "$tmp/b.yaml" --set model.init_from="$tmp/mixtral" \
  --set log.metrics_file="$tmp/one.jsonl" train >"$tmp/one.log" 2>&1 || { tail -n 20 "$tmp/one.log"; exit 1; }
read -r step_ms _ mt_tps < <(summary "$tmp/one.jsonl")
"$py" "$ref" bench --model "$tmp/mixtral" --seq-len 256 --batch-size 8 --threads 2 --steps 6 --warmup 2 >"$tmp/ref.json"
"$py" - "$tmp/ref.json" "$mt_tps" "$step_ms" <<'PY'
import json, sys
ref = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
mt, ms = float(sys.argv[2]), float(sys.argv[3])
print(f"mixtral-style (8 experts top-2, dim 256, 4 layers, seq 256, batch 8, f32), 1 rank, 2 threads:")
print(f"  meshtrain : {mt:8.0f} tok/s  ({ms:.1f} ms/step)")
print(f"  PyTorch {ref['torch']} per-expert loop: {ref['tokens_per_s']:8.0f} tok/s  ({ref['step_ms']:.1f} ms/step, {ref['blas']})")
print(f"  ratio     : {mt / ref['tokens_per_s']:.2f}x (goal >= 2x)")
PY

echo "expert parallel, global batch 8 x 256, 1 thread per rank ($(nproc) cores):"
echo "  ep  ranks  step ms  all-to-all ms  share"
for ep in $eps; do
  "$root/scripts/mpirun.sh" -np "$ep" "$build/meshtrain" --config "$tmp/b.yaml" --set model.init_from="$tmp/mixtral" \
    --set parallel.ep="$ep" --set training.threads=1 --set log.metrics_file="$tmp/ep$ep.jsonl" train \
    >"$tmp/ep$ep.log" 2>&1 || { tail -n 20 "$tmp/ep$ep.log"; exit 1; }
  read -r s d _ < <(summary "$tmp/ep$ep.jsonl")
  "$py" -c "import sys; s, d = float(sys.argv[2]), float(sys.argv[3]); print(f'  {int(sys.argv[1]):2d}  {int(sys.argv[1]):5d}  {s:7.1f}  {d:13.1f}  {100 * d / s:4.1f}%')" "$ep" "$s" "$d"
done
