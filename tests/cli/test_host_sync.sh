#!/usr/bin/env bash
# Host synchronisations per training step (the count `log.level: debug` prints as "host syncs this step: N").
# The CPU backend counts the code points where a GPU run waits for its device, so this runs on any machine:
# on 1 rank, tp = 2 (sequence and loss parallel), dp_shard = 2 (fully_shard) and cp = 2, with several
# micro-batches and gradient clipping on, every step must make exactly the one documented host read (loss and
# grad norm together, for the non-finite rule and the clip scale), logged step or not.
# MoE (docs/design/moe.md, "Host synchronisations"): the router statistics ride on the same read and the routing stays
# on the device, so ep 1 dropless (also with the selection bias's updates) and ep 2 with a capacity make the same one;
# dropless ep 2 reads each sparse layer's counts once per forward: 1 + micro-batches x sparse layers. On the CPU
# counters, and with EMU_BUILD_DIR (the emulated CUDA build, tests/cli/test_emulated.sh) on the emulated device: ep 1,
# and ep 2 with a capacity on the NCCL stand-in.
# Prints "host_sync: N passed, N failed[, N skipped]" last.
#   tests/cli/test_host_sync.sh BUILD_DIR [EMU_BUILD_DIR]
set -uo pipefail
build=${1:?usage: test_host_sync.sh BUILD_DIR [EMU_BUILD_DIR]}
emu=${2:-}

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
# (want and bin: the count and the binary, max_syncs and $mt unless check_with sets them.)
want=$max_syncs
bin=$mt
check() {
  local name=$1 np=$2 max_syncs=$want
  shift 2
  if ! timeout 600 "$mpirun" -np "$np" "$bin" --config "$tmp/t.yaml" "$@" train >"$tmp/$name.log" 2>&1; then
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

# check_with WANT BIN NAME NP [--set ...]: check with another count or binary.
check_with() {
  local w=$1 b=$2
  shift 2
  want=$w bin=$b check "$@"
  want=$max_syncs bin=$mt
}
# MoE: mixtral, 4 experts top-2 in both layers, the balance loss on; micro-batches of 2 rows.
moe=(--set model.type=mixtral --set model.moe.n_experts=4 --set model.moe.ffn_dim=48
     --set model.moe.output_router_logits=true)
cap=(--set model.moe.capacity_factor=1.5)
check moe_ep1_dropless 1 "${moe[@]}"
# The aux-loss-free balancing's bias: updated and reported from its host copy, no read.
check moe_ep1_bias 1 "${moe[@]}" --set model.moe.bias_update_rate=0.001
check moe_ep2_capacity 2 "${moe[@]}" "${cap[@]}" --set parallel.ep=2 --set parallel.dp_replicate=1
# Dropless ep: 1 + 2 micro-batches (each rank's 4 rows of the 8) x 2 sparse layers.
check_with 5 "$mt" moe_ep2_dropless 2 "${moe[@]}" --set parallel.ep=2 --set parallel.dp_replicate=1
# ... which start-up says, naming the key that removes them; with a capacity it says nothing.
if grep -aq "dropless expert parallel.*one host sync per sparse layer.*model.moe.capacity_factor > 0" \
     "$tmp/moe_ep2_dropless.log" && ! grep -aq "dropless expert parallel" "$tmp/moe_ep2_capacity.log"; then
  ok "dropless ep says at start-up that it syncs per sparse layer and that a capacity removes it"
else
  bad "the dropless ep start-up line" "$(grep -a "dropless" "$tmp/moe_ep2_dropless.log" "$tmp/moe_ep2_capacity.log" | head -n 3)"
fi
# On the emulated device (comm.device cuda): the routing, the grouped GEMMs and the statistics as CUDA kernels, ep 2
# on the NCCL stand-in (a device each); 2 short steps (4 rows of 16 tokens), the emulator being slow.
if [ -n "$emu" ] && [ -x "$emu/meshtrain" ]; then
  steps=2
  emu_set=(--set comm.device=cuda --set training.steps=2 --set training.batch_size=4 --set training.seq_len=16
           --set eval.interval=0 --set sample.interval=0)
  check_with 1 "$emu/meshtrain" emu_moe_ep1_dropless 1 "${moe[@]}" "${emu_set[@]}"
  MT_EMU_DEVICES=2 check_with 1 "$emu/meshtrain" emu_moe_ep2_capacity_nccl 2 "${moe[@]}" "${cap[@]}" "${emu_set[@]}" \
    --set comm.backend=nccl --set parallel.ep=2 --set parallel.dp_replicate=1
else
  skip "MoE host syncs on the emulated device" "no emulated build given (EMU_BUILD_DIR: build-emu's meshtrain)"
fi

summary host_sync
[ "$failed" -eq 0 ]
