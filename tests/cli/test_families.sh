#!/usr/bin/env bash
# The model families (models/model.h) against the independent PyTorch reference (scripts/reference/llama_ref.py):
# for each of Llama 3 (llama3 RoPE scaling, a head_dim other than dim / n_heads, transformers 5's spelling),
# Mistral (linear RoPE scaling, a sliding window, tied embeddings), Qwen2 (q/k/v biases, untied and tied), Qwen3
# (q/k norms, head_dim 12) and the mixtures of experts Mixtral (balance loss), Qwen2-MoE (shared expert, dense and
# sparse layers mixed, balance loss) and Qwen3-MoE (renormalised top-k, no balance loss), the reference writes a
# Hugging Face directory, both train 10 AdamW steps from it in f64, and meshtrain's losses match the reference's
# within 1e-5 on 1 rank and on tp 2 x dp_shard 2 (every parameter sharded, biases included). The
# YAML gives no model keys: the architecture comes from config.json. The checkpoint written keeps the original's
# model_type, architectures and keys, and loads back. Mixtral with and without the balance loss (the YAML's
# output_router_logits over config.json's) against the reference, and the metrics' aux_loss against its aux.
# Phi-3 (fused qkv_proj and gate_up_proj in its files, LongRoPE with long and with short factors) the same way and
# on pp 2 and cp 2; its checkpoints' files hold the fused tensors (names and shapes) that the reference reads to
# the same logits, and a resume from them on another mesh continues the reference's losses;
# `meshtrain estimate` and `plan --search` take it. Gemma 2 (tied, a window of 8 below the sequence's 32, both
# soft-caps, query_pre_attn_scalar) and Gemma 3's text model (q/k norms, sliding_window_pattern 3, its sliding layers'
# RoPE base beside the global layers' linear-scaled one) the same way, then on pp 2, cp 2 and cp 4 (ring), their
# logits against the reference's, and a window of 0 refused naming the key. DeepSeek-V3 and V2 (latent attention,
# YaRN, group-limited routing, shared experts, dense first layers) the same way, V3 also on cp 2, cp 4, pp 2, ep 2 and
# tp 2 without sequence parallel, with bad config.json input named. Bad family input gives its message.
# Prints "families: N passed, N failed[, N skipped]" last.
#   tests/cli/test_families.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_families.sh BUILD_DIR}
source "$(dirname "$0")/common.sh"
ref="$root/scripts/reference/llama_ref.py"

if ! "$py" -c "import torch" 2>/dev/null; then
  for f in llama3 mistral qwen2 qwen2_tied qwen3 mixtral qwen2_moe qwen3_moe phi3 phi3_v5 gemma2 gemma3_text deepseek_v3 deepseek_v2 deepseek_v3_mtp; do skip "$f against the PyTorch reference" "python3-torch is not installed"; done
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
family qwen3 --model-type qwen3 --head-dim 12
# The mixtures of experts (models/llama/moe.h), the routers drawn wide by the reference so that no top-k choice is
# near a tie: mixtral with the balance loss; qwen2_moe with its shared expert, dense and sparse layers mixed (layer
# 1 sparse of 3: decoder_sparse_step 2) and the balance loss; qwen3_moe renormalising the top-k, without it.
family mixtral --model-type mixtral --n-experts 4 --experts-per-token 2 --moe-ffn-dim 24 --output-router-logits
family qwen2_moe --model-type qwen2_moe --n-layers 3 --n-experts 4 --experts-per-token 2 --moe-ffn-dim 16 \
  --shared-expert-ffn-dim 24 --decoder-sparse-step 2 --output-router-logits
family qwen3_moe --model-type qwen3_moe --n-experts 4 --experts-per-token 2 --moe-ffn-dim 24 --norm-topk-prob
# Phi-3: LongRoPE's long factors (training.seq_len 32 > original_max_position_embeddings 16) and its attention
# factor sqrt(1 + ln 4 / ln 16) (max_position_embeddings 64 = 4 x 16), Phi-3's own spelling (rope_scaling's three
# keys, the context at the top level); then the short factors (original 32) in transformers 5's spelling, tied.
family phi3 --model-type phi3 --rope-scaling longrope:16
family phi3_v5 --model-type phi3 --rope-scaling longrope:32 --rope-spelling v5 --tie-embeddings

# A phi3 checkpoint is a Phi-3 directory: its files hold self_attn.qkv_proj.weight ((H + 2 KV) hd, C) and
# mlp.gate_up_proj.weight (2F, C) joined from the parameters, no q/k/v or gate/up of their own (saved on 4 ranks:
# sharded by tp and dp_shard, several files and an index; and under pp 2, each stage its own layer's); the
# reference, which computes with the fused tensors as Phi-3's modules do, reads them to the logits meshtrain
# computes from the same checkpoint (the rows' order in a fused tensor is checked by the resume below: both would
# read a wrong join alike). phi3 under pp 2 and cp 2 also equals the reference.
# phi3_fused CK LOGITS: the files of $tmp/phi3.CK.ckpt's last checkpoint hold the fused tensors, whose logits in the
# reference equal meshtrain's from the same checkpoint (LOGITS).
phi3_fused() {
  local ck=$1
  if out=$("$py" - "$root/scripts/reference" "$tmp/phi3.$ck.ckpt/step_00000010" "$2" <<'PY' 2>&1
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
import llama_ref as r
ck, npy = sys.argv[2:4]
w = r.read_model_weights(ck)
c = r.LlamaConfig.load(ck)
hd, H, KV, F = c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
for i in range(c.num_hidden_layers):
    p = f"model.layers.{i}."
    assert w[p + "self_attn.qkv_proj.weight"].shape == ((H + 2 * KV) * hd, c.hidden_size), w[p + "self_attn.qkv_proj.weight"].shape
    assert w[p + "mlp.gate_up_proj.weight"].shape == (2 * F, c.hidden_size), w[p + "mlp.gate_up_proj.weight"].shape
split = [n for n in w if n.endswith(tuple(f".{s}.weight" for s in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")))]
assert not split, split
model = r.load_model(ck, torch.float64)
with torch.no_grad():
    ref = model(torch.tensor([[1, 2, 3, 4]]))[0].numpy()
ours = np.load(npy)
d = float(np.abs(ours - ref).max())
assert d < 1e-4, d
print(f"{len(w)} tensors, qkv_proj {w['model.layers.0.self_attn.qkv_proj.weight'].shape}, gate_up_proj "
      f"{w['model.layers.0.mlp.gate_up_proj.weight'].shape}; logits within {d:.1e} of the reference's")
PY
  ); then ok "phi3 ($ck): the checkpoint's files hold the fused tensors, which the reference reads to meshtrain's logits: $out"
  else bad "phi3 ($ck): the checkpoint's fused tensors" "$out"; fi
}

phi3_files() {
  # pp 2: each stage saves its layer's fused tensors (the other stage's parameters named as the files name them).
  rm -rf "$tmp/phi3.pp2.ckpt"
  if ! timeout 300 "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/phi3" --set parallel.pp=2 \
    --set training.micro_batch_size=4 --set log.metrics_file="$tmp/phi3.pp2.jsonl" \
    --set checkpoint.dir="$tmp/phi3.pp2.ckpt" train >"$tmp/phi3.pp2.log" 2>&1; then
    bad "phi3 under pp 2" "$(tail -n 20 "$tmp/phi3.pp2.log")"
  elif out=$("$py" "$compare" "$tmp/phi3.pp2.jsonl" "$tmp/phi3.ref.json" --rel0 1e-5 --abs 1e-5 --steps 10 2>&1); then
    ok "phi3 under pp 2: 10 f64 steps within 1e-5 of the reference: $out"
  else
    bad "phi3 under pp 2: losses against the reference" "$out"
  fi
  # cp 2: each rank's tokens at their global positions in LongRoPE's tables (picked by the whole sequence's length).
  if timeout 300 "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/phi3" --set parallel.cp=2 \
    --set log.metrics_file="$tmp/phi3.cp2.jsonl" train >"$tmp/phi3.cp2.log" 2>&1 &&
    out=$("$py" "$compare" "$tmp/phi3.cp2.jsonl" "$tmp/phi3.ref.json" --rel0 1e-5 --abs 1e-5 --steps 10 2>&1); then
    ok "phi3 under cp 2: 10 f64 steps within 1e-5 of the reference: $out"
  else
    bad "phi3 under cp 2" "${out:-$(tail -n 20 "$tmp/phi3.cp2.log")}"
  fi
  "$mpirun" -np 1 "$mt" logits --checkpoint "$tmp/phi3.pp2.ckpt/step_00000010" --tokens 1,2,3,4 \
    --out "$tmp/phi3.pp2.logits.npy" >"$tmp/phi3.pp2.logits.log" 2>&1
  phi3_fused np4 "$tmp/phi3.logits.npy"
  phi3_fused pp2 "$tmp/phi3.pp2.logits.npy"
  # Save and load are each other's inverse: tp 2 x dp_shard 2 saves step 5's fused tensors, 1 rank resumes from
  # them for steps 6-10, which are the reference's (a join or a split of the wrong rows would change them).
  rm -rf "$tmp/phi3.at5.ckpt" "$tmp/phi3.resumed.ckpt" && mkdir -p "$tmp/phi3.resumed.ckpt"
  if timeout 300 "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/phi3" --set parallel.tp=2 \
    --set parallel.dp_shard=2 --set parallel.fsdp.min_weight_size=0 --set checkpoint.dir="$tmp/phi3.at5.ckpt" \
    --set checkpoint.interval=5 train >"$tmp/phi3.at5.log" 2>&1 &&
    cp -r "$tmp/phi3.at5.ckpt/step_00000005" "$tmp/phi3.resumed.ckpt/" &&
    timeout 300 "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/phi3" \
      --set checkpoint.dir="$tmp/phi3.resumed.ckpt" --set log.metrics_file="$tmp/phi3.resumed.jsonl" train \
      >"$tmp/phi3.resumed.log" 2>&1; then
    if out=$("$py" "$compare" "$tmp/phi3.resumed.jsonl" "$tmp/phi3.ref.json" --rel0 1e-5 --abs 1e-5 --from-step 6 \
      --steps 5 2>&1); then
      ok "phi3: saved on tp 2 x dp_shard 2 at step 5, resumed on 1 rank: steps 6-10 within 1e-5 of the reference: $out"
    else
      bad "phi3: resumed from its fused checkpoint: losses against the reference" "$out"
    fi
  else
    bad "phi3: save at step 5 and resume" "$(tail -n 20 "$tmp/phi3.at5.log" "$tmp/phi3.resumed.log" 2>/dev/null)"
  fi
  # estimate (issue 53 part 4): the reference's parameter count, the fused tensors counted as their parts.
  local params
  params=$("$py" -c "import json, sys; print(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])['params'])" \
    "$tmp/phi3.init.log" 2>/dev/null)
  expect "phi3: meshtrain estimate takes a Phi-3 directory (the reference's $params parameters)" zero \
    "estimate: phi3 ($params parameters) on 4 ranks" -- \
    "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/phi3" --set parallel.tp=2 estimate --world 4
  expect "phi3: plan --search takes a Phi-3 directory" zero "plans tried on h100_ib" -- \
    "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/phi3" plan --search --world 4 \
    --cluster "$root/configs/clusters/h100_ib.yaml"
}
phi3_files

# Gemma 2 and 3 (models/llama/families.cpp): the scores' soft-cap and scale chosen so that tanh bends them (the small
# init's scores are ~0.05), the final soft-cap likewise; windows of 8 tokens in a 32-token sequence.
family gemma2 --model-type gemma2 --head-dim 16 --tie-embeddings --sliding-window 8 --query-pre-attn-scalar 4 \
  --attn-softcap 0.05 --final-softcap 0.2
family gemma3_text --model-type gemma3_text --n-layers 3 --head-dim 16 --sliding-window 8 --query-pre-attn-scalar 8 \
  --sliding-window-pattern 3 --rope-local-theta 1000 --rope-theta 1000000 --rope-scaling linear:2 --final-softcap 0.2

# on_mesh NAME "M:NP:ARGS": directory NAME trained on NP ranks with ARGS (mesh M) equals the reference's losses.
on_mesh() {
  local name=$1 mesh=$2 m np out
  m=${mesh%%:*} np=$(echo "$mesh" | cut -d: -f2)
  # shellcheck disable=SC2046
  if timeout 300 "$mpirun" -np "$np" "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/$name" \
    --set log.metrics_file="$tmp/$name.$m.jsonl" $(echo "$mesh" | cut -d: -f3-) train >"$tmp/$name.$m.log" 2>&1 &&
    out=$("$py" "$compare" "$tmp/$name.$m.jsonl" "$tmp/$name.ref.json" --rel0 1e-5 --abs 1e-5 --steps 10 2>&1); then
    ok "$name under $m: 10 f64 steps within 1e-5 of the reference: $out"
  else
    bad "$name under $m" "${out:-$(tail -n 20 "$tmp/$name.$m.log")}"
  fi
}
# dir_logits NAME: `meshtrain logits` of directory NAME equals the reference's forward.
dir_logits() {
  local name=$1 out
  "$mpirun" -np 1 "$mt" logits --checkpoint "$tmp/$name" --tokens 5,17,99,3,250,8,8,41,77,120,1,2,3,4,5,6,7,8,9,10 \
    --out "$tmp/$name.dir.logits.npy" >"$tmp/$name.dir.logits.log" 2>&1
  if out=$("$py" - "$root/scripts/reference" "$tmp/$name" "$tmp/$name.dir.logits.npy" <<'PY' 2>&1
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
import llama_ref as r
model = r.load_model(sys.argv[2], torch.float64)
with torch.no_grad():
    ref = model(torch.tensor([[5, 17, 99, 3, 250, 8, 8, 41, 77, 120, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]))[0].numpy()
ours = np.load(sys.argv[3])
d = float(np.abs(ours - ref).max())
assert ours.shape == ref.shape and d < 1e-5, (ours.shape, d)
print(f"logits {ours.shape} within {d:.1e}")
PY
  ); then ok "$name: meshtrain logits of the directory equal the reference's: $out"
  else bad "$name: logits against the reference" "$out"; fi
}

# gemma_meshes NAME: pp 2 (gemma3_text: untied), cp 2 and cp 4 on the ring (the window crosses the ranks' chunks),
# cp 2 all-gathered and Ulysses equal the reference's losses; `meshtrain logits` of the directory equals the reference's forward.
gemma_meshes() {
  local name=$1 mesh m
  for mesh in "pp2:2:--set parallel.pp=2 --set training.micro_batch_size=4" "cp2:2:--set parallel.cp=2" \
    "cp4:4:--set parallel.cp=4" "cp2_all_gather:2:--set parallel.cp=2 --set parallel.cp_method=all_gather" \
    "cp2_ulysses:2:--set parallel.cp=2 --set parallel.cp_method=alltoall"; do
    m=${mesh%%:*}
    [ "$m" = pp2 ] && [ "$name" = gemma2 ] && continue  # tied: pp refuses a weight shared across stages
    on_mesh "$name" "$mesh"
  done
  dir_logits "$name"
  # estimate and plan --search: the reference's parameter count (four norms a layer, Gemma 3's q/k norms).
  local params
  params=$("$py" -c "import json, sys; print(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])['params'])" \
    "$tmp/$name.init.log" 2>/dev/null)
  expect "$name: meshtrain estimate takes the directory (the reference's $params parameters)" zero \
    "estimate: $name ($params parameters) on 4 ranks" -- \
    "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/$name" --set parallel.tp=2 estimate --world 4
  expect "$name: plan --search takes the directory" zero "plans tried on h100_ib" -- \
    "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/$name" plan --search --world 4 \
    --cluster "$root/configs/clusters/h100_ib.yaml"
}
gemma_meshes gemma2
gemma_meshes gemma3_text
# The window on the ring (ring_attention.h: each rank's K/V sent straight to the distances the window reaches, dK/dV
# straight back): gemma2 at 64 tokens, its sliding layer 0's window of 8 inside chunks of 8 (cp 4, head_tail: rank
# r holds chunks r and 7 - r), so distances 1 and 3 are needed and 2 is not. cp 2 and cp 4 equal 1 rank, and
# `meshtrain plan` counts per rank, with K/V = 2 x 8 rows x T/cp tokens x 2 kv heads x 16 x 8 B (f64) and dK/dV the
# same: cp 4 forward 2 (window) + 3 (global layer 1) K/V, backward 2 x 2 + 3 + 4 (a causal ring: 6 and 14);
# cp 2 forward 1 + 1, backward 2 + 1 + 2 (a causal ring: 2 and 6).
for np in 1 2 4; do
  timeout 300 "$mpirun" -np $np "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/gemma2" \
    --set training.seq_len=64 --set parallel.cp=$np --set log.metrics_file="$tmp/gemma2.w64.cp$np.jsonl" train \
    >"$tmp/gemma2.w64.cp$np.log" 2>&1 || bad "gemma2 at 64 tokens under cp $np" "$(tail -n 20 "$tmp/gemma2.w64.cp$np.log")"
done
for np in 2 4; do
  if out=$("$py" "$compare" "$tmp/gemma2.w64.cp$np.jsonl" "$tmp/gemma2.w64.cp1.jsonl" --rel0 1e-9 --abs 1e-9 --steps 10 2>&1); then
    ok "gemma2 (a window of 8 in 64 tokens) under cp $np equals 1 rank: $out"
  else bad "gemma2 (a window of 8 in 64 tokens) under cp $np against 1 rank" "$out"; fi
  "$mpirun" -np $np "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/gemma2" --set training.seq_len=64 \
    --set parallel.cp=$np plan >"$tmp/gemma2.plan$np.out" 2>&1
  kv=$((2 * 8 * 64 / np * 2 * 16 * 8))
  if [ $np -eq 4 ]; then fwd=$((5 * kv)) bwd=$((11 * kv)); else fwd=$((2 * kv)) bwd=$((5 * kv)); fi
  same_count "gemma2 under cp $np: the ring's forward bytes = the window's formula (a causal ring: $(((np - 1) * 2 * kv)) B)" \
    "$(counted "$tmp/gemma2.plan$np.out" forward cp.)" $fwd
  same_count "gemma2 under cp $np: the ring's backward bytes = the window's formula (a causal ring: $((2 * (2 * np - 1) * kv)) B)" \
    "$(counted "$tmp/gemma2.plan$np.out" backward cp.)" $bwd
done
"$py" - "$tmp/gemma2" "$tmp/gemma2_w0" <<'PY'
import json, os, shutil, sys
src, dst = sys.argv[1:3]
shutil.copytree(src, dst, dirs_exist_ok=True)
c = json.load(open(os.path.join(dst, "config.json")))
c["sliding_window"] = 0
json.dump(c, open(os.path.join(dst, "config.json"), "w"))
PY
expect "gemma2: a window of 0 in config.json is refused, naming the key" nonzero "sliding_window = 0: expected an integer >= 1" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/gemma2_w0" train
expect "gemma2: a window of 0 in the YAML is refused, naming the key" nonzero "model.sliding_window = 0: model.type = gemma2 needs the window of its sliding layers" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.type=gemma2 --set model.sliding_window_pattern=2 train

# DeepSeek-V3 and V2 (models/llama/mla.cpp; the reference's DeepSeek from the formulas): latent attention with a
# query latent (V3) and a plain q_proj (V2), YaRN with both mscale corrections, 8 experts in 4 groups of which a
# token's 2 come from its 2 best groups (V3: sigmoid + e_score_correction_bias, top-2 group scores; V2: softmax,
# group_limited_greedy), the shared experts, a dense first layer; then V3 under cp 2, cp 4, pp 2 and ep 2, its logits,
# Ulysses, recompute, and bad input naming the key.
ds_common=(--n-layers 3 --ffn-dim 48 --kv-lora-rank 16 --qk-nope-head-dim 8 --qk-rope-head-dim 4 --v-head-dim 6
  --n-experts 8 --experts-per-token 2 --moe-ffn-dim 12 --n-group 4 --topk-group 2 --first-k-dense-replace 1
  --norm-topk-prob)
family deepseek_v3 --model-type deepseek_v3 "${ds_common[@]}" --q-lora-rank 12 --n-shared-experts 1 \
  --routed-scaling-factor 2.5 --rope-scaling yarn:4,16,32,1,1.0,0.8
family deepseek_v2 --model-type deepseek_v2 "${ds_common[@]}" --n-shared-experts 2 --topk-method group_limited_greedy \
  --routed-scaling-factor 1.5 --rope-scaling yarn:4,16,32,1,0.707,0.707
# DeepSeek-V3 with its multi-token prediction module (num_nextn_predict_layers 1, mtp_loss_weight 0.3): the
# objective L_main + 0.3 L_mtp against the reference's on every mesh below too; its checkpoint's files keep
# DeepSeek's copies of the shared embedding and head, which the reference checks equal to the main ones.
family deepseek_v3_mtp --model-type deepseek_v3 "${ds_common[@]}" --q-lora-rank 12 --n-shared-experts 1 \
  --routed-scaling-factor 2.5 --rope-scaling yarn:4,16,32,1,1.0,0.8 --num-nextn-predict-layers 1 --mtp-loss-weight 0.3
deepseek_meshes() {
  local name mesh m
  for name in deepseek_v3 deepseek_v3_mtp deepseek_v2; do
  for mesh in "cp2:2:--set parallel.cp=2" "cp4:4:--set parallel.cp=4" \
    "pp2:2:--set parallel.pp=2 --set training.micro_batch_size=4" "ep2:2:--set parallel.ep=2" \
    "tp2_nosp:2:--set parallel.tp=2 --set parallel.sequence_parallel=false" \
    "tp2_loss_parallel:2:--set parallel.tp=2 --set parallel.loss_parallel=true" \
    "cp2_ulysses:2:--set parallel.cp=2 --set parallel.cp_method=alltoall" \
    "dp_shard2_recompute:2:--set parallel.dp_shard=2 --set parallel.recompute.patterns=[model.layers.*] --set parallel.recompute.keep=[attention]"; do
    m=${mesh%%:*}
    [ "$name" = deepseek_v3 ] && case $m in tp2_loss_parallel | dp_shard2_recompute) continue ;; esac
    [ "$name" = deepseek_v2 ] && case $m in cp2 | pp2 | ep2) ;; *) continue ;; esac
    on_mesh "$name" "$mesh"
  done
  done
  if out=$("$py" - "$root/scripts/reference" "$tmp/deepseek_v3_mtp.np4.ckpt/step_00000010" <<'PY' 2>&1
import sys
sys.path.insert(0, sys.argv[1])
import torch
import llama_ref as r
model = r.load_model(sys.argv[2], torch.float64)  # checks the copies equal the shared tensors, then drops them
print("loaded with", sum(p.numel() for p in model.parameters()), "parameters")
PY
  ); then ok "deepseek_v3_mtp: the checkpoint's files hold DeepSeek's copies of the shared embedding and head, equal to them (the reference reads it): $out"
  else bad "deepseek_v3_mtp: the checkpoint as the reference reads it" "$out"; fi
  for name in deepseek_v3 deepseek_v2; do
    dir_logits "$name"
  done
  # Bad input in config.json, each refused naming its key.
  local edit key value want
  for edit in "qk_rope_head_dim:5:qk_rope_head_dim = 5: RoPE needs an even width" \
    "n_group:3:model.moe.n_group = 3 does not divide model.moe.n_experts = 8" \
    "topk_group:6:model.moe.topk_group = 6 exceeds model.moe.n_group = 4" \
    "num_nextn_predict_layers:2:num_nextn_predict_layers = 2: one multi-token prediction depth is implemented"; do
    key=${edit%%:*} value=$(echo "$edit" | cut -d: -f2) want=$(echo "$edit" | cut -d: -f3-)
    "$py" - "$tmp/deepseek_v3" "$tmp/deepseek_bad" "$key" "$value" <<'PY'
import json, os, shutil, sys
src, dst, key, value = sys.argv[1:5]
shutil.copytree(src, dst, dirs_exist_ok=True)
c = json.load(open(os.path.join(dst, "config.json")))
c[key] = int(value)
json.dump(c, open(os.path.join(dst, "config.json"), "w"))
PY
    expect "deepseek_v3: config.json's $key = $value is refused, naming the key" nonzero "$want" -- \
      "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/deepseek_bad" train
  done
  expect "latent attention is DeepSeek's" nonzero "model.mla.kv_lora_rank = 16: model.type = llama has no latent attention" -- \
    "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.mla.kv_lora_rank=16 --set model.mla.qk_rope_head_dim=32 \
    --set model.mla.v_head_dim=8 --set model.n_kv_heads=8 train
  expect "deepseek_v3 needs its latent attention" nonzero "model.mla.kv_lora_rank = 0: model.type = deepseek_v3 needs its latent attention" -- \
    "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.type=deepseek_v3 --set model.moe.n_experts=4 \
    --set model.moe.ffn_dim=16 --set model.moe.router_score=sigmoid train
}
deepseek_meshes

# With and without the balance loss, one directory (mixtral's, output_router_logits true): the YAML's
# model.moe.output_router_logits = false wins over config.json's (how a run trains, not what the model is) and
# gives the reference's losses trained from a copy that says false; the two runs differ (the loss term is there),
# and the balance loss in the metrics is router_aux_loss_coef times the reference's aux of every step.
moe_balance() {
  "$py" - "$tmp/mixtral" "$tmp/mixtral_nobal" <<'PY' || { bad "mixtral without the balance loss: the copy"; return; }
import json, os, shutil, sys
src, dst = sys.argv[1:3]
shutil.copytree(src, dst, dirs_exist_ok=True)
c = json.load(open(os.path.join(dst, "config.json")))
assert c["output_router_logits"] is True, c
c["output_router_logits"] = False
json.dump(c, open(os.path.join(dst, "config.json"), "w"))
PY
  "$py" "$ref" train --model "$tmp/mixtral_nobal" --data "$tmp/data/docs_train_*.bin" --steps 10 --batch-size 8 \
    --seq-len 32 --lr 3e-3 --schedule cosine --warmup-steps 3 --lr-min 3e-4 --weight-decay 0.1 --grad-clip 1.0 \
    --threads 1 --dtype f64 --out "$tmp/mixtral_nobal.ref.json" >"$tmp/mixtral_nobal.ref.log" 2>&1 ||
    { bad "mixtral without the balance loss: reference train" "$(tail -n 10 "$tmp/mixtral_nobal.ref.log")"; return; }
  if timeout 300 "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/mixtral" \
    --set model.moe.output_router_logits=false --set log.metrics_file="$tmp/mixtral_nobal.jsonl" train \
    >"$tmp/mixtral_nobal.log" 2>&1; then
    if out=$("$py" "$compare" "$tmp/mixtral_nobal.jsonl" "$tmp/mixtral_nobal.ref.json" --rel0 1e-5 --abs 1e-5 --steps 10 2>&1); then
      ok "mixtral with model.moe.output_router_logits=false over config.json's true: the reference without the balance loss within 1e-5: $out"
    else
      bad "mixtral without the balance loss against the reference" "$out"
    fi
  else
    bad "mixtral with model.moe.output_router_logits=false over config.json's true" "$(tail -n 10 "$tmp/mixtral_nobal.log")"
  fi
  if out=$("$py" "$compare" "$tmp/mixtral.np1.jsonl" "$tmp/mixtral_nobal.jsonl" --exact --steps 10 --expect-differ 2>&1); then
    ok "mixtral: the balance loss changes the losses: $out"
  else
    bad "mixtral: with and without the balance loss give the same losses" "$out"
  fi
  if out=$("$py" - "$tmp/mixtral.np1.jsonl" "$tmp/mixtral.ref.json" "$tmp/mixtral_nobal.jsonl" "$tmp/mixtral" <<'PY' 2>&1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
ref = json.load(open(sys.argv[2]))["aux_losses"]
off = [json.loads(l) for l in open(sys.argv[3]) if '"loss"' in l]
coef = json.load(open(sys.argv[4] + "/config.json"))["router_aux_loss_coef"]
assert len(rows) == 10 and len(ref) == 10 and len(off) == 10, (len(rows), len(ref), len(off))
worst = max(abs(r["aux_loss"] - coef * a) / (coef * a) for r, a in zip(rows, ref))
assert worst < 1e-9, worst
assert all(r["aux_loss"] == 0 for r in off), [r["aux_loss"] for r in off]
print(f"coef {coef}, step 1 {rows[0]['aux_loss']:.6g}, largest relative difference {worst:.1e}; 0 without it")
PY
  ); then ok "mixtral: the metrics' aux_loss is router_aux_loss_coef x the reference's aux: $out"
  else bad "mixtral: the metrics' aux_loss against the reference's" "$out"; fi
}
moe_balance

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
expect "an unknown RoPE scaling type is refused" nonzero "model.rope_scaling.type = 'dynamic': expected one of 'none', 'linear', 'llama3'" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.rope_scaling.type=dynamic train
expect "YaRN is DeepSeek's here" nonzero "model.rope_scaling.type = yarn: model.type = llama has no YaRN here" -- \
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

# Phi-3's bad input: LongRoPE's factor lists must have one value per frequency, from config.json and from the YAML;
# a partial rotary factor is refused; its window follows Mistral's rule.
"$py" - "$tmp/phi3" "$tmp/phi3_bad" <<'PY'
import json, os, shutil, sys
src, dst = sys.argv[1:3]
shutil.copytree(src, dst, dirs_exist_ok=True)
c = json.load(open(os.path.join(dst, "config.json")))
c["rope_scaling"]["short_factor"] = c["rope_scaling"]["short_factor"][:3]
json.dump(c, open(os.path.join(dst, "config.json"), "w"))
PY
expect "phi3: a LongRoPE factor list of the wrong length is refused, naming the key" nonzero "rope_scaling.short_factor has 3 values: LongRoPE needs one per frequency, head_dim / 2 = 4" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/phi3_bad" train
expect "phi3: the YAML's LongRoPE factor lists must have head_dim / 2 values" nonzero "model.rope_scaling.long_factor has 2 values: longrope needs head_dim / 2 = 16" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.type=phi3 --set model.rope_scaling.type=longrope \
  --set "model.rope_scaling.short_factor=[$(printf '1,%.0s' $(seq 15))1]" --set "model.rope_scaling.long_factor=[1,2]" train
expect "phi3: longrope without its factor lists is refused" nonzero "model.rope_scaling.short_factor: longrope needs short_factor and long_factor" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.type=phi3 --set model.rope_scaling.type=longrope train
"$py" - "$tmp/phi3" "$tmp/phi3_partial" <<'PY'
import json, os, shutil, sys
src, dst = sys.argv[1:3]
shutil.copytree(src, dst, dirs_exist_ok=True)
c = json.load(open(os.path.join(dst, "config.json")))
c["partial_rotary_factor"] = 0.5
json.dump(c, open(os.path.join(dst, "config.json"), "w"))
PY
expect "phi3: a partial rotary factor is refused, naming the key" nonzero "partial_rotary_factor = 0.5: meshtrain rotates the whole head (1 only)" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.init_from="$tmp/phi3_partial" train
expect "phi3: a sliding window shorter than the sequence is refused" nonzero "model.sliding_window = 16 is shorter than training.seq_len = 32" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set model.type=phi3 --set model.sliding_window=16 train

summary families
