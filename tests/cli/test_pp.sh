#!/usr/bin/env bash
# Pipeline parallel end to end (issue 27): each schedule (gpipe, 1f1b, interleaved_1f1b, zb1p) at pp 2 and pp 4, and
# pp 2 with dp_replicate 2, tp 2, dp_shard 2, cp 2, dp_shard 2 x tp 2 (8 ranks) and recompute, give the losses of 1
# rank over 20 steps (within 1e-4) and the same sample; checkpoints saved on pp 2 resume on 1 rank and those of 1
# rank on pp 4, and hold the same tensors; `meshtrain plan` prints the stages, the timeline and pp bytes equal to
# the schedule's count; a rank stopped during a pipeline transfer ends the job naming the stage, the micro-batch
# and the peer; bad input is a clear error naming the keys. Prints "pp: N passed, N failed" last.
#   tests/cli/test_pp.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_pp.sh BUILD_DIR}

source "$(dirname "$0")/common.sh"

docs_data
# 8 layers: pp 4 x pp_virtual 2 gives every stage one. micro_batch_size 1: 8 micro-batches (4 under dp 2).
write_yaml "dim: 64, n_layers: 8, n_heads: 8, n_kv_heads: 4, ffn_dim: 96, vocab_size: 256, max_seq_len: 32" \
  "steps: 20, batch_size: 8, seq_len: 32, micro_batch_size: 1" "parallel: {dp_replicate: 1}"

train base 1 || bad "1-rank baseline" "$(tail -n 20 "$tmp/base.log")"

# Every schedule at pp 2 and pp 4; the log line says the pipeline ran with that schedule.
for p in 2 4; do
  for s in gpipe 1f1b interleaved_1f1b zb1p; do
    v=1
    [ $s = interleaved_1f1b ] && v=2
    same_as base pp${p}_$s $p "pp=$p $s" --set parallel.pp=$p --set parallel.pp_schedule=$s --set parallel.pp_virtual=$v
    if grep -q "pipeline: $((p * v)) stages on pp = $p (pp_virtual $v).*schedule $s over 8 micro-batches" "$tmp/pp${p}_$s.log"; then
      ok "pp=$p $s: the run says its stages and schedule"
    else bad "pp=$p $s: the pipeline line" "$(grep -a pipeline "$tmp/pp${p}_$s.log" | head -n 2)"; fi
  done
done
# A measured bubble is recorded per step beside the formula.
if "$py" - "$tmp/pp2_1f1b.jsonl" <<'PY'; then ok "pp=2 1f1b: per-step bubble records (every rank, beside the formula 1/8)"; else bad "bubble records"; fi
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"pp_bubble"' in l]
assert len(recs) == 20, len(recs)
assert all(len(r["pp_bubble"]) == 2 and abs(r["pp_bubble_formula"] - 1 / 8) < 1e-12 for r in recs)
assert all(max(r["pp_in_flight"]) == 2 for r in recs), [r["pp_in_flight"] for r in recs]
PY

# Composed with every other dim.
meshes=("4|pp=2 x dp_replicate=2|--set parallel.dp_replicate=2"
        "4|pp=2 x tp=2|--set parallel.tp=2"
        "4|pp=2 x dp_shard=2|--set parallel.dp_shard=2 --set parallel.fsdp.min_weight_size=1000"
        "4|pp=2 x cp=2|--set parallel.cp=2"
        "8|pp=2 x dp_shard=2 x tp=2|--set parallel.dp_shard=2 --set parallel.tp=2 --set parallel.fsdp.min_weight_size=1000"
        "2|pp=2 with recompute|--set parallel.recompute.patterns=[\"model.layers.*\"]"
        "4|pp=2 interleaved_1f1b x tp=2 (no sequence parallel)|--set parallel.tp=2 --set parallel.sequence_parallel=false --set parallel.pp_schedule=interleaved_1f1b --set parallel.pp_virtual=2")
i=0
for m in "${meshes[@]}"; do
  IFS='|' read -r np what args <<<"$m"
  i=$((i + 1))
  # shellcheck disable=SC2086
  same_as base c$i "$np" "$what" --set parallel.pp=2 $args
done

same_as base c_keep 4 "pp=2 x dp_shard=2, reshard_after_forward false" --set parallel.pp=2 --set parallel.dp_shard=2 \
  --set parallel.fsdp.min_weight_size=1000 --set parallel.fsdp.reshard_after_forward=false
# fully_shard's units under pp: gathered per micro-batch (forward and backward) when resharding, once per step when
# not. Stage 0 has 5 units (the embedding and 4 layers), 4 micro-batches per dp rank.
for keep in true false; do
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set parallel.pp=2 --set parallel.dp_shard=2 \
    --set parallel.fsdp.min_weight_size=1000 --set parallel.fsdp.reshard_after_forward=$keep plan >"$tmp/fsdp_$keep.out" 2>&1 ||
    bad "meshtrain plan pp=2 x dp_shard=2" "$(tail -n 20 "$tmp/fsdp_$keep.out")"
done
want_true="gather calls=40 reduce calls=20" want_false="gather calls=5 reduce calls=5"
for keep in true false; do
  got=$(awk '/tag=fsdp.gather/ {g=$5} /tag=fsdp.reduce/ {r=$5} END {print "gather " g " reduce " r}' "$tmp/fsdp_$keep.out")
  want=want_$keep
  if [ "$got" = "${!want}" ]; then ok "pp=2 x dp_shard=2, reshard_after_forward $keep: a step's fsdp collectives on stage 0: $got"
  else bad "fsdp collectives under pp (reshard_after_forward $keep)" "got $got, want ${!want}"; fi
done

# Checkpoints: the same tensors as without pp, and resume across pp degrees.
ck=(--set checkpoint.interval=10)
train save1 1 --set checkpoint.dir="$tmp/ck1" "${ck[@]}" || bad "1-rank save" "$(tail -n 20 "$tmp/save1.log")"
if train save_pp2 2 --set parallel.pp=2 --set checkpoint.dir="$tmp/ck2" "${ck[@]}" &&
   train resume_on_1 1 --set checkpoint.dir="$tmp/r1" --set checkpoint.resume="$tmp/ck2/step_00000010"; then
  if out=$("$py" "$compare" "$tmp/resume_on_1.jsonl" "$tmp/base.jsonl" --from-step 10 --steps 10 2>&1); then
    ok "saved on pp=2, resumed on 1 rank: $out"; else bad "resume pp=2 -> 1" "$out"; fi
else
  bad "resume pp=2 -> 1" "$(tail -n 20 "$tmp/save_pp2.log" "$tmp/resume_on_1.log" 2>/dev/null)"
fi
if train resume_on_pp4 4 --set parallel.pp=4 --set checkpoint.dir="$tmp/r4" --set checkpoint.resume="$tmp/ck1/step_00000010"; then
  if out=$("$py" "$compare" "$tmp/resume_on_pp4.jsonl" "$tmp/base.jsonl" --from-step 10 --steps 10 2>&1); then
    ok "saved on 1 rank, resumed on pp=4: $out"; else bad "resume 1 -> pp=4" "$out"; fi
else
  bad "resume 1 -> pp=4" "$(tail -n 20 "$tmp/resume_on_pp4.log")"
fi
# The pp = 2 checkpoint names every tensor the 1-rank one does (weights and moments), in files of both stages.
if "$py" - "$tmp/ck1/step_00000010" "$tmp/ck2/step_00000010" <<'PY'; then ok "a pp=2 checkpoint holds the 1-rank checkpoint's tensors"; else bad "pp=2 checkpoint tensors"; fi
import json, os, struct, sys
def names(d, prefix):
    idx = os.path.join(d, prefix + ".safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) else [prefix + ".safetensors"]
    out = {}
    for f in files:
        b = open(os.path.join(d, f), "rb").read()
        n = struct.unpack("<Q", b[:8])[0]
        h = json.loads(b[8:8 + n]); h.pop("__metadata__", None)
        out.update({k: v["shape"] for k, v in h.items()})
    return out
for prefix in ("model", "optimizer"):
    a, b = names(sys.argv[1], prefix), names(sys.argv[2], prefix)
    assert a == b, (prefix, set(a) ^ set(b))
assert len(json.load(open(os.path.join(sys.argv[2], "model.safetensors.index.json")))["weight_map"]) == len(names(sys.argv[1], "model"))
PY

# meshtrain plan: the stages, the timeline, and the pp bytes against the schedule's count.
"$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set parallel.pp=2 --set parallel.tp=2 --set parallel.pp_schedule=zb1p plan \
  >"$tmp/plan.out" 2>&1 || bad "meshtrain plan with pp" "$(tail -n 20 "$tmp/plan.out")"
expect "meshtrain plan: the stage assignment" zero "stage 1 on pp rank 1: decoder layers [4, 8), model.norm, lm_head and the loss" -- cat "$tmp/plan.out"
expect "meshtrain plan: the timeline" zero "rank 1: F0 Bi0 F1 Bi1 W0 F2 Bi2 W1" -- cat "$tmp/plan.out"
expect "meshtrain plan: pp bytes = the schedule's count" zero "(equal)" -- grep "pp bytes per rank" "$tmp/plan.out"

# A rank stopped in a pipeline transfer: the job ends within the timeout, naming the stage, micro-batch and peer
# (rank 0 blocks in the receive of micro-batch 0's gradient: its activation sends are async, not yet waited for).
start=$(date +%s)
MT_FAULT_STOP_AT="pp transfer:1" timeout 120 "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set parallel.pp=2 \
  --set comm.timeout_s=3 --set eval.interval=0 --set sample.interval=0 train >"$tmp/stuck.log" 2>&1
rc=$?
took=$(($(date +%s) - start))
if [ $rc -ne 0 ] && [ $took -lt 60 ] && grep -q "pp gradient of stage 1, micro-batch 0, from pp rank 1) on group 'pp'" "$tmp/stuck.log" &&
   grep -q "world rank 1 did not arrive" "$tmp/stuck.log"; then
  ok "a rank stopped in a pipeline transfer ends the job in ${took}s, naming the stage, micro-batch and peer"
else
  bad "stopped rank in a pipeline transfer (exit $rc, ${took}s)" "$(grep -a "timeout\|comm" "$tmp/stuck.log" | head -n 5)"
fi

# Bad input: clear errors naming the keys, before any collective.
expect "pp that does not divide the ranks" nonzero "parallel.pp = 3 does not divide the job's 4 ranks" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set parallel.pp=3 train
expect "more stages than layers" nonzero "parallel.pp x parallel.pp_virtual = 16 stages but model.n_layers = 8" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set parallel.pp=4 --set parallel.pp_schedule=interleaved_1f1b \
  --set parallel.pp_virtual=4 --set training.micro_batch_size=1 train
expect "an explicit split that does not sum to n_layers" nonzero "parallel.pp_layers sums to 7 but model.n_layers = 8" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set parallel.pp=2 --set 'parallel.pp_layers=[3, 4]' train
expect "an explicit split of the wrong length" nonzero "parallel.pp_layers lists 3 stages but parallel.pp x parallel.pp_virtual = 2" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set parallel.pp=2 --set 'parallel.pp_layers=[3, 4, 1]' train
expect "too few micro-batches" nonzero "parallel.pp = 4 needs at least 4 micro-batches per step, but training.batch_size / dp / training.micro_batch_size = 8 / 1 / 4 = 2" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set parallel.pp=4 --set training.micro_batch_size=4 train
expect "interleaved_1f1b with micro-batches not a multiple of pp" nonzero "must be a multiple of parallel.pp = 4" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set parallel.pp=4 --set parallel.pp_schedule=interleaved_1f1b \
  --set parallel.pp_virtual=2 --set training.batch_size=6 train
expect "pp_virtual without interleaved_1f1b" nonzero "parallel.pp_virtual = 2 needs parallel.pp_schedule = interleaved_1f1b" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set parallel.pp=2 --set parallel.pp_virtual=2 train
expect "an unknown schedule" nonzero "parallel.pp_schedule = 'dualpipe': expected one of gpipe, 1f1b, interleaved_1f1b, zb1p" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set parallel.pp=2 --set parallel.pp_schedule=dualpipe train
expect "tied embeddings across stages" nonzero "model.tie_embeddings = true with parallel.pp = 2" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set parallel.pp=2 --set model.tie_embeddings=true train
expect "zb1p with fully_shard" nonzero "parallel.pp_schedule = zb1p with parallel.dp_shard = 2" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set parallel.pp=2 --set parallel.dp_shard=2 --set parallel.pp_schedule=zb1p train
expect "pp_layers without pp" nonzero "parallel.pp_layers is given but parallel.pp = 1" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set 'parallel.pp_layers=[8]' train

summary pp
