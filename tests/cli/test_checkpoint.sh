#!/usr/bin/env bash
# Checkpoints that cost training little and are never trusted blindly (issue: goodput under failures):
#  - asynchronous saves (checkpoint.async) write the same bytes as synchronous ones, at the same steps, and a
#    resume from one is bit-identical; a rank killed while its writer thread writes leaves the previous checkpoint;
#  - every file's checksum is in meta.json, and meta.json has its own: a flipped byte, a truncated shard, a shard
#    from another step, a damaged index, an edited step or optimizer_steps, a deleted meta.json, an MoE bias edited
#    in meta.json and a planted index are errors naming the file and what, and resume: auto falls back to the
#    newest checkpoint that verifies (its save of the skipped step says that it replaces it); checkpoints of
#    formats 3 and 2 load with a warning;
#  - a partial save left by a dead run is removed by the next, saying so;
#  - an asynchronous save is renamed into place as soon as every writer is done, not at the next step boundary;
#  - checkpoint.interval_s and checkpoint.interval: auto (Young/Daly) choose when; the metrics say what each save
#    cost and where the wall time went (goodput).
#   tests/cli/test_checkpoint.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_checkpoint.sh BUILD_DIR}
source "$(dirname "$0")/common.sh"

docs_data --val-fraction 0.1
cat >"$tmp/t.yaml" <<YAML
model: {dim: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 64, vocab_size: 256, max_seq_len: 32}
training: {steps: 12, batch_size: 8, seq_len: 32, lr: 3.0e-3, warmup_steps: 3, lr_min: 3.0e-4, grad_clip: 1.0,
           weight_decay: 0.1, threads: 1, schedule: cosine}
data: {train: "$tmp/data/docs_train_*.bin", val: "$tmp/data/docs_val_*.bin"}
eval: {interval: 6, steps: 2}
sample: {interval: 0}
log: {interval: 1}
checkpoint: {interval: 4, keep: 0}
YAML
train() {  # train NAME NP [--set ...]: metrics in $tmp/NAME.jsonl, checkpoints in $tmp/NAME.ckpt (kept)
  local name=$1 np=$2
  shift 2
  rm -f "$tmp/$name.jsonl"
  timeout 300 "$mpirun" -np "$np" "$mt" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/$name.jsonl" \
    --set checkpoint.dir="$tmp/$name.ckpt" "$@" train >"$tmp/$name.log" 2>&1
}

# --- Synchronous and asynchronous saves write the same bytes ---
train sync 2 || bad "sync run" "$(tail -n 20 "$tmp/sync.log")"
if train async 2 --set checkpoint.async=true; then
  for s in 00000004 00000008 00000012; do
    if out=$(same_safetensors "$tmp/sync.ckpt/step_$s" "$tmp/async.ckpt/step_$s"); then ok "async = sync at step $s, byte for byte: $out"
    else bad "async = sync at step $s, byte for byte" "$out"; fi
  done
  check "async: the metrics record each save (mode, stall, snapshot) and its commit once, and the goodput" -- "$py" -c "
import json, sys
r = [json.loads(l) for l in open('$tmp/async.jsonl')]
saves = [(e['step'], e['mode']) for e in r if e.get('event') == 'checkpoint']
commits = [e['step'] for e in r if e.get('event') == 'checkpoint_committed']
assert saves == [(4, 'async'), (8, 'async'), (12, 'sync')], saves
assert commits == [4, 8, 12], commits
snap = [e['snapshot_bytes'] for e in r if e.get('event') == 'checkpoint' and e['mode'] == 'async']
assert all(b > 0 for b in snap), snap
steps = [e['step'] for e in r if 'loss' in e]
assert steps == list(range(1, 13)), steps
g = [e for e in r if e.get('event') == 'goodput'][-1]
parts = g['productive_s'] + g['checkpoint_s'] + g['eval_s'] + g['setup_s'] + g['other_s']
assert abs(parts - g['wall_s']) < 1e-6 + 1e-3 * g['wall_s'] and 0 < g['goodput'] <= 1, g
st = [e for e in r if e.get('event') == 'start'][0]
assert st['start_step'] == 0 and st['world'] == 2 and st['resumed_from'] is None, st
print('saves', saves, 'snapshot bytes', snap, 'goodput', round(g['goodput'], 3))"
  expect "async: the log says the snapshot's memory" zero "MiB of host memory on this rank); written in the background" -- cat "$tmp/async.log"
  expect "the run prints its goodput with the parts" zero "checkpoint stalls" -- grep -a "^goodput" "$tmp/async.log"
  check "meta.json (format 4) lists a checksum for every file of the directory but itself, and has its own" -- "$py" -c "
import json, os, sys
d = '$tmp/async.ckpt/step_00000008'
m = json.load(open(d + '/meta.json'))
files = sorted(f for f in os.listdir(d) if f != 'meta.json')
assert m['format_version'] == 4 and sorted(m['checksums']) == files, (sorted(m['checksums']), files)
sums = list(m['checksums'].values()) + [m['meta_checksum']]
assert all(v.startswith('xxh3-64:') and len(v) == 24 for v in sums), sums
print(len(files), 'files')"
else
  bad "async run" "$(tail -n 20 "$tmp/async.log")"
fi
mv "$tmp/async.jsonl" "$tmp/async-full.jsonl"
train async 2 --set checkpoint.async=true --set checkpoint.resume="$tmp/async.ckpt/step_00000008" &&
  check "resume from an asynchronous save (step 8) is bit-identical" -- "$py" "$compare" "$tmp/async.jsonl" "$tmp/sync.jsonl" --exact --from-step 8 --steps 4 ||
  bad "resume from step 8" "$(tail -n 20 "$tmp/async.log")"

# --- Damaged checkpoints: named, never resumed silently; resume: auto falls back ---
# damaged NAME HOW: a copy of the sync run's checkpoints whose step 12 is damaged by HOW (run in it).
damaged() {
  rm -rf "$tmp/$1.ckpt"
  cp -r "$tmp/sync.ckpt" "$tmp/$1.ckpt"
  (cd "$tmp/$1.ckpt/step_00000012" && eval "$2")
}
flip='python3 -c "
f = open(\"model-00001-of-00002.safetensors\", \"r+b\"); f.seek(-100, 2); b = f.read(1); f.seek(-100, 2); f.write(bytes([b[0] ^ 1]))"'
damaged flip "$flip"
damaged trunc 'truncate -s -64 optimizer-00002-of-00002.safetensors'
damaged other 'cp ../step_00000008/model-00002-of-00002.safetensors .'
damaged index 'sed -i "s/model-00002-of-00002/model-00001-of-00002/" model.safetensors.index.json'
damaged optindex 'sed -i "s/optimizer-00002-of-00002/optimizer-00001-of-00002/" optimizer.safetensors.index.json'
# meta.json itself: its step or optimizer_steps edited (valid JSON, other numbers), or the file deleted.
meta_set='python3 -c "import json, sys; m = json.load(open(\"meta.json\")); m[sys.argv[1]] = int(sys.argv[2]); json.dump(m, open(\"meta.json\", \"w\"), indent=2)"'
damaged metastep "$meta_set step 11"
damaged metaopt "$meta_set optimizer_steps 13"
damaged metagone 'rm meta.json'
# NAME|FILE|WHAT: resuming step 12 explicitly fails with "step_00000012/FILE: WHAT" (a directory without meta.json:
# "not a complete checkpoint"), printed once; resume: auto falls back to step 8 saying the same, redoes steps 9-12
# bit-identically, and says that its save of step 12 replaces the skipped directory.
for c in "flip|model-00001-of-00002.safetensors|checksum mismatch" "trunc|optimizer-00002-of-00002.safetensors|checksum mismatch" \
         "other|model-00002-of-00002.safetensors|checksum mismatch" "index|model.safetensors.index.json|checksum mismatch" \
         "optindex|optimizer.safetensors.index.json|checksum mismatch" "metastep|meta.json|checksum mismatch" \
         "metaopt|meta.json|checksum mismatch" "metagone|meta.json|missing"; do
  IFS='|' read -r n file what <<<"$c"
  named="$tmp/$n.ckpt/step_00000012/$file: $what"
  explicit=$named
  [ "$n" = metagone ] && explicit="step_00000012: not a complete checkpoint (no meta.json)"
  expect "$n: resuming the damaged step 12 names $file ($what)" nonzero "$explicit" -- \
    "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.steps=14 --set checkpoint.allow_config_change=true \
    --set checkpoint.dir="$tmp/$n.explicit" --set checkpoint.resume="$tmp/$n.ckpt/step_00000012" train
  c_out=$(grep -cF "$explicit" "$tmp/out")
  [ "$c_out" = 1 ] && ok "$n: the error is printed once" || bad "$n: the error is printed once" "$c_out lines" "$(grep -F "$explicit" "$tmp/out")"
  expect "$n: resume: auto falls back to step 8" zero "falls back to $tmp/$n.ckpt/step_00000008" -- \
    "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set checkpoint.dir="$tmp/$n.ckpt" --set checkpoint.interval=0 \
    --set log.metrics_file="$tmp/$n.jsonl" train
  cp "$tmp/out" "$tmp/$n.out"
  expect "$n: and its line names $file ($what)" zero "$named" -- grep -a "falls back to $tmp/$n.ckpt/step_00000008" "$tmp/$n.out"
  if grep -qF "resumed from $tmp/$n.ckpt/step_00000008 at step 8" "$tmp/$n.out"; then
    check "$n: the fallback run redoes steps 9-12 bit-identically" -- "$py" "$compare" "$tmp/$n.jsonl" "$tmp/sync.jsonl" --exact --from-step 8 --steps 4
    expect "$n: its save of step 12 says that it replaces the skipped directory" zero "$tmp/$n.ckpt/step_00000012 is replaced" -- cat "$tmp/$n.out"
  else
    bad "$n: resumed from step 8" "$(grep -a resumed "$tmp/$n.out")"
  fi
done
# Checkpoints written before meta.json had a checksum of its own (format 3), or any checksum (format 2), still load,
# with one line saying what is not verified.
for v in 3 2; do
  rm -rf "$tmp/old$v.ckpt" && cp -r "$tmp/sync.ckpt" "$tmp/old$v.ckpt"
  "$py" -c "
import json; p = '$tmp/old$v.ckpt/step_00000012/meta.json'; m = json.load(open(p)); m.pop('meta_checksum', None)
if $v == 2: del m['checksums']
m['format_version'] = $v; json.dump(m, open(p, 'w'))"
  want="$tmp/old$v.ckpt/step_00000012/meta.json has no checksum of its own (format 3, written before format 4)"
  [ $v = 2 ] && want="$tmp/old$v.ckpt/step_00000012: no checksums in meta.json (format 2"
  expect "a format $v checkpoint loads, with a warning" zero "$want" -- \
    "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.steps=13 --set checkpoint.allow_config_change=true \
    --set checkpoint.dir="$tmp/old$v.ckpt" train
  grep -qF "resumed from $tmp/old$v.ckpt/step_00000012 at step 12" "$tmp/out" && ok "format $v: resumed from step 12" ||
    bad "format $v: resumed from step 12" "$(grep -a -e resumed -e warn "$tmp/out")"
done

# --- An MoE model's selection bias (meta.json's model_state), and a file the loader would read that the save did
# not write, on a one-writer checkpoint (model.safetensors, no index): resume: auto falls back to step 4 ---
sed -e 's/^model: .*/model: {type: mixtral, dim: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 64, vocab_size: 256, max_seq_len: 32, moe: {n_experts: 4, ffn_dim: 32, bias_update_rate: 0.01}}/' \
  -e 's/steps: 12,/steps: 8,/' "$tmp/t.yaml" >"$tmp/moe.yaml"
moe_train() {  # moe_train NAME [--set ...]: one rank; metrics in $tmp/NAME.jsonl, checkpoints in $tmp/NAME.ckpt
  local name=$1
  shift
  rm -f "$tmp/$name.jsonl"
  timeout 300 "$mpirun" -np 1 "$mt" --config "$tmp/moe.yaml" --set log.metrics_file="$tmp/$name.jsonl" \
    --set checkpoint.dir="$tmp/$name.ckpt" "$@" train >"$tmp/$name.log" 2>&1
}
rm -rf "$tmp/moe.ckpt"
if moe_train moe && grep -q router_bias "$tmp/moe.ckpt/step_00000008/meta.json"; then
  for c in "bias|meta.json|checksum mismatch" "planted|model-00001-of-00001.safetensors|not recorded in meta.json"; do
    IFS='|' read -r n file what <<<"$c"
    rm -rf "$tmp/moe_$n.ckpt" && cp -r "$tmp/moe.ckpt" "$tmp/moe_$n.ckpt"
    (cd "$tmp/moe_$n.ckpt/step_00000008" && case $n in
      bias) python3 -c "import json; m = json.load(open('meta.json')); m['model_state']['router_bias'][0][0] += 0.01; json.dump(m, open('meta.json', 'w'), indent=2)" ;;
      # step 4's weights under an index that maps every tensor to them: read instead of model.safetensors.
      planted) cp ../step_00000004/model.safetensors model-00001-of-00001.safetensors && python3 -c "
import json, struct
f = open('model.safetensors', 'rb'); n = struct.unpack('<Q', f.read(8))[0]
names = [k for k in json.loads(f.read(n)) if k != '__metadata__']
json.dump({'metadata': {}, 'weight_map': {k: 'model-00001-of-00001.safetensors' for k in names}}, open('model.safetensors.index.json', 'w'))" ;;
    esac)
    if moe_train "moe_$n"; then
      expect "moe $n: resume: auto names $file ($what) and falls back to step 4" zero \
        "$tmp/moe_$n.ckpt/step_00000008/$file: $what" -- grep -a "falls back to $tmp/moe_$n.ckpt/step_00000004" "$tmp/moe_$n.log"
      check "moe $n: the fallback run redoes steps 5-8 bit-identically" -- "$py" "$compare" "$tmp/moe_$n.jsonl" "$tmp/moe.jsonl" --exact --from-step 4 --steps 4
    else
      bad "moe $n: the run after the damage" "$(tail -n 20 "$tmp/moe_$n.log")"
    fi
  done
else
  bad "moe run with bias_update_rate (model_state in meta.json)" "$(tail -n 20 "$tmp/moe.log")"
fi

# --- A rank killed while its writer thread writes (async): the previous checkpoint stays; the next run removes the
# partial save, saying so, and goes on from it bit-identically ---
rm -rf "$tmp/killed.ckpt"
if MT_FAULT_CHECKPOINT=8 train killed 2 --set checkpoint.async=true; then
  bad "killed in an async save: the job exits non-zero" "exit 0"
else
  check "killed in an async save: step 4 complete, step 8 only a partial .tmp" -- test -f "$tmp/killed.ckpt/step_00000004/meta.json" -a \
    -d "$tmp/killed.ckpt/step_00000008.tmp" -a ! -e "$tmp/killed.ckpt/step_00000008"
fi
if train killed 2 --set checkpoint.async=true; then
  expect "the next run removes the partial save, saying so" zero "step_00000008.tmp" -- grep -a "removed .*a partial save" "$tmp/killed.log"
  check "the partial save is gone" -- test ! -e "$tmp/killed.ckpt/step_00000008.tmp"
  check "and the run goes on from step 4 bit-identically" -- "$py" "$compare" "$tmp/killed.jsonl" "$tmp/sync.jsonl" --exact --from-step 4 --steps 8
else
  bad "the run after the kill" "$(tail -n 20 "$tmp/killed.log")"
fi

# --- An asynchronous save is on disk as soon as its writers finish (rank 0's thread completes it), not at the next
# step boundary: with steps made slow (0.6 s), step 4's directory is renamed into place before step 5 ends ---
rm -rf "$tmp/early.ckpt"
if MT_FAULT_SLOW_RANK=0:600 train early 2 --set checkpoint.async=true --set training.steps=6 --set eval.interval=0; then
  check "async: step 4's save is on disk before step 5 ends, not at the boundary after it" -- "$py" -c "
import json
r = [json.loads(l) for l in open('$tmp/early.jsonl')]
c = [e for e in r if e.get('event') == 'checkpoint_committed' and e['step'] == 4][0]
s5 = [e for e in r if e.get('step') == 5 and 'loss' in e][-1]
assert 'renamed_time' in c, c
assert c['renamed_time'] < s5['time'], (c['renamed_time'], s5['time'])
print('on disk %.3f s after the last writer finished, %.2f s before the boundary that confirmed it' % (c['commit_lag_s'], c['before_boundary_s']))"
  check "async: no writer's done file is left in the checkpoint" -- test -z "$(ls -A "$tmp/early.ckpt"/step_00000004 | grep writer)"
else
  bad "the slow async run" "$(tail -n 20 "$tmp/early.log")"
fi

# --- When: seconds, or Young/Daly from the measured cost ---
rm -rf "$tmp/secs.ckpt"
train secs 2 --set checkpoint.interval=0 --set checkpoint.interval_s=0.02 --set training.steps=30 &&
  check "checkpoint.interval_s: saves by time, more than the final one" -- "$py" -c "
import json; s = [e['step'] for e in map(json.loads, open('$tmp/secs.jsonl')) if e.get('event') == 'checkpoint']
assert len(s) >= 3 and s == sorted(set(s)) and s[-1] == 30, s; print('saved at', s)" ||
  bad "interval_s run" "$(tail -n 20 "$tmp/secs.log")"
rm -rf "$tmp/auto.ckpt"
train auto 2 --set checkpoint.interval=auto --set checkpoint.mtbf_s=3600 --set checkpoint.async=true &&
  expect "interval: auto measures a save after step 2 and prints its choice and the expected loss" zero "expected loss per failure" -- \
    grep -a "checkpoint.interval auto: a save holds training" "$tmp/auto.log" ||
  bad "interval auto run" "$(tail -n 20 "$tmp/auto.log")"
expect "interval: auto without mtbf_s is a config error naming the key" nonzero "checkpoint.mtbf_s" -- \
  "$mt" --config "$tmp/t.yaml" --set checkpoint.interval=auto --set checkpoint.dir="$tmp/x.ckpt" train
expect "interval: a word other than auto is a config error" nonzero "checkpoint.interval: expected a step count or auto" -- \
  "$mt" --config "$tmp/t.yaml" --set checkpoint.interval=often --set checkpoint.dir="$tmp/x.ckpt" train

summary checkpoint
[ $failed -eq 0 ]
