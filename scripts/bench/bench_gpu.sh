#!/usr/bin/env bash
# Issue 6's GPU benchmarks in one run, with a summary table:
#  1. meshtrain training a ~1B Llama (dim 2048, 16 layers, 16 heads, 8 kv heads, ffn 5632, vocab 32000,
#     seq 2048, bf16) on one GPU: median tokens/s after the first 5 steps, MFU against 989 TFLOP/s
#     (6N + 12 L d T FLOPs per token), peak device memory beside the model state it expects;
#  2. PyTorch on the same model, batch and sequence (scripts/bench/torch_llama_bench.py): eager with SDPA
#     and torch.compile; the ratio meshtrain / compiled (target >= 1.1);
#  3. attention alone, causal, head dim 128, seq 8192, forward+backward TFLOP/s (target >= 330) beside
#     PyTorch's SDPA on the same shapes.
# Each part that fails prints its error row and the script goes on. Raw JSON lines go to
# $OUT/bench_gpu.jsonl (or runs/bench_gpu.jsonl).
#   scripts/bench/bench_gpu.sh [BUILD_DIR] [--batch-size 8] [--steps 30] [--quick]
# --quick: a tiny model and short sequences (a smoke test; on a machine without a GPU the PyTorch and
# attention parts run on the CPU and meshtrain's GPU run reports its error).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$root/build
batch=8   # 8 x 2048 tokens: ~17 GiB of model state + activations, well inside an 80 GiB H100
steps=30
quick=0
while [ $# -gt 0 ]; do
  case $1 in
    --batch-size) batch=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    -*) echo "bench_gpu.sh: unknown option $1" >&2; exit 2 ;;
    *) build=$1; shift ;;
  esac
done
py=python3  # the one that has torch (Debian's on the CI VM, the GPU machine's own there)
for c in python3 /usr/bin/python3; do
  if "$c" -c "import torch" 2>/dev/null; then py=$c; break; fi
done
mpirun=${MPIRUN:-$root/scripts/mpirun.sh}
device=cuda
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || device=cpu
out_dir=${OUT:-$root/runs}
mkdir -p "$out_dir"
results=$out_dir/bench_gpu.jsonl
: >"$results"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ $quick = 1 ]; then
  model=(64 2 4 2 128 256) seq=64 batch=2 steps=6 att=(1 4 4 256 64)
else
  model=(2048 16 16 8 5632 32000) seq=2048 att=(4 16 16 8192 128)
fi
read -r dim layers heads kv ffn vocab <<<"${model[*]}"
read -r aB aH aKV aT ahd <<<"${att[*]}"

# 1. meshtrain: random tokens in an llm.c shard (the data does not change the speed).
"$py" - "$tmp/rand_train_000.bin" "$vocab" "$(( (steps + 2) * batch * seq + 1 ))" <<'PY'
import random, struct, sys
path, vocab, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(0)
with open(path, "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
    f.write(struct.pack(f"<{n}H", *(rng.randrange(vocab) for _ in range(n))))
PY
cat >"$tmp/bench.yaml" <<YAML
model: {dim: $dim, n_layers: $layers, n_heads: $heads, n_kv_heads: $kv, ffn_dim: $ffn, vocab_size: $vocab, max_seq_len: $seq}
training: {steps: $steps, batch_size: $batch, seq_len: $seq, dtype: $([ $device = cpu ] && echo fp32 || echo bf16), warmup_steps: 5, lr: 3.0e-4, lr_min: 3.0e-5}
data: {train: "$tmp/rand_train_*.bin", val: ""}
eval: {interval: 0}
sample: {interval: 0}
checkpoint: {dir: ""}
comm: {device: $device}
log: {interval: 1, metrics_file: "$tmp/mt.jsonl"}
YAML
if "$mpirun" -np 1 "$build/meshtrain" --config "$tmp/bench.yaml" train >"$tmp/mt.log" 2>&1; then
  "$py" - "$tmp/mt.jsonl" "$batch" "$seq" <<'PY' >>"$results"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
rows = rows[5:] or rows
tps = sorted(r["tokens_per_s"] for r in rows)[len(rows) // 2]
mfu = sorted(r["mfu"] for r in rows)[len(rows) // 2]
mem = max(r["peak_mem_bytes"] for r in rows)
print(json.dumps({"impl": "meshtrain", "tokens_per_s": round(tps, 1), "mfu": round(mfu, 4),
                  "peak_mem_gib": round(mem / 2**30, 2), "batch": int(sys.argv[2]), "seq": int(sys.argv[3])}))
PY
  grep -h "model state on rank 0" "$tmp/mt.log" | sed 's/.*\] //' | head -n 1 >"$tmp/state.txt"
else
  err=$(grep -a -m1 -E "error|\[cuda\]|\[attention\]" "$tmp/mt.log" | sed 's/"/\\"/g' | cut -c1-200)
  echo "{\"impl\": \"meshtrain\", \"error\": \"${err:-exit $?}\"}" >>"$results"
fi

# 2. PyTorch on the same model, batch and sequence.
"$py" "$root/scripts/bench/torch_llama_bench.py" --device "$device" --dim "$dim" --n-layers "$layers" --n-heads "$heads" \
  --n-kv-heads "$kv" --ffn-dim "$ffn" --vocab-size "$vocab" --seq-len "$seq" --batch-size "$batch" \
  --steps $((steps > 10 ? 10 : steps)) --warmup 3 --mode both $([ $device = cpu ] && echo --dtype fp32) \
  >>"$results" 2>"$tmp/torch.err" || echo "{\"impl\": \"torch\", \"error\": \"$(tail -n 1 "$tmp/torch.err" | sed 's/"/\\"/g' | cut -c1-200)\"}" >>"$results"

# 3. Attention alone: meshtrain's kernel and PyTorch's SDPA, same shapes and FLOP count.
adtype=bf16
[ $device = cpu ] && adtype=f32
"$build/scripts/bench/bench_attention" --device "$device" --dtype $adtype --B "$aB" --H "$aH" --KV "$aKV" --T "$aT" \
  --hd "$ahd" >>"$results" 2>"$tmp/att.err" || true
"$py" "$root/scripts/bench/attention_torch.py" --device "$device" --dtype "$([ $adtype = f32 ] && echo fp32 || echo bf16)" \
  --B "$aB" --H "$aH" --KV "$aKV" --T "$aT" --hd "$ahd" >>"$results" 2>"$tmp/att_torch.err" ||
  echo "{\"kernel\": \"torch_sdpa\", \"error\": \"$(tail -n 1 "$tmp/att_torch.err" | sed 's/"/\\"/g' | cut -c1-200)\"}" >>"$results"

# Summary.
"$py" - "$results" "$(cat "$tmp/state.txt" 2>/dev/null)" "$device" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {(r["impl"] if "impl" in r else "attention_" + r.get("kernel", "?")): r for r in rows}
def fmt(r, key, f="{:.1f}"):
    if r is None: return "-"
    if "error" in r: return "error: " + str(r["error"])[:60]
    return f.format(r[key]) if key in r else "-"
print(f"\n== GPU benchmarks ({sys.argv[3]})")
for name in ("meshtrain", "torch_eager", "torch_compile"):
    r = by.get(name) or by.get("torch" if name.startswith("torch") else name)
    if r is not None and "error" in r:
        print(f"{name:14s} error: {str(r['error'])[:100]}")
        continue
    print(f"{name:14s} tokens/s {fmt(r, 'tokens_per_s'):>12s}   MFU {fmt(r, 'mfu', '{:.1%}'):>8s}   "
          f"peak memory {fmt(r, 'peak_mem_gib', '{:.2f} GiB'):>10s}")
m, c = by.get("meshtrain"), by.get("torch_compile")
if m and c and "tokens_per_s" in m and "tokens_per_s" in c:
    print(f"meshtrain / torch.compile: {m['tokens_per_s'] / c['tokens_per_s']:.2f}x (target >= 1.1)")
if m and "mfu" in m:
    print(f"meshtrain MFU {m['mfu']:.1%} (target >= 50% of 989 TFLOP/s)")
if sys.argv[2]:
    print(f"expected model state: {sys.argv[2]}")
a, t = by.get("attention_meshtrain"), by.get("attention_torch_sdpa")
print(f"attention fwd+bwd TFLOP/s: meshtrain {fmt(a, 'fwdbwd_tflops')}, torch SDPA {fmt(t, 'fwdbwd_tflops')} "
      f"(target >= 330); forward: {fmt(a, 'fwd_tflops')} vs {fmt(t, 'fwd_tflops')}")
PY
# The flash kernel alone, timed with CUDA events, over both head dims and two lengths (one JSON line each).
if [ $device = cuda ] && [ -x "$build/scripts/bench/bench_attention_gpu" ] && [ $quick = 0 ]; then
  echo "== flash attention kernel alone (bench_attention_gpu, CUDA events, causal, B 4, H 16)"
  "$build/scripts/bench/bench_attention_gpu" --T 2048,8192 --hd 64,128 | tee "$out_dir/bench_attention_gpu.jsonl"
fi
echo "raw results: $results"
