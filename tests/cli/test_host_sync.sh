#!/usr/bin/env bash
# Host synchronisations per training step (the count `log.level: debug` prints as "host syncs this step: N").
# The CPU backend counts the code points where a GPU run waits for its device, so this runs on any machine:
# on 1 rank, tp = 2 (sequence and loss parallel), dp_shard = 2 (fully_shard) and cp = 2, with several
# micro-batches and gradient clipping on, every step must make exactly the one documented host read (loss and
# grad norm together, for the non-finite rule and the clip scale), logged step or not.
# Prints "host_sync: N passed, N failed" last.
#   tests/cli/test_host_sync.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_host_sync.sh BUILD_DIR}

source "$(dirname "$0")/common.sh"

# The documented number of host syncs in a step (docs/ARCHITECTURE.md, "Host synchronisations").
max_syncs=1
steps=5

docs_data
cat >"$tmp/t.yaml" <<YAML
model: {dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 96, vocab_size: 250, max_seq_len: 32}
training: {steps: $steps, batch_size: 8, micro_batch_size: 2, seq_len: 32, lr: 3.0e-3, warmup_steps: 2, grad_clip: 0.5,
           threads: 1}
data: {train: "$tmp/data/docs_train_*.bin"}
log: {interval: 4, level: debug}
YAML

# check NAME NP [--set ...]: every rank logs every step's count, and each is exactly max_syncs.
check() {
  local name=$1 np=$2
  shift 2
  if ! timeout 600 "$mpirun" -np "$np" "$mt" --config "$tmp/t.yaml" "$@" train >"$tmp/$name.log" 2>&1; then
    bad "$name: training failed" "$(tail -n 15 "$tmp/$name.log")"
    return
  fi
  local lines counts
  lines=$(grep -a -c "host syncs this step:" "$tmp/$name.log")
  if [ "$lines" -ne $((np * steps)) ]; then
    bad "$name: $lines count lines, expected $((np * steps)) ($np ranks x $steps steps)" \
      "$(grep -a "host syncs" "$tmp/$name.log" | head -n 5)"
    return
  fi
  counts=$(grep -a "host syncs this step:" "$tmp/$name.log" | sed 's/.*host syncs this step: //' | sort -u | tr '\n' ' ')
  if [ "$counts" = "$max_syncs " ]; then
    ok "$name: $max_syncs host sync in each of $steps steps on each of $np ranks (logged steps and not)"
  else
    bad "$name: host syncs per step were {$counts}, expected exactly $max_syncs" \
      "$(grep -a "host syncs" "$tmp/$name.log" | head -n 8)"
  fi
}

check one_rank 1
check tp2 2 --set parallel.tp=2 --set parallel.dp_replicate=1
check tp2_no_sp 2 --set parallel.tp=2 --set parallel.dp_replicate=1 --set parallel.sequence_parallel=false
check fsdp2 2 --set parallel.dp_shard=2 --set parallel.dp_replicate=1
check cp2 2 --set parallel.cp=2 --set parallel.dp_replicate=1
check dp2_tp2 4 --set parallel.tp=2 --set parallel.dp_replicate=2
check fp8_tensorwise 1 --set training.dtype=bf16 --set training.fp8=tensorwise

summary host_sync
[ "$failed" -eq 0 ]
