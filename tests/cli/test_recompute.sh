#!/usr/bin/env bash
# Activation recompute end to end (parallel.recompute): whole decoder layers, selective (attention kept),
# every second layer and the MLPs alone give the losses of no recompute bit for bit over 20 steps (with
# validation and samples in between), on 1 rank, with tp = 2 and with cp = 2; bad patterns and keep
# entries are clear errors naming the key. Prints "recompute: N passed, N failed" last.
#   tests/cli/test_recompute.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_recompute.sh BUILD_DIR}

source "$(dirname "$0")/common.sh"
same_as_exact=1  # recompute changes no arithmetic: losses bit for bit

docs_data
write_yaml "dim: 64, n_layers: 4, n_heads: 8, n_kv_heads: 4, ffn_dim: 96, vocab_size: 256, max_seq_len: 64" \
  "steps: 20, batch_size: 4, seq_len: 64"
# same_as BASE NAME NP DESCRIPTION [--set ...]: the run's losses equal BASE's bit for bit, and so do its samples.
full=(--set 'parallel.recompute.patterns=["model.layers.*"]')
selective=(--set 'parallel.recompute.patterns=["model.layers.*"]' --set 'parallel.recompute.keep=[attention]')

train base 1 || bad "1-rank baseline" "$(tail -n 20 "$tmp/base.log")"
same_as base full 1 "1 rank, full recompute of every decoder layer" "${full[@]}"
same_as base selective 1 "1 rank, selective recompute (attention kept)" "${selective[@]}"
same_as base every2 1 "1 rank, every second layer" "${full[@]}" --set parallel.recompute.every=2
same_as base mlp 1 "1 rank, the MLPs" --set 'parallel.recompute.patterns=["model.layers.*.mlp"]'

tp2=(--set parallel.tp=2 --set parallel.dp_replicate=1)
train base_tp2 2 "${tp2[@]}" || bad "tp=2 baseline" "$(tail -n 20 "$tmp/base_tp2.log")"
same_as base_tp2 full_tp2 2 "tp=2, full recompute" "${tp2[@]}" "${full[@]}"
same_as base_tp2 selective_tp2 2 "tp=2, selective recompute" "${tp2[@]}" "${selective[@]}"

cp2=(--set parallel.cp=2 --set parallel.dp_replicate=1)
train base_cp2 2 "${cp2[@]}" || bad "cp=2 baseline" "$(tail -n 20 "$tmp/base_cp2.log")"
same_as base_cp2 full_cp2 2 "cp=2, full recompute" "${cp2[@]}" "${full[@]}"
same_as base_cp2 selective_cp2 2 "cp=2, selective recompute" "${cp2[@]}" "${selective[@]}"

# Bad input: errors name the key and what is wrong.
expect "a pattern matching nothing" nonzero \
  "parallel.recompute.patterns[0] = 'model.layer.*' matches no module of the model" -- \
  "$mt" --config "$tmp/t.yaml" --set 'parallel.recompute.patterns=["model.layer.*"]' train
expect "keep: [mlp]" nonzero "parallel.recompute.keep[0] = 'mlp': expected one of 'attention'" -- \
  "$mt" --config "$tmp/t.yaml" "${full[@]}" --set 'parallel.recompute.keep=[mlp]' train
expect "a module type recompute cannot handle" nonzero \
  "parallel.recompute.patterns[0] = 'model.norm' matches model.norm (RMSNorm): recompute applies to" -- \
  "$mt" --config "$tmp/t.yaml" --set 'parallel.recompute.patterns=[model.norm]' train
expect "every: 0" nonzero "parallel.recompute.every = 0" -- \
  "$mt" --config "$tmp/t.yaml" "${full[@]}" --set parallel.recompute.every=0 train

echo "recompute: $passed passed, $failed failed"
[ $failed -eq 0 ]
