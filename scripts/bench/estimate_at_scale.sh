#!/usr/bin/env bash
# `meshtrain estimate` on paper, at scale (issue 28, docs/PERFORMANCE.md): Llama 3 8B on 8 and 64 H100s, 70B on 64
# and 512, 405B on 8,192 at seq 8K and on 16,384 with cp 16 at seq 131K, on configs/clusters/h100_ib.yaml, with the
# meshes their authors used as far as meshtrain has the dims. One process, no ranks; prints one row per run beside
# the published figure and the ratio.
#   scripts/bench/estimate_at_scale.sh [BUILD_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cluster="$root/configs/clusters/h100_ib.yaml"
common=(--set training.dtype=bf16 --set comm.device=cuda --set model.rope_theta=500000 --set model.vocab_size=128256
        --set model.n_kv_heads=8 --set parallel.dp_replicate=1 --set data.train="" --set data.val="")
l8b=(--set model.dim=4096 --set model.n_layers=32 --set model.n_heads=32 --set model.ffn_dim=14336)
l70b=(--set model.dim=8192 --set model.n_layers=80 --set model.n_heads=64 --set model.ffn_dim=28672)
l405b=(--set model.dim=16384 --set model.n_layers=126 --set model.n_heads=128 --set model.ffn_dim=53248)
seqlen() { echo --set training.seq_len="$1" --set model.max_seq_len="$1"; }

# name|world|published TFLOP/s per GPU (low-high)|source|args
runs=(
  "8B, 8 GPUs, FSDP 8, seq 8K, selective AC|8|326-386|torchtitan (33-39% MFU on H100)|${l8b[*]} $(seqlen 8192) --set training.batch_size=8 --set parallel.dp_shard=8 --set parallel.recompute.patterns=[\"model.layers.*\"] --set parallel.recompute.keep=[\"attention\"]"
  "8B, 64 GPUs, FSDP 64, seq 8K, selective AC|64|326-386|torchtitan (33-39% MFU on H100)|${l8b[*]} $(seqlen 8192) --set training.batch_size=64 --set parallel.dp_shard=64 --set parallel.recompute.patterns=[\"model.layers.*\"] --set parallel.recompute.keep=[\"attention\"]"
  "70B, 64 GPUs, FSDP 8 x TP 8, seq 8K, full AC|64|326-386|torchtitan (33-39% MFU on H100)|${l70b[*]} $(seqlen 8192) --set training.batch_size=16 --set parallel.dp_shard=8 --set parallel.tp=8 --set parallel.recompute.patterns=[\"model.layers.*\"]"
  "70B, 512 GPUs, FSDP 64 x TP 8, seq 8K, full AC|512|326-386|torchtitan (33-39% MFU on H100)|${l70b[*]} $(seqlen 8192) --set training.batch_size=128 --set parallel.dp_shard=64 --set parallel.tp=8 --set parallel.recompute.patterns=[\"model.layers.*\"]"
  "405B, 8,192 GPUs, PP 16 x FSDP 64 x TP 8, seq 8K|8192|430|Llama 3 paper, Table 4 (43% MFU)|${l405b[*]} $(seqlen 8192) --set training.batch_size=2048 --set training.micro_batch_size=1 --set parallel.dp_shard=64 --set parallel.tp=8 --set parallel.pp=16 --set parallel.pp_schedule=interleaved_1f1b --set parallel.pp_virtual=2 --set parallel.fsdp.reshard_after_forward=false --set parallel.recompute.patterns=[\"model.layers.*\"]"
  "405B, 16,384 GPUs, PP 16 x FSDP 8 x CP 16 x TP 8, seq 131K|16384|380|Llama 3 paper, Table 4 (38% MFU)|${l405b[*]} $(seqlen 131072) --set training.batch_size=128 --set training.micro_batch_size=1 --set parallel.dp_shard=8 --set parallel.cp=16 --set parallel.tp=8 --set parallel.pp=16 --set parallel.pp_schedule=interleaved_1f1b --set parallel.pp_virtual=2 --set parallel.fsdp.reshard_after_forward=false --set parallel.recompute.patterns=[\"model.layers.*\"]"
)
printf '%-62s %9s %9s %10s %10s %8s %16s %7s\n' run "peak GiB" "step s" "tok/s/GPU" "TFLOP/GPU" MFU "published TFLOP" ratio
i=0
for r in "${runs[@]}"; do
  IFS='|' read -r name world pub src args <<<"$r"
  i=$((i + 1))
  # shellcheck disable=SC2086
  "$build/meshtrain" "${common[@]}" $args estimate --world "$world" --cluster "$cluster" --json "$tmp/e$i.json" \
    >"$tmp/e$i.out" 2>&1 || { tail -n 5 "$tmp/e$i.out"; exit 1; }
  /usr/bin/python3 - "$tmp/e$i.json" "$name" "$pub" "$src" "$world" <<'PY'
import json, sys
e = json.load(open(sys.argv[1])); name, pub, src, world = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
peak = max(s["peak_bytes"] for s in e["stages"]) / 2**30
tflops = e["mfu"] * 989
lo, hi = (float(x) for x in (pub.split("-") + pub.split("-"))[:2]) if "-" in pub else (float(pub), float(pub))
mid = (lo + hi) / 2
print(f"{name:62s} {peak:9.1f} {e['step_s']:9.2f} {e['tokens_per_s'] / world:10.0f} {tflops:10.0f} {100 * e['mfu']:7.1f}% {pub:>16s} {tflops / mid:7.2f}")
PY
done
echo "(TFLOP/GPU: model FLOPs (6 N + 12 L d T per token) per second per GPU, MFU x 989 (bf16 dense peak); published: the source in each row)"
# (grep may meet a closed pipe once head has its 8 lines: not an error under pipefail)
for i in $(seq 1 ${#runs[@]}); do echo; echo "== run $i"; { grep -E "^(pp stage 0|rank 0)|peak|time:|^step|note" "$tmp/e$i.out" || true; } | head -n 8; done
