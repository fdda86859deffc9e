#!/usr/bin/env bash
# A model larger than any one rank (issue 25): a 31M-parameter Llama (16 layers; f32 weights 118 MiB, full training
# state 16 B x 31M = 471 MiB) trains on 8 ranks each capped at 112 MiB of tensors (with --full: 24 layers, 46M
# parameters, 176 MiB of f32 weights, a cap of 170 MiB; training.memory_limit_mb: the host allocator's own cap, which
# fails with an error naming the key instead of the kernel killing the rank; prlimit --as would count the address
# space of MPI's shared memory and the CUDA libraries, not the tensors). Under the cap: sharded creation on
# dp_shard 8, 5 steps, a sharded save, a resume on dp_shard 4 x tp 2 for 5 more steps, losses within 1e-5 of an
# uncapped run; the saved directory loads in scripts/reference/llama_ref.py with the logits meshtrain computes. The
# same cap kills the whole-model path (every rank making every parameter whole, rank 0 gathering to save), checked
# here by the error a cap just above one rank's share gives a 1-rank run.
# Prints "scale: N passed, N failed" last.
#   tests/cli/test_scale.sh BUILD_DIR [--full]
set -uo pipefail
build=${1:?usage: test_scale.sh BUILD_DIR [--full]}
# layers, the cap per rank (MiB, below the f32 weights), the f32 weights (MiB) and a rank's share at creation (MiB).
layers=16 cap_mb=112 weights_mb=118 share=59.
[ "${2:-}" = --full ] && layers=24 cap_mb=170 weights_mb=176 share=88.

source "$(dirname "$0")/common.sh"

docs_data
# min_weight_size 1024: every matrix is sharded; 16 (or 24) layers so that one gathered layer (7.7 MiB) is small
# beside a rank's share of the state (59 or 88 MiB): the gathered weights, their gradients and the activations take
# about 37 MiB above the share (12 layers do not fit below their own f32 weights).
write_yaml "dim: 384, n_layers: $layers, n_heads: 6, n_kv_heads: 6, ffn_dim: 1152, vocab_size: 256, max_seq_len: 64" \
  "steps: 10, batch_size: 8, seq_len: 64, schedule: constant" \
  "parallel: {dp_replicate: 1, fsdp: {min_weight_size: 1024}}
checkpoint: {interval: 5, keep: 0}"
sed -i 's/^eval: .*/eval: {interval: 0}/; s/^sample: .*/sample: {interval: 0}/' "$tmp/t.yaml"
cap=(--set training.memory_limit_mb=$cap_mb)

# The uncapped reference: 10 steps on dp_shard 8.
train free 8 --set parallel.dp_shard=8 || bad "uncapped dp_shard=8 run" "$(tail -n 20 "$tmp/free.log")"
# Capped: 5 steps and a save on dp_shard 8, then 5 more on dp_shard 4 x tp 2 from that checkpoint (a constant
# schedule: the learning rate does not depend on training.steps).
if train capped 8 --set parallel.dp_shard=8 --set training.steps=5 "${cap[@]}" --set checkpoint.dir="$tmp/capped.ckpt"; then
  ok "under a $cap_mb MiB cap per rank (f32 weights $weights_mb MiB): created, 5 steps, saved on dp_shard=8"
  expect "creation held only this rank's part" zero "host memory at the peak of creating the model on rank 0: $share" -- cat "$tmp/capped.log"
else
  bad "capped dp_shard=8 run" "$(tail -n 20 "$tmp/capped.log")"
fi
ck="$tmp/capped.ckpt/step_00000005"
check "the checkpoint is sharded over 8 writers" -- test -f "$ck/model-00008-of-00008.safetensors" -a \
  -f "$ck/optimizer-00008-of-00008.safetensors" -a -f "$ck/model.safetensors.index.json"
timeout 600 "$mpirun" -np 8 "$mt" --config "$tmp/t.yaml" --set parallel.dp_shard=4 --set parallel.tp=2 "${cap[@]}" \
  --set checkpoint.dir="$tmp/capped.ckpt" --set log.metrics_file="$tmp/resumed.jsonl" train >"$tmp/resumed.log" 2>&1 &&
  expect "resumed under the cap on dp_shard=4 x tp=2" zero "resumed from $ck at step 5" -- cat "$tmp/resumed.log" ||
  bad "capped resume on dp_shard=4 x tp=2" "$(tail -n 20 "$tmp/resumed.log")"
cat "$tmp/capped.jsonl" "$tmp/resumed.jsonl" >"$tmp/both.jsonl" 2>/dev/null
check "the capped runs' 10 losses equal the uncapped run's within 1e-5" -- "$py" "$compare" "$tmp/both.jsonl" "$tmp/free.jsonl" \
  --steps 10 --rel0 1e-5 --abs 1e-5

# The saved directory in the PyTorch reference: the logits meshtrain computes (on 2 ranks, no cap) for 8 tokens.
check_logits "the sharded checkpoint" 2 "$ck"

# The whole model on one rank under the same cap: refused before anything is allocated (the model's size against the
# rank's memory, training.memory_limit_mb here), naming the keys, not a kill.
expect "the whole model on one rank under the cap is a clear error" nonzero "the model does not fit in this rank's memory: model.n_layers = $layers" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" "${cap[@]}" --set checkpoint.dir="$tmp/one.ckpt" train

summary scale
[ $failed -eq 0 ]
