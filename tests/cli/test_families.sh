#!/usr/bin/env bash
# The model families (models/model.h) against the independent PyTorch reference (scripts/reference/llama_ref.py):
# for each of Llama 3 (llama3 RoPE scaling, a head_dim other than dim / n_heads, transformers 5's spelling),
# Mistral (linear RoPE scaling, a sliding window, tied embeddings) and Qwen2 (q/k/v biases, untied and tied), the
# reference writes a Hugging Face directory, both train 10 AdamW steps from it in f64, and meshtrain's losses match
# the reference's within 1e-5 on 1 rank and on tp 2 x dp_shard 2 (every parameter sharded, biases included). The
# YAML gives no model keys: the architecture comes from config.json. The checkpoint written keeps the original's
# model_type, architectures and keys, and loads back. Bad family input gives its message.
# Prints "families: N passed, N failed[, N skipped]" last.
#   tests/cli/test_families.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_families.sh BUILD_DIR}
source "$(dirname "$0")/common.sh"
ref="$root/scripts/reference/llama_ref.py"

if ! "$py" -c "import torch" 2>/dev/null; then
  for f in llama3 mistral qwen2 qwen2_tied; do skip "$f against the PyTorch reference" "python3-torch is not installed"; done
  summary families
  exit 0
fi

docs_data --val-fraction 0.1
cat >"$tmp/t.yaml" <<YAML
training: {steps: 10, batch_size: 8, seq_len: 32, lr: 3.0e-3, warmup_steps: 3, lr_min: 3.0e-4, grad_clip: 1.0,
           weight_decay: 0.1, threads: 1, schedule: cosine, dtype: fp64}
data: {train: "$tmp/data/docs_train_*.bin", val: ""}
eval: {interval: 0}
sample: {interval: 0}
log: {interval: 1}
YAML

# family NAME INIT_ARGS...: the reference's directory $tmp/NAME, its 10 f64 steps, meshtrain's on 1 and 4 ranks.
family() {
  local name=$1
  shift
  if ! "$py" "$ref" init --out "$tmp/$name" --dim 32 --n-layers 2 --n-heads 4 --n-kv-heads 2 --ffn-dim 64 \
    --vocab-size 256 --max-seq-len 64 --seed 5 "$@" >"$tmp/$name.init.log" 2>&1; then
    bad "$name: reference init" "$(tail -n 5 "$tmp/$name.init.log")"
    return
  fi
  "$py" "$ref" train --model "$tmp/$name" --data "$tmp/data/docs_train_*.bin" --steps 10 --batch-size 8 --seq-len 32 \
    --lr 3e-3 --schedule cosine --warmup-steps 3 --lr-min 3e-4 --weight-decay 0.1 --grad-clip 1.0 --threads 1 \
    --dtype f64 --out "$tmp/$name.ref.json" >"$tmp/$name.ref.log" 2>&1 ||
    { bad "$name: reference train" "$(tail -n 10 "$tmp/$name.ref.log")"; return; }
  local np mesh
  for np in 1 4; do
    mesh=()
    [ $np -eq 4 ] && mesh=(--set parallel.tp=2 --set parallel.dp_shard=2 --set parallel.fsdp.min_weight_size=0)
    rm -rf "$tmp/$name.np$np.ckpt"
    if timeout 300 "$mpirun" -np $np "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/$name" \
      --set log.metrics_file="$tmp/$name.np$np.jsonl" --set checkpoint.dir="$tmp/$name.np$np.ckpt" "${mesh[@]}" \
      train >"$tmp/$name.np$np.log" 2>&1; then
      if out=$("$py" "$compare" "$tmp/$name.np$np.jsonl" "$tmp/$name.ref.json" --rel0 1e-5 --abs 1e-5 --steps 10 2>&1); then
        ok "$name on $np rank(s)$([ $np -eq 4 ] && echo ' (tp 2 x dp_shard 2)'): 10 f64 steps within 1e-5 of the reference: $out"
      else
        bad "$name on $np rank(s): losses against the reference" "$out"
      fi
    else
      bad "$name on $np rank(s)" "$(tail -n 20 "$tmp/$name.np$np.log")"
    fi
  done
  # The checkpoint's config.json: the original's model_type, architectures and every key it had (the RoPE keys in
  # both spellings, the dtype as stored), and meshtrain reads back the same model.
  local ck="$tmp/$name.np4.ckpt/step_00000010"
  check_cfg="import json, sys
o, s = (json.load(open(p + '/config.json')) for p in sys.argv[1:3])
skip = {'torch_dtype', 'dtype', 'rope_scaling', 'rope_parameters', 'rope_theta'}
bad = [(k, o[k], s.get(k)) for k in o if k not in skip and s.get(k) != o[k]]
assert not bad, bad
print('model_type', s['model_type'], s['architectures'], len(o), 'keys kept')"
  if out=$("$py" -c "$check_cfg" "$tmp/$name" "$ck" 2>&1); then ok "$name: the checkpoint's config.json keeps the original's keys: $out"
  else bad "$name: the checkpoint's config.json" "$out"; fi
  expect "$name: the checkpoint loads back as the model (meshtrain logits reads its config.json)" zero "logits (4, 256)" -- \
    "$mpirun" -np 1 "$mt" logits --checkpoint "$ck" --tokens 1,2,3,4 --out "$tmp/$name.logits.npy"
  expect "$name: the checkpoint is a Hugging Face directory init_from reads" zero "initialised from" -- \
    "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.steps=1 --set model.init_from="$ck" train
}

family llama3 --model-type llama --rope-scaling llama3:8,1,4,16 --head-dim 12 --rope-spelling v5
family mistral --model-type mistral --rope-scaling linear:2 --sliding-window 64 --tie-embeddings
family qwen2 --model-type qwen2
family qwen2_tied --model-type qwen2 --tie-embeddings

# Under tensor parallel each rank holds its slice of a q/k/v bias, and the plan says so.
"$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/qwen2" --set parallel.tp=2 plan >"$tmp/plan.out" 2>&1
if grep -Eq "model\.layers\.0\.self_attn\.q_proj\.bias +\(32,\) +\[RRRRRS\(0\)\] \(16,\)" "$tmp/plan.out"; then
  ok "qwen2 under tp 2: the plan shows each rank's half of the q bias, Shard(0) on tp like its weight's rows"
else
  bad "qwen2 under tp 2: the q bias's layout" "$(grep -E 'q_proj' "$tmp/plan.out" | head -n 4)"
fi

# --- Bad input ---
expect "a family meshtrain does not implement is refused with the list" nonzero "model.type = 'gpt2': meshtrain implements llama, mistral, qwen2" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.type=gpt2 train
expect "mistral: a sliding window shorter than the sequence is refused" nonzero "model.sliding_window = 16 is shorter than training.seq_len = 32" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.type=mistral --set model.sliding_window=16 train
expect "llama has no sliding window" nonzero "model.sliding_window = 64: model.type = llama has no sliding window" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.sliding_window=64 train
expect "the YAML's model.type must agree with config.json's model_type" nonzero "model.type = llama but model.init_from's $tmp/qwen2/config.json says model_type = qwen2" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.type=llama --set model.init_from="$tmp/qwen2" train
expect "an unknown RoPE scaling type is refused" nonzero "model.rope_scaling.type = 'yarn': expected one of 'none', 'linear', 'llama3'" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.rope_scaling.type=yarn train
expect "llama3 scaling: high_freq_factor must exceed low_freq_factor" nonzero "model.rope_scaling.high_freq_factor = 1 must exceed model.rope_scaling.low_freq_factor = 2" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.rope_scaling.type=llama3 --set model.rope_scaling.low_freq_factor=2 --set model.rope_scaling.high_freq_factor=1 train
expect "an odd head_dim is refused" nonzero "model.head_dim = 7: RoPE needs an even head dim" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.head_dim=7 train
"$py" - "$tmp/mistral" "$tmp/mistral_short" <<'PY'
import json, os, shutil, sys
src, dst = sys.argv[1:3]
shutil.copytree(src, dst, dirs_exist_ok=True)
c = json.load(open(os.path.join(dst, "config.json")))
c["sliding_window"] = 16
json.dump(c, open(os.path.join(dst, "config.json"), "w"))
PY
expect "mistral: config.json's sliding window shorter than training.seq_len is refused" nonzero "model.sliding_window = 16 is shorter than training.seq_len = 32" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/mistral_short" train

summary families
