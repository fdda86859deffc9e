#!/usr/bin/env bash
# `meshtrain estimate` of LoRA against full fine-tuning at scale (issue 52, docs/PERFORMANCE.md): Llama 3.1 8B on 8
# H100s (configs/clusters/h100_ib.yaml), dp_shard 8, bf16, one sequence of SEQ tokens a rank, under each recompute
# policy: full fine-tuning, LoRA rank 8 and LoRA rank 64 (all seven targets). One process, no ranks; prints per row
# the peak memory per rank, the model state, the step time, and the ratios full / LoRA (goal: memory per rank at
# least 2.5x smaller with LoRA).
#   scripts/bench/estimate_lora.sh [BUILD_DIR] [SEQ]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
seq=${2:-8192}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cluster="$root/configs/clusters/h100_ib.yaml"
# Llama 3.1 8B (config.json: hidden 4096, 32 layers, 32 heads, 8 kv heads, intermediate 14336, vocab 128256, RoPE
# llama3 scaling with factor 8).
l8b=(--set model.dim=4096 --set model.n_layers=32 --set model.n_heads=32 --set model.n_kv_heads=8
     --set model.ffn_dim=14336 --set model.vocab_size=128256 --set model.rope_theta=500000
     --set model.rope_scaling.type=llama3 --set model.rope_scaling.factor=8 --set model.max_seq_len="$seq")
common=(--set training.dtype=bf16 --set comm.device=cuda --set parallel.dp_replicate=1 --set parallel.dp_shard=8
        --set training.batch_size=8 --set training.seq_len="$seq" --set data.train="" --set data.val="")
rc='parallel.recompute.patterns=["model.layers.*"]'
printf '%-34s %-14s %10s %10s %10s %9s %9s\n' recompute run "peak GiB" "state GiB" "step s" "full/this" "state f/t"
for policy in none selective full; do
  case $policy in
    none) over=() ;;
    selective) over=(--set "$rc" --set 'parallel.recompute.keep=["attention"]') ;;
    full) over=(--set "$rc") ;;
  esac
  for run in full r8 r64; do
    case $run in full) lora=0 ;; r8) lora=8 ;; r64) lora=64 ;; esac
    "$build/meshtrain" "${common[@]}" "${l8b[@]}" "${over[@]}" --set lora.rank=$lora estimate --world 8 \
      --cluster "$cluster" --json "$tmp/$policy.$run.json" >"$tmp/$policy.$run.out" 2>&1 ||
      { tail -n 5 "$tmp/$policy.$run.out"; exit 1; }
    /usr/bin/python3 - "$tmp/$policy.full.json" "$tmp/$policy.$run.json" "$policy" "$run" <<'PY'
import json, sys
full, this = (json.load(open(f)) for f in sys.argv[1:3])
policy, run = sys.argv[3], sys.argv[4]
peak = lambda e: max(s["peak_bytes"] for s in e["stages"])
state = lambda e: max(s["state_bytes"] for s in e["stages"])
names = {"full": "full fine-tuning", "r8": "LoRA rank 8", "r64": "LoRA rank 64"}
print(f"{policy:34s} {names[run]:14s} {peak(this) / 2**30:10.2f} {state(this) / 2**30:10.2f} {this['step_s']:10.3f} "
      f"{peak(full) / peak(this):9.2f} {state(full) / state(this):9.2f}")
PY
  done
done
echo "(seq $seq, one sequence a rank, bf16 on H100 80 GB: h100_ib.yaml; full/this: full fine-tuning's peak over this run's)"
echo
grep -E "LoRA rank|frozen base|trainable parameters \(|gradients |optimizer moments|activations|peak  " \
  "$tmp/full.r8.out" | cut -c1-150
