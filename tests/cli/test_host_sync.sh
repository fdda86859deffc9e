#!/usr/bin/env bash
# Host synchronisations per training step (the count `log.level: debug` prints as "host syncs this step: N").
# The CPU backend counts the code points where a GPU run waits for its device, so this runs on any machine:
# on 1 rank, tp = 2 (sequence and loss parallel), dp_shard = 2 (fully_shard) and cp = 2, with several
# micro-batches and gradient clipping on, every step must make exactly the one documented host read (loss and
# grad norm together, for the non-finite rule and the clip scale), logged step or not.
# MoE (docs/design/moe.md, "Host synchronisations"): the router statistics ride on the same read and the routing stays
# on the device, so ep 1 dropless (also with the selection bias's updates), ep 2 with a capacity and dropless ep 2
# (bounded: model.moe.dropless_bound's fixed blocks) make the same one, but for a step recomputed because its rows
# overflowed the bound: one read per attempt. Exact dropless ep 2 (dropless_bound 0) reads each sparse layer's counts
# once per forward: 1 + micro-batches x sparse layers. On the CPU counters, and with EMU_BUILD_DIR (the emulated CUDA
# build, tests/cli/test_emulated.sh) on the emulated device: ep 1, and ep 2 with a capacity and bounded dropless on
# the NCCL stand-in.
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
# Exact dropless ep: 1 + 2 micro-batches (each rank's 4 rows of the 8) x 2 sparse layers.
check_with 5 "$mt" moe_ep2_exact 2 "${moe[@]}" --set model.moe.dropless_bound=0 --set parallel.ep=2 \
  --set parallel.dp_replicate=1
# check_bounded NAME BIN NP [--set ...]: bounded dropless ep: every rank's step makes 1 + the times rank 0's log
# says it was recomputed ("step N had rows past the bound"; log.level debug: every rank logs it), and some step
# makes exactly 1.
check_bounded() {
  local name=$1 b=$2 np=$3
  shift 3
  if ! timeout 600 "$mpirun" -np "$np" "$b" --config "$tmp/t.yaml" "$@" train >"$tmp/$name.log" 2>&1; then
    bad "$name: training failed" "$(tail -n 15 "$tmp/$name.log")"
    return
  fi
  local out
  if out=$("$py" - "$tmp/$name.log" "$np" "$steps" <<'PY' 2>&1
import collections, re, sys
text = open(sys.argv[1], errors="replace").read()
np_, steps = int(sys.argv[2]), int(sys.argv[3])
counts = collections.defaultdict(list)
for step, n in re.findall(r"step (\d+): host syncs this step: (\d+)", text):
    counts[int(step)].append(int(n))
redone = collections.Counter(int(s) for s in re.findall(r"\[r0\].*step (\d+) had rows past the bound", text))
assert sorted(counts) == list(range(1, steps + 1)) and all(len(v) == np_ for v in counts.values()), dict(counts)
bad = {s: v for s, v in counts.items() if v != [1 + redone[s]] * np_}
assert not bad, f"per step (ranks' counts): {bad}; recomputed: {dict(redone)}"
assert any(redone[s] == 0 for s in counts), f"every step was recomputed: {dict(redone)}"
print(f"1 host sync in each of {sum(redone[s] == 0 for s in counts)} steps, 1 + r in the {len(redone)} recomputed "
      f"({dict(redone)}), on each of {np_} ranks")
PY
  ); then ok "$name: $out"; else bad "$name" "$out"; fi
}
check_bounded moe_ep2_bounded "$mt" 2 "${moe[@]}" --set parallel.ep=2 --set parallel.dp_replicate=1
# ... which start-up says: exact, that it syncs per sparse layer and that a capacity removes it; bounded, its fixed
# blocks and the recompute; with a capacity nothing.
if grep -aq "dropless expert parallel.*one host sync per sparse layer.*model.moe.capacity_factor > 0" \
     "$tmp/moe_ep2_exact.log" &&
   grep -aq "dropless expert parallel.*fixed blocks of f x the mean rows.*no host sync per sparse layer.*recomputed" \
     "$tmp/moe_ep2_bounded.log" && ! grep -aq "dropless expert parallel" "$tmp/moe_ep2_capacity.log"; then
  ok "dropless ep says at start-up how it sizes the exchange (exact: a sync per sparse layer; bounded: fixed blocks)"
else
  bad "the dropless ep start-up line" "$(grep -a "dropless" "$tmp/moe_ep2_exact.log" "$tmp/moe_ep2_bounded.log" \
    "$tmp/moe_ep2_capacity.log" | head -n 3)"
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
  # 3 steps: the bound may be raised at both of the first two (to E / k, which cannot overflow).
  MT_EMU_DEVICES=2 steps=3 check_bounded emu_moe_ep2_bounded_nccl "$emu/meshtrain" 2 "${moe[@]}" "${emu_set[@]}" \
    --set training.steps=3 --set comm.backend=nccl --set parallel.ep=2 --set parallel.dp_replicate=1
else
  skip "MoE host syncs on the emulated device" "no emulated build given (EMU_BUILD_DIR: build-emu's meshtrain)"
fi

summary host_sync
[ "$failed" -eq 0 ]
