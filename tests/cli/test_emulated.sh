#!/usr/bin/env bash
# The CUDA training step on the emulated CUDA device (issue 29 part 3; tests/emu, test-only): the CUDA build of
# meshtrain (build-emu, -Demulate_cuda=true: the kernels, cuBLASLt and NCCL stand-ins run on the CPU) trains a
# tiny model with comm.device=cuda and is compared with the CPU backend (BUILD_DIR/meshtrain):
#  - fp32, 5 steps within 1e-4 of the CPU on 1 rank, dp_replicate 2, tp 2, cp 2 (ring and all_gather), a mixtral
#    model on 1 rank and on ep 2 (dropless, and with a capacity that drops rows: fixed blocks),
#    dp_shard 2 and pp 2 (1f1b; zb1p x tp 2: the pipeline's batched sends and receives on the NCCL stand-in,
#    whose sends are synchronous as NCCL's), with the ranks sharing one emulated device (comm.backend mpi: device
#    buffers staged through the
#    host) and with a device each (MT_EMU_DEVICES, comm.backend nccl: the NCCL stand-in over MPI);
#  - MoE with pp on NCCL (the router statistics beside the pipeline's messages): pp 2 1f1b and gpipe, pp 4 zb1p,
#    ep 2 x pp 2, and interleaved_1f1b (whose transfers NCCL takes in lockstep: its own lists hang there, dense too)
#    equal the CPU;
#  - bf16 within 2% of fp32 at step 5; MoE bf16 (tensor-core grouped GEMMs) within 2% of the CPU's fp32;
#  - attention.kernel cudnn (cuDNN's stand-in, tests/emu/cudnn_emu.cpp) against flash: bf16, GQA, cp 2 ring, tp 2, and
#    packed documents on 1 rank and (auto: cuDNN on the diagonal, flash off it) on cp 2, within 1% over 3 steps;
#    cudnn with documents and cp 2 is refused at start-up naming the key;
#  - training.fp8 (bf16 with FP8 linears) within 1e-4 of the CPU's FP8 emulation: tensorwise on 1 rank, rowwise on
#    tp 2 (tensorwise on dp_shard 2 with --full);
#  - training.cuda_graph: the graphed steps give the eager steps' bits (1 rank fp32 and FP8, cp 2 ring through cuDNN; --full: tp 2,
#    fully_shard 2), one host sync a step; pp 2 runs eagerly, saying why;
#  - one host synchronisation per step, as on a GPU (with training.fp8 too);
#  - a rank stopped before a tp collective on NCCL: its peer's watchdog names it and ends the job (no hang);
#  - a checkpoint written from the emulated device resumes on the CPU backend bit for bit in the losses' 1e-4,
#    and a CPU checkpoint resumes on the emulated device;
#  - the emulator's own reports (a host pointer where a device one belongs, a run past an allocation, a missing
#    stream wait) fail the run: MT_EMU_ABORT=1 turns each into an abort;
#  - `estimate --calibrate --quick` with comm.device=cuda on 2 ranks writes a cluster file of the device (cores_per_node
#    0, a bf16 peak, the device's memory, links on device buffers) that estimate reads; on 1 rank it refuses, as
#    the CPU calibration does (no link to measure), unless --links-from names a file to take the links from.
# The same list runs on a real GPU: scripts/gpu_check.sh calls this script with its CUDA build as EMU_BUILD_DIR
# (the cases that need a GPU per rank skip where the machine has fewer).
# MT_TEST_FULL=1 (scripts/test.sh --full; scripts/gpu_check.sh on a GPU) adds the meshes whose collectives the
# default list already runs on the same backend elsewhere (full_pair below).
# Prints "emulated: N passed, N failed[, N skipped]" last.
#   tests/cli/test_emulated.sh BUILD_DIR EMU_BUILD_DIR
set -uo pipefail
build=${1:?usage: test_emulated.sh BUILD_DIR EMU_BUILD_DIR}
emu=${2:?usage: test_emulated.sh BUILD_DIR EMU_BUILD_DIR}
source "$(dirname "$0")/common.sh"
emt="$emu/meshtrain"
export MT_EMU_ABORT=1
export MT_TEST_RETRY_HANG=1  # common.sh's mpi_logged: one more run after a watchdog timeout, printed

if [ ! -x "$emt" ]; then
  skip "the training step on the emulated CUDA device" "$emt was not built (no CUDA headers?)"
  summary emulated
  exit 0
fi

docs_data
cat >"$tmp/t.yaml" <<YAML
model: {dim: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 64, vocab_size: 256, max_seq_len: 32}
training: {steps: 5, batch_size: 4, seq_len: 32, lr: 3.0e-3, warmup_steps: 1, grad_clip: 1.0, threads: 1}
data: {train: "$tmp/data/docs_train_*.bin", val: ""}
eval: {interval: 0}
sample: {interval: 0}
log: {interval: 1}
comm: {timeout_s: 180}  # a run takes under a minute: a hang is named in 3 minutes
YAML

# devices: the CUDA devices a rank can see: the emulated build's MT_EMU_DEVICES (1 unless set), else the GPUs.
devices() {
  # grep reads the binaries themselves: a pipe from strings into grep -q fails under pipefail (strings gets SIGPIPE).
  # The CUDA code, this text included, is in the backend library beside the executable (runtime/core/cuda_table.h).
  if grep -qa "emulated CUDA device, test-only" "$emt" "$(dirname "$emt")/libmeshtrain_cuda.so" 2>/dev/null; then
    echo "${MT_EMU_DEVICES:-1}"
  else
    nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true  # grep -c prints 0 itself when there is none
  fi
}

# run NAME BINARY NP [--set ...]: metrics in $tmp/NAME.jsonl, output in $tmp/NAME.log.
run() {
  local name=$1 bin=$2 np=$3
  shift 3
  mpi_logged "$tmp/$name.log" "$mpirun" -np "$np" "$bin" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/$name.jsonl" \
    "$@" train
}
# pair WHAT NP BACKEND [--set ...]: the CPU run and the emulated run (comm.backend BACKEND) of the same config,
# their losses compared.
pair() {
  local what=$1 np=$2 backend=$3
  shift 3
  local name
  name=$(printf '%s' "$what" | tr -c 'a-z0-9' '_')
  if [ "$backend" = nccl ] && [ "$(devices)" -lt "$np" ]; then
    skip "$what" "NCCL needs a device per rank: $np ranks, $(devices) device(s)"
    return
  fi
  # The CPU run of a config is made once: the device-sharing (mpi) and device-each (nccl) cases share it.
  local cpu
  cpu=cpu_$(printf '%s ' "$np" "$@" | md5sum | cut -c1-12)
  if [ ! -s "$tmp/$cpu.jsonl" ] && ! run "$cpu" "$mt" "$np" "$@"; then
    bad "$what: the CPU run" "$(tail -n 10 "$tmp/$cpu.log")"
    rm -f "$tmp/$cpu.jsonl"
    return
  fi
  ln -sf "$cpu.jsonl" "$tmp/cpu_$name.jsonl"  # by the case's name too (the checkpoint cases read cpu_1_rank_fp32)
  if ! run "emu_$name" "$emt" "$np" --set comm.device=cuda --set comm.backend="$backend" "$@"; then
    # The log's end without the step lines and the per-rank banner: what ended the run comes first in the excerpt.
    bad "$what: the emulated CUDA run" "$(grep -av '^step \|emulated CUDA device, test-only' "$tmp/emu_$name.log" | tail -n 15)"
    return
  fi
  if out=$("$py" "$compare" "$tmp/emu_$name.jsonl" "$tmp/$cpu.jsonl" --rel0 1e-4 --abs 1e-4 --steps 5 2>&1); then
    ok "$what: emulated CUDA = CPU within 1e-4 over 5 steps: $out"
  else
    bad "$what: emulated CUDA against CPU" "$out"
  fi
}

# full_pair: a pair run only with MT_TEST_FULL=1, counted as skipped otherwise (its collectives run in the default
# list on the same backend: tp's all-reduce in dp_shard 2 x tp 2, the pipeline's sends in zb1p x tp 2).
full_pair() {
  if [ "${MT_TEST_FULL:-0}" = 1 ]; then pair "$@"; else skip "$1" "with --full (MT_TEST_FULL=1) only"; fi
}

pair "1 rank fp32" 1 mpi
expect "the emulated binary says it runs on the emulated device" zero "emulated CUDA device, test-only" -- cat "$tmp/emu_1_rank_fp32.log"
full_pair "dp_replicate 2 sharing one device (mpi)" 2 mpi
full_pair "tp 2 sharing one device (mpi)" 2 mpi --set parallel.tp=2
pair "cp 2 ring (mpi)" 2 mpi --set parallel.cp=2 --set parallel.dp_replicate=1
pair "cp 2 all_gather (mpi)" 2 mpi --set parallel.cp=2 --set parallel.dp_replicate=1 --set parallel.cp_method=all_gather
pair "dp_shard 2 (mpi)" 2 mpi --set parallel.dp_shard=2 --set parallel.dp_replicate=1 --set parallel.fsdp.min_weight_size=0
pair "pp 2 1f1b sharing one device (mpi)" 2 mpi --set parallel.pp=2 --set training.micro_batch_size=1
export MT_EMU_DEVICES=4
full_pair "pp 2 1f1b, a device each (nccl)" 2 nccl --set parallel.pp=2 --set training.micro_batch_size=1
pair "pp 2 zb1p x tp 2, a device each (nccl)" 4 nccl --set parallel.pp=2 --set parallel.tp=2 --set parallel.dp_replicate=1 --set parallel.pp_schedule=zb1p --set training.micro_batch_size=1
full_pair "dp_replicate 2, a device each (nccl)" 2 nccl
full_pair "tp 2, a device each (nccl)" 2 nccl --set parallel.tp=2
pair "cp 2 ring, a device each (nccl)" 2 nccl --set parallel.cp=2 --set parallel.dp_replicate=1
pair "dp_shard 2 x tp 2, a device each (nccl)" 4 nccl --set parallel.dp_shard=2 --set parallel.tp=2 --set parallel.dp_replicate=1 --set parallel.fsdp.min_weight_size=0
# Mixture of experts: the router, dispatch, grouped GEMMs and combine on the device, and expert parallel's
# all-to-alls on the NCCL stand-in.
moe=(--set model.type=mixtral --set model.moe.n_experts=4 --set model.moe.ffn_dim=48 --set model.moe.output_router_logits=true)
pair "mixtral 4 experts top-2, balance loss (mpi)" 1 mpi "${moe[@]}"
pair "mixtral ep 2, a device each (nccl)" 2 nccl "${moe[@]}" --set parallel.ep=2 --set parallel.dp_replicate=1
# With a capacity that drops rows: ep sends fixed blocks (counts on the device, the padding skipped by the grouped GEMM).
pair "mixtral ep 2 capacity 1.0, a device each (nccl)" 2 nccl "${moe[@]}" --set parallel.ep=2 \
  --set parallel.dp_replicate=1 --set model.moe.capacity_factor=1.0
# MoE with pp on NCCL: the router statistics ride beside each activation and gradient (runtime/train/pipeline.cpp),
# so no collective over the stages sits among the pipeline's sends; the stand-in runs every operation at issue, so
# a misordered one hangs here (comm.timeout_s names it). Every schedule, pp 4, and ep 2 x pp 2.
moe_pp=("${moe[@]}" --set model.n_layers=4 --set parallel.dp_replicate=1 --set training.micro_batch_size=1)
full_pair "mixtral pp 2 1f1b, a device each (nccl)" 2 nccl "${moe_pp[@]}" --set parallel.pp=2
full_pair "mixtral pp 2 gpipe, a device each (nccl)" 2 nccl "${moe_pp[@]}" --set parallel.pp=2 --set parallel.pp_schedule=gpipe
# Interleaved 1F1B's own lists wait on each other under NCCL's batches (dense models too: the stand-in, like a GPU's
# streams, hung in the first step), so on NCCL its transfers are placed in lockstep (pp_lockstep_lists), saying so;
# evaluation (the forwards' own lockstep lists) every 2 steps.
pair "mixtral pp 2 interleaved_1f1b (2 chunks a rank, transfers in lockstep), a device each (nccl)" 2 nccl \
  "${moe_pp[@]}" --set parallel.pp=2 --set parallel.pp_schedule=interleaved_1f1b --set parallel.pp_virtual=2 \
  --set data.val="$tmp/data/docs_val_*.bin" --set eval.interval=2 --set eval.steps=1
expect "interleaved_1f1b on NCCL says its transfers are placed in lockstep, and why" zero \
  "pipeline: interleaved_1f1b's transfers placed in lockstep for NCCL (its own lists would wait on each other there: rank 0 waits in the batch" -- \
  cat "$tmp/emu_mixtral_pp_2_interleaved_1f1b__2_chunks_a_rank__transfers_in_lockstep___a_device_each__nccl_.log"
pair "mixtral pp 4 zb1p, a device each (nccl)" 4 nccl "${moe_pp[@]}" --set parallel.pp=4 --set parallel.pp_schedule=zb1p
pair "mixtral ep 2 x pp 2 1f1b, a device each (nccl)" 4 nccl "${moe_pp[@]}" --set parallel.pp=2 --set parallel.ep=2
# training.fp8 (docs/design/fp8.md): the cast kernels and cuBLASLt's FP8 GEMMs (the stand-in: E4M3/E5M2 operands,
# scale pointers, TN only) against the CPU's bit-exact FP8 emulation; tensorwise on 1 rank, rowwise (outer-vector
# scales) on tp 2 (local shards), and with --full tensorwise on dp_shard 2 (the gathered weight cast). 1 layer, lr
# 1e-4: the bf16 ops around the GEMMs (attention's sums, bf16 roundings) are not bit-equal between the CPU and the
# device (bf16 alone differs by 2e-4 at step 5 with lr 3e-3), and a value that lands on the other side of an FP8
# rounding boundary moves a whole FP8 step, which Adam's first steps amplify with the learning rate: at lr 5e-4 the
# FP8 runs agree to 1e-7 with 2 layers but differ by 1-2e-4 with 1; at 1e-4 they agree to ~1e-7 on every mesh here.
fp8=(--set training.dtype=bf16 --set model.dim=64 --set model.ffn_dim=128 --set model.n_layers=1 --set training.lr=1.0e-4)
pair "fp8 tensorwise, 1 rank (mpi)" 1 mpi "${fp8[@]}" --set training.fp8=tensorwise
pair "fp8 rowwise, tp 2 (mpi)" 2 mpi "${fp8[@]}" --set training.fp8=rowwise --set parallel.tp=2 --set parallel.dp_replicate=1
full_pair "fp8 tensorwise, dp_shard 2 (mpi)" 2 mpi "${fp8[@]}" --set training.fp8=tensorwise --set parallel.dp_shard=2 \
  --set parallel.dp_replicate=1 --set parallel.fsdp.min_weight_size=0
# A peer that never joins an NCCL collective ends the job instead of hanging it: rank 1 of tp 2 stops itself before
# sampling, so rank 0 waits in the sampling forward's tp all-reduce, which the stand-in runs at once on the host, as
# NCCL's host side may block too (a communicator connects to its peers at its first operation). The watchdog
# watches a collective from before its issue, aborts the communicators (ncclCommAbort) and the job, naming rank 1
# (comm/nccl/nccl_group.cpp); a hang would run into the 120-s limit.
if [ "$(devices)" -lt 2 ]; then
  skip "a stopped peer of an NCCL collective" "NCCL needs a device per rank: 2 ranks, $(devices) device(s)"
else
  start=$(date +%s.%N)
  MT_FAULT_STOP_AT="sampling:1" timeout -k 5 120 "$mpirun" -np 2 "$emt" --config "$tmp/t.yaml" --set comm.device=cuda \
    --set comm.backend=nccl --set parallel.tp=2 --set sample.interval=1 --set sample.tokens=4 --set comm.timeout_s=5 \
    train >"$tmp/emu_stop.log" 2>&1
  rc=$?
  took=$(printf %.1f "$(echo "$(date +%s.%N) - $start" | bc)")
  if [ $rc -ne 0 ] && [ "$(echo "$took < 100" | bc)" = 1 ] &&
    grep -aq "\[comm\] timeout: .* on group 'tp' .* on rank 0 .*world rank 1 did not arrive" "$tmp/emu_stop.log"; then
    ok "a stopped peer of an NCCL collective: rank 0 names rank 1 and the job ends (exit $rc after $took s, start-up included)"
  else
    bad "a stopped peer of an NCCL collective ends the job naming it" "exit $rc after $took s" \
      "$(grep -av '^step \|emulated CUDA device, test-only' "$tmp/emu_stop.log" | tail -n 8)"
  fi
fi
unset MT_EMU_DEVICES

# bf16 (the tensor-core path where the kernels have one) against the emulated fp32 run.
if run emu_bf16 "$emt" 1 --set comm.device=cuda --set training.dtype=bf16; then
  if out=$("$py" - "$tmp/emu_bf16.jsonl" "$tmp/emu_1_rank_fp32.jsonl" <<'PY' 2>&1
import json, sys
def last(p): return [json.loads(l) for l in open(p) if '"loss"' in l][-1]
a, b = last(sys.argv[1]), last(sys.argv[2]); d = abs(a["loss"] - b["loss"]) / b["loss"]
print("step", a["step"], "bf16", a["loss"], "fp32", b["loss"], "relative difference %.4f" % d)
sys.exit(0 if d < 0.02 and a["loss"] != b["loss"] else 1)
PY
  ); then ok "bf16 on the emulated device within 2% of fp32 at step 5 (and really rounded): $out"; else bad "bf16 against fp32" "$out"; fi
else
  bad "bf16 on the emulated device" "$(tail -n 15 "$tmp/emu_bf16.log")"
fi

# MoE in bf16: the grouped GEMMs on tensor cores (mma.sync, runtime/kernels/cuda/moe_grouped.cu) against the CPU's fp32
# run of the same config (the mixtral pair above), within 2% at every step and really rounded.
if run emu_moe_bf16 "$emt" 1 --set comm.device=cuda --set training.dtype=bf16 "${moe[@]}"; then
  if out=$("$py" - "$tmp/emu_moe_bf16.jsonl" "$tmp/cpu_mixtral_4_experts_top_2__balance_loss__mpi_.jsonl" <<'PY' 2>&1
import json, sys
def rows(p): return [json.loads(l) for l in open(p) if '"loss"' in l]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
d = max(abs(x["loss"] - y["loss"]) / y["loss"] for x, y in zip(a, b))
print(len(a), "steps, largest relative difference %.5f" % d)
sys.exit(0 if len(a) == len(b) == 5 and d < 0.02 and a[-1]["loss"] != b[-1]["loss"] else 1)
PY
  ); then ok "MoE bf16 (tensor-core grouped GEMMs) on the emulated device within 2% of the CPU's fp32: $out"
  else bad "MoE bf16 against fp32" "$out"; fi
else
  bad "MoE bf16 on the emulated device" "$(tail -n 15 "$tmp/emu_moe_bf16.log")"
fi

# Attention through cuDNN (here its stand-in, tests/emu/cudnn_emu.cpp; on a GPU the real library) against the flash
# kernel: bf16, head dim 64 (the flash kernel's), GQA, cp 2 ring (the blocks' row offsets, dk/dv accumulated, the
# log-sum-exp merge), 3 steps within 1% (bf16 roundings differ: the stand-in rounds once per output).
cudnn_run=(--set comm.device=cuda --set training.dtype=bf16 --set model.dim=128 --set model.n_heads=2
  --set model.n_kv_heads=1 --set parallel.cp=2 --set parallel.dp_replicate=1 --set training.steps=3)
if run emu_cp_flash "$emt" 2 "${cudnn_run[@]}" --set attention.kernel=flash &&
  run emu_cp_cudnn "$emt" 2 "${cudnn_run[@]}" --set attention.kernel=cudnn; then
  if out=$("$py" "$compare" "$tmp/emu_cp_cudnn.jsonl" "$tmp/emu_cp_flash.jsonl" --rel0 1e-2 --abs 1e-2 --steps 3 2>&1); then
    ok "cp 2 ring, bf16: attention.kernel cudnn = flash within 1% over 3 steps: $out"
  else
    bad "cp 2 ring, bf16: attention.kernel cudnn against flash" "$out"
  fi
  expect "attention.kernel cudnn says it runs cuDNN, its version and path" zero "runs cuDNN's fused attention, cuDNN 9" \
    -- cat "$tmp/emu_cp_cudnn.log"
else
  bad "cp 2 ring, bf16, attention.kernel cudnn and flash" \
    "$(grep -av '^step \|emulated CUDA device, test-only' "$tmp/emu_cp_cudnn.log" "$tmp/emu_cp_flash.log" | tail -n 15)"
fi
# tp 2 (each rank its heads: 2 query heads and 1 key/value head of 4 and 2), cudnn against flash over 2 steps.
tp_cudnn=(--set comm.device=cuda --set training.dtype=bf16 --set model.dim=256 --set model.n_heads=4
  --set model.n_kv_heads=2 --set parallel.tp=2 --set parallel.dp_replicate=1 --set training.steps=2)
if run emu_tp_flash "$emt" 2 "${tp_cudnn[@]}" --set attention.kernel=flash &&
  run emu_tp_cudnn "$emt" 2 "${tp_cudnn[@]}" --set attention.kernel=cudnn; then
  if out=$("$py" "$compare" "$tmp/emu_tp_cudnn.jsonl" "$tmp/emu_tp_flash.jsonl" --rel0 1e-2 --abs 1e-2 --steps 2 2>&1); then
    ok "tp 2, bf16: attention.kernel cudnn = flash within 1% over 2 steps: $out"
  else
    bad "tp 2, bf16: attention.kernel cudnn against flash" "$out"
  fi
else
  bad "tp 2, bf16, attention.kernel cudnn and flash" "$(tail -n 15 "$tmp/emu_tp_cudnn.log")"
fi
# Packed documents (a per-query lower bound in cuDNN's mask) on 1 rank, cudnn against flash; with cp 2 (blocks off
# the diagonal, whose queries may see no key) attention.kernel cudnn is refused at start-up, naming the key.
doc_run=(--set comm.device=cuda --set training.dtype=bf16 --set model.dim=128 --set model.n_heads=2
  --set model.n_kv_heads=1 --set data.document_separator=10 --set training.steps=3)
if run emu_doc_flash "$emt" 1 "${doc_run[@]}" --set attention.kernel=flash &&
  run emu_doc_cudnn "$emt" 1 "${doc_run[@]}" --set attention.kernel=cudnn; then
  if out=$("$py" "$compare" "$tmp/emu_doc_cudnn.jsonl" "$tmp/emu_doc_flash.jsonl" --rel0 1e-2 --abs 1e-2 --steps 3 2>&1); then
    ok "documents, bf16: attention.kernel cudnn = flash within 1% over 3 steps: $out"
  else
    bad "documents, bf16: attention.kernel cudnn against flash" "$out"
  fi
else
  bad "documents, bf16, attention.kernel cudnn and flash" "$(tail -n 15 "$tmp/emu_doc_cudnn.log")"
fi
# auto with documents and cp 2: cuDNN on the ring's diagonal blocks, the flash kernel off it (said once), merged
# (--full only: 44 s here, and test_gpu_cudnn.cpp checks the fallback itself at the op level).
if [ "${MT_TEST_FULL:-0}" != 1 ]; then
  skip "documents, cp 2, attention.kernel auto against flash" "with --full (MT_TEST_FULL=1) only"
elif run emu_cpdoc_auto "$emt" 2 "${doc_run[@]}" --set parallel.cp=2 --set parallel.dp_replicate=1 &&
  run emu_cpdoc_flash "$emt" 2 "${doc_run[@]}" --set parallel.cp=2 --set parallel.dp_replicate=1 \
    --set attention.kernel=flash; then
  if out=$("$py" "$compare" "$tmp/emu_cpdoc_auto.jsonl" "$tmp/emu_cpdoc_flash.jsonl" --rel0 1e-2 --abs 1e-2 --steps 3 2>&1) &&
    grep -aq "for this call (packed documents in a block off the diagonal" "$tmp/emu_cpdoc_auto.log"; then
    ok "documents, cp 2, attention.kernel auto (cuDNN on the diagonal, flash off it) = flash within 1%: $out"
  else
    bad "documents, cp 2, attention.kernel auto against flash" "$out"
  fi
else
  bad "documents, cp 2, attention.kernel auto and flash" "$(tail -n 15 "$tmp/emu_cpdoc_auto.log")"
fi
expect "attention.kernel cudnn with fp32 activations is refused naming the key" nonzero "attention.kernel = cudnn takes bf16" -- \
  "$emt" --config "$tmp/t.yaml" --set comm.device=cuda --set attention.kernel=cudnn train
expect "attention.kernel cudnn with documents and cp 2 is refused naming the key" nonzero "attention.kernel = cudnn" -- \
  "$mpirun" -np 2 "$emt" --config "$tmp/t.yaml" --set comm.device=cuda --set training.dtype=bf16 \
  --set attention.kernel=cudnn --set data.document_separator=10 --set parallel.cp=2 --set parallel.dp_replicate=1 train

# training.cuda_graph: after 2 eager steps each step replays the captured graphs (forward, backward, gradient sync,
# loss; clipping and AdamW): the bits of the eager steps, on 1 rank (fp32) and with the collectives inside the graph
# (cp 2 ring through cuDNN's stand-in; --full: tp 2 bf16, fully_shard 2), one host sync a step; a run the graphs
# cannot hold (pp 2) says why and runs eagerly.
same_bits() {  # same_bits A B: every step's loss and grad norm equal to the last bit
  "$py" - "$tmp/$1.jsonl" "$tmp/$2.jsonl" <<'PY'
import json, sys
def rows(f):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, open(f)) if r.get("kind", "step") == "step" and "loss" in r]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
print(f"{len(a)} steps, last {a[-1] if a else None} / {b[-1] if b else None}")
sys.exit(0 if a and a == b else 1)
PY
}
graph_case() {  # graph_case NAME NP [--set ...]: eager and graphed runs of the same config, compared
  local name=$1 np=$2
  shift 2
  if run "eager_$name" "$emt" "$np" "$@" && run "graph_$name" "$emt" "$np" "$@" --set training.cuda_graph=true \
    --set log.level=debug; then
    local counts out
    counts=$(grep -a "host syncs this step:" "$tmp/graph_$name.log" | sed 's/.*host syncs this step: //' | sort -u | tr '\n' ' ')
    if ! grep -aq "captured the step's forward, backward and gradient sync at step 3" "$tmp/graph_$name.log"; then
      bad "cuda_graph, $name: no graph was captured" "$(grep -a "cuda_graph" "$tmp/graph_$name.log" | head -n 5)"
    elif out=$(same_bits "graph_$name" "eager_$name" 2>&1) && [ "$counts" = "1 " ]; then
      ok "cuda_graph, $name: the eager steps' bits (loss and grad norm), one host sync a step: $out"
    else
      bad "cuda_graph, $name: against the eager steps (host syncs a step: {$counts})" "$out"
    fi
  else
    bad "cuda_graph, $name" "$(grep -av '^step ' "$tmp/graph_$name.log" "$tmp/eager_$name.log" | tail -n 15)"
  fi
}
# 4 steps: 2 eager, the capture's step and one replay of both graphs.
graph_case "1 rank fp32" 1 --set comm.device=cuda --set training.steps=4
graph_case "cp 2 ring cudnn" 2 "${cudnn_run[@]}" --set training.steps=4 --set attention.kernel=cudnn
graph_case "fp8 tensorwise" 1 --set comm.device=cuda --set training.dtype=bf16 --set training.fp8=tensorwise \
  --set training.steps=4
if [ "${MT_TEST_FULL:-0}" = 1 ]; then  # NCCL inside the graph again, under other meshes (--full: 60 s here)
  graph_case "tp 2 bf16" 2 --set comm.device=cuda --set training.dtype=bf16 --set parallel.tp=2 \
    --set parallel.dp_replicate=1 --set training.steps=4
  graph_case "fully_shard 2" 2 --set comm.device=cuda --set parallel.dp_shard=2 --set parallel.dp_replicate=1 \
    --set training.micro_batch_size=1 --set training.steps=4
else
  skip "cuda_graph, tp 2 and fully_shard 2" "with --full (MT_TEST_FULL=1) only"
fi
if run graph_pp "$emt" 2 --set comm.device=cuda --set parallel.pp=2 --set parallel.dp_replicate=1 \
  --set training.micro_batch_size=2 --set training.steps=2 --set training.cuda_graph=true; then
  expect "cuda_graph with pp 2 runs eagerly, saying why" zero \
    "training.cuda_graph: the steps run without CUDA graphs: pipeline parallel" -- cat "$tmp/graph_pp.log"
else
  bad "cuda_graph with pp 2" "$(tail -n 15 "$tmp/graph_pp.log")"
fi

# One host synchronisation per step (the loss and the grad norm read together), as on a GPU.
if run emu_sync "$emt" 2 --set comm.device=cuda --set parallel.tp=2 --set training.micro_batch_size=2 --set log.level=debug; then
  counts=$(grep -a "host syncs this step:" "$tmp/emu_sync.log" | sed 's/.*host syncs this step: //' | sort -u | tr '\n' ' ')
  lines=$(grep -a -c "host syncs this step:" "$tmp/emu_sync.log")
  if [ "$counts" = "1 " ] && [ "$lines" -eq 10 ]; then ok "one host sync in each of 5 steps on each of 2 ranks (tp 2, 2 micro-batches)"
  else bad "host syncs per step on the emulated device" "counts {$counts} on $lines lines"; fi
else
  bad "host sync run" "$(tail -n 15 "$tmp/emu_sync.log")"
fi

# The same with training.fp8: the amax, the scales and the casts stay on the device (no host read); 2 steps.
if run emu_sync_fp8 "$emt" 1 --set comm.device=cuda "${fp8[@]}" --set training.fp8=tensorwise --set training.steps=2 \
    --set training.micro_batch_size=2 --set log.level=debug; then
  counts=$(grep -a "host syncs this step:" "$tmp/emu_sync_fp8.log" | sed 's/.*host syncs this step: //' | sort -u | tr '\n' ' ')
  lines=$(grep -a -c "host syncs this step:" "$tmp/emu_sync_fp8.log")
  if [ "$counts" = "1 " ] && [ "$lines" -eq 2 ]; then ok "fp8 tensorwise: one host sync in each of 2 steps (2 micro-batches)"
  else bad "host syncs per step with training.fp8 on the emulated device" "counts {$counts} on $lines lines"; fi
else
  bad "fp8 host sync run" "$(tail -n 15 "$tmp/emu_sync_fp8.log")"
fi

# A traced step on the device: each device op's run on its stream (a pair of events) on a "GPU kernels" lane, in
# the op spans' order, none starting before its op was issued, inside the traced steps' range; the memory track
# follows the device's caching allocator (its peak = the step's device peak).
if run emu_trace "$emt" 2 --set comm.device=cuda --set parallel.tp=2 --set 'profile.steps=[3,4]' \
    --set profile.dir="$tmp/emu_trace"; then
  if out=$("$py" - "$tmp/emu_trace/trace.json" <<'PY' 2>&1
import json, sys
ev = json.load(open(sys.argv[1]))["traceEvents"]
lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("name") == "thread_name"}
for pid in sorted({e["pid"] for e in ev}):
    ops = [e for e in ev if e.get("pid") == pid and e.get("cat") == "op"]
    gpu = [e for e in ev if e.get("pid") == pid and e.get("cat") == "gpu"]
    steps = [e for e in ev if e.get("pid") == pid and e.get("cat") == "step"]
    assert gpu, f"rank {pid}: no GPU span"
    assert all(lanes[(pid, e["tid"])] == "GPU kernels" for e in gpu), "a GPU span off the GPU kernels lane"
    # Each GPU span is the run of an op span (the ops on device tensors; host ops have none), in the same order,
    # starting no earlier than its launch (50 us for the reference event's placement).
    i = 0
    for g in gpu:
        while i < len(ops) and ops[i]["name"] != g["name"]:
            i += 1
        assert i < len(ops), f"rank {pid}: GPU span {g['name']} at {g['ts']} matches no later op span"
        assert g["ts"] >= ops[i]["ts"] - 50 and g["dur"] >= 0, f"rank {pid}: {g['name']} runs before its launch"
        i += 1
    assert min(g["ts"] for g in gpu) >= min(s["ts"] for s in steps), "a GPU span before the traced steps"
    # The memory track follows the device's caching allocator: its peak in each step is the step's device peak.
    cs = sorted((e for e in ev if e.get("pid") == pid and e.get("ph") == "C" and e["name"] == "memory"), key=lambda e: e["ts"])
    for s in steps:
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        vals = [sum(e["args"].values()) for e in ([e for e in cs if e["ts"] <= t0][-1:] + [e for e in cs if t0 < e["ts"] <= t1])]
        assert vals and max(vals) == s["args"]["bytes"], f"rank {pid}: memory track peak {max(vals or [-1])}, device allocator {s['args']['bytes']}"
print(f"{len(gpu)} GPU spans per rank (of {len(ops)} op spans), in the ops' order, each after its launch; the memory track's peak = the device allocator's in every step")
PY
  ); then ok "device spans in the trace: $out"; else bad "device spans in the trace" "$out"; fi
else
  bad "traced run on the emulated device" "$(tail -n 15 "$tmp/emu_trace.log")"
fi

# Checkpoints cross the backends: written on the emulated device at step 3, resumed on the CPU; and back.
if run emu_ck "$emt" 1 --set comm.device=cuda --set checkpoint.dir="$tmp/emu_ck" --set checkpoint.interval=3 &&
  run cpu_from_emu "$mt" 1 --set checkpoint.dir="$tmp/cpu_from_emu_ck" --set checkpoint.resume="$tmp/emu_ck/step_00000003"; then
  if out=$("$py" "$compare" "$tmp/cpu_from_emu.jsonl" "$tmp/cpu_1_rank_fp32.jsonl" --from-step 3 --steps 2 --rel0 1e-4 --abs 1e-4 2>&1); then
    ok "an emulated-device checkpoint resumes on the CPU with the CPU run's losses: $out"; else bad "emulated -> CPU resume" "$out"; fi
else
  bad "emulated -> CPU checkpoint" "$(tail -n 10 "$tmp/emu_ck.log" "$tmp/cpu_from_emu.log" 2>/dev/null)"
fi
if run cpu_ck "$mt" 1 --set checkpoint.dir="$tmp/cpu_ck" --set checkpoint.interval=3 &&
  run emu_from_cpu "$emt" 1 --set comm.device=cuda --set checkpoint.dir="$tmp/emu_from_cpu_ck" --set checkpoint.resume="$tmp/cpu_ck/step_00000003"; then
  if out=$("$py" "$compare" "$tmp/emu_from_cpu.jsonl" "$tmp/cpu_1_rank_fp32.jsonl" --from-step 3 --steps 2 --rel0 1e-4 --abs 1e-4 2>&1); then
    ok "a CPU checkpoint resumes on the emulated device with the CPU run's losses: $out"; else bad "CPU -> emulated resume" "$out"; fi
else
  bad "CPU -> emulated checkpoint" "$(tail -n 10 "$tmp/cpu_ck.log" "$tmp/emu_from_cpu.log" 2>/dev/null)"
fi

# The device's calibration (runtime/planner/calibrate.cpp): tiny shapes (--quick), a device per rank where there are
# 2 (the NCCL stand-in on the emulated device), else the 2 ranks share one through the MPI backend.
export MT_EMU_DEVICES=2
cal_backend=nccl
[ "$(devices)" -lt 2 ] && cal_backend=mpi
if mpi_logged "$tmp/cal_dev.log" "$mpirun" -np 2 "$emt" --config "$tmp/t.yaml" --set comm.device=cuda \
    --set comm.backend=$cal_backend estimate --calibrate --quick --out "$tmp/cal_dev.yaml" &&
  "$emt" --config "$tmp/t.yaml" --set comm.device=cuda --set training.dtype=bf16 estimate --world 2 \
    --cluster "$tmp/cal_dev.yaml" --json "$tmp/cal_dev_e.json" >"$tmp/cal_dev_e.log" 2>&1; then
  if out=$("$py" - "$tmp/cal_dev.yaml" "$tmp/cal_dev_e.json" "$cal_backend" <<'PY' 2>&1
import json, re, sys
text = open(sys.argv[1]).read()
def num(key):
    m = re.search(rf"^{key}: ([0-9.e+-]+)$", text, re.M)
    assert m, f"no {key}"
    return float(m.group(1))
assert not re.search(r"^cores_per_node: [1-9]", text, re.M), "cores_per_node set: the figures would be a core's"
assert re.search(r"^peak_tflops: \{bf16: [0-9.e+-]+, fp32: [0-9.e+-]+\}$", text, re.M), "peak_tflops: no bf16 and fp32"
assert num("device_memory_gib") > 0 and num("memory_bandwidth_gbs") > 0
assert 0 < num("gemm_efficiency") <= 1 and 0 < num("attention_efficiency") <= 1
assert re.search(r"^node_by_ranks:\n  2:", text, re.M), "no node_by_ranks 2"
assert not re.search(r"^\s*sync_us:", text, re.M), "sync_us measured for devices of their own"
src = re.search(r'^source: "(.*)"$', text, re.M).group(1)
assert "a CUDA device each" in src or "sharing each CUDA device" in src, src[:200]
assert f"comm backend {sys.argv[3]}" in src, src[:300]
e = json.load(open(sys.argv[2]))
assert e["step_s"] > 0 and e["stages"][0]["compute_s"] > 0, e["step_s"]
print(f"{num('device_memory_gib')} GiB a rank, backend {sys.argv[3]}, estimate step {e['step_s']:.3g} s")
PY
  ); then ok "calibrate --quick on the device, 2 ranks: a cluster file of the device that estimate reads ($out)"
  else bad "calibrate --quick on the device: the file" "$out"; fi
else
  bad "calibrate --quick on the device, 2 ranks" "$(grep -av 'emulated CUDA device, test-only' "$tmp/cal_dev.log" "$tmp/cal_dev_e.log" 2>/dev/null | tail -n 15)"
fi
unset MT_EMU_DEVICES
expect "calibrate on the device, 1 rank: no link to measure, as on CPU ranks" nonzero \
  "calibration needs at least 2 ranks to measure a link (mpirun -np 2 or more; this job has 1), or --links-from FILE" -- \
  "$emt" --config "$tmp/t.yaml" --set comm.device=cuda estimate --calibrate --quick --out "$tmp/cal_dev1.yaml"
# One device, one rank (a one-GPU machine): the links taken from another cluster file, said in the file.
if "$emt" --config "$tmp/t.yaml" --set comm.device=cuda estimate --calibrate --quick \
    --links-from "$root/configs/clusters/h100_ib.yaml" --out "$tmp/cal_dev1.yaml" >"$tmp/cal_dev1.log" 2>&1 &&
  out=$("$py" - "$tmp/cal_dev1.yaml" "$root/configs/clusters/h100_ib.yaml" <<'PY' 2>&1
import re, sys
text, other = open(sys.argv[1]).read(), open(sys.argv[2]).read()
line = lambda t, k: re.search(rf"^{k}: (.*)$", t, re.M).group(1)
assert line(text, "node") == line(other, "node") and line(text, "network") == line(other, "network"), "links differ"
assert re.search(r"^devices_per_node: 1$", text, re.M) and not re.search(r"^node_by_ranks:", text, re.M)
assert "NOT measured: taken from" in text and "h100_ib" in line(text, "source"), "the file does not say so"
print("node", line(text, "node"))
PY
  ); then ok "calibrate on the device, 1 rank, --links-from: the device measured, the links taken and said ($out)"
else bad "calibrate on the device, 1 rank, --links-from" "$(tail -n 8 "$tmp/cal_dev1.log"; echo "${out:-}")"; fi

summary emulated
