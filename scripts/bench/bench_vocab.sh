#!/usr/bin/env bash
# Step time against the vocabulary (issue 26, docs/PERFORMANCE.md): the same model body (dim 256, 4 layers,
# 8 heads, 4 kv heads, ffn 768; seq 256, batch 4, fp32, 1 rank x 2 threads) at vocab 256, 32,000 (Llama 2) and
# 128,256 (Llama 3), on uint32 token shards of random ids, beside the PyTorch reference (llama_ref.py bench) at the
# same sizes. The logits' share of a step (lm_head forward and backward, the loss, the embedding and their AdamW
# update) is measured as (step(V) - step(256)) / step(V), and predicted from FLOPs (6 V d of 6 N + 12 L d T per
# token). Prints one row per vocabulary and the ratio 128,256 / 32,000.
#   scripts/bench/bench_vocab.sh [BUILD_DIR] [STEPS]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
steps=${2:-8}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
threads=2
export OMP_NUM_THREADS=$threads
d=256 L=4 H=8 KV=4 F=768 T=256 B=4

rows=()
for V in 256 32000 128256; do
  # Random ids of this vocabulary in uint32 shards (llm.c's magic 20240801, version 7): speed does not depend on
  # the text.
  /usr/bin/python3 - "$tmp/v$V" "$V" <<'PY'
import os, sys, numpy as np
d, V = sys.argv[1], int(sys.argv[2])
os.makedirs(d, exist_ok=True)
toks = np.random.default_rng(0).integers(0, V, 200000, dtype=np.uint32)
hdr = np.zeros(256, np.int32); hdr[:3] = (20240801, 7, len(toks))
open(os.path.join(d, "bench_000.bin"), "wb").write(hdr.tobytes() + toks.tobytes())
PY
  "$root/scripts/mpirun.sh" -np 1 "$build/meshtrain" --set model.dim=$d --set model.n_layers=$L --set model.n_heads=$H \
    --set model.n_kv_heads=$KV --set model.ffn_dim=$F --set model.vocab_size=$V --set model.max_seq_len=$T \
    --set training.seq_len=$T --set training.batch_size=$B --set training.steps=$steps --set training.threads=$threads \
    --set training.warmup_steps=1 --set data.train="$tmp/v$V/bench_*.bin" --set data.val="" --set eval.interval=0 \
    --set sample.interval=0 --set log.interval=1 --set log.metrics_file="$tmp/m$V.jsonl" train >"$tmp/mt$V.log" 2>&1 ||
    { tail -n 20 "$tmp/mt$V.log"; exit 1; }
  /usr/bin/python3 "$root/scripts/reference/llama_ref.py" bench --dim $d --n-layers $L --n-heads $H --n-kv-heads $KV \
    --ffn-dim $F --vocab-size $V --seq-len $T --batch-size $B --threads $threads --steps 5 --warmup 2 >"$tmp/ref$V.json"
done

/usr/bin/python3 - "$tmp" $d $L $H $KV $F $T $B <<'PY'
import json, statistics, sys
tmp = sys.argv[1]
d, L, H, KV, F, T, B = map(int, sys.argv[2:])
def step_ms(V):
    recs = [json.loads(l) for l in open(f"{tmp}/m{V}.jsonl") if '"loss"' in l]
    return statistics.median(r["step_ms"] for r in recs[2:])
def ref_ms(V):
    r = json.loads(open(f"{tmp}/ref{V}.json").read().strip().splitlines()[-1])
    return 1e3 * B * T / r["tokens_per_s"]
def flops(V):  # 6 N + 12 L d T per token, N without the embedding (lm_head's matmul counted)
    hd = d // H
    n = L * (2 * d * H * hd + 2 * d * KV * hd + 3 * d * F + 2 * d) + d + V * d
    return 6 * n + 12 * L * d * T
base = step_ms(256)
print(f"model body: dim {d}, {L} layers, {H} heads ({KV} kv), ffn {F}; batch {B} x seq {T}, fp32, 1 rank x 2 threads")
print(f"{'vocab':>8} {'meshtrain ms':>13} {'PyTorch ms':>11} {'ratio':>6} {'logits share':>13} {'FLOP share':>11}")
for V in (256, 32000, 128256):
    ms, ref = step_ms(V), ref_ms(V)
    share = (ms - base) / ms if V != 256 else 0.0
    fshare = 6 * V * d / flops(V)
    print(f"{V:>8} {ms:>13.1f} {ref:>11.1f} {ref / ms:>5.2f}x {100 * share:>12.0f}% {100 * fshare:>10.0f}%")
print(f"128,256 / 32,000: meshtrain {step_ms(128256) / step_ms(32000):.2f}x the step time, "
      f"PyTorch {ref_ms(128256) / ref_ms(32000):.2f}x, FLOPs {flops(128256) / flops(32000):.2f}x")
PY
