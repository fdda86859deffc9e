#!/usr/bin/env bash
# End-to-end tests of `meshtrain train`, `meshtrain generate` and `meshtrain logits` under mpirun:
#  - parallelism invariance: dp_replicate = 2 and 4, and micro-batching, give the losses of 1 rank;
#  - the PyTorch reference (scripts/reference/llama_ref.py) on the same weights and data:
#    step 0 within 1e-5 relative, 10 AdamW steps within 1e-4 absolute (untied and tied);
#  - resume from a checkpoint is bit-identical (the random init not drawn); on another mesh within tolerance;
#  - a rank killed while writing a checkpoint leaves the previous one, and resume: auto uses it;
#  - the CPU GEMM peak kept per machine (log.peak_cache: written, used, a corrupt or foreign file probed again),
#    and the set-up timeline (one line, one "setup" record whose parts add up);
#  - every kind of bad data, checkpoint, config.json (unknown RoPE scaling or model_type, Llama's attention
#    biases, activation) and config input gives its message; config.json's architecture is read (RoPE scaling in
#    both spellings) and the YAML's model keys must agree with it; logits of a checkpoint and of a Hugging Face directory, and their bad input.
# Prints "train: N passed, N failed[, N skipped]" last.
#   tests/cli/test_train.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_train.sh BUILD_DIR}
source "$(dirname "$0")/common.sh"
ref="$root/scripts/reference/llama_ref.py"


# A small byte-level dataset from the project's own docs.
docs_data --val-fraction 0.1
cat >"$tmp/t.yaml" <<YAML
model: {dim: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 64, vocab_size: 256, max_seq_len: 32}
training: {steps: 20, batch_size: 8, seq_len: 32, lr: 3.0e-3, warmup_steps: 3, lr_min: 3.0e-4, grad_clip: 1.0,
           weight_decay: 0.1, threads: 1, schedule: cosine}
data: {train: "$tmp/data/docs_train_*.bin", val: "$tmp/data/docs_val_*.bin"}
eval: {interval: 10, steps: 2}
sample: {interval: 10, tokens: 16, prompt: "The "}
log: {interval: 1}
checkpoint: {interval: 10, keep: 0}
YAML
train() {  # train NAME NP [--set ...]: metrics in $tmp/NAME.jsonl, checkpoints in $tmp/NAME.ckpt
  local name=$1 np=$2
  shift 2
  rm -rf "$tmp/$name.jsonl" "$tmp/$name.ckpt"
  timeout 300 "$mpirun" -np "$np" "$mt" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/$name.jsonl" \
    --set checkpoint.dir="$tmp/$name.ckpt" "$@" train >"$tmp/$name.log" 2>&1
}

# no_sums DIR: a checkpoint's meta.json without its checksums, its own included (as written before format 3), so
# that the loader's own checks of damaged files are reached (tests/cli/test_checkpoint.sh checks the checksums).
no_sums() {
  "$py" -c "import json, sys; p = sys.argv[1] + '/meta.json'; m = json.load(open(p)); m.pop('checksums', None); m.pop('meta_checksum', None); m['format_version'] = 2; json.dump(m, open(p, 'w'))" "$1"
}

# --- Invariance over the data-parallel mesh and micro-batching ---
if train base 1; then ok "train 20 steps on 1 rank: $(grep -c '"loss"' "$tmp/base.jsonl") steps logged"; else
  bad "train 20 steps on 1 rank" "$(tail -n 20 "$tmp/base.log")"; fi
expect "progress lines, eval, sample" zero "val_loss" -- cat "$tmp/base.log"
# The sample line echoes the prompt "The ": what the model added after it must be there too (16 tokens, each
# printed as one character or an escape).
check "sample at step 10: the prompt and 16 generated tokens" -- "$py" -c "
import re, sys; t = open('$tmp/base.log', encoding='utf-8', errors='replace').read()
m = re.search(r'sample step 10 \| The (.*)', t); assert m, 'no sample line for step 10'
assert len(m.group(1)) >= 16, ('fewer than 16 generated tokens after the prompt', m.group(1))
print('generated:', repr(m.group(1)))"
check "loss decreases" -- "$py" -c "
import json; r=[json.loads(l) for l in open('$tmp/base.jsonl') if '\"loss\"' in l]
assert r[-1]['loss'] < r[0]['loss'] - 0.5, (r[0]['loss'], r[-1]['loss'])
for k in ('step','loss','lr','grad_norm','tokens_per_s','mfu','peak_mem_bytes'): assert k in r[0], k
print('loss', r[0]['loss'], '->', r[-1]['loss'])"
for np in 2 4; do
  train "dp$np" $np && check "dp_replicate=$np gives the losses of 1 rank" -- "$py" "$compare" "$tmp/dp$np.jsonl" "$tmp/base.jsonl" --steps 20 ||
    bad "dp_replicate=$np run" "$(tail -n 20 "$tmp/dp$np.log")"
done
train micro 2 --set training.micro_batch_size=2 &&
  check "micro-batches of 2 on 2 ranks give the losses of 1 rank" -- "$py" "$compare" "$tmp/micro.jsonl" "$tmp/base.jsonl" --steps 20 ||
  bad "micro-batch run" "$(tail -n 20 "$tmp/micro.log")"

# --- Gradient sync: buckets overlapped with backward vs one redistribute per parameter ---
expect "gradient sync plans its buckets" zero "gradient sync: 1 bucket(s) (f32): " -- cat "$tmp/dp2.log"
train bucket0 2 --set training.grad_bucket_mb=0 &&
  check "per-parameter gradient sync equals the bucketed one bit for bit (2 ranks)" -- "$py" "$compare" "$tmp/bucket0.jsonl" "$tmp/dp2.jsonl" --exact --steps 20 ||
  bad "per-parameter sync run" "$(tail -n 20 "$tmp/bucket0.log")"
train buckets 4 --set training.grad_bucket_mb=0.01 --set training.micro_batch_size=1 &&
  check "many small buckets, micro-batches, 4 ranks: the losses of 1 rank" -- "$py" "$compare" "$tmp/buckets.jsonl" "$tmp/base.jsonl" --steps 20 ||
  bad "small-bucket run" "$(tail -n 20 "$tmp/buckets.log")"

# --- Mixed precision (bf16 emulated in f32 on the CPU: the policy's numbers, not its speed) ---
# Step-20 losses of two runs within 2% of each other.
within_2pct="import json, sys
def last(p): return [json.loads(l) for l in open(p) if '\"loss\"' in l][-1]
a, b = last(sys.argv[1]), last(sys.argv[2]); d = abs(a['loss'] - b['loss']) / b['loss']
print('step', a['step'], 'loss', a['loss'], 'vs', b['loss'], 'relative difference %.4f' % d); sys.exit(0 if d < 0.02 else 1)"
train bf16 1 --set training.dtype=bf16 &&
  check "bf16: 20 steps within 2% of fp32 at step 20" -- "$py" -c "$within_2pct" "$tmp/bf16.jsonl" "$tmp/base.jsonl" ||
  bad "bf16 run" "$(tail -n 20 "$tmp/bf16.log")"
expect "bf16: the policy is announced" zero "mixed precision: bf16 compute (emulated in f32 on the CPU" -- cat "$tmp/bf16.log"
check "bf16 losses differ from fp32 (really rounded)" -- "$py" "$compare" "$tmp/bf16.jsonl" "$tmp/base.jsonl" --exact --steps 20 --expect-differ
train bf16dp2 2 --set training.dtype=bf16 --set training.grad_reduce_dtype=bf16 &&
  check "bf16 with gradients reduced in bf16 on 2 ranks: within 2% of fp32 at step 20" -- "$py" -c "$within_2pct" "$tmp/bf16dp2.jsonl" "$tmp/base.jsonl" ||
  bad "bf16 dp2 run" "$(tail -n 20 "$tmp/bf16dp2.log")"
train bf16r 1 --set training.dtype=bf16 --set checkpoint.resume="$tmp/bf16.ckpt/step_00000010" &&
  check "bf16 resume at step 10 is bit-identical (f32 master weights in the checkpoint)" -- "$py" "$compare" "$tmp/bf16r.jsonl" "$tmp/bf16.jsonl" --exact --from-step 10 --steps 10 ||
  bad "bf16 resume run" "$(tail -n 20 "$tmp/bf16r.log")"

# --- Resume ---
train resumed 1 --set checkpoint.resume="$tmp/base.ckpt/step_00000010" &&
  check "resume at step 10 is bit-identical" -- "$py" "$compare" "$tmp/resumed.jsonl" "$tmp/base.jsonl" --exact --from-step 10 --steps 10 ||
  bad "resume run" "$(tail -n 20 "$tmp/resumed.log")"
expect "resume is announced" zero "resumed from $tmp/base.ckpt/step_00000010 at step 10" -- cat "$tmp/resumed.log"
# A run that may resume allocates its parameters undrawn: the checkpoint's values replace them, or (nothing to load,
# as in base) the random init is drawn then, the same bits as a run that never resumes draws at creation.
expect "resume: no random init drawn, the checkpoint loads every parameter" zero "at step 10 (no random init drawn: the checkpoint loaded every parameter)" -- cat "$tmp/resumed.log"
train never 1 --set checkpoint.resume=never &&
  check "the random init drawn after the search for a checkpoint equals the one drawn at creation" -- "$py" "$compare" "$tmp/base.jsonl" "$tmp/never.jsonl" --exact --steps 20 ||
  bad "resume: never run" "$(tail -n 20 "$tmp/never.log")"

# --- Set-up: the CPU GEMM peak kept per machine, the set-up timeline ---
# pk NAME NP [--set ...]: a 2-rank resume at step 10 and one step, the peak kept in $tmp/peak; its launch's wall
# time (ms) in $tmp/NAME.wall.
pk() {
  local name=$1 np=$2 t0
  shift 2
  t0=$(date +%s%N)
  train "$name" "$np" --set checkpoint.resume="$tmp/base.ckpt/step_00000010" --set training.steps=11 \
    --set log.peak_cache="$tmp/peak" "$@"
  local rc=$?
  echo $(( ($(date +%s%N) - t0) / 1000000 )) >"$tmp/$name.wall"
  return $rc
}
pk_file() { ls "$tmp"/peak/cpu_peak-*.json 2>/dev/null; }
if pk pk1 2; then
  f=$(pk_file)
  if [ "$(echo "$f" | grep -c .)" = 1 ] && grep -qF "probed in" "$tmp/pk1.log" && grep -qF "kept in $f" "$tmp/pk1.log"; then
    ok "GEMM peak: probed on the first start and kept in $(basename "$f")"
  else bad "GEMM peak: probed on the first start and kept" "files: $f" "$(grep -F 'GEMM peak' "$tmp/pk1.log")"; fi
else bad "GEMM peak: first run" "$(tail -n 20 "$tmp/pk1.log")"; fi
# The set-up timeline: one line on rank 0, one record whose parts are in order, non-negative, add up to the whole,
# count MPI's start-up, and end within the launch's wall time.
check "set-up timeline: one line, one record, parts in order adding up to the whole" -- "$py" - "$tmp/pk1" <<'PY'
import json, re, sys
p = sys.argv[1]
log = open(p + ".log", errors="replace").read()
lines = re.findall(r"set-up ([0-9.]+) s from the process's start to the first step done: (.*) \(s\)", log)
assert len(lines) == 1, ("set-up lines", len(lines))
assert "MPI start-up" in lines[0][1] and "checkpoint loaded" in lines[0][1] and "GEMM peak" in lines[0][1], lines[0]
recs = [json.loads(l) for l in open(p + ".jsonl") if l.startswith("{")]
setup = [r for r in recs if r.get("event") == "setup"]
assert len(setup) == 1, ("setup records", len(setup))
s = setup[0]
names = [x["part"] for x in s["parts"]]
assert names == ["exec", "mpi", "config", "mesh", "model", "load", "peak", "report", "first_step"], names
assert all(x["s"] >= 0 for x in s["parts"]), s["parts"]
assert abs(sum(x["s"] for x in s["parts"]) - s["total_s"]) < 1e-6, s
assert s["start_step"] == 10 and s["peak"] == "probed", s
mpi = s["parts"][1]["s"]
assert mpi > 0.01, ("MPI start-up not counted", mpi)
start = [r for r in recs if r.get("event") == "start"][0]
wall = int(open(p + ".wall").read()) / 1e3
assert start["setup_s"] < s["total_s"] < wall, (start["setup_s"], s["total_s"], wall)
assert abs(float(lines[0][0]) - s["total_s"]) < 0.01, (lines[0][0], s["total_s"])
print(f"total {s['total_s']:.2f} s (launch {wall:.2f} s): " + ", ".join(f"{x['part']} {x['s']:.2f}" for x in s["parts"]))
PY
# The next start reads the file: no probe, the same figure, and the record says so.
if pk pk2 2; then
  f=$(pk_file)
  want=$("$py" -c "import json, sys; print(f'{json.load(open(sys.argv[1]))[\"flops\"] / 1e9:.1f}')" "$f")
  if grep -qF "cached in $f" "$tmp/pk2.log" && ! grep -qF "probed in" "$tmp/pk2.log" &&
    grep -qF "CPU GEMM peak $want GFLOP/s" "$tmp/pk2.log" && grep -qF '"peak":"cached"' "$tmp/pk2.jsonl"; then
    ok "GEMM peak: the next start uses the kept one ($want GFLOP/s), not probed"
  else bad "GEMM peak: the next start uses the kept one ($want GFLOP/s)" "$(grep -F 'GEMM peak' "$tmp/pk2.log")"; fi
else bad "GEMM peak: second run" "$(tail -n 20 "$tmp/pk2.log")"; fi
# A corrupt file and one written for another machine: one warning naming it, probed again, rewritten whole.
for how in corrupt foreign; do
  f=$(pk_file)
  if [ $how = corrupt ]; then printf '{"key": {"cpu": ' >"$f"; why="not a peak cache file"
  else "$py" -c "import json, sys; j = json.load(open(sys.argv[1])); j['key']['cpu'] = 'another CPU'; json.dump(j, open(sys.argv[1], 'w'))" "$f"
    why="written for another machine"; fi
  if pk pk_$how 2 && [ "$(grep -cF "log.peak_cache: ignoring $f: $why" "$tmp/pk_$how.log")" = 1 ] &&
    grep -qF "probed in" "$tmp/pk_$how.log" && "$py" -c "import json, sys; assert json.load(open(sys.argv[1]))['flops'] > 0" "$f" &&
    pk pk_${how}2 2 && grep -qF "cached in $f" "$tmp/pk_${how}2.log"; then
    ok "GEMM peak: a $how file is named once, probed again and rewritten"
  else bad "GEMM peak: a $how file is named once, probed again and rewritten" "$(grep -F 'peak' "$tmp/pk_$how.log")"; fi
done
# Another layout (1 rank on the node, not 2) has a file of its own; two jobs writing at once leave whole files.
pk pk_a 1 & pk pk_b 1; wait
if [ "$(pk_file | grep -c .)" = 2 ] && grep -qF "probed in" "$tmp/pk_a.log" &&
  "$py" -c "import json, sys; [json.load(open(f)) for f in sys.argv[1:]]" $(pk_file) && ! ls "$tmp"/peak/*.tmp.* 2>/dev/null; then
  ok "GEMM peak: 1 rank on the node has its own file; two jobs writing it at once leave it whole"
else bad "GEMM peak: another layout, concurrent writers" "$(ls -l "$tmp/peak")" "$(grep -F 'peak' "$tmp/pk_a.log" "$tmp/pk_b.log")"; fi
# auto: $XDG_CACHE_HOME/meshtrain; off: nothing written.
XDG_CACHE_HOME="$tmp/xdg" pk pk_auto 1 --set log.peak_cache=auto
XDG_CACHE_HOME="$tmp/xdg2" pk pk_off 1 --set log.peak_cache=off
if ls "$tmp"/xdg/meshtrain/cpu_peak-*.json >/dev/null 2>&1 && [ ! -e "$tmp/xdg2" ] && grep -qF "probed in" "$tmp/pk_off.log" &&
  ! grep -qF "kept in" "$tmp/pk_off.log"; then ok "log.peak_cache: auto keeps it under \$XDG_CACHE_HOME/meshtrain, off keeps nothing"
else bad "log.peak_cache: auto and off" "$(ls -R "$tmp/xdg" "$tmp/xdg2" 2>&1)" "$(grep -F 'peak' "$tmp/pk_auto.log" "$tmp/pk_off.log")"; fi
train resumed2 2 --set checkpoint.resume="$tmp/base.ckpt/step_00000010" &&
  check "resume on 2 ranks from a 1-rank checkpoint" -- "$py" "$compare" "$tmp/resumed2.jsonl" "$tmp/base.jsonl" --from-step 10 --steps 10 ||
  bad "resume on another mesh" "$(tail -n 20 "$tmp/resumed2.log")"
# A rank dies half way through the step-20 checkpoint: step 10 stays loadable and resume: auto picks it.
if MT_FAULT_CHECKPOINT=20 train killed 2; then
  bad "killed while checkpointing: the job exits non-zero" "exit 0" "$(tail -n 5 "$tmp/killed.log")"
else
  expect "killed while checkpointing: the job exits non-zero, the rank says why" zero "dies while writing" -- cat "$tmp/killed.log"
fi
check "the killed checkpoint is left as .tmp, step 10 complete" -- test -d "$tmp/killed.ckpt/step_00000020.tmp" -a \
  -f "$tmp/killed.ckpt/step_00000010/meta.json" -a ! -e "$tmp/killed.ckpt/step_00000020"
mv "$tmp/killed.jsonl" "$tmp/killed-first.jsonl"
timeout 300 "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/killed.jsonl" \
  --set checkpoint.dir="$tmp/killed.ckpt" train >"$tmp/killed2.log" 2>&1 &&
  check "resume: auto continues from step 10 bit-identically" -- "$py" "$compare" "$tmp/killed.jsonl" "$tmp/dp2.jsonl" --exact --from-step 10 --steps 10 ||
  bad "resume after the kill" "$(tail -n 20 "$tmp/killed2.log")"

# A stop signal (Slurm's warning before the time limit): every rank stops at the same step with a checkpoint,
# exits 128 + 10 (SIGUSR1), and resume: auto continues from there.
rm -rf "$tmp/sig.jsonl" "$tmp/sig.ckpt"
timeout 300 "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.steps=100000 --set checkpoint.interval=0 \
  --set log.metrics_file="$tmp/sig.jsonl" --set checkpoint.dir="$tmp/sig.ckpt" train >"$tmp/sig.log" 2>&1 &
sig_job=$!
wait_for_steps "$tmp/sig.jsonl" 3 300 0.2
# The ranks only (their command lines start with the binary; timeout's and mpirun's do not).
pkill -USR1 -f -- "^$mt .*checkpoint.dir=$tmp/sig.ckpt" 2>/dev/null
wait $sig_job
sig_rc=$?
if [ $sig_rc -eq 138 ]; then
  expect "SIGUSR1: the ranks stop with a checkpoint" zero "received: stopped after step" -- cat "$tmp/sig.log"
  sig_step=$(ls "$tmp/sig.ckpt" | grep -E '^step_[0-9]{8}$' | tail -n 1)
  expect "SIGUSR1: resume continues from $sig_step" zero "resumed from $tmp/sig.ckpt/$sig_step" -- \
    "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.steps=$((10#${sig_step#step_} + 2)) \
    --set checkpoint.dir="$tmp/sig.ckpt" --set log.metrics_file="$tmp/sig2.jsonl" train
else
  bad "SIGUSR1: the job exits 138 (128 + SIGUSR1) after checkpointing" "exit $sig_rc" "$(tail -n 10 "$tmp/sig.log")"
fi

# --- Non-finite steps: never applied, never saved; resume: auto survives a damaged checkpoint ---
# finite.py DIR: every tensor of every checkpoint in DIR is finite.
cat >"$tmp/finite.py" <<'PY'
import glob, json, math, struct, sys
bad = []
for f in sorted(glob.glob(sys.argv[1] + "/step_*/*.safetensors")):
    raw = open(f, "rb").read(); n = struct.unpack("<Q", raw[:8])[0]; h = json.loads(raw[8:8 + n]); body = raw[8 + n:]
    for k, e in h.items():
        if k == "__metadata__": continue
        a, b = e["data_offsets"]
        if any(not math.isfinite(x) for x in struct.unpack("<%df" % ((b - a) // 4), body[a:b])): bad.append(f + ": " + k)
print(len(bad), "non-finite tensors", bad[:3]); sys.exit(1 if bad else 0)
PY
# lr 1e4 without clipping: AdamW's exp_avg_sq overflows at step 2, and with keep 1 a saved NaN checkpoint
# deleted the last good one.
train nan 1 --set training.lr=1e4 --set training.grad_clip=0 --set training.warmup_steps=0 \
  --set checkpoint.interval=1 --set checkpoint.keep=1 && bad "diverging run (lr 1e4): exits non-zero" "exit 0"
# Which guard stops it depends on the kernels' rounding: a finite gradient with an overflowing AdamW state (the
# checkpoint refused, naming the tensor), or a non-finite gradient norm (the update not applied).
if grep -qE "tensor '[^']+' holds a non-finite value|not finite, the update was not applied" "$tmp/nan.log"; then
  ok "diverging run: stopped with the non-finite tensor or step named"
else
  bad "diverging run: stopped with the non-finite tensor or step named" "$(tail -n 15 "$tmp/nan.log")"
fi
check "diverging run: every checkpoint left holds only finite tensors" -- "$py" "$tmp/finite.py" "$tmp/nan.ckpt"
nan_step=$(ls "$tmp/nan.ckpt" | grep -E '^step_[0-9]{8}$' | tail -n 1)
expect "diverging run: resume: auto loads the last good checkpoint, $nan_step" zero "resumed from $tmp/nan.ckpt/$nan_step" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.steps=$((10#${nan_step#step_})) --set checkpoint.dir="$tmp/nan.ckpt" \
  --set checkpoint.allow_config_change=true train
# lr 1e3: the loss and gradients become NaN at step 5; the update is not applied and the run stops naming the step.
train nanstop 2 --set training.lr=1e3 --set training.warmup_steps=0 --set checkpoint.interval=1 --set checkpoint.keep=1 &&
  bad "NaN gradients: exits non-zero" "exit 0"
expect "NaN gradients: the run stops naming the step, loss and grad norm" zero "the update was not applied and the run stops" -- cat "$tmp/nanstop.log"
check "NaN gradients: every checkpoint left holds only finite tensors" -- "$py" "$tmp/finite.py" "$tmp/nanstop.ckpt"
train nanskip 1 --set training.lr=1e3 --set training.warmup_steps=0 --set training.nonfinite=skip \
  --set training.max_nonfinite_steps=3 && bad "nonfinite: skip: exits non-zero after 3 in a row" "exit 0"
expect "nonfinite: skip: stops after max_nonfinite_steps in a row" zero "3 non-finite steps in a row" -- cat "$tmp/nanskip.log"
expect "nonfinite: skip: skipped steps counted in the metrics" zero '"skipped_steps":2' -- cat "$tmp/nanskip.jsonl"
# The newest checkpoint is damaged: resume names the file; resume: auto falls back to the previous one.
rm -rf "$tmp/dmg.ckpt" && cp -r "$tmp/base.ckpt" "$tmp/dmg.ckpt" && truncate -s 100 "$tmp/dmg.ckpt/step_00000020/model.safetensors"
expect "damaged newest checkpoint: resume: auto falls back with a warning" zero "falls back to $tmp/dmg.ckpt/step_00000010" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.steps=21 --set checkpoint.dir="$tmp/dmg.ckpt" train
# Written by 2 ranks: two model files and an index.
truncate -s 100 "$tmp/dmg.ckpt/step_00000021/model-00002-of-00002.safetensors"
expect "damaged checkpoint, explicit resume: the file is named" nonzero "$tmp/dmg.ckpt/step_00000021/model-00002-of-00002.safetensors" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set checkpoint.resume="$tmp/dmg.ckpt/step_00000021" --set checkpoint.dir="$tmp/x" train
# A failed save removes its temporary directory and keeps the previous checkpoint.
MT_FAULT_CHECKPOINT=20:error train failsave 1 && bad "failed save: exits non-zero" "exit 0"
check "failed save: no .tmp left, step 10 kept" -- test ! -e "$tmp/failsave.ckpt/step_00000020.tmp" -a \
  -f "$tmp/failsave.ckpt/step_00000010/meta.json"

# --- generate ---
# Greedy decoding (temperature 0) prints the prompt, then exactly the 24 tokens (bytes) that the PyTorch
# reference picks from the same checkpoint in f64 (llama_ref.py generate); a step where the reference's best two
# logits are within 1e-3 (a near tie f32 may break the other way) ends the comparison there. On 1 and 2 ranks.
for np in 1 2; do
  timeout 300 "$mpirun" -np $np "$mt" generate --checkpoint "$tmp/base.ckpt" --prompt "Once upon" --tokens 24 \
    --temperature 0 >"$tmp/gen$np.out" 2>"$tmp/gen$np.err" || bad "generate on $np rank(s)" "$(tail -n 10 "$tmp/gen$np.err")"
done
check "generate: the prompt, then 24 generated bytes, the same on 1 and 2 ranks" -- "$py" -c "
out = open('$tmp/gen1.out', 'rb').read(); prompt = b'Once upon'
assert out.startswith(prompt) and out.endswith(b'\n') and len(out) == len(prompt) + 24 + 1, out
assert open('$tmp/gen2.out', 'rb').read() == out, 'differs on 2 ranks'
print('generated', out[len(prompt):-1])"
if "$py" -c "import torch" 2>/dev/null; then
  "$py" "$ref" generate --model "$tmp/base.ckpt/step_00000020" --prompt "Once upon" --tokens 24 --max-seq-len 32 \
    --threads 1 >"$tmp/greedy.json" 2>"$tmp/greedy.err" || bad "reference generate" "$(tail -n 5 "$tmp/greedy.err")"
  check "generate: greedy continuation equals the PyTorch reference's from the same checkpoint" -- "$py" -c "
import json, sys
out = open('$tmp/gen1.out', 'rb').read(); ref = json.load(open('$tmp/greedy.json'))
got = list(out[len('Once upon'):-1])
assert len(got) == 24 == len(ref['tokens']), (len(got), len(ref['tokens']))
for i, (g, r, m) in enumerate(zip(got, ref['tokens'], ref['margins'])):
    if g != r:
        assert m < 1e-3, ('token %d: %d, the reference picks %d by a margin of %g' % (i, g, r, m))
        print('equal up to a near tie at token', i); sys.exit(0)
print('24 tokens equal:', bytes(got))"
else
  skip "generate: greedy continuation equals the PyTorch reference's" "python3-torch is not installed"
fi
expect "plot_metrics draws a PNG" zero ".png" -- "$py" "$root/scripts/plot_metrics.py" "$tmp/base.jsonl" --out "$tmp/base.png"

# --- The PyTorch reference ---
if "$py" -c "import torch" 2>/dev/null; then
  for tied in 0 1; do
    flag=""
    [ $tied -eq 1 ] && flag="--tie-embeddings"
    "$py" "$ref" init --out "$tmp/ref$tied" --dim 32 --n-layers 2 --n-heads 4 --n-kv-heads 2 --ffn-dim 64 \
      --vocab-size 256 --max-seq-len 32 --seed 3 $flag >/dev/null
    "$py" "$ref" train --model "$tmp/ref$tied" --data "$tmp/data/docs_train_*.bin" --steps 10 --batch-size 8 --seq-len 32 \
      --lr 3e-3 --schedule cosine --warmup-steps 3 --lr-min 3e-4 --weight-decay 0.1 --grad-clip 1.0 --threads 1 \
      --out "$tmp/ref$tied.json" >"$tmp/ref$tied.log" 2>&1 || bad "reference train (tied=$tied)" "$(tail -n 10 "$tmp/ref$tied.log")"
    train "mt$tied" 1 --set model.init_from="$tmp/ref$tied" --set training.steps=10 --set model.tie_embeddings=$([ $tied -eq 1 ] && echo true || echo false) &&
      check "PyTorch reference: step 1 within 1e-5 rel, 10 steps within 1e-4 (tied=$tied)" -- "$py" "$compare" "$tmp/mt$tied.jsonl" "$tmp/ref$tied.json" --steps 10 ||
      bad "init_from run (tied=$tied)" "$(tail -n 20 "$tmp/mt$tied.log")"
  done
else
  for tied in 0 1; do skip "PyTorch reference (tied=$tied)" "python3-torch is not installed (scripts/setup.sh installs it)"; done
fi

# --- Bad input: data ---
mkdir -p "$tmp/bad"
"$py" - "$tmp/bad" <<'PY'
import struct, sys, os
d = sys.argv[1]
def shard(name, magic=20240520, version=1, count=None, tokens=range(100), cut=0):
    toks = list(tokens)
    hdr = struct.pack("<256i", magic, version, len(toks) if count is None else count, *([0] * 253))
    body = struct.pack(f"<{len(toks)}H", *toks)
    data = hdr + body
    open(os.path.join(d, name), "wb").write(data[:len(data) - cut])
shard("magic.bin", magic=1234)
shard("version.bin", version=7)
shard("size.bin", count=600)
shard("trunc.bin", cut=10)
shard("vocab.bin", tokens=[1, 2, 300, 4] * 30)
open(os.path.join(d, "short.bin"), "wb").write(b"\0" * 100)
shard("tiny.bin", tokens=range(50))
PY
for k in magic version size trunc vocab short; do
  case $k in
    magic) msg="bad magic 1234 at offset 0" ;;
    version) msg="version 7" ;;
    size) msg="does not match" ;;
    trunc) msg="does not match" ;;
    vocab) msg=">= vocab_size 256" ;;
    short) msg="magic.bin" ; msg="short.bin" ;;
  esac
  expect "bad data: $k" nonzero "$msg" -- "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set data.train="$tmp/bad/$k.bin" train
done
expect "bad data: token offset named" nonzero "at offset 1028" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set data.train="$tmp/bad/vocab.bin" train
expect "bad data: no file matches" nonzero "no file matches" -- "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set data.train="$tmp/none_*.bin" train
expect "bad data: fewer tokens than a batch" nonzero "fewer than one batch" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set data.train="$tmp/bad/tiny.bin" train

# --- Bad input: checkpoints and init_from ---
"$py" - "$tmp/base.ckpt/step_00000020/model.safetensors" "$tmp/bad" <<'PY'
import json, struct, sys, os
src, d = sys.argv[1], sys.argv[2]
raw = open(src, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
hdr = json.loads(raw[8:8 + n]); body = raw[8 + n:]
tensors = {k: (v, body[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in hdr.items() if k != "__metadata__"}
def write(name, ts):
    # Re-packed so that the data offsets tile the data, as valid safetensors files do.
    h, blobs, off = {}, [], 0
    for k, (e, b) in ts.items():
        h[k] = {"dtype": e["dtype"], "shape": e["shape"], "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hb = json.dumps(h).encode()
    os.makedirs(os.path.join(d, name), exist_ok=True)
    open(os.path.join(d, name, "model.safetensors"), "wb").write(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))
t = dict(tensors); del t["model.norm.weight"]; write("missing", t)
t = dict(tensors); t["model.extra.weight"] = tensors["model.norm.weight"]; write("extra", t)
t = dict(tensors); e, b = tensors["model.norm.weight"]; e = dict(e); e["shape"] = [e["shape"][0] // 2, 2]; t["model.norm.weight"] = (e, b); write("shape", t)
t = dict(tensors); e, b = tensors["model.norm.weight"]; e = dict(e); e["dtype"] = "I32"; t["model.norm.weight"] = (e, b); write("int", t)
t = dict(tensors); e, b = tensors["model.norm.weight"]; t["model.norm.weight"] = (e, struct.pack("<f", float("nan")) + b[4:]); write("nan", t)
os.makedirs(os.path.join(d, "garbage"), exist_ok=True)
open(os.path.join(d, "garbage", "model.safetensors"), "wb").write(b"\xff" * 64)
PY
expect "init_from: missing tensor" nonzero "missing tensor 'model.norm.weight'" -- "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/bad/missing" train
expect "init_from: extra tensor" nonzero "unexpected tensor 'model.extra.weight'" -- "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/bad/extra" train
expect "init_from: mis-shaped tensor" nonzero "'model.norm.weight' has shape (16, 2), the model expects (32,)" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/bad/shape" train
expect "init_from: an integer tensor is refused" nonzero "tensor 'model.norm.weight' has dtype I32" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/bad/int" train
expect "init_from: a NaN weight is refused at load" nonzero "tensor 'model.norm.weight' holds a non-finite value (nan at element 0 of this rank's part)" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/bad/nan" train
cp "$tmp/base.ckpt/step_00000020/meta.json" "$tmp/base.ckpt/step_00000020/optimizer.safetensors" "$tmp/bad/nan/"
no_sums "$tmp/bad/nan"
expect "resume: a NaN weight in a checkpoint is refused at load" nonzero "model.safetensors: tensor 'model.norm.weight' holds a non-finite value" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set checkpoint.resume="$tmp/bad/nan" --set checkpoint.dir="$tmp/x" train
expect "init_from: corrupt file" nonzero "[checkpoint]" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/bad/garbage" train
expect "init_from: no such path" nonzero "no such file or directory" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/nope" train
expect "init_from: a model key the YAML gives must agree with config.json" nonzero "model.dim = 64 but model.init_from's $tmp/ref0/config.json says hidden_size = 32" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.dim=64 --set model.init_from="$tmp/ref0" train
# A checkpoint's config.json (the Hugging Face LlamaConfig save_checkpoint writes), edited: transformers 5's
# rope_parameters in place of rope_theta is read; what meshtrain's Llama does not compute is refused by name.
"$py" - "$tmp/base.ckpt/step_00000020" "$tmp/hfcfg" <<'PY'
import json, os, shutil, sys
src, d = sys.argv[1], sys.argv[2]
base = json.load(open(os.path.join(src, "config.json")))
def variant(name, drop=(), **over):
    os.makedirs(os.path.join(d, name), exist_ok=True)
    shutil.copy(os.path.join(src, "model.safetensors"), os.path.join(d, name))
    c = {k: v for k, v in base.items() if k not in drop}
    c.update(over)
    json.dump(c, open(os.path.join(d, name, "config.json"), "w"), indent=2)
variant("v5", drop=("rope_theta", "torch_dtype"), rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
variant("v5theta", drop=("rope_theta",), rope_parameters={"rope_type": "default", "rope_theta": 500.0})
variant("v4", drop=("rope_parameters", "dtype"), rope_scaling=None)
variant("llama3", rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
variant("scaling", drop=("rope_parameters",), rope_scaling={"type": "linear", "factor": 2.0})
variant("yarn", drop=("rope_parameters",), rope_scaling={"rope_type": "yarn", "factor": 2.0})
variant("gpt2", model_type="gpt2")
variant("attn_bias", attention_bias=True)
variant("mlp_bias", mlp_bias=True)
variant("gelu", hidden_act="gelu")
PY
expect "init_from: a checkpoint directory (config.json, model.safetensors; optimizer.safetensors ignored)" zero "initialised from" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.steps=1 --set model.init_from="$tmp/base.ckpt/step_00000020" train
expect "init_from: transformers 5's config.json (rope_parameters, dtype)" zero "initialised from" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.steps=1 --set model.init_from="$tmp/hfcfg/v5" train
expect "init_from: transformers 4's config.json (rope_theta, rope_scaling null)" zero "initialised from" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.steps=1 --set model.init_from="$tmp/hfcfg/v4" train
expect "init_from: the architecture comes from config.json (rope_parameters.rope_theta 500)" zero "initialised from" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.steps=1 --set model.init_from="$tmp/hfcfg/v5theta" train
expect "init_from: rope_parameters.rope_theta disagrees with the YAML's" nonzero "model.rope_theta = 10000 but model.init_from's $tmp/hfcfg/v5theta/config.json says rope_theta = 500" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.rope_theta=10000 --set model.init_from="$tmp/hfcfg/v5theta" train
expect "init_from: llama3 RoPE scaling (transformers 5's rope_parameters) is read" zero "initialised from" -- "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.steps=1 --set model.init_from="$tmp/hfcfg/llama3" train
expect "init_from: an unknown RoPE type is refused" nonzero "hfcfg/yarn/config.json: rope_scaling.rope_type = \"yarn\": meshtrain implements RoPE scaling" -- "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/hfcfg/yarn" train
expect "init_from: an unsupported model_type is refused with the list" nonzero "hfcfg/gpt2/config.json: model_type = 'gpt2': meshtrain implements llama, mistral, qwen2" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/hfcfg/gpt2" train
expect "init_from: linear RoPE scaling (transformers 4's rope_scaling with \"type\") is read" zero "initialised from" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.steps=1 --set model.init_from="$tmp/hfcfg/scaling" train
expect "init_from: attention_bias is refused" nonzero "hfcfg/attn_bias/config.json: attention_bias = true: meshtrain's Llama has no attention biases" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/hfcfg/attn_bias" train
expect "init_from: mlp_bias is refused" nonzero "hfcfg/mlp_bias/config.json: mlp_bias = true" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/hfcfg/mlp_bias" train
expect "init_from: hidden_act gelu is refused" nonzero "hfcfg/gelu/config.json: hidden_act = \"gelu\": meshtrain's MLP is SwiGLU" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/hfcfg/gelu" train
# meshtrain logits: a checkpoint (or a Hugging Face directory, the same config.json) to a (T, V) float32 .npy.
expect "logits: a checkpoint.dir's newest checkpoint, on 2 ranks" zero "logits (5, 256) of $tmp/base.ckpt/step_00000020 written" -- "$mpirun" -np 2 "$mt" logits --checkpoint "$tmp/base.ckpt" --tokens 84,104,101,32,113 --out "$tmp/logits.npy"
check "logits: the .npy holds float32 (5, 256)" -- "$py" -c "
h = open('$tmp/logits.npy', 'rb').read(128).decode('latin1')
assert \"'descr': '<f4'\" in h and \"'shape': (5, 256)\" in h, h
print(h.split(chr(10))[0][10:].strip())"
expect "logits: a Hugging Face directory (config.json, no meta.json)" zero "logits (3, 256)" -- "$mpirun" -np 1 "$mt" logits --checkpoint "$tmp/hfcfg/v5" --tokens 1,2,3 --out "$tmp/logits_hf.npy"
expect "logits: a token past the vocabulary" nonzero "--tokens: token 256 (item 1) is >= vocab_size 256" -- "$mpirun" -np 2 "$mt" logits --checkpoint "$tmp/base.ckpt" --tokens 1,256 --out "$tmp/l.npy"
expect "logits: a token that is not a number" nonzero "--tokens: 'x' (item 2) is not a token id" -- "$mpirun" -np 1 "$mt" logits --checkpoint "$tmp/base.ckpt" --tokens 1,2,x --out "$tmp/l.npy"
expect "logits: more tokens than model.max_seq_len" nonzero "33 tokens, more than the model's 32 positions" -- "$mpirun" -np 1 "$mt" logits --checkpoint "$tmp/base.ckpt" --tokens "$(seq -s, 1 33)" --out "$tmp/l.npy"
expect "logits: neither a checkpoint nor a Hugging Face model" nonzero "neither a checkpoint (meta.json), a directory holding one, nor a Hugging Face model" -- "$mpirun" -np 1 "$mt" logits --checkpoint "$tmp/bad" --tokens 1 --out "$tmp/l.npy"
expect "logits: a Hugging Face directory with llama3 RoPE" zero "logits (1, 256)" -- "$mpirun" -np 1 "$mt" logits --checkpoint "$tmp/hfcfg/llama3" --tokens 1 --out "$tmp/l.npy"
expect "resume: not a checkpoint" nonzero "not a complete checkpoint" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set checkpoint.resume="$tmp/bad" --set checkpoint.dir="$tmp/x" train
expect "resume: a different model is refused" nonzero "model.ffn_dim: 64 in the checkpoint, 48 now" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.ffn_dim=48 --set checkpoint.resume="$tmp/base.ckpt/step_00000010" --set checkpoint.dir="$tmp/x" train
expect "resume: a different model, allowed, still fails on the shapes" nonzero "the model expects" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.ffn_dim=48 --set checkpoint.allow_config_change=true --set checkpoint.resume="$tmp/base.ckpt/step_00000010" --set checkpoint.dir="$tmp/x" train
expect "resume: a different seed is refused" nonzero "training.seed: 0 in the checkpoint, 5 now" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.seed=5 --set checkpoint.resume="$tmp/base.ckpt/step_00000010" --set checkpoint.dir="$tmp/x" train
expect "resume: a different schedule, allowed, is reported" zero "with a different config: training.lr: 0.003 in the checkpoint, 0.002 now" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.lr=2e-3 --set training.steps=11 --set checkpoint.allow_config_change=true --set checkpoint.resume="$tmp/base.ckpt/step_00000010" --set checkpoint.dir="$tmp/x2" train
expect "resume: checkpoint.resume without checkpoint.dir is an error" nonzero "checkpoint.dir is empty" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set checkpoint.resume="$tmp/base.ckpt/step_00000010" train
expect "checkpoint.dir not writable: refused before the first step" nonzero "checkpoint.dir = $tmp/t.yaml/ck is not writable" -- "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set checkpoint.dir="$tmp/t.yaml/ck" --set log.metrics_file="$tmp/nowrite.jsonl" train
check "checkpoint.dir not writable: no step was run" -- test ! -s "$tmp/nowrite.jsonl"

# --- Sharded checkpoints (Hugging Face's layout, every rank a writer) ---
ck="$tmp/dp4.ckpt/step_00000020"
check "4 ranks write 4 model and 4 optimizer files, each with its index, and no single file" -- test \
  -f "$ck/model-00004-of-00004.safetensors" -a -f "$ck/model.safetensors.index.json" -a \
  -f "$ck/optimizer-00004-of-00004.safetensors" -a -f "$ck/optimizer.safetensors.index.json" -a \
  ! -e "$ck/model.safetensors" -a ! -e "$ck/model-00005-of-00004.safetensors"
check "the indexes map every tensor once, the files hold what they say, writers' bytes balanced, and the tensors equal the 1-rank run's within tolerance" -- \
  "$py" - "$ck" "$tmp/base.ckpt/step_00000020" "$root/scripts/reference" <<'PY'
import json, os, sys
sys.path.insert(0, sys.argv[3])
import llama_ref as L
import numpy as np
d, base = sys.argv[1], sys.argv[2]
for prefix in ("model", "optimizer"):
    idx = json.load(open(os.path.join(d, prefix + ".safetensors.index.json")))
    files = sorted(set(idx["weight_map"].values()))
    assert files == [f"{prefix}-{k:05d}-of-00004.safetensors" for k in range(1, 5)], files
    sizes = {f: 0 for f in files}
    for f in files:
        ts, _ = L.read_safetensors(os.path.join(d, f))
        assert set(ts) == {n for n, g in idx["weight_map"].items() if g == f}, (f, sorted(ts))
    w = L.read_model_weights(d, prefix)
    assert idx["metadata"]["total_size"] == sum(a.nbytes for a in w.values())
    for n, a in w.items():
        sizes[idx["weight_map"][n]] += a.nbytes
    one = L.read_safetensors(os.path.join(base, prefix + ".safetensors"))[0]
    assert set(one) == set(w), sorted(set(one) ^ set(w))
    for n in one:
        assert np.allclose(w[n], one[n], rtol=1e-3, atol=1e-5), n
    print(prefix, "bytes per file", sorted(sizes.values()))
PY
train r4to2 2 --set checkpoint.resume="$ck/../step_00000010" --set parallel.dp_replicate=2 &&
  check "resume on 2 ranks from a 4-writer checkpoint gives the 4-rank losses" -- "$py" "$compare" "$tmp/r4to2.jsonl" "$tmp/dp4.jsonl" --from-step 10 --steps 10 ||
  bad "resume from a sharded checkpoint" "$(tail -n 20 "$tmp/r4to2.log")"
expect "logits of a sharded checkpoint on 1 rank" zero "logits (5, 256) of $ck written" -- "$mpirun" -np 1 "$mt" logits --checkpoint "$ck" --tokens 84,104,101,32,113 --out "$tmp/logits4.npy"
expect "init_from a sharded checkpoint (model.safetensors.index.json)" zero "initialised from" -- "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.steps=1 --set model.init_from="$ck" train
# Bad sharded checkpoints: each named by file and tensor, on every rank, before a parameter changes.
shard_bad() {  # shard_bad NAME: a copy of the 4-writer checkpoint in $tmp/sbad/NAME, past its checksums
  rm -rf "$tmp/sbad/$1" && mkdir -p "$tmp/sbad" && cp -r "$ck" "$tmp/sbad/$1" && no_sums "$tmp/sbad/$1"
}
shard_bad missing && rm "$tmp/sbad/missing/model-00002-of-00004.safetensors"
expect "sharded checkpoint: a missing file is named" nonzero "model.safetensors.index.json: the index names $tmp/sbad/missing/model-00002-of-00004.safetensors" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set checkpoint.resume="$tmp/sbad/missing" --set checkpoint.dir="$tmp/x" train
shard_bad trunc && truncate -s 1000 "$tmp/sbad/trunc/optimizer-00003-of-00004.safetensors"
expect "sharded checkpoint: a truncated file is named" nonzero "$tmp/sbad/trunc/optimizer-00003-of-00004.safetensors: " -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set checkpoint.resume="$tmp/sbad/trunc" --set checkpoint.dir="$tmp/x" train
shard_bad moved && "$py" - "$tmp/sbad/moved/model.safetensors.index.json" <<'PY'
import json, sys
p = sys.argv[1]; j = json.load(open(p)); m = j["weight_map"]
f = m["model.norm.weight"]
m["model.norm.weight"] = next(g for g in sorted(set(m.values())) if g != f)
json.dump(j, open(p, "w"))
PY
expect "sharded checkpoint: an index naming a tensor its file lacks" nonzero "the index puts tensor 'model.norm.weight' in" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set checkpoint.resume="$tmp/sbad/moved" --set checkpoint.dir="$tmp/x" train
shard_bad twice && "$py" - "$tmp/sbad/twice" <<'PY'
import os, sys
d = sys.argv[1]
os.remove(os.path.join(d, "model.safetensors.index.json"))  # shards without an index: every file is read
for f in os.listdir(d):
    if f.startswith("optimizer"): os.remove(os.path.join(d, f))
import shutil
shutil.copy(os.path.join(d, "model-00001-of-00004.safetensors"), os.path.join(d, "model-00005-of-00005.safetensors"))
PY
expect "Hugging Face shards: a tensor in two files is named" nonzero "appears in both $tmp/sbad/twice/model-00001-of-00004.safetensors and $tmp/sbad/twice/model-00005-of-00005.safetensors" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/sbad/twice" train
expect "checkpoint.writers: a negative count is refused" nonzero "checkpoint.writers = -1" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set checkpoint.writers=-1 train
train w1 2 --set checkpoint.writers=1 --set training.steps=10 &&
  check "checkpoint.writers 1 on 2 ranks: one model.safetensors and one optimizer.safetensors, no index" -- test \
    -f "$tmp/w1.ckpt/step_00000010/model.safetensors" -a -f "$tmp/w1.ckpt/step_00000010/optimizer.safetensors" -a \
    ! -e "$tmp/w1.ckpt/step_00000010/model.safetensors.index.json" || bad "checkpoint.writers 1" "$(tail -n 20 "$tmp/w1.log")"

# --- Vocabularies past 65,536: llm.c's uint32 shards (magic 20240801, version 7), Qwen2's vocabulary ---
"$py" - "$tmp/big" <<'PY'
import os, sys, numpy as np
d = sys.argv[1]; os.makedirs(d, exist_ok=True)
rng = np.random.default_rng(5)
# A repeating pattern of ids across the whole vocabulary (so that the loss can fall), most of them past uint16.
base = rng.integers(0, 151936, size=97, dtype=np.uint32)
toks = np.tile(base, 60)
head = np.zeros(256, dtype="<i4"); head[0], head[1], head[2] = 20240801, 7, toks.size
open(os.path.join(d, "q_train_000000.bin"), "wb").write(head.tobytes() + toks.astype("<u4").tobytes())
bad = toks.copy(); bad[50] = 151936
head[2] = bad.size
open(os.path.join(d, "bad_000000.bin"), "wb").write(head.tobytes() + bad.astype("<u4").tobytes())
print((toks > 65535).mean())
PY
big=(--set model.vocab_size=151936 --set data.train="$tmp/big/q_train_*.bin" --set data.val= --set eval.interval=0
     --set sample.interval=0 --set training.steps=10 --set checkpoint.interval=0)
# tp 2 over 4 steps (the 1-rank run's first 4 of 10): the vocabulary's cost is the suite's largest.
train big1 1 "${big[@]}" && train big_tp2 2 "${big[@]}" --set training.steps=4 --set parallel.tp=2 --set parallel.dp_replicate=1 &&
  check "vocab 151,936 from uint32 shards: tp=2 (vocab-sharded embedding and lm_head, loss parallel) gives the 1-rank losses" -- \
    "$py" "$compare" "$tmp/big_tp2.jsonl" "$tmp/big1.jsonl" --steps 4 ||
  bad "vocab 151,936 runs" "$(tail -n 20 "$tmp/big1.log" "$tmp/big_tp2.log" 2>/dev/null)"
check "vocab 151,936: the loss falls" -- "$py" -c "
import json; r=[json.loads(l)['loss'] for l in open('$tmp/big1.jsonl') if '\"loss\"' in l]
assert r[-1] < r[0] - 0.5, r; print(r[0], '->', r[-1])"
expect "a uint32 token past the vocabulary names the shard and the offset" nonzero "bad_000000.bin: token 151936 at offset 1224 >= vocab_size 151936" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" "${big[@]}" --set data.train="$tmp/big/bad_000000.bin" train

# --- Bad input: config ---
expect "config: batch not divisible by dp" nonzero "training.batch_size = 6 must be divisible by dp" -- "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set training.batch_size=6 train
expect "config: micro-batch" nonzero "training.micro_batch_size = 3 must divide" -- "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.micro_batch_size=3 train
expect "config: seq_len > max_seq_len" nonzero "training.seq_len = 64 exceeds model.max_seq_len = 32" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.seq_len=64 train
expect "config: heads" nonzero "model.n_heads = 4 must be divisible by model.n_kv_heads = 3" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.n_kv_heads=3 train
expect "config: schedule" nonzero "training.schedule = 'linear': expected one of" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.schedule=linear train
expect "config: grad_reduce_dtype" nonzero "training.grad_reduce_dtype = 'fp16': expected one of" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.grad_reduce_dtype=fp16 train

expect "config: threads bounded" nonzero "training.threads = 100000: expected at most 1024" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.threads=100000 train
expect "config: model.dim overflow" nonzero "model.dim x model.vocab_size = 4611686018427387904 x 256: the product overflows" -- "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.dim=4611686018427387904 train
expect "config: batch x seq_len overflow" nonzero "training.batch_size x training.seq_len = 1152921504606846976 x 32: the product overflows" -- "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.batch_size=1152921504606846976 train
expect "--log-level: an unknown level is a clear error on every rank" nonzero "bad log level 'bogus'" -- "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --log-level bogus train

summary train
[ $failed -eq 0 ]
