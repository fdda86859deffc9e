#!/usr/bin/env bash
# In-memory checkpoints (checkpoint.memory, issue 54 part 1): each rank's state every step in a shared-memory
# segment ($MT_SHM_DIR here, /dev/shm by default) and a copy on its peer rank:
#  - a rank killed (SIGKILL) while writing its segment leaves the previous one, which the relaunch loads (the
#    half-written spare is named, not loaded, and removed); the other ranks, a save ahead, load their previous
#    segment (the spare their stopped run left), even without the peer's copies; the resumed losses equal the
#    uninterrupted run's bit for bit;
#  - a truncated segment, one of another step and a deleted one are not loaded: the peer's copy is, saying so;
#  - with neither a rank's own segment nor its peer's copy, every rank resumes from the disk;
#  - on 4 ranks, a rank whose machine lost its memory loads its peer's copy while two ranks take no part in the
#    exchange (the relaunch used to hang there);
#  - a run that ends removes its segments; `meshtrain supervise` removes those of a job it gives up on.
#   tests/cli/test_memory_checkpoint.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_memory_checkpoint.sh BUILD_DIR}
source "$(dirname "$0")/common.sh"

docs_data --val-fraction 0.1
export MT_SHM_DIR="$tmp/shm"
mkdir -p "$MT_SHM_DIR"
cat >"$tmp/t.yaml" <<YAML
model: {dim: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 64, vocab_size: 256, max_seq_len: 32}
training: {steps: 12, batch_size: 8, seq_len: 32, lr: 3.0e-3, warmup_steps: 3, lr_min: 3.0e-4, grad_clip: 1.0,
           weight_decay: 0.1, threads: 1, schedule: cosine}
data: {train: "$tmp/data/docs_train_*.bin"}
eval: {interval: 0}
sample: {interval: 0}
log: {interval: 1, peak_cache: "off"}
checkpoint: {interval: 4, keep: 0, memory: {interval: 1, peer: true}}
YAML
ckpt="$tmp/mem.ckpt"
train() {  # train NAME [--set ...]: 2 ranks, metrics in $tmp/NAME.jsonl, the job's checkpoints in $ckpt
  local name=$1
  shift
  rm -f "$tmp/$name.jsonl"
  timeout 120 "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/$name.jsonl" \
    --set checkpoint.dir="$ckpt" "$@" train >"$tmp/$name.log" 2>&1
}
segs() { ls "$MT_SHM_DIR" | grep -c '^meshtrain-'; }
own() { ls "$MT_SHM_DIR"/meshtrain-*-r"$1" 2>/dev/null; }
lose() {  # lose RANK: its machine's memory lost: its segment, its spares and the copies it holds
  rm -f "$MT_SHM_DIR"/meshtrain-*-r"$1" "$MT_SHM_DIR"/meshtrain-*-r"$1".tmp.* "$MT_SHM_DIR"/meshtrain-*-peer"$1"*
}
restore() {  # the state the killed run left: its checkpoints and its segments
  rm -rf "$ckpt" "$MT_SHM_DIR"
  cp -a "$tmp/snap.ckpt" "$ckpt"
  cp -a "$tmp/snap.shm" "$MT_SHM_DIR"
}
same_losses() {  # same_losses WHAT NAME FROM [STEPS]
  check "$1: the losses equal the uninterrupted run's bit for bit" -- "$py" "$compare" "$tmp/$2.jsonl" "$tmp/ref.jsonl" \
    --exact --from-step "$3" --steps "${4:-$((12 - $3))}"
}

# The uninterrupted run (in-memory saves every step do not change a bit), its segments removed at its end.
train ref || bad "the uninterrupted run" "$(tail -n 20 "$tmp/ref.log")"
expect "the first in-memory save is reported" zero "in-memory checkpoint of step 1:" -- cat "$tmp/ref.log"
if [ "$(segs)" = 0 ]; then ok "a run that ends removes its segments"; else bad "a run that ends removes its segments" "$(ls "$MT_SHM_DIR")"; fi
rm -rf "$ckpt"

# Rank 0 killed (SIGKILL) half way through writing its segment of step 7: its step-6 segment stays whole.
MT_FAULT_MEMORY=7:0 train killed && bad "killed: exits non-zero" "exit 0"
expect "the fault fired while writing" zero "is killed (SIGKILL) half way through writing its in-memory checkpoint of step 7" -- cat "$tmp/killed.log"
if ls "$MT_SHM_DIR" | grep -q '\-r0\.tmp\.'; then ok "the half-written segment is a .tmp file"; else bad "the half-written segment is a .tmp file" "$(ls "$MT_SHM_DIR")"; fi
cp -a "$ckpt" "$tmp/snap.ckpt"
cp -a "$MT_SHM_DIR" "$tmp/snap.shm"

if train resumed; then
  expect "the half-written spare is named and not loaded" zero "not loaded: half written" -- grep -a "r0.tmp.[0-9]*: .*not loaded: half written" "$tmp/resumed.log"
  expect "the stopped run's spares are removed, saying so" zero "a stopped run left" -- grep -a "rank 0: removed 1 spare of .*-r0 a stopped run left" "$tmp/resumed.log"
  expect "rank 0 loads its segment of step 6, not the disk's step 4" zero "resuming step 6 from memory: rank 0 from its own segment" -- cat "$tmp/resumed.log"
  expect "rank 1, a save ahead, loads its previous segment" zero "resuming step 6 from memory: rank 1 from its previous segment" -- cat "$tmp/resumed.log"
  same_losses "killed while writing a segment" resumed 6
  if [ "$(segs)" = 0 ]; then ok "the resumed run removes its segments at its end"; else bad "segments removed at the end" "$(ls "$MT_SHM_DIR")"; fi
else
  bad "the relaunch after a kill while writing" "$(tail -n 20 "$tmp/resumed.log")"
fi

# Without the peers' copies the previous segments still give every rank step 6 (they used to be removed as left by
# a stopped run, and every rank went to the disk's step 4).
restore
if train no_peer --set checkpoint.memory.peer=false; then
  expect "no peer: rank 1 loads its previous segment, not the disk" zero "resuming step 6 from memory: rank 1 from its previous segment" -- cat "$tmp/no_peer.log"
  same_losses "no peer, the previous segments" no_peer 6
else
  bad "the relaunch without the peers' copies" "$(tail -n 20 "$tmp/no_peer.log")"
fi

# Rank 1's segment truncated and its spare gone: not loaded, its peer's copy (held by rank 0) is.
restore
f=$(own 1)
rm -f "$f".tmp.*
truncate -s $(($(stat -c %s "$f") / 2)) "$f"
if train truncated; then
  expect "a truncated segment is named and not loaded" zero "truncated" -- grep -a "rank 1: .*-r1: truncated .*not loaded" "$tmp/truncated.log"
  expect "rank 1 loads its peer's copy, saying so" zero "resuming step 6 from memory: rank 1 from its peer's copy, held by rank 0" -- cat "$tmp/truncated.log"
  same_losses "a truncated segment" truncated 6
else
  bad "the relaunch with a truncated segment" "$(tail -n 20 "$tmp/truncated.log")"
fi

# Rank 1's segments deleted (its machine lost its memory): the peer's copy. Killed again at step 9 for the next case.
restore
lose 1
MT_FAULT_MEMORY=9:1 train deleted
expect "a rank whose segment is deleted loads its peer's copy" zero "resuming step 6 from memory: rank 1 from its peer's copy" -- cat "$tmp/deleted.log"
expect "the other rank loads its own" zero "resuming step 6 from memory: rank 0 from its own segment" -- cat "$tmp/deleted.log"
same_losses "a deleted segment" deleted 6 2
later=$(own 0)
cp "$later" "$tmp/later-r0"

# Rank 0's segment from another step (8 or 9): not loaded, the peer's copy of step 6 is.
restore
cp "$tmp/later-r0" "$(own 0)"
if train other_step; then
  expect "a segment of another step is named and not loaded" zero "not step 6 that every rank has: not loaded" -- cat "$tmp/other_step.log"
  expect "rank 0 loads its peer's copy" zero "resuming step 6 from memory: rank 0 from its peer's copy, held by rank 1" -- cat "$tmp/other_step.log"
  same_losses "a segment of another step" other_step 6
else
  bad "the relaunch with a segment of another step" "$(tail -n 20 "$tmp/other_step.log")"
fi

# Rank 1 has neither its segment nor its peer's copy: every rank resumes from the disk's step 4.
restore
rm -f "$(own 1)" "$(own 1)".tmp.* "$MT_SHM_DIR"/meshtrain-*-r1-peer0*
if train disk; then
  expect "no common in-memory step: the disk, saying so" zero "in-memory checkpoints not used: no step that every rank has" -- cat "$tmp/disk.log"
  expect "every rank resumes the disk's step 4" zero "step_00000004 at step 4" -- cat "$tmp/disk.log"
  same_losses "the disk fallback" disk 4
else
  bad "the relaunch from the disk" "$(tail -n 20 "$tmp/disk.log")"
fi

# 4 ranks: rank 0 killed while writing step 7 (ranks 1-3 a save ahead), then rank 2's machine loses its memory.
# Step 6 is rank 0's own, ranks 1 and 3's previous, and rank 2's copy held by rank 3: only ranks 2 and 3 exchange.
rm -rf "$ckpt" "$MT_SHM_DIR"/*
train4_run() {  # train4_run NAME [--set ...]: 4 ranks
  local name=$1
  shift
  rm -f "$tmp/$name.jsonl"
  timeout 120 "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/$name.jsonl" \
    --set checkpoint.dir="$ckpt" "$@" train >"$tmp/$name.log" 2>&1
}
train4_run ref4 || bad "the uninterrupted 4-rank run" "$(tail -n 20 "$tmp/ref4.log")"
rm -rf "$ckpt"
MT_FAULT_MEMORY=7:0 train4_run killed4 && bad "4 ranks killed: exits non-zero" "exit 0"
lose 2
if train4_run lost4; then
  expect "4 ranks: rank 2 loads its copy held by rank 3" zero "resuming step 6 from memory: rank 2 from its peer's copy, held by rank 3" -- cat "$tmp/lost4.log"
  expect "4 ranks: ranks 1 and 3 load their previous segments" zero "resuming step 6 from memory: ranks 1, 3 from their previous segments" -- cat "$tmp/lost4.log"
  check "4 ranks, a machine's memory lost: the losses equal the uninterrupted run's bit for bit" -- "$py" "$compare" \
    "$tmp/lost4.jsonl" "$tmp/ref4.jsonl" --exact --from-step 6 --steps 6
else
  bad "4 ranks: the relaunch after a machine lost its memory (it used to hang)" "$(tail -n 20 "$tmp/lost4.log")"
fi

# interval: auto weighs saves 2-4 against the step: every step when under 2% (steps slowed to 0.3 s), else the fewest
# steps that keep it under 2% (this tiny model's 10-ms steps); the saves that follow keep to the interval chosen.
rm -rf "$ckpt" "$MT_SHM_DIR"/*
auto_saves() {  # auto_saves NAME: "N S1 S2 ...": the interval chosen, then the steps of the in-memory saves after the 4 weighed
  "$py" - "$tmp/$1.log" "$tmp/$1.jsonl" <<'PY'
import json, re, sys
m = re.search(r"in-memory checkpoints every (\d+) steps? \(checkpoint.memory.interval auto", open(sys.argv[1], errors="replace").read())
steps = [r["step"] for r in map(json.loads, open(sys.argv[2])) if r.get("event") == "checkpoint" and r.get("mode") == "memory"]
print(m.group(1) if m else "none", *steps[4:])
PY
}
MT_FAULT_SLOW_RANK=0:300 train auto_slow --set checkpoint.memory.interval=auto || bad "interval auto, slow steps" "$(tail -n 20 "$tmp/auto_slow.log")"
got=$(auto_saves auto_slow)
if [ "$got" = "1 6 7 9 10 11" ]; then ok "interval auto: saves under 2% of a 0.3-s step are kept every step ($got)"
else bad "interval auto: every step when the saves cost under 2%" "got: $got (interval, then the saved steps after 1, 2, 3, 5; 4, 8 and 12 are the disk's)" "$(grep -a "interval auto" "$tmp/auto_slow.log")"; fi
rm -rf "$ckpt"
train auto_fast --set checkpoint.memory.interval=auto --set training.steps=40 || bad "interval auto, fast steps" "$(tail -n 20 "$tmp/auto_fast.log")"
read -r n rest <<<"$(auto_saves auto_fast)"
wrong=$(for st in $rest; do [ $((st % n)) -eq 0 ] || echo "$st"; done)
if [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -gt 1 ] && [ -z "$wrong" ]; then ok "interval auto: saves dearer than 2% of a short step kept every $n steps (saved: $rest)"
else bad "interval auto: a longer interval when the saves cost over 2%" "interval $n, saved at $rest" "$(grep -a "interval auto" "$tmp/auto_fast.log")"; fi
rm -rf "$ckpt"
# With checkpoint.mtbf_s: Young/Daly's interval, sqrt(2 x cost x mtbf_s) in steps (here mtbf_s 50: some steps).
train auto_yd --set checkpoint.memory.interval=auto --set checkpoint.mtbf_s=50 --set training.steps=30 ||
  bad "interval auto with mtbf_s" "$(tail -n 20 "$tmp/auto_yd.log")"
if out=$("$py" - "$tmp/auto_yd.log" <<'PY'
import math, re, sys
m = re.search(r"in-memory checkpoints every (\d+) steps? \(checkpoint.memory.interval auto: a save holds the loop ([0-9.]+) s, "
              r"[0-9.]+% of a ([0-9.]+)-s step; sqrt\(2 x [0-9.]+ x mtbf_s 50\)", open(sys.argv[1], errors="replace").read())
assert m, "no Young/Daly line"
n, c, step = int(m.group(1)), float(m.group(2)), float(m.group(3))
# The printed figures are rounded to 1 ms (a save of a few ms: up to 25% off): the interval within a third of the
# formula's on them, and a step.
want = math.sqrt(2 * c * 50) / step
assert want / 1.35 - 1 <= n <= want * 1.35 + 1, (n, want)
assert n >= 2, (n, want)
print(f"every {n} steps for {want:.2f} (a save {c} s, a step {step} s, mtbf_s 50)")
PY
); then ok "interval auto with checkpoint.mtbf_s: Young/Daly's interval, $out"
else bad "interval auto with checkpoint.mtbf_s: Young/Daly's interval" "$out"; fi
rm -rf "$ckpt"
expect "interval -1 is refused naming the key" nonzero "checkpoint.memory.interval" -- "$mt" --config "$tmp/t.yaml" --set checkpoint.dir="$ckpt" --set checkpoint.memory.interval=-1 check
expect "interval soon is refused: a step count or auto" nonzero "a step count or auto" -- "$mt" --config "$tmp/t.yaml" --set checkpoint.dir="$ckpt" --set checkpoint.memory.interval=soon check

# The supervisor gives up (no relaunch allowed) on a job killed mid-run: it removes the job's segments.
rm -rf "$ckpt" "$MT_SHM_DIR"/*
MT_FAULT_MEMORY=5:1 timeout 120 "$mt" supervise --max-restarts 0 --backoff 0 -- "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" \
  --set checkpoint.dir="$ckpt" --set log.metrics_file="$tmp/sup.jsonl" train >"$tmp/sup.log" 2>&1
expect "supervise gives up" zero "giving up" -- cat "$tmp/sup.log"
expect "supervise says it removed the job's segments" zero "in-memory checkpoint segment" -- grep -a "removed" "$tmp/sup.log"
if [ "$(segs)" = 0 ]; then ok "supervise removes the segments of a job it gives up on"; else bad "supervise removes the segments" "$(ls "$MT_SHM_DIR")"; fi

summary memory_checkpoint
[ $failed -eq 0 ]
