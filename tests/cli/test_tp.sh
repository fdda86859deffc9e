#!/usr/bin/env bash
# Tensor and sequence parallel end to end (parallelism invariance: any mesh gives the losses of 1 rank): tp = 2 and 4,
# with and without sequence parallel and loss parallel, dp_replicate = 2 x tp = 2
# and dp_replicate = 2 x tp = 4, give the losses of 1 rank over 20 steps; also
# when started from the same Hugging Face-named checkpoint; a YAML plan equal to
# the default gives the same; plan errors give their messages; `meshtrain plan`
# prints the layouts and the bytes. Prints "tp: N passed, N failed" last.
#   tests/cli/test_tp.sh BUILD_DIR [--full]
set -uo pipefail
build=${1:?usage: test_tp.sh BUILD_DIR}
full=0
[ "${2:-}" = "--full" ] && full=1

source "$(dirname "$0")/common.sh"

docs_data
# ffn_dim 100 and vocab 250 do not divide by 4 or 8: uneven shards of MLP and vocabulary.
write_yaml "dim: 64, n_layers: 2, n_heads: 8, n_kv_heads: 4, ffn_dim: 100, vocab_size: 250, max_seq_len: 32" \
  "steps: 20, batch_size: 8, seq_len: 32"
# The docs are plain ASCII (< 128), so vocabulary 250 holds every byte.

train base 1 --set checkpoint.dir="$tmp/base.ckpt" --set checkpoint.interval=10 ||
  bad "1-rank baseline" "$(tail -n 20 "$tmp/base.log")"
same_as base tp2 2 "tp=2 (sequence + loss parallel)" --set parallel.tp=2 --set parallel.dp_replicate=1
same_as base tp2_nosp 2 "tp=2 without sequence parallel" --set parallel.tp=2 --set parallel.dp_replicate=1 --set parallel.sequence_parallel=false
same_as base tp2_nolp 2 "tp=2 without loss parallel" --set parallel.tp=2 --set parallel.dp_replicate=1 --set parallel.loss_parallel=false
same_as base tp4 4 "tp=4 (sequence + loss parallel)" --set parallel.tp=4 --set parallel.dp_replicate=1
same_as base tp4_plain 4 "tp=4 without sequence or loss parallel" --set parallel.tp=4 --set parallel.dp_replicate=1 --set parallel.sequence_parallel=false --set parallel.loss_parallel=false
same_as base dp2tp2 4 "dp_replicate=2 x tp=2" --set parallel.tp=2 --set parallel.dp_replicate=2
same_as base dp2tp4 8 "dp_replicate=2 x tp=4" --set parallel.tp=4 --set parallel.dp_replicate=2
if [ $full -eq 1 ]; then
  same_as base tp8 8 "tp=8" --set parallel.tp=8 --set parallel.dp_replicate=1 --set model.n_heads=8 --set model.n_kv_heads=8
fi

# A 1-rank checkpoint resumed on dp = 2 x tp = 2 (exact resume, on another mesh: the same losses).
if train resume_tp 4 --set parallel.tp=2 --set parallel.dp_replicate=2 --set checkpoint.dir="$tmp/resume_tp.ckpt" \
    --set checkpoint.resume="$tmp/base.ckpt/step_00000010"; then
  if out=$("$py" "$compare" "$tmp/resume_tp.jsonl" "$tmp/base.jsonl" --from-step 10 --steps 10 2>&1); then
    ok "a 1-rank checkpoint resumed on dp=2 x tp=2: $out"; else bad "resume on tp" "$out"; fi
else
  bad "resume on tp" "$(tail -n 20 "$tmp/resume_tp.log")"
fi

# The same Hugging Face-named checkpoint loaded on 1 rank and on tp = 2.
"$py" "$root/scripts/reference/llama_ref.py" init --out "$tmp/hf" --dim 64 --n-layers 2 --n-heads 8 --n-kv-heads 4 \
  --ffn-dim 100 --vocab-size 250 --max-seq-len 32 --seed 5 >/dev/null 2>&1 || bad "reference init"
train hf1 1 --set model.init_from="$tmp/hf" || bad "init_from on 1 rank" "$(tail -n 20 "$tmp/hf1.log")"
if train hf_tp2 4 --set model.init_from="$tmp/hf" --set parallel.tp=2 --set parallel.dp_replicate=2; then
  if out=$("$py" "$compare" "$tmp/hf_tp2.jsonl" "$tmp/hf1.jsonl" --steps 20 2>&1); then
    ok "init_from the same checkpoint: dp=2 x tp=2 matches 1 rank: $out"; else bad "init_from with tp" "$out"; fi
else
  bad "init_from with tp" "$(tail -n 20 "$tmp/hf_tp2.log")"
fi

# A YAML plan written out equal to the default gives the same run.
cat >"$tmp/plan.yaml" <<'YAML'
parallel:
  tp_plan:
    - {pattern: model.embed_tokens, style: RowwiseParallel, input_layouts: Replicate, output_layouts: Shard(1)}
    - {pattern: model.norm, style: SequenceParallel}
    - {pattern: lm_head, style: ColwiseParallel, input_layouts: Shard(1), output_layouts: Shard(-1)}
    - {pattern: "model.layers.*.*_layernorm", style: SequenceParallel}
    - {pattern: "model.layers.*.self_attn", style: PrepareModuleInput, input_layouts: Shard(1), desired_input_layouts: Replicate}
    - {pattern: "model.layers.*.mlp", style: PrepareModuleInput, input_layouts: Shard(1), desired_input_layouts: Replicate}
    - {pattern: "**.q_proj", style: ColwiseParallel}
    - {pattern: "**.k_proj", style: ColwiseParallel}
    - {pattern: "**.v_proj", style: ColwiseParallel}
    - {pattern: "**.gate_proj", style: ColwiseParallel}
    - {pattern: "**.up_proj", style: ColwiseParallel}
    - {pattern: "**.o_proj", style: RowwiseParallel, output_layouts: Shard(1)}
    - {pattern: "**.down_proj", style: RowwiseParallel, output_layouts: Shard(1)}
YAML
cat "$tmp/t.yaml" "$tmp/plan.yaml" >"$tmp/t_plan.yaml"
if timeout 300 "$mpirun" -np 2 "$mt" --config "$tmp/t_plan.yaml" --set log.metrics_file="$tmp/yaml.jsonl" \
    --set parallel.tp=2 --set parallel.dp_replicate=1 train >"$tmp/yaml.log" 2>&1; then
  if out=$("$py" "$compare" "$tmp/yaml.jsonl" "$tmp/tp2.jsonl" --exact --steps 20 2>&1); then
    ok "a YAML plan equal to the default gives the same losses bit for bit"; else bad "YAML plan" "$out"; fi
else
  bad "YAML plan" "$(tail -n 20 "$tmp/yaml.log")"
fi

# Plan errors.
plan_error() {  # plan_error NAME TEXT YAML-ENTRY...
  local name=$1 text=$2
  shift 2
  { cat "$tmp/t.yaml"; echo "parallel:"; echo "  tp_plan:"; for e in "$@"; do echo "    - $e"; done; } >"$tmp/err.yaml"
  expect "plan error: $name" nonzero "$text" -- "$mpirun" -np 2 "$mt" --config "$tmp/err.yaml" --set parallel.tp=2 \
    --set parallel.dp_replicate=1 train
}
plan_error "unmatched pattern" "plan pattern 'model.layers.*.attn.q_proj' (ColwiseParallel) matches no module" \
  "{pattern: model.layers.*.attn.q_proj, style: ColwiseParallel}"
plan_error "double match" "model.layers.0.self_attn.q_proj is matched by two plan entries: '**.q_proj' (ColwiseParallel) and 'model.layers.*.self_attn.*' (RowwiseParallel)" \
  "{pattern: '**.q_proj', style: ColwiseParallel}" "{pattern: 'model.layers.*.self_attn.*', style: RowwiseParallel}"
plan_error "unsupported module type" "ColwiseParallel cannot handle model.norm (RMSNorm): it applies to Linear and Embedding modules" \
  "{pattern: model.norm, style: ColwiseParallel}"
plan_error "sequence parallel on a Linear" "SequenceParallel cannot handle lm_head (Linear)" "{pattern: lm_head, style: SequenceParallel}"
plan_error "unknown style" "parallel.tp_plan[0].style = 'ColParallel': expected ColwiseParallel" "{pattern: lm_head, style: ColParallel}"
plan_error "an argument the style does not take" "parallel.tp_plan[0].use_local_output: ColwiseParallel takes input_layouts, output_layouts" \
  "{pattern: lm_head, style: ColwiseParallel, use_local_output: 'false'}"
plan_error "bad placement" "parallel.tp_plan[0].output_layouts = 'Shard(x)': expected a placement" \
  "{pattern: lm_head, style: ColwiseParallel, output_layouts: Shard(x)}"
expect "indivisible heads" nonzero "model.n_heads = 8 and model.n_kv_heads = 4 must both be divisible by parallel.tp = 8" -- \
  "$mpirun" -np 8 "$mt" --config "$tmp/t.yaml" --set parallel.tp=8 --set parallel.dp_replicate=1 train
expect "sequence length" nonzero "training.seq_len = 30 must be a multiple of 4: parallel.tp = 4 with sequence_parallel" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set parallel.tp=4 --set parallel.dp_replicate=1 --set training.seq_len=30 train

# meshtrain plan: layouts per rank and the communication of a step.
expect "meshtrain plan: parameter layouts" zero "model.layers.0.self_attn.q_proj.weight" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set parallel.tp=2 --set parallel.dp_replicate=2 plan
cp "$tmp/out" "$tmp/plan.out"
expect "meshtrain plan: module hooks" zero "model.layers.0.self_attn: input S(1) -> R on tp" -- cat "$tmp/plan.out"
expect "meshtrain plan: measured bytes equal the analytic count (consistency: runtime vs its formula)" zero \
  "tp activations: measured = analytic" -- cat "$tmp/plan.out"
# Counted here: per direction 2 layers x 4 + 2 all-gathers/reduce-scatters of a 4 x 32 x 64 f32 activation, half
# of it each (tp = 2).
same_count "meshtrain plan: forward tp bytes = the test's own count" "$(counted "$tmp/plan.out" forward layout)" \
  $(((4 * 2 + 2) * 4 * 32 * 64 * 4 / 2))
same_count "meshtrain plan: backward tp bytes = the test's own count" "$(counted "$tmp/plan.out" backward layout)" \
  $(((4 * 2 + 2) * 4 * 32 * 64 * 4 / 2))

echo "tp: $passed passed, $failed failed"
[ $failed -eq 0 ]
