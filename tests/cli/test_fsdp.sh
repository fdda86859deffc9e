#!/usr/bin/env bash
# Fully sharded data parallel end to end (parallelism invariance): dp_shard = 2, 4, 8, dp_replicate 2 x dp_shard 2,
# dp_shard 2 x tp 2, dp_replicate 2 x dp_shard 2 x tp 2 and dp_shard 2 x cp 2, each also with
# reshard_after_forward false and with recompute, give the losses of 1 rank over 20 steps; a model whose weights
# only divide along the tp-sharded dim is sharded over both mesh dims; the model state on rank 0 equals the
# expected sharded count; `meshtrain plan` prints every layout decision and bytes equal to the analytic count;
# checkpoints saved on dp_shard = 4 resume on dp_replicate 2 x tp 2 and the reverse; bad input is a clear error.
# Prints "fsdp: N passed, N failed" last.
#   tests/cli/test_fsdp.sh BUILD_DIR [--full]
set -uo pipefail
build=${1:?usage: test_fsdp.sh BUILD_DIR}
full=0
[ "${2:-}" = "--full" ] && full=1

source "$(dirname "$0")/common.sh"

docs_data
# min_weight_size 1000: every matrix is sharded, the norm weights (64) stay replicated.
write_yaml "dim: 64, n_layers: 2, n_heads: 8, n_kv_heads: 4, ffn_dim: 96, vocab_size: 256, max_seq_len: 32" \
  "steps: 20, batch_size: 8, seq_len: 32" "parallel: {dp_replicate: 1, fsdp: {min_weight_size: 1000}}"

train base 1 || bad "1-rank baseline" "$(tail -n 20 "$tmp/base.log")"
meshes=("2|dp_shard=2|--set parallel.dp_shard=2"
        "4|dp_shard=4|--set parallel.dp_shard=4"
        "8|dp_shard=8|--set parallel.dp_shard=8"
        "4|dp_replicate=2 x dp_shard=2|--set parallel.dp_replicate=2 --set parallel.dp_shard=2"
        "4|dp_shard=2 x tp=2|--set parallel.dp_shard=2 --set parallel.tp=2"
        "8|dp_replicate=2 x dp_shard=2 x tp=2|--set parallel.dp_replicate=2 --set parallel.dp_shard=2 --set parallel.tp=2"
        "4|dp_shard=2 x cp=2|--set parallel.dp_shard=2 --set parallel.cp=2")
i=0
for m in "${meshes[@]}"; do
  IFS='|' read -r np what args <<<"$m"
  i=$((i + 1))
  # shellcheck disable=SC2086
  same_as base m$i "$np" "$what" $args
  # shellcheck disable=SC2086
  same_as base m${i}_keep "$np" "$what, reshard_after_forward false" $args --set parallel.fsdp.reshard_after_forward=false
  # shellcheck disable=SC2086
  same_as base m${i}_ac "$np" "$what, recompute" $args --set 'parallel.recompute.patterns=["model.layers.*"]'
done
# bf16 (f32 master weights, bf16 compute copies) with every matrix sharded: layers compute with the gathered
# weight, never this rank's compute copy of its shard (sharded creation once added the copy after fully_shard's
# state, so the shard won). The same losses as 1 rank in bf16, within bf16's reduction-order tolerance.
train bf1 1 --set training.dtype=bf16 || bad "bf16 1-rank baseline" "$(tail -n 20 "$tmp/bf1.log")"
for m in "2|dp_shard=2|--set parallel.dp_shard=2" "4|dp_shard=2 x tp=2|--set parallel.dp_shard=2 --set parallel.tp=2"; do
  IFS='|' read -r np what args <<<"$m"
  # shellcheck disable=SC2086
  if train "bf_$np" "$np" --set training.dtype=bf16 $args; then
    if out=$("$py" "$compare" "$tmp/bf_$np.jsonl" "$tmp/bf1.jsonl" --rel0 1e-3 --abs 5e-3 --steps 20 2>&1); then
      ok "bf16 $what, weights sharded: $out"; else bad "bf16 $what, weights sharded" "$out"; fi
  else
    bad "bf16 $what, weights sharded: train" "$(tail -n 5 "$tmp/bf_$np.log")"
  fi
done
# The model state on rank 0: the shards' and the replicated parameters' bytes, as the layouts predict.
for n in 2 4 8; do
  idx=$([ $n = 2 ] && echo 1 || ([ $n = 4 ] && echo 2 || echo 3))
  expect "model state on rank 0 at dp_shard=$n equals the expected sharded count" zero "elements (the rank's shards and the replicated small parameters): equal" -- \
    grep "model state on rank 0" "$tmp/m$idx.log"
done
# dp_shard=2 halves it (up to the replicated norm weights).
s1=$(grep -oE 'model state on rank 0: [0-9.]+' "$tmp/base.log" | grep -oE '[0-9.]+$')
s2=$(grep -oE 'model state on rank 0: [0-9.]+' "$tmp/m1.log" | grep -oE '[0-9.]+$')
if "$py" -c "import sys; a, b = float('$s1'), float('$s2'); sys.exit(0 if 0.49 < b / a < 0.52 else 1)"; then
  ok "dp_shard=2 holds about half the model state of 1 rank ($s2 of $s1 MiB)"; else bad "half the model state" "$s2 of $s1 MiB"; fi

# dp_shard = 3 x tp = 2 on a narrow model (dim 8): the MLP and embedding weights divide only along the
# tp-sharded dim (ffn 96 and vocab 256 by 3 x 2 = 6? 96 yes: sharded over both mesh dims; 256 no: a large weight
# nothing divides stays replicated, with a warning); the same losses as 1 rank.
odd=(--set model.dim=8 --set model.n_heads=2 --set model.n_kv_heads=2 --set training.batch_size=6 --set parallel.fsdp.min_weight_size=500)
train odd1 1 "${odd[@]}" || bad "narrow-model baseline" "$(tail -n 20 "$tmp/odd1.log")"
same_as odd1 odd_ds3tp2 6 "dp_shard=3 x tp=2, weights sharded over both mesh dims" "${odd[@]}" --set parallel.dp_shard=3 --set parallel.tp=2
"$mpirun" -np 6 "$mt" --config "$tmp/t.yaml" "${odd[@]}" --set parallel.dp_shard=3 --set parallel.tp=2 plan >"$tmp/odd_plan.out" 2>&1 ||
  bad "meshtrain plan on dp_shard=3 x tp=2" "$(tail -n 20 "$tmp/odd_plan.out")"
expect "meshtrain plan: a weight sharded over both mesh dims" zero "Shard(0) with tp: only dim 0 (96) divides, already sharded 2x: sharded over both (96 = 2 x 3 parts)" -- \
  grep "model.layers.0.mlp.gate_proj.weight" "$tmp/odd_plan.out"
expect "meshtrain plan: a large weight that nothing divides stays replicated" zero "replicated: no dim of (256, 8) divides by dp_shard = 3: stays replicated" -- \
  grep "model.embed_tokens.weight   " "$tmp/odd_plan.out"
expect "a large weight that nothing divides: a warning" zero "fully_shard: lm_head.weight: no dim of (256, 8) divides" -- cat "$tmp/odd_plan.out"

# meshtrain plan: every decision, and the bytes of a step against the analytic count.
for keep in true false; do
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set parallel.dp_shard=2 --set parallel.tp=2 \
    --set parallel.fsdp.reshard_after_forward=$keep plan >"$tmp/plan.out" 2>&1 || bad "meshtrain plan" "$(tail -n 20 "$tmp/plan.out")"
  expect "meshtrain plan (reshard_after_forward $keep): a decision" zero "Shard(1): largest dim divisible by dp_shard = 2: dim 1 (64)" -- \
    grep "model.layers.0.self_attn.q_proj.weight" "$tmp/plan.out"
  expect "meshtrain plan (reshard_after_forward $keep): replicated norm" zero "replicated: 64 elements <= min_weight_size 1000" -- \
    grep "model.norm.weight   " "$tmp/plan.out"
  expect "meshtrain plan (reshard_after_forward $keep): forward bytes = analytic (consistency: runtime vs its formula)" \
    zero "(equal)" -- grep "fsdp bytes per rank: forward" "$tmp/plan.out"
  expect "meshtrain plan (reshard_after_forward $keep): backward bytes = analytic (consistency: runtime vs its formula)" \
    zero "(equal)" -- grep "fsdp bytes per rank: backward" "$tmp/plan.out"
  # Counted here from the YAML: each rank's tp part of every sharded weight, halved by dp_shard = 2 (f32):
  # per layer q 32x64 + k, v 16x64 + o 64x32 + gate, up 48x64 + down 64x48 = 15360 / 2; embedding and lm_head
  # 128x64 / 2 each; the norms (64) stay replicated. One all-gather sends (2-1) x that.
  slot=$((2 * (32 * 64 + 2 * 16 * 64 + 64 * 32 + 3 * 48 * 64) / 2 + 2 * 128 * 64 / 2))
  same_count "meshtrain plan (reshard_after_forward $keep): forward fsdp bytes = the test's own count" \
    "$(counted "$tmp/plan.out" forward fsdp.)" $((slot * 4))
  want=$((slot * 4 * 2))
  [ $keep = false ] && want=$((slot * 4))
  same_count "meshtrain plan (reshard_after_forward $keep): backward fsdp bytes = the test's own count" \
    "$(counted "$tmp/plan.out" backward fsdp.)" $want
done

# Checkpoints hold whole Hugging Face tensors: saved on dp_shard = 4, resumed on dp_replicate 2 x tp 2, and the
# reverse; the same losses as the run that did not stop.
ck=(--set checkpoint.interval=10)
if train save_ds4 4 --set parallel.dp_shard=4 --set checkpoint.dir="$tmp/ds4.ckpt" "${ck[@]}" &&
   train resume_on_tp 4 --set parallel.dp_replicate=2 --set parallel.tp=2 --set checkpoint.dir="$tmp/r1.ckpt" \
     --set checkpoint.resume="$tmp/ds4.ckpt/step_00000010"; then
  if out=$("$py" "$compare" "$tmp/resume_on_tp.jsonl" "$tmp/base.jsonl" --from-step 10 --steps 10 2>&1); then
    ok "saved on dp_shard=4, resumed on dp_replicate=2 x tp=2: $out"; else bad "resume dp_shard -> tp" "$out"; fi
else
  bad "resume dp_shard -> tp" "$(tail -n 20 "$tmp/save_ds4.log" "$tmp/resume_on_tp.log" 2>/dev/null)"
fi
if train save_tp 4 --set parallel.dp_replicate=2 --set parallel.tp=2 --set checkpoint.dir="$tmp/tp.ckpt" "${ck[@]}" &&
   train resume_on_ds 4 --set parallel.dp_shard=4 --set checkpoint.dir="$tmp/r2.ckpt" \
     --set checkpoint.resume="$tmp/tp.ckpt/step_00000010"; then
  if out=$("$py" "$compare" "$tmp/resume_on_ds.jsonl" "$tmp/base.jsonl" --from-step 10 --steps 10 2>&1); then
    ok "saved on dp_replicate=2 x tp=2, resumed on dp_shard=4: $out"; else bad "resume tp -> dp_shard" "$out"; fi
else
  bad "resume tp -> dp_shard" "$(tail -n 20 "$tmp/save_tp.log" "$tmp/resume_on_ds.log" 2>/dev/null)"
fi

# Bad input.
expect "dp_shard does not divide the ranks" nonzero "parallel: dp_replicate*dp_shard*cp*tp = 1*3*1*1 = 3 but the job has 4 ranks" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set parallel.dp_shard=3 train
expect "a unit pattern that matches nothing" nonzero "parallel.fsdp.patterns: pattern 'model.layer.*' matches no module of the model" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set parallel.dp_shard=2 --set 'parallel.fsdp.patterns=["model.layer.*"]' train
expect "min_weight_size negative" nonzero "parallel.fsdp.min_weight_size = -5: expected a number of elements >= 0" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set parallel.dp_shard=2 --set parallel.fsdp.min_weight_size=-5 train
expect "param_dtype other than training.dtype" nonzero "parallel.fsdp.param_dtype = bf16 differs from training.dtype = fp32" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set parallel.dp_shard=2 --set parallel.fsdp.param_dtype=bf16 train
expect "a module in two units" nonzero "is in two units" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set parallel.dp_shard=2 --set 'parallel.fsdp.patterns=["model.layers.*", "model.layers.0.mlp"]' train

echo "fsdp: $passed passed, $failed failed"
[ $failed -eq 0 ]
