#!/usr/bin/env bash
# training.fp8 on the CPU backend (docs/design/fp8.md; the CPU emulates E4M3/E5M2 bit-exactly, the reference the
# emulated CUDA device is compared with in test_emulated.sh):
#  - tensorwise and rowwise stay within 3% of bf16 over 20 steps, and differ from it (FP8 really runs: the test can
#    fail), and from each other;
#  - the same FP8 run twice gives the same losses (the casts are deterministic);
#  - fp8 on 2 ranks (tp 2, dp_shard 2) within 3% of bf16 on 1 rank at step 20;
#  - training.fp8 without training.dtype bf16 is refused at start-up naming both keys, before any step;
#  - lm_head and MoE routers stay bf16 (exempt: no fallback line names them);
#  - a Linear whose local weight is not made of multiples of 16 runs bf16 and says so once; a row count that is not
#    runs bf16, said once for all Linears.
# Prints "fp8: N passed, N failed" last.
#   tests/cli/test_fp8.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_fp8.sh BUILD_DIR}
source "$(dirname "$0")/common.sh"

docs_data
cat >"$tmp/t.yaml" <<YAML
model: {dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 128, vocab_size: 256, max_seq_len: 32}
training: {steps: 20, batch_size: 4, seq_len: 32, lr: 3.0e-3, warmup_steps: 2, grad_clip: 1.0, threads: 1, dtype: bf16}
data: {train: "$tmp/data/docs_train_*.bin", val: ""}
eval: {interval: 0}
sample: {interval: 0}
log: {interval: 1}
YAML

run() {  # run NAME NP [--set ...]
  local name=$1 np=$2
  shift 2
  timeout 600 "$mpirun" -np "$np" "$mt" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/$name.jsonl" "$@" train \
    >"$tmp/$name.log" 2>&1
}

# close WHAT A B TOL: A's loss at the last step within TOL (relative) of B's, and not bit-equal to it.
close() {
  local out
  if out=$("$py" - "$tmp/$2.jsonl" "$tmp/$3.jsonl" "$4" <<'PY' 2>&1
import json, sys
def losses(p): return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if "loss" in r}
a, b, tol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
s = max(a)
assert s == max(b) == 20, f"last steps {s}, {max(b)}"
d = abs(a[s] - b[s]) / abs(b[s])
differ = sum(a[k] != b[k] for k in a)
print(f"step {s}: {a[s]:.6f} vs {b[s]:.6f}, relative {d:.4f}; {differ} of {len(a)} steps differ")
sys.exit(0 if d < tol and differ > 0 else 1)
PY
  ); then ok "$1: $out"; else bad "$1" "$out"; fi
}

if run bf16 1 && run tw 1 --set training.fp8=tensorwise && run rw 1 --set training.fp8=rowwise &&
  run tw_again 1 --set training.fp8=tensorwise; then
  close "tensorwise within 3% of bf16 at step 20, and not the same numbers" tw bf16 0.03
  close "rowwise within 3% of bf16 at step 20, and not the same numbers" rw bf16 0.03
  close "rowwise and tensorwise differ (other scales, E4M3 gradients)" rw tw 0.03
  if out=$("$py" "$compare" "$tmp/tw_again.jsonl" "$tmp/tw.jsonl" --rel0 0 --abs 0 --steps 20 2>&1); then
    ok "tensorwise twice: the same losses bit for bit: $out"
  else
    bad "tensorwise twice: the same losses" "$out"
  fi
  if grep -aq "runs in bf16" "$tmp/tw.log"; then
    bad "a model whose Linears all fit says nothing of a bf16 fallback" "$(grep -a "runs in bf16" "$tmp/tw.log" | head -n 3)"
  else
    ok "a model whose Linears all fit says nothing of a bf16 fallback"
  fi
else
  bad "fp8 runs on 1 rank" "$(tail -n 15 "$tmp/bf16.log" "$tmp/tw.log" "$tmp/rw.log" 2>/dev/null)"
fi

# 2 ranks: tp 2 (local shards: k/v 32 -> 16 columns each still fit) and fully_shard 2 (the gathered weight cast).
if run tw_tp2 2 --set training.fp8=tensorwise --set parallel.tp=2 --set parallel.dp_replicate=1 &&
  run tw_fsdp2 2 --set training.fp8=tensorwise --set parallel.dp_shard=2 --set parallel.dp_replicate=1 \
    --set parallel.fsdp.min_weight_size=0; then
  close "tp 2, tensorwise: within 3% of 1-rank bf16 at step 20" tw_tp2 bf16 0.03
  close "dp_shard 2, tensorwise: within 3% of 1-rank bf16 at step 20" tw_fsdp2 bf16 0.03
else
  bad "fp8 runs on 2 ranks" "$(tail -n 15 "$tmp/tw_tp2.log" "$tmp/tw_fsdp2.log" 2>/dev/null)"
fi

expect "training.fp8 with fp32 on 2 ranks is refused at start-up naming training.fp8 and training.dtype" nonzero \
  "training.fp8 = tensorwise needs training.dtype = bf16" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.fp8=tensorwise --set training.dtype=fp32 train
if grep -aq "^step " "$tmp/out"; then bad "the refusal comes before any step" "$(grep -a "^step " "$tmp/out" | head -n 2)"
else ok "the refusal comes before any step (config checks run on every rank before the mesh is made)"; fi
expect "an unknown recipe is refused naming training.fp8" nonzero "training.fp8" -- \
  "$mt" --config "$tmp/t.yaml" --set training.fp8=blockwise train

# ffn_dim 72: gate/up/down do not fit FP8's multiples of 16; they run bf16, each said once (3 lines per layer).
if run misfit 1 --set training.fp8=tensorwise --set model.ffn_dim=72 --set training.steps=3; then
  n=$(grep -a -c "runs in bf16" "$tmp/misfit.log")
  if [ "$n" -eq 6 ] && grep -aq "training.fp8: model.layers.0.mlp.down_proj runs in bf16" "$tmp/misfit.log"; then
    ok "Linears that do not fit run bf16, each said once ($n lines for 2 layers x gate, up, down)"
  else
    bad "the bf16 fallback said once per Linear" "$n lines" "$(grep -a "runs in bf16" "$tmp/misfit.log" | head -n 8)"
  fi
else
  bad "fp8 with a misfit ffn_dim" "$(tail -n 15 "$tmp/misfit.log")"
fi

# lm_head (vocab 250) and a mixtral router (4 experts) would not fit FP8: they are exempt (bf16 by the model's
# choice), so no fallback line names them; the experts' grouped GEMMs are not Linears (bf16 too).
if run exempt 1 --set training.fp8=tensorwise --set model.vocab_size=250 --set model.type=mixtral \
    --set model.moe.n_experts=4 --set model.moe.ffn_dim=64 --set training.steps=3; then
  if grep -aE "runs in bf16|such calls" "$tmp/exempt.log" | grep -q .; then
    bad "lm_head and the router are exempt from FP8" "$(grep -aE "runs in bf16|such calls" "$tmp/exempt.log" | head -n 4)"
  else
    ok "lm_head (vocab 250) and the router (4 experts) are exempt: no FP8 fallback names them"
  fi
else
  bad "fp8 with mixtral and vocab 250" "$(tail -n 15 "$tmp/exempt.log")"
fi

# seq_len 30: 4 x 30 = 120 rows, not a multiple of 16: every call runs bf16, said once for all Linears.
if run rows 1 --set training.fp8=tensorwise --set training.seq_len=30 --set training.steps=2; then
  n=$(grep -a -c "such calls run in bf16" "$tmp/rows.log")
  if [ "$n" -eq 1 ] && grep -aq "training.fp8: 120 rows (not a multiple of 16)" "$tmp/rows.log"; then
    ok "a row count that does not fit runs bf16, said once for all Linears"
  else
    bad "the row-count fallback said once" "$n lines" "$(grep -a "bf16" "$tmp/rows.log" | head -n 4)"
  fi
else
  bad "fp8 with 120 rows" "$(tail -n 15 "$tmp/rows.log")"
fi

summary fp8
[ "$failed" -eq 0 ]
