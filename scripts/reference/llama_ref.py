#!/usr/bin/python3
"""An independent PyTorch reference for meshtrain's Llama (and the Qwen3, MoE, Phi-3, Gemma and DeepSeek families).

The model follows Hugging Face Llama's parameter names and semantics so that
the same config.json + model.safetensors directory can be trained by meshtrain
(`model.init_from`) and by this script, and their per-step losses compared.
It is written from the published definitions (no `transformers` import, no code
taken from other projects) and kept small enough to read in one sitting.

Families (config.json's model_type; absent = llama), all the Llama architecture (RMSNorm, RoPE, GQA, SwiGLU):
  llama    Llama 1/2/3.x. attention_bias true: a bias on q_proj, k_proj, v_proj AND o_proj; mlp_bias true is refused.
  mistral  no biases; sliding_window (absent: 4096, transformers' default; null: none) is refused when it is
           below the sequence length (a window that long masks nothing, so the model is plain causal attention).
  qwen2    Qwen2/Qwen2.5: a bias on q_proj, k_proj, v_proj always, none on o_proj; use_sliding_window true is
           refused as mistral's window is.
  qwen3    Qwen3: self_attn.q_norm and k_norm (gains of head_dim values): each head of q and of k, viewed
           (B, T, H, hd), is RMSNormed over hd (eps rms_norm_eps, in at least f32 as the model's norms) BEFORE RoPE.
           head_dim from config.json (absent: 128, Qwen3Config's default); attention_bias true: biases on q, k, v
           and o_proj; use_sliding_window true is refused.
  mixtral  Mistral's attention (no biases; sliding_window absent or null: none, else refused below the sequence
           length). Every layer's MLP is block_sparse_moe: router gate (E, C), experts.{j}.w1 / w3 (F, C) and w2
           (C, F), expert(x) = w2(silu(w1 x) * w3 x); E num_local_experts, k num_experts_per_tok, F
           intermediate_size; the top-k weights are always renormalised. router_jitter_noise != 0 is refused.
  qwen2_moe  Qwen2's attention. Layer i's mlp is sparse iff i is not in mlp_only_layers, num_experts > 0 and
           (i + 1) % decoder_sparse_step == 0, else a dense SwiGLU of width intermediate_size. Sparse: mlp.gate
           (E, C), mlp.experts.{j}.{gate,up,down}_proj of width moe_intermediate_size, plus
           sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x) (width shared_expert_intermediate_size);
           renormalised iff norm_topk_prob (default false). E num_experts.
  qwen3_moe  Qwen3's attention (q_norm, k_norm; head_dim absent: hidden_size / heads); qwen2_moe's sparse layers
           without the shared expert.
  phi3     Phi-3: Llama's computation with fused projections, as Phi-3's modules are: self_attn.qkv_proj
           ((H + 2 KV) hd, C), whose output splits into q (H hd), k (KV hd) and v (KV hd) in that order, and
           mlp.gate_up_proj (2F, C), whose output's first F values are the gate and the last F the up projection:
           down_proj(silu(gate) * up). No biases; sliding_window (absent or null: none) is refused below the
           sequence length; rms_norm_eps absent: 1e-5; partial_rotary_factor other than 1 and non-zero dropouts
           (resid_pdrop, embd_pdrop, attention_dropout) are refused. RoPE may be longrope (below).
  gemma2, gemma3_text  Gemma 2 and Gemma 3's text model (GemmaForCausalLM below, from Gemma's formulas): RMSNorm
           x * rsqrt(mean x^2 + eps) * (1 + w); the embedding's output times sqrt(hidden_size) (rounded to the
           model's dtype); GeGLU down(gelu_tanh(gate x) * up x); per layer h = x + post_attention_layernorm(attn(
           input_layernorm(x))), y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))); scores
           q.k * query_pre_attn_scalar^-1/2, then attn_logit_softcapping c: c tanh(s / c); layer i a sliding layer
           (a query at p sees keys at p - sliding_window < s <= p) when gemma2 and i even, or gemma3_text and
           (i + 1) % sliding_window_pattern != 0 (layer_types, when given, must agree); gemma3_text: q_norm and
           k_norm (the (1 + w) RMSNorm over each head), the sliding layers' RoPE base rope_local_base_freq without
           rope_scaling; the final logits z -> f tanh(z / f), f = final_logit_softcapping (null: none). Tied by
           default (transformers' default).
  deepseek_v3, deepseek_v2  DeepSeek-V3 / V2 (DeepseekV3ForCausalLM / DeepseekV2ForCausalLM, below, from the
           published formulas); Llama's layer (RMSNorm, h = x + attn(norm x), y = h + mlp(norm h)) with:
           multi-head latent attention (dn qk_nope_head_dim, dr qk_rope_head_dim, dv v_head_dim, dqk = dn + dr,
           H heads, num_key_value_heads = H): q = q_b_proj(q_a_layernorm(q_a_proj x)) (q_lora_rank null: q_proj x)
           viewed (B, T, H, dqk) = (q_nope, q_pe); kv_a_proj_with_mqa x = (c (kv_lora_rank), k_pe (dr, ONE key
           for every head)); kv_b_proj(kv_a_layernorm c) viewed (B, T, H, dn + dv) = (k_nope, v); RoPE on q_pe and
           k_pe only, over dr, on INTERLEAVED pairs (2j, 2j+1) (DeepSeek's layout: V3's rope_interleave true,
           V2's complex numbers; computed as [x0, x2, .., x1, x3, ..] then HF's rotate_half, the same q.k);
           causal softmax of (q_nope, rope q_pe).(k_nope, rope k_pe) * dqk^-1/2 m^2, m = yarn_mscale(factor,
           mscale_all_dim) under YaRN with mscale_all_dim != 0, else 1 (DeepSeek's code and transformers'
           DeepseekV3 for both versions; transformers 5's DeepseekV2 leaves m^2 out); o_proj of (B, T, H dv).
           MLP: layer i < first_k_dense_replace (or n_routed_experts null, V2) a SwiGLU of intermediate_size;
           the others mlp.gate (E n_routed_experts, C), mlp.experts.{j} SwiGLUs of moe_intermediate_size and
           mlp.shared_experts of moe_intermediate_size * n_shared_experts (none for 0 / null; no gate on it):
           out = sum_k w_k expert_{e_k}(x) + shared_experts(x). Router logits gate(x) in f32 (f64 in an f64 run):
           V3 (scoring_func sigmoid, topk_method noaux_tc): s = sigmoid(logits), sel = s +
           mlp.gate.e_score_correction_bias (E; a buffer: saved, never trained or decayed); a group score is the
           sum of the 2 largest sel in each of n_group consecutive groups; the topk_group best groups kept, the
           others' sel set to 0 (not -inf); top-k experts by sel; w = s there.
           V2 (softmax): s = softmax(logits); greedy: top-k by s; group_limited_greedy: a group score is its max
           s, the topk_group best kept, the others' s set to 0, then top-k; w = s there.
           Both: w /= (sum w + 1e-20) when norm_topk_prob (V2: and k > 1), then w *= routed_scaling_factor.
           (For V2 with norm_topk_prob true, this is issue 53's definition; DeepSeek's own V2 code does not scale
           after renormalising, and transformers 5's DeepseekV2 ignores norm_topk_prob: the released V2 files
           have it false, where all agree.) No balance loss: output_router_logits true is refused.
           RoPE plain or yarn (below). Refused, naming the key: q_lora_rank 0, moe_layer_freq != 1, an odd
           qk_rope_head_dim, head_dim != qk_rope_head_dim, n_group not dividing n_routed_experts (V3: groups of
           fewer than 2), topk_group > n_group, num_nextn_predict_layers > 1 (V2: > 0), rope_interleave false,
           attention_bias true, another scoring_func or topk_method.
           Multi-token prediction (DeepSeek-V3's paper, section 2.2; depth D = num_nextn_predict_layers, 1 only):
           the MTP module is model.layers.{L}, L = num_hidden_layers: enorm.weight (C), hnorm.weight (C),
           eh_proj.weight (C, 2C), a whole decoder layer of index L (latent attention; its MLP dense iff L <
           first_k_dense_replace, else sparse with its own router, correction bias and experts) and
           shared_head.norm.weight (C). Its embedding and output head are the main model's embed_tokens and lm_head
           (the paper's shared embedding and output head: one parameter each, whose gradient sums both uses, seen
           once by AdamW); DeepSeek's files also hold copies, model.layers.{L}.embed_tokens.weight and
           model.layers.{L}.shared_head.head.weight: `init` writes them (equal to the main ones), loading checks a
           copy present equals its tensor (else exits naming it) and drops it (absent copies are fine).
           With h the main model's final normed hidden states (the input of lm_head), targets y (y_i = t_{i+1}):
           x_i = eh_proj([enorm(embed(y_i)), hnorm(h_i)]) (the embedding first), z = layer L over the whole
           sequence (causal, RoPE positions 0..T-1), logits_mtp = lm_head(shared_head.norm(z)); position i < T-1
           is trained on y_{i+1} (the token two ahead), T-1 on nothing. L_mtp = the summed cross-entropy of those
           B*(T-1) targets over the batch's B*T main targets (the paper's 1/T); train minimises L_main + w L_mtp,
           each micro-batch's sums over the whole batch's B*T as the main loss. w: config.json's "mtp_loss_weight"
           (meshtrain's own key, not DeepSeek's) when present, else train's / loss's --mtp-loss-weight (default
           0.3, the paper's first-phase value). Training only: forward, `generate` and the logits use the main
           head; the validation loss is L_main; loss masks with MTP are refused (not defined).
  Any other model_type is refused (naming the supported ones), as is a hidden_act other than silu (Gemma:
  gelu_pytorch_tanh).
MoE router, as transformers computes it: logits = gate(x) in the model's dtype; softmax in f32 (f64 in an f64 run);
  torch.topk; renormalised as above; rounded to the hidden dtype; out[t] = sum_k w[t,k] expert_e[t,k](x[t]),
  computed expert by expert with index_add_ (an expert no token chose still runs on no rows: zero gradients).
Balance loss (transformers' load_balancing_loss_func, no attention mask): the router logits of every MoE layer of
  one forward (N = B*T rows each) concatenated (R rows); p = softmax; mask = one_hot(topk(p, k), E) (R, k, E);
  aux = E * sum(mean_rows(mask) * mean_rows(p)[None]) (k for perfectly balanced routing). When config.json's
  output_router_logits is true, train minimises and logs ce + router_aux_loss_coef * aux, per forward (per
  micro-batch, averaged over them as the ce is), and `loss` prints it; otherwise the loss is plain ce. For an MoE
  model train also writes "aux_losses" (each step's aux, micro-batches averaged) and `loss` prints "aux".
RoPE: rope_theta and the scaling in either config.json spelling:
  transformers 4: top-level rope_theta; rope_scaling null or {rope_type (or the older "type"), factor, ...}
  transformers 5: rope_parameters {rope_type, rope_theta, factor, ...} (rope_type "default": no scaling)
  Both may be present; a key given twice with different values is an error. rope_type is default, linear,
  llama3, (phi3 only) longrope or (deepseek only, and the only scaling there) yarn; any other (dynamic, ...) is
  refused.
  linear: inv_freq / factor (positions / factor).
  llama3 (Meta's Llama 3.1): with wavelen = 2 pi / inv_freq, old = original_max_position_embeddings:
  wavelen < old / high_freq_factor: unchanged; wavelen > old / low_freq_factor: inv_freq / factor; between:
  s = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor),
  inv_freq = (1 - s) inv_freq / factor + s inv_freq.
  longrope (Phi-3's LongRoPE; keys short_factor and long_factor, head_dim / 2 numbers each, and
  original_max_position_embeddings, which phi3 files may give at the top level instead, default 4096):
  inv_freq[i] / ext[i] with ext = long_factor when the forward's sequence length T exceeds
  original_max_position_embeddings (transformers picks by the largest position + 1, T here), else short_factor;
  cos and sin are multiplied by attention_factor when given, else with f = factor when given, else
  max_position_embeddings / original: 1 if f <= 1, else sqrt(1 + ln f / ln original).
  yarn (DeepSeek's; d = qk_rope_head_dim, base rope_theta, f factor, L original_max_position_embeddings,
  beta_fast (default 32), beta_slow (1), mscale, mscale_all_dim; f must equal max_position_embeddings / L, as
  transformers versions disagree on which they use): yarn_mscale(s, m) = 1 if s <= 1 else 0.1 m ln s + 1;
  corr(n) = d ln(L / (2 pi n)) / (2 ln base); low = max(floor corr(beta_fast), 0), high = min(ceil
  corr(beta_slow), d - 1) (+0.001 when equal); ramp_j = clamp((j - low) / (high - low), 0, 1), e_j = 1 - ramp_j;
  inv_freq_j = base^(-2j/d) ((1 - e_j) / f + e_j); cos and sin times yarn_mscale(f, mscale) / yarn_mscale(f,
  mscale_all_dim) when both are non-zero, else yarn_mscale(f).
  Precision: inv_freq (theta^(-2i/hd), then the scaling), the angles position * inv_freq and their cos and sin
  are all computed in f64 and rounded once to the model's dtype (f32, or f64 for --dtype f64 and generate).
  head_dim: config.json's, else hidden_size / num_attention_heads.
Loss masks (issue 41; train --masks): beside a token shard X.bin, X.mask holds 256 little-endian int32 (magic
  20241127, version 1, the shard's token count, a packing length T_pack (0: not packed) that must divide the
  sequence length, the rest 0) and then one uint8 per token, 1 where that token is a trained target; a shard
  without one trains every token. The target at stream position p counts iff mask[p] = 1; a step's loss is the
  sum of the counted targets' cross-entropy over the number counted in the whole batch (every micro-batch), the
  validation loss the same over all its batches. Written from that definition alone.
AdamW decays the parameters of dim >= 2 (embeddings, linear weights, lm_head, routers, experts) only: norm gains
(q_norm, k_norm included) and biases are not decayed.
Init: normal(0, 0.02) for matrices and biases, ones for norm gains, EXCEPT the MoE routers (block_sparse_moe.gate,
mlp.gate), drawn with std 0.5 (ROUTER_INIT_STD) so that the top-k choices are far from ties and an f32 run, an f64
run and meshtrain route every token alike; DeepSeek-V3's e_score_correction_bias normal(0, 0.1), drawn after
every parameter; DeepSeek-V3's MTP module (parameters, then its bias) after all of the main model's, so a seed gives
the same main weights with and without it.
DeepSeek self-checks (a second, naive computation of the attention, YaRN and the routers):
  /usr/bin/python3 scripts/reference/deepseek_check.py

  llama_ref.py init  --out DIR [--dim 64 --n-layers 2 --n-heads 4 --n-kv-heads 2 --ffn-dim 160
                     --vocab-size 256 --norm-eps 1e-5 --rope-theta 10000 --max-seq-len 256]
                     [--tie-embeddings] [--seed 0] [--dtype f32|bf16]
                     [--model-type llama|mistral|qwen2|qwen3|mixtral|qwen2_moe|qwen3_moe|phi3|gemma2|
                     gemma3_text|deepseek_v3|deepseek_v2] [--head-dim HD]
                     [--attention-bias (llama)] [--sliding-window N (mistral)] [--rope-spelling v4|v5]
                     [--rope-scaling none|linear:FACTOR|llama3:FACTOR,LOW,HIGH,ORIG|longrope:ORIG]
                     MoE: [--n-experts 4 --experts-per-token 2 --moe-ffn-dim F (default --ffn-dim)
                     --router-aux-loss-coef C (default 0.02 mixtral, 0.001 qwen) --output-router-logits]
                     qwen MoEs: [--norm-topk-prob --decoder-sparse-step 1 --mlp-only-layers 0,3]
                     qwen2_moe: [--shared-expert-ffn-dim S (default --ffn-dim)]
                     mixtral writes --moe-ffn-dim as intermediate_size; the qwen MoEs write it as
                     moe_intermediate_size and --ffn-dim as intermediate_size (their dense layers)
                     biases (qwen2, qwen2_moe; llama with --attention-bias) are drawn normal(0, 0.02), not zero
                     deepseek: [--q-lora-rank R (0 or absent: null) --kv-lora-rank 16 --qk-nope-head-dim 8
                     --qk-rope-head-dim 4 --v-head-dim 8 --n-shared-experts 1 --n-group 1 --topk-group 1
                     --routed-scaling-factor 1 --first-k-dense-replace 1 --topk-method greedy|group_limited_greedy
                     (v2) --rope-scaling yarn:FACTOR,ORIG,BETA_FAST,BETA_SLOW,MSCALE,MSCALE_ALL_DIM] and the MoE
                     --n-experts 4 (n_routed_experts), --experts-per-token 2, --moe-ffn-dim (default --ffn-dim),
                     --norm-topk-prob; --ffn-dim is the dense layers' intermediate_size; --n-kv-heads is not
                     used (num_key_value_heads = --n-heads)
                     deepseek_v3: [--num-nextn-predict-layers 0|1 (default 0) --mtp-loss-weight W (written as
                     config.json's mtp_loss_weight; needs --num-nextn-predict-layers 1)]
  llama_ref.py train --model DIR --data GLOB --steps N --batch-size B --seq-len T
                     [--micro-batch-size M] [--lr 3e-4 --schedule constant|cosine --warmup-steps 0
                     --lr-min 0 --weight-decay 0.1 --beta1 0.9 --beta2 0.95 --eps 1e-8 --grad-clip 1.0]
                     [--threads 2] [--dtype f32|f64] [--masks] [--val-data GLOB --eval-interval N
                     --eval-steps K] [--mtp-loss-weight 0.3] --out losses.json
                     JSON {"losses", "grad_norms", "lrs"} and, for an MoE model, "aux_losses"; with --masks
                     "trained_tokens" (each step's counted targets); with validation "val_losses" [{step, val_loss}];
                     with an MTP module "losses" are L_main + w L_mtp and "mtp_losses" each step's L_mtp
  llama_ref.py loss  --model DIR --data GLOB --batch-size B --seq-len T --step S [--mtp-loss-weight 0.3]
                     JSON {"loss"} and, for an MoE model, "aux"; with an MTP module "loss" = L_main + w L_mtp and
                     "mtp_loss" = L_mtp
  llama_ref.py generate --model DIR --prompt TEXT --tokens N [--max-seq-len T --norm-eps 1e-5 --rope-theta 10000]
                     greedy continuation as JSON {"tokens", "margins"}; DIR is a Hugging Face directory or a
                     meshtrain checkpoint (step_XXXXXXXX: sizes from meta.json, the rest from the options)
  llama_ref.py bench [--dim 256 --n-layers 4 --n-heads 8 --n-kv-heads 4 --ffn-dim 768 --vocab-size 256
                     --seq-len 256 --batch-size 8 --threads 2 --steps 10 --warmup 3]
"""
import argparse
import glob
import json
import math
import os
import re
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# =============================================================== safetensors
# Format: u64 little-endian header length N, N bytes of JSON
# {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
# then the tensor bytes; offsets are relative to the end of the header.

_NP_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4"}


def f32_to_bf16_bits(a):
    """Rounds f32 values to bf16 (nearest, ties to even) and returns the uint16 bit patterns."""
    u = np.ascontiguousarray(a, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype("<u2")


def bf16_bits_to_f32(bits):
    # bf16 is exactly the upper 16 bits of an f32.
    return (bits.astype("<u4") << 16).view("<f4")


def write_safetensors(path, tensors, dtype="F32", metadata=None):
    """tensors: {name: torch.Tensor or np.ndarray}; dtype: F32, F16 or BF16 for every tensor."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        a = t.detach().cpu().to(torch.float32).numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float32)
        if dtype == "BF16":
            raw = f32_to_bf16_bits(a).tobytes()
        elif dtype in ("F32", "F16"):
            raw = a.astype(_NP_DTYPES[dtype]).tobytes()
        else:
            raise ValueError(f"write_safetensors: unsupported dtype {dtype}")
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hdr = json.dumps(header, separators=(",", ":")).encode()
    hdr += b" " * (-len(hdr) % 8)  # pad so the tensor data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)))
        f.write(hdr)
        for raw in blobs:
            f.write(raw)


def read_safetensors(path):
    """Returns ({name: float32 np.ndarray}, metadata dict). Half types are widened to f32."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = memoryview(raw)[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        if not 0 <= begin <= end <= len(body):
            raise ValueError(f"{path}: tensor {name} has data_offsets {e['data_offsets']} past the file's end")
        if e["dtype"] == "BF16":
            a = bf16_bits_to_f32(np.frombuffer(body[begin:end], dtype="<u2"))
        elif e["dtype"] in _NP_DTYPES:
            a = np.frombuffer(body[begin:end], dtype=_NP_DTYPES[e["dtype"]])
        else:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
        if a.size != math.prod(e["shape"]):
            raise ValueError(f"{path}: tensor {name} has {a.size} elements, shape {e['shape']}")
        out[name] = np.array(a, dtype=np.float64 if e["dtype"] == "F64" else np.float32).reshape(e["shape"])
    return out, header.get("__metadata__", {})

def read_model_weights(model_dir, prefix="model"):
    """The tensors of DIR/<prefix>.safetensors, or of the files DIR/<prefix>.safetensors.index.json maps them to
    (Hugging Face's sharded layout, which meshtrain writes when several ranks save)."""
    index = os.path.join(model_dir, prefix + ".safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(model_dir, prefix + ".safetensors"))[0]
    weight_map = json.load(open(index))["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        tensors, _ = read_safetensors(os.path.join(model_dir, file))
        for name, a in tensors.items():
            if weight_map.get(name) == file:
                out[name] = a
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise ValueError(f"{index}: tensors {missing} are not in the files it names")
    return out

# ===================================================================== model


MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
               "gemma3_text": "Gemma3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM"}
GEMMA_TYPES = ("gemma2", "gemma3_text")
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
# transformers' defaults for a key absent from config.json, per family.
_DEFAULTS = {
    "max_position_embeddings": {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768,
                                "mixtral": 4096 * 32, "qwen2_moe": 32768, "qwen3_moe": 32768, "phi3": 4096,
                                "gemma2": 8192, "gemma3_text": 131072, "deepseek_v2": 2048, "deepseek_v3": 4096},
    "rms_norm_eps": {"mixtral": 1e-5, "phi3": 1e-5},  # every other family: 1e-6
    "rope_theta": {"mixtral": 1e6, "gemma3_text": 1e6},  # every other family: 10000
    "num_experts": {"mixtral": 8, "qwen2_moe": 60, "qwen3_moe": 128},
    "num_experts_per_tok": {"mixtral": 2, "qwen2_moe": 4, "qwen3_moe": 8},
    "moe_intermediate_size": {"qwen2_moe": 1408, "qwen3_moe": 768},
}
# The keys each RoPE type takes besides rope_type/type and rope_theta (transformers' rope_config_validation).
ROPE_KEYS = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings")}
LONGROPE_OPTIONAL = ("factor", "attention_factor")
# YaRN's optional keys and transformers' defaults (mscale, mscale_all_dim absent: the plain yarn_mscale(factor)).
YARN_OPTIONAL = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": None, "mscale_all_dim": None}


class ConfigError(ValueError):
    """A config.json (or an option) that describes a model this reference does not compute."""


def _number(v, key, positive=True):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise ConfigError(f"{key} = {json.dumps(v)}: expected a number{' > 0' if positive else ''}")
    return v


def read_rope(d, default_theta=10000.0, yarn=False):
    """(rope_theta, scaling) from a config dict, scaling None (plain RoPE) or {"rope_type": "linear" | "llama3",
    and that type's ROPE_KEYS}. Reads transformers 4's top-level rope_theta and rope_scaling (whose type key was
    "type" before 4.45) and transformers 5's rope_parameters (rope_theta and the scaling keys together); every
    place a key is given must agree. yarn: whether YaRN is computed (DeepSeek's)."""
    found = {}  # key -> (where, value)

    def put(key, where, v):
        if key in found and found[key][1] != v:
            raise ConfigError(f"{where} = {json.dumps(v)} but {found[key][0]} = {json.dumps(found[key][1])}: "
                              "which one?")
        found.setdefault(key, (where, v))

    if d.get("rope_theta") is not None:
        put("rope_theta", "rope_theta", _number(d["rope_theta"], "rope_theta"))
    for where in ("rope_scaling", "rope_parameters"):
        r = d.get(where)
        if r is None:
            continue
        if not isinstance(r, dict):
            raise ConfigError(f"{where} = {json.dumps(r)}: expected an object or null")
        for k, v in r.items():
            if k == "partial_rotary_factor" and v == 1:
                continue  # the whole head rotates: plain RoPE's own behaviour
            key = "rope_type" if k == "type" else k
            if key == "rope_theta":
                v = _number(v, f"{where}.rope_theta")
            put(key, f"{where}.{k}", v)
    rope_type = found.get("rope_type", (None, "default"))[1]
    if rope_type not in ROPE_KEYS or (rope_type == "yarn" and not yarn):
        raise ConfigError(f"{found['rope_type'][0]} = {json.dumps(rope_type)}: supported RoPE types are "
                          f"{', '.join(t for t in ROPE_KEYS if t != 'yarn')} (yarn: DeepSeek-V2 / V3 only)")
    optional = {"longrope": LONGROPE_OPTIONAL, "yarn": tuple(YARN_OPTIONAL)}.get(rope_type, ())
    allowed = ("rope_type", "rope_theta") + ROPE_KEYS[rope_type] + optional
    for key, (where, v) in found.items():
        if key not in allowed:
            raise ConfigError(f"{where} = {json.dumps(v)}: not a parameter of rope_type {json.dumps(rope_type)}")
    theta = found["rope_theta"][1] if "rope_theta" in found else default_theta
    if rope_type == "default":
        return float(theta), None
    scaling = {"rope_type": rope_type}
    for key in ROPE_KEYS[rope_type]:
        if key not in found:
            raise ConfigError(f"rope_type {json.dumps(rope_type)} needs {key} (in rope_scaling or rope_parameters)")
        v, where = found[key][1], found[key][0]
        if key in ("short_factor", "long_factor"):
            if not isinstance(v, list):
                raise ConfigError(f"{where} = {json.dumps(v)}: expected a list of numbers")
            scaling[key] = [_number(x, where) for x in v]
        else:
            scaling[key] = _number(v, where)
    for key in LONGROPE_OPTIONAL if rope_type == "longrope" else ():
        if key in found:
            scaling[key] = _number(found[key][1], found[key][0])
    if rope_type == "yarn":  # mscale and mscale_all_dim may be 0 (= not given); null is the default
        for key, default in YARN_OPTIONAL.items():
            v = found[key][1] if key in found else None
            scaling[key] = default if v is None else _number(v, found[key][0], positive=key.startswith("beta"))
            if key.startswith("mscale") and scaling[key] is not None and scaling[key] < 0:
                raise ConfigError(f"{found[key][0]} = {json.dumps(v)}: expected a number >= 0")
        if scaling["original_max_position_embeddings"] != int(scaling["original_max_position_embeddings"]):
            raise ConfigError("yarn's original_max_position_embeddings must be an integer")
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ConfigError(f"llama3 RoPE: high_freq_factor = {scaling['high_freq_factor']} must exceed "
                          f"low_freq_factor = {scaling['low_freq_factor']}")
    return float(theta), scaling


def phi3_rope(d):
    """A copy of a phi3 config dict whose longrope objects have original_max_position_embeddings: Phi-3's files
    keep it at the top level (Phi3Config's default 4096)."""
    d = dict(d)
    original = d.get("original_max_position_embeddings")
    original = 4096 if original is None else original
    for where in ("rope_scaling", "rope_parameters"):
        r = d.get(where)
        if isinstance(r, dict) and r.get("rope_type", r.get("type")) == "longrope":
            d[where] = dict({"original_max_position_embeddings": original}, **r)
    return d


def _int(v, key, minimum):
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"{key} = {json.dumps(v)}: expected an integer >= {minimum}")
    return v


def _bool(v, key):
    if not isinstance(v, bool):
        raise ConfigError(f"{key} = {json.dumps(v)}: expected true or false")
    return v


class LlamaConfig:
    """A Hugging Face config.json of the Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, Phi-3, Gemma
    or DeepSeek family (see the module docstring); raises ConfigError for what the reference does not compute."""

    def __init__(self, d):
        def get(key, default):  # a null value is transformers' default, as an absent one
            return default if d.get(key) is None else d[key]

        self.model_type = get("model_type", "llama")
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type = {json.dumps(self.model_type)}: supported model types are "
                              f"{', '.join(MODEL_TYPES)}")
        if self.model_type in GEMMA_TYPES:
            for key in ("hidden_activation", "hidden_act"):
                if get(key, "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
                    raise ConfigError(f"{key} = {json.dumps(d[key])}: Gemma's MLP is GeGLU (gelu_pytorch_tanh)")
        elif get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act = {json.dumps(d['hidden_act'])}: the MLP is SwiGLU (hidden_act \"silu\")")
        self.hidden_size = d["hidden_size"]
        self.num_hidden_layers = d["num_hidden_layers"]
        self.num_attention_heads = d["num_attention_heads"]
        self.num_key_value_heads = get("num_key_value_heads", self.num_attention_heads)
        self.intermediate_size = d["intermediate_size"]
        self.vocab_size = d["vocab_size"]
        mt = self.model_type
        self.rms_norm_eps = get("rms_norm_eps", _DEFAULTS["rms_norm_eps"].get(mt, 1e-6))
        self.rope_theta, self.rope_scaling = read_rope(phi3_rope(d) if mt == "phi3" else d,
                                                       _DEFAULTS["rope_theta"].get(mt, 10000.0),
                                                       yarn=mt in DEEPSEEK_TYPES)
        self.max_position_embeddings = get("max_position_embeddings", _DEFAULTS["max_position_embeddings"][mt])
        self.fused = mt == "phi3"  # Phi-3's qkv_proj and gate_up_proj
        self.tie_word_embeddings = get("tie_word_embeddings", mt in GEMMA_TYPES)
        # Qwen3Config's head_dim defaults to 128; every other family's to hidden_size / num_attention_heads.
        # DeepSeek: head_dim is qk_rope_head_dim (DeepseekV3Config writes it so; read_deepseek checks it).
        self.head_dim = get("head_dim", 128 if mt == "qwen3" else get("qk_rope_head_dim", 64) if mt in DEEPSEEK_TYPES
                            else self.hidden_size // self.num_attention_heads)
        assert self.num_attention_heads % self.num_key_value_heads == 0, "heads must be a multiple of kv heads"
        if self.head_dim % 2 and mt not in DEEPSEEK_TYPES:  # DeepSeek's: qk_rope_head_dim, read_deepseek's
            raise ConfigError(f"head_dim = {self.head_dim}: RoPE needs an even head dim")
        self.check_longrope(d, get)
        # Biases, as each family's attention declares them (Mistral's has none, whatever the file says).
        # Qwen3's q_norm and k_norm: an RMSNorm over each head's head_dim values of q and k, before RoPE.
        self.qk_norm = mt in QK_NORM_TYPES or mt == "gemma3_text"
        self.gemma = mt in GEMMA_TYPES
        if self.gemma:
            self.read_gemma(d, get)
        if mt == "llama":
            if get("mlp_bias", False):
                raise ConfigError("mlp_bias = true: the reference's MLP has no biases")
            self.qkv_bias = self.o_bias = bool(get("attention_bias", False))
        elif mt in QK_NORM_TYPES:  # Qwen3: attention_bias puts a bias on all four projections, as Llama's
            self.qkv_bias = self.o_bias = _bool(get("attention_bias", False), "attention_bias")
        elif mt == "phi3" or self.gemma or mt in DEEPSEEK_TYPES:
            if get("attention_bias", False):
                raise ConfigError(f"attention_bias = true: {mt}'s attention has no biases here")
            self.qkv_bias = self.o_bias = False
        else:
            self.qkv_bias, self.o_bias = mt in ("qwen2", "qwen2_moe"), False
        # Sliding-window attention: the window in tokens (a query sees itself and the window - 1 before it), or None.
        if mt == "mistral":
            self.sliding_window = d.get("sliding_window", 4096)  # absent: MistralConfig's default; null: none
        elif mt in ("mixtral", "phi3"):
            self.sliding_window = d.get("sliding_window")  # MixtralConfig's and Phi3Config's default: none
        elif mt in ("qwen2", "qwen2_moe") and get("use_sliding_window", False):
            self.sliding_window = d.get("sliding_window", 4096)
        elif self.gemma:
            pass  # read_gemma's
        elif mt in QK_NORM_TYPES and get("use_sliding_window", False):
            raise ConfigError("use_sliding_window = true: Qwen3's per-layer sliding-window attention is not "
                              "implemented")
        else:
            self.sliding_window = None
        self.read_moe(d, get)
        self.num_nextn_predict_layers, self.mtp_loss_weight = 0, None  # DeepSeek-V3's MTP (read_deepseek)
        self.deepseek = mt in DEEPSEEK_TYPES
        if self.deepseek:
            self.read_deepseek(d, get)
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ConfigError(f"sliding_window = {json.dumps(self.sliding_window)}: expected an integer >= 1 or null")

    def read_gemma(self, d, get):
        """Gemma 2 / 3's keys with transformers' defaults; which layers slide (layer_types must agree)."""
        g3 = self.model_type == "gemma3_text"
        self.query_pre_attn_scalar = get("query_pre_attn_scalar", 256)
        # null is no soft-capping; an absent key is the family's default.
        self.attn_logit_softcapping = d.get("attn_logit_softcapping", None if g3 else 50.0)
        self.final_logit_softcapping = d.get("final_logit_softcapping", None if g3 else 30.0)
        self.sliding_window = d.get("sliding_window", 4096)
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ConfigError(f"sliding_window = {json.dumps(self.sliding_window)}: Gemma needs an integer >= 1")
        pattern = get("sliding_window_pattern", 6) if g3 else 2
        self.sliding = [(i + 1) % pattern != 0 for i in range(self.num_hidden_layers)]
        kinds = d.get("layer_types")
        if kinds is not None and kinds != ["sliding_attention" if s else "full_attention" for s in self.sliding]:
            raise ConfigError(f"layer_types = {json.dumps(kinds)}: not the pattern this reference computes")
        self.rope_local_base_freq = get("rope_local_base_freq", 10000.0) if g3 else None
        if get("attention_dropout", 0.0) != 0:
            raise ConfigError("attention_dropout: dropout is not implemented (0 only)")

    def check_longrope(self, d, get):
        """longrope is Phi-3's (its factor lists one number per frequency); Phi-3's other keys this reference does
        not compute are refused. The model's max_position_embeddings joins the scaling (its attention factor)."""
        r = self.rope_scaling
        if r is not None and r["rope_type"] == "longrope":
            if self.model_type != "phi3":
                raise ConfigError(f"rope_type \"longrope\" is Phi-3's, not {self.model_type}'s")
            for key in ("short_factor", "long_factor"):
                if len(r[key]) != self.head_dim // 2:
                    raise ConfigError(f"rope_scaling.{key} has {len(r[key])} values: longrope needs head_dim / 2 "
                                      f"= {self.head_dim // 2}")
            r["max_position_embeddings"] = self.max_position_embeddings
        if self.model_type != "phi3":
            return
        if get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"partial_rotary_factor = {d['partial_rotary_factor']}: only 1 (the whole head "
                              "rotates) is implemented")
        for key in ("resid_pdrop", "embd_pdrop", "attention_dropout"):
            if get(key, 0.0) != 0:
                raise ConfigError(f"{key} = {json.dumps(d[key])}: dropout is not implemented (0 only)")

    def read_moe(self, d, get):
        """The mixture-of-experts keys (transformers' names). Mixtral: every layer sparse, experts of width
        intermediate_size, weights always renormalised. Qwen2-MoE / Qwen3-MoE: layer i sparse iff i is not in
        mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step == 0 (else a dense MLP of width
        intermediate_size); experts of width moe_intermediate_size; renormalised iff norm_topk_prob."""
        mt = self.model_type
        self.moe = mt in MOE_TYPES
        self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size = 0, 0, 0
        self.shared_expert_intermediate_size, self.norm_topk_prob = 0, False
        self.decoder_sparse_step, self.mlp_only_layers = 1, []
        self.output_router_logits, self.router_aux_loss_coef = False, 0.0
        if not self.moe:
            return
        if get("router_jitter_noise", 0) != 0:
            raise ConfigError(f"router_jitter_noise = {json.dumps(d['router_jitter_noise'])}: router jitter "
                              "(random noise in training) is not implemented; expected 0")
        if mt == "mixtral":
            self.num_experts = _int(get("num_local_experts", 8), "num_local_experts", 1)
            self.moe_intermediate_size = self.intermediate_size
            self.norm_topk_prob = True  # Mixtral always renormalises the top-k weights
        else:
            self.num_experts = _int(get("num_experts", _DEFAULTS["num_experts"][mt]), "num_experts", 0)
            self.moe_intermediate_size = _int(get("moe_intermediate_size", _DEFAULTS["moe_intermediate_size"][mt]),
                                              "moe_intermediate_size", 1)
            self.norm_topk_prob = _bool(get("norm_topk_prob", False), "norm_topk_prob")
            self.decoder_sparse_step = _int(get("decoder_sparse_step", 1), "decoder_sparse_step", 1)
            layers = get("mlp_only_layers", [])
            if not isinstance(layers, list):
                raise ConfigError(f"mlp_only_layers = {json.dumps(layers)}: expected a list of layer indices")
            self.mlp_only_layers = [_int(i, "mlp_only_layers[]", 0) for i in layers]
            if mt == "qwen2_moe":
                self.shared_expert_intermediate_size = _int(get("shared_expert_intermediate_size", 5632),
                                                            "shared_expert_intermediate_size", 1)
        k = get("num_experts_per_tok", _DEFAULTS["num_experts_per_tok"][mt])
        if self.num_experts > 0:
            _int(k, "num_experts_per_tok", 1)
            if k > self.num_experts:
                raise ConfigError(f"num_experts_per_tok = {k} exceeds the {self.num_experts} experts")
        self.num_experts_per_tok = k
        self.output_router_logits = _bool(get("output_router_logits", False), "output_router_logits")
        coef = get("router_aux_loss_coef", 0.001)
        self.router_aux_loss_coef = _number(coef, "router_aux_loss_coef", positive=False)
        if coef < 0:
            raise ConfigError(f"router_aux_loss_coef = {json.dumps(coef)}: expected a number >= 0")

    def read_deepseek(self, d, get):
        """DeepSeek-V2 / V3's keys (transformers' DeepseekV2Config / DeepseekV3Config names and defaults): the
        multi-head latent attention's ranks and head dims, the routed and shared experts, the router (V3: sigmoid,
        the correction bias, noaux_tc; V2: softmax, greedy or group_limited_greedy). What is not computed here is
        refused naming its key."""
        v3 = self.model_type == "deepseek_v3"

        def need(key, default, check):
            v = get(key, default)
            if v is None:
                raise ConfigError(f"{key} is needed (absent or null)")
            return check(v, key)

        def integer(minimum):
            return lambda v, key: _int(v, key, minimum)

        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(f"num_key_value_heads = {self.num_key_value_heads}: DeepSeek's attention has one key "
                              f"and value per head (num_attention_heads = {self.num_attention_heads})")
        self.q_lora_rank = d.get("q_lora_rank", 1536)  # null: a plain q_proj (V2-Lite)
        if self.q_lora_rank is not None:
            _int(self.q_lora_rank, "q_lora_rank", 1)
        self.kv_lora_rank = need("kv_lora_rank", 512, integer(1))
        self.qk_nope_head_dim = need("qk_nope_head_dim", 128, integer(0))
        self.qk_rope_head_dim = need("qk_rope_head_dim", 64, integer(2))
        self.v_head_dim = need("v_head_dim", 128, integer(1))
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim = {self.qk_rope_head_dim}: RoPE needs an even dimension")
        if self.head_dim != self.qk_rope_head_dim:
            raise ConfigError(f"head_dim = {self.head_dim}: DeepSeek's is qk_rope_head_dim = {self.qk_rope_head_dim}")
        if v3 and not _bool(get("rope_interleave", True), "rope_interleave"):
            raise ConfigError("rope_interleave = false: only DeepSeek's interleaved RoPE pairs are implemented")
        # Multi-token prediction (V3's paper, 2.2): depth 1 only. V2's files have no such key; one given is refused.
        self.num_nextn_predict_layers = _int(get("num_nextn_predict_layers", 0), "num_nextn_predict_layers", 0)
        if self.num_nextn_predict_layers > (1 if v3 else 0):
            raise ConfigError(f"num_nextn_predict_layers = {json.dumps(d['num_nextn_predict_layers'])}: "
                              + ("multi-token prediction of depth 1 only (0 or 1)" if v3 else
                                 "multi-token prediction is DeepSeek-V3's (deepseek_v2: 0 only)"))
        # meshtrain's own key (not DeepSeek's): the MTP loss's weight; absent, train's --mtp-loss-weight.
        self.mtp_loss_weight = d.get("mtp_loss_weight")
        if self.mtp_loss_weight is not None:
            _number(self.mtp_loss_weight, "mtp_loss_weight", positive=False)
            if self.mtp_loss_weight < 0:
                raise ConfigError(f"mtp_loss_weight = {json.dumps(self.mtp_loss_weight)}: expected a number >= 0")
        if get("attention_dropout", 0.0) != 0:
            raise ConfigError("attention_dropout: dropout is not implemented (0 only)")
        if get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"moe_layer_freq = {json.dumps(d['moe_layer_freq'])}: only 1 is implemented")
        if _bool(get("output_router_logits", False), "output_router_logits"):
            raise ConfigError("output_router_logits = true: DeepSeek's auxiliary balance losses are not implemented")
        scoring, methods = ("sigmoid", ("noaux_tc",)) if v3 else ("softmax", ("greedy", "group_limited_greedy"))
        if get("scoring_func", scoring) != scoring:
            raise ConfigError(f"scoring_func = {json.dumps(d['scoring_func'])}: {self.model_type}'s is {scoring}")
        self.topk_method = get("topk_method", methods[0])
        if self.topk_method not in methods:
            raise ConfigError(f"topk_method = {json.dumps(self.topk_method)}: {self.model_type} computes "
                              f"{' or '.join(methods)}")
        self.moe_intermediate_size = need("moe_intermediate_size", 2048 if v3 else 1407, integer(1))
        self.n_routed_experts = get("n_routed_experts", 256 if v3 else None)  # V2's null: every layer dense
        self.n_shared_experts = get("n_shared_experts", 1 if v3 else None) or 0
        _int(self.n_shared_experts, "n_shared_experts", 0)
        self.first_k_dense_replace = need("first_k_dense_replace", 3 if v3 else 0, integer(0))
        self.norm_topk_prob = _bool(get("norm_topk_prob", v3), "norm_topk_prob")
        self.routed_scaling_factor = need("routed_scaling_factor", 2.5 if v3 else 1.0, _number)
        self.num_experts_per_tok, self.n_group, self.topk_group = 0, 1, 1
        if self.n_routed_experts is not None:
            E = _int(self.n_routed_experts, "n_routed_experts", 1)
            self.num_experts_per_tok = need("num_experts_per_tok", 8 if v3 else None, integer(1))
            if self.num_experts_per_tok > E:
                raise ConfigError(f"num_experts_per_tok = {self.num_experts_per_tok} exceeds the {E} experts")
            grouped = v3 or self.topk_method == "group_limited_greedy"
            self.n_group = need("n_group", 8 if v3 else None, integer(1)) if grouped else 1
            self.topk_group = need("topk_group", 4 if v3 else None, integer(1)) if grouped else 1
            if E % self.n_group:
                raise ConfigError(f"n_group = {self.n_group} does not divide n_routed_experts = {E}")
            if self.topk_group > self.n_group:
                raise ConfigError(f"topk_group = {self.topk_group} exceeds n_group = {self.n_group}")
            if v3 and E // self.n_group < 2:
                raise ConfigError(f"n_group = {self.n_group}: V3's group score sums each group's 2 best experts, "
                                  f"so a group needs at least 2 of the {E} experts")
        r = self.rope_scaling
        if r is not None and r["rope_type"] != "yarn":
            raise ConfigError(f"rope_type {json.dumps(r['rope_type'])}: DeepSeek's RoPE here is plain or yarn")
        if r is not None and r["rope_type"] == "yarn":
            ratio = self.max_position_embeddings / r["original_max_position_embeddings"]
            if ratio != r["factor"]:
                # transformers takes the factor as this ratio when original_max_position_embeddings is given,
                # older versions the factor itself: refuse a file on which they disagree.
                raise ConfigError(f"rope_scaling.factor = {r['factor']} but max_position_embeddings / "
                                  f"original_max_position_embeddings = {ratio}: transformers versions differ on "
                                  "which one YaRN uses")

    def deepseek_sparse(self, i):
        """Whether DeepSeek layer i's MLP is the mixture of experts (moe_layer_freq 1)."""
        return self.deepseek and self.n_routed_experts is not None and i >= self.first_k_dense_replace

    def sparse_layer(self, i):
        """Whether layer i's MLP is the mixture of experts."""
        return (self.moe and self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def has_moe(self):
        return any(self.sparse_layer(i) for i in range(self.num_hidden_layers))

    def check_seq_len(self, seq_len):
        """Sliding-window attention is not implemented outside Gemma: refuse a window that would mask something."""
        if self.gemma:
            return
        if self.sliding_window is not None and self.sliding_window < seq_len:
            raise ConfigError(f"sliding_window = {self.sliding_window} is below the sequence length {seq_len}: "
                              "sliding-window attention is not implemented (a window at least the sequence length "
                              "is plain causal attention)")

    @staticmethod
    def load(model_dir):
        path = os.path.join(model_dir, "config.json")
        with open(path) as f:
            try:
                return LlamaConfig(json.load(f))
            except ConfigError as e:
                raise ConfigError(f"{path}: {e}") from None


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # Normalise in at least f32 (as HF does) so half-precision inputs do not lose the mean of squares;
        # in an f64 run this stays f64 for the finite-difference checks.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim, theta, scaling=None, seq_len=0):
    """The hd/2 RoPE frequencies theta^(-2i/hd), scaled as `scaling` says (None: plain), in f64. seq_len: the
    forward's sequence length (longrope's choice of factors)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is not None and scaling["rope_type"] == "longrope":
        longer = seq_len > scaling["original_max_position_embeddings"]
        ext = torch.tensor(scaling["long_factor" if longer else "short_factor"], dtype=torch.float64)
        return inv_freq / ext
    if scaling is not None and scaling["rope_type"] == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    return inv_freq if scaling is None else scale_inv_freq(inv_freq, scaling)


def yarn_mscale(scale, m=1.0):
    """YaRN's magnitude correction 0.1 m ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_inv_freq(d, base, scaling):
    """YaRN's d/2 frequencies in f64: with f = factor, L = original_max_position_embeddings, the frequency index
    j ramps from the original's (extrapolation, j <= low) to the original's / f (interpolation, j >= high), where
    low and high are the indices (floored / ceiled, clamped to [0, d-1]) at which beta_fast and beta_slow
    rotations fit in L positions: corr(n) = d ln(L / (2 pi n)) / (2 ln base)."""
    f, L = scaling["factor"], scaling["original_max_position_embeddings"]

    def corr(n):
        return d * math.log(L / (n * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(scaling["beta_fast"])), 0)
    high = min(math.ceil(corr(scaling["beta_slow"])), d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freq = base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    return (1 / (f * pos_freq)) * (1 - extrapolation) + (1 / pos_freq) * extrapolation


def rope_attention_factor(scaling):
    """longrope's and yarn's multiplier of cos and sin (1 for any other RoPE)."""
    if scaling is not None and scaling["rope_type"] == "yarn":
        m, m_all = scaling["mscale"], scaling["mscale_all_dim"]
        if m and m_all:
            return yarn_mscale(scaling["factor"], m) / yarn_mscale(scaling["factor"], m_all)
        return yarn_mscale(scaling["factor"])
    if scaling is None or scaling["rope_type"] != "longrope":
        return 1.0
    if "attention_factor" in scaling:
        return scaling["attention_factor"]
    original = scaling["original_max_position_embeddings"]
    f = scaling.get("factor", scaling["max_position_embeddings"] / original)
    return 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(original))


def scale_inv_freq(inv_freq, scaling):
    """inv_freq (f64) under rope_type linear (all frequencies / factor: positions / factor) or llama3 (Meta's
    Llama 3.1 definition: long wavelengths / factor, short ones unchanged, a smooth blend between)."""
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] != "llama3":
        raise ConfigError(f"rope_type {json.dumps(scaling['rope_type'])} is not implemented")
    old, low, high = (scaling[k] for k in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"))
    wavelen = 2 * math.pi / inv_freq
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old / low, inv_freq / factor, blended)
    return torch.where(wavelen < old / high, inv_freq, out)


def rope_cos_sin(seq_len, head_dim, theta, dtype=None, scaling=None):
    """cos, sin of shape (seq_len, head_dim) in HF's layout: the hd/2 frequencies, then the same again.
    Computed in f64 (frequencies, angles, cos and sin) and rounded once to `dtype` (default: torch's)."""
    dtype = dtype or torch.get_default_dtype()
    inv_freq = rope_inv_freq(head_dim, theta, scaling, seq_len)
    angle = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angle = torch.cat([angle, angle], dim=-1)
    m = rope_attention_factor(scaling)
    return (m * angle.cos()).to(dtype), (m * angle.sin()).to(dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    """x: (..., T, hd). HF pairs element i with element i + hd/2 (not adjacent elements)."""
    return x * cos + rotate_half(x) * sin


def gqa_attention(q, k, v):
    """Causal grouped-query attention without materialising repeated kv heads.

    q: (B, H, T, hd); k, v: (B, KV, T, hd). kv head j serves q heads j*G .. (j+1)*G-1 with G = H/KV,
    which is what viewing H as (KV, G) gives.
    """
    B, H, T, hd = q.shape
    KV = k.shape[1]
    qg = q.view(B, KV, H // KV, T, hd)
    scores = qg @ k.unsqueeze(2).transpose(-1, -2) / math.sqrt(hd)  # (B, KV, G, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)  # True above the diagonal = future
    scores = scores.masked_fill(causal, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.unsqueeze(2)  # (B, KV, G, T, hd)
    return out.view(B, H, T, hd)


class LlamaAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        # Biases (Qwen2's q, k, v; Llama's attention_bias on all four) are added after the projections.
        self.widths = [n * self.head_dim for n in (self.n_heads, self.n_kv_heads, self.n_kv_heads)]
        if c.fused:  # Phi-3: one projection whose output is q, k, v in that order
            self.qkv_proj = nn.Linear(c.hidden_size, sum(self.widths), bias=False)
        else:
            self.q_proj = nn.Linear(c.hidden_size, self.widths[0], bias=c.qkv_bias)
            self.k_proj = nn.Linear(c.hidden_size, self.widths[1], bias=c.qkv_bias)
            self.v_proj = nn.Linear(c.hidden_size, self.widths[2], bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=c.o_bias)
        # Qwen3: RMSNorm (gain of head_dim values, shared by the heads) on each head of q and of k, before RoPE.
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def forward(self, x, cos, sin):
        B, T, _ = x.shape

        def heads(t, n, norm=None):  # (B, T, n*hd) -> (B, n, T, hd), normalised per head over hd when norm
            t = t.view(B, T, n, self.head_dim)
            return (t if norm is None else norm(t)).transpose(1, 2)

        if hasattr(self, "qkv_proj"):
            xq, xk, xv = self.qkv_proj(x).split(self.widths, dim=-1)
        else:
            xq, xk, xv = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = apply_rope(heads(xq, self.n_heads, self.q_norm), cos, sin)
        k = apply_rope(heads(xk, self.n_kv_heads, self.k_norm), cos, sin)
        v = heads(xv, self.n_kv_heads)
        o = gqa_attention(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        if c.fused:  # Phi-3: one projection whose output is the gate, then the up projection
            self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        else:
            self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
            self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SwiGLU(nn.Module):
    """down(silu(gate x) * up x) with the projections under the given names: an expert (Mixtral's w1, w3, w2;
    the Qwen MoE experts' and shared expert's gate_proj, up_proj, down_proj)."""

    def __init__(self, dim, ffn, gate="gate_proj", up="up_proj", down="down_proj"):
        super().__init__()
        self.names = (gate, up, down)
        for name, shape in ((gate, (dim, ffn)), (down, (ffn, dim)), (up, (dim, ffn))):  # Mixtral's order w1 w2 w3
            setattr(self, name, nn.Linear(*shape, bias=False))

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


def route(logits, k, renormalise):
    """The router's decisions from its logits (N, E): (weights (N, k), experts (N, k)). softmax in at least f32
    (transformers: dtype=float32; an f64 run stays f64), top-k, divided by their sum when `renormalise`, then
    rounded to the logits' (the hidden states') dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    weights, experts = torch.topk(probs, k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


class SparseMoeBlock(nn.Module):
    """Mixtral's block_sparse_moe, Qwen2-MoE's and Qwen3-MoE's mlp: a linear router (gate) over E experts, each
    token through its top k, their outputs summed with the routing weights; Qwen2-MoE adds a shared expert scaled
    by sigmoid(shared_expert_gate(x))."""

    def __init__(self, c):
        super().__init__()
        self.k, self.renormalise = c.num_experts_per_tok, c.norm_topk_prob
        names = ("w1", "w3", "w2") if c.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(c.hidden_size, c.moe_intermediate_size, *names)
                                     for _ in range(c.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if c.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(c.hidden_size, c.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, x, router_logits=None):
        """x: (B, T, C). Appends the router logits (B*T, E) to `router_logits` when it is a list."""
        B, T, C = x.shape
        x = x.reshape(B * T, C)
        logits = self.gate(x)
        weights, experts = route(logits, self.k, self.renormalise)
        # transformers' loop: each expert on the tokens that chose it (in any of the k slots), scaled by that
        # slot's weight and added into those tokens' rows. An expert no token chose still runs (on no rows), so
        # its gradients are zeros, not None, and the optimizer steps it as transformers' training would.
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            slot, tok = torch.where(experts.t() == e)
            out.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if router_logits is not None:
            router_logits.append(logits)
        return out.view(B, T, C)


def load_balancing_loss(router_logits, num_experts, k):
    """transformers' load_balancing_loss_func without an attention mask: the router logits of every MoE layer
    pooled into R rows; E * sum_e (fraction of the R*k slots routed to e, per slot) * (mean probability of e)."""
    logits = torch.cat(router_logits, dim=0)
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    _, selected = torch.topk(probs, k, dim=-1)
    mask = F.one_hot(selected, num_experts).to(probs.dtype)  # (R, k, E)
    tokens_per_expert = mask.mean(dim=0)  # (k, E)
    router_prob_per_expert = probs.mean(dim=0)  # (E,)
    return num_experts * (tokens_per_expert * router_prob_per_expert[None]).sum()


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c, index=0):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = LlamaAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.sparse = c.sparse_layer(index)
        if not self.sparse:
            self.mlp = LlamaMLP(c)
        elif c.model_type == "mixtral":
            self.block_sparse_moe = SparseMoeBlock(c)
        else:
            self.mlp = SparseMoeBlock(c)

    def forward(self, h, cos, sin, router_logits=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        if not self.sparse:
            return h + self.mlp(self.post_attention_layernorm(h))
        moe = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return h + moe(self.post_attention_layernorm(h), router_logits)


class LlamaModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """state_dict() names are exactly HF's: model.embed_tokens.weight, model.layers.{i}...., lm_head.weight."""

    def __init__(self, c):
        super().__init__()
        self.config = c
        self.model = LlamaModel(c)
        # Tied: no separate lm_head parameter at all, so it is neither saved nor counted twice by the optimizer.
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, tokens, router_logits=None):
        """tokens: (B, T) int64 -> logits (B, T, V). With a list `router_logits`, each MoE layer appends its
        router logits (B*T, E) to it, in layer order."""
        c = self.config
        T = tokens.shape[1]
        c.check_seq_len(T)
        w = self.model.embed_tokens.weight
        cos, sin = rope_cos_sin(T, c.head_dim, c.rope_theta, w.dtype, c.rope_scaling)
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            h = layer(h, cos, sin, router_logits)
        h = self.model.norm(h)
        return F.linear(h, w) if self.lm_head is None else self.lm_head(h)

    def loss_terms(self, tokens, targets, reduction="mean"):
        """(cross-entropy, balance loss of this forward's router logits or None for a model without MoE layers)."""
        router_logits = [] if self.config.has_moe else None
        logits = self(tokens, router_logits)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)
        aux = None
        if router_logits:
            aux = load_balancing_loss(router_logits, self.config.num_experts, self.config.num_experts_per_tok)
        return ce, aux

    def total_loss(self, ce, aux, n_tokens=1):
        """The loss transformers minimises: ce, plus router_aux_loss_coef * aux when output_router_logits. For a
        summed ce pass its token count, so that the total divided by it is the mean ce + coef * aux."""
        if aux is None or not self.config.output_router_logits:
            return ce
        return ce + self.config.router_aux_loss_coef * aux * n_tokens

    def loss(self, tokens, targets, reduction="mean"):
        ce, aux = self.loss_terms(tokens, targets, reduction)
        return self.total_loss(ce, aux, targets.numel() if reduction == "sum" else 1)


# ----------------------------------------------------------------- Gemma 2 and 3


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), in at least f32, then the input's dtype."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.to(xf.dtype))
        return y.to(x.dtype)


def soft_cap(x, cap):
    return x if cap is None else cap * torch.tanh(x / cap)


def gemma_attention(q, k, v, scale, softcap, window):
    """q (B, H, T, hd), k, v (B, KV, T, hd): causal grouped-query attention with the scores q.k * scale soft-capped,
    and with a window a query at p seeing keys at p - window < s <= p only."""
    B, H, T, hd = q.shape
    KV = k.shape[1]
    qg = q.view(B, KV, H // KV, T, hd)
    scores = soft_cap(qg @ k.unsqueeze(2).transpose(-1, -2) * scale, softcap)  # (B, KV, G, T, T)
    p = torch.arange(T, device=q.device)
    hidden = p[None, :] > p[:, None]  # (T, T) a key after its query
    if window is not None:
        hidden = hidden | (p[:, None] - p[None, :] >= window)
    out = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v.unsqueeze(2)
    return out.view(B, H, T, hd)


class GemmaAttention(nn.Module):
    def __init__(self, c, index):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.sliding = c.sliding[index]
        self.scale = c.query_pre_attn_scalar ** -0.5
        self.softcap, self.window = c.attn_logit_softcapping, c.sliding_window if self.sliding else None

    def forward(self, x, rope):
        B, T, _ = x.shape
        cos, sin = rope[self.sliding]

        def heads(t, n, norm=None):
            t = t.view(B, T, n, self.head_dim)
            return (t if norm is None else norm(t)).transpose(1, 2)

        q = apply_rope(heads(self.q_proj(x), self.n_heads, self.q_norm), cos, sin)
        k = apply_rope(heads(self.k_proj(x), self.n_kv_heads, self.k_norm), cos, sin)
        o = gemma_attention(q, k, heads(self.v_proj(x), self.n_kv_heads), self.scale, self.softcap, self.window)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class GemmaMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, c, index):
        super().__init__()
        norm = lambda: GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = GemmaAttention(c, index)
        self.mlp = GemmaMLP(c)

    def forward(self, x, rope):
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)


class GemmaForCausalLM(nn.Module):
    """Gemma 2 / Gemma 3 text: Hugging Face's parameter names."""

    def __init__(self, c):
        super().__init__()
        self.config = c
        self.model = GemmaModel(c)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, tokens, router_logits=None):
        c = self.config
        T = tokens.shape[1]
        w = self.model.embed_tokens.weight
        glob = rope_cos_sin(T, c.head_dim, c.rope_theta, w.dtype, c.rope_scaling)
        local = glob if c.rope_local_base_freq is None else rope_cos_sin(T, c.head_dim, c.rope_local_base_freq,
                                                                         w.dtype)
        rope = {False: glob, True: local}
        h = self.model.embed_tokens(tokens) * torch.tensor(c.hidden_size ** 0.5, dtype=w.dtype)
        for layer in self.model.layers:
            h = layer(h, rope)
        h = self.model.norm(h)
        logits = F.linear(h, w) if self.lm_head is None else self.lm_head(h)
        return soft_cap(logits, c.final_logit_softcapping)

    loss_terms = None  # set below: LlamaForCausalLM's (cross-entropy; no router)


# ------------------------------------------------------------ DeepSeek-V2 and V3


def deinterleave(x):
    """(..., d) -> (..., d) as [x0, x2, x4, ..., x1, x3, ...]: DeepSeek's RoPE pairs (2j, 2j+1) become HF's
    (j, j + d/2), so that apply_rope rotates them. q and k are permuted alike, so q.k is that of the pairs."""
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(x.shape)


class DeepseekAttention(nn.Module):
    """Multi-head latent attention. q from a low-rank path (q_a_proj, q_a_layernorm, q_b_proj) or q_proj; keys
    and values from the compressed c = kv_a_proj_with_mqa(x)[:kv_lora] through kv_a_layernorm and kv_b_proj, plus
    one RoPE key k_pe = kv_a_proj_with_mqa(x)[kv_lora:] shared by every head. Each head's q and k are (nope,
    rope) of dn + dr values; RoPE (interleaved pairs) on the dr part only; scores scaled by dqk^-1/2 m^2."""

    def __init__(self, c):
        super().__init__()
        self.H, self.dn, self.dr, self.dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora = c.kv_lora_rank
        dqk, C = self.dn + self.dr, c.hidden_size
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(C, self.H * dqk, bias=False)
        else:
            self.q_a_proj = nn.Linear(C, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, self.H * dqk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(C, self.kv_lora + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.H * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.H * self.dv, C, bias=False)
        self.scale = dqk ** -0.5 * deepseek_softmax_mscale(c.rope_scaling) ** 2

    def forward(self, x, cos, sin):
        """x (B, T, C); cos, sin (T, dr) in apply_rope's layout -> (B, T, C)."""
        B, T, _ = x.shape
        H, dn, dr, dv = self.H, self.dn, self.dr, self.dv
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, dn + dr).transpose(1, 2)  # (B, H, T, dqk)
        q_nope, q_pe = q.split([dn, dr], dim=-1)
        ckv = self.kv_a_proj_with_mqa(x)  # (B, T, kv_lora + dr)
        c_kv, k_pe = ckv.split([self.kv_lora, dr], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, H, dn + dv).transpose(1, 2)  # (B, H, T, dn+dv)
        k_nope, v = kv.split([dn, dv], dim=-1)
        q_pe = apply_rope(deinterleave(q_pe), cos, sin)  # (B, H, T, dr)
        k_pe = apply_rope(deinterleave(k_pe.view(B, 1, T, dr)), cos, sin)  # (B, 1, T, dr): one for every head
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(B, H, T, dr)], dim=-1)  # (B, H, T, dqk)
        scores = q @ k.transpose(-1, -2) * self.scale  # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        o = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v  # (B, H, T, dv)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * dv))


def deepseek_softmax_mscale(scaling):
    """m of the attention scale dqk^-1/2 m^2: yarn_mscale(factor, mscale_all_dim) under YaRN with a non-zero
    mscale_all_dim, else 1."""
    if scaling is None or scaling["rope_type"] != "yarn" or not scaling["mscale_all_dim"]:
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])


def deepseek_route(logits, c, bias=None):
    """DeepSeek's router from its logits (N, E) in at least f32: (weights (N, k), experts (N, k)).
    V3 (noaux_tc): s = sigmoid(logits); sel = s + bias; a group's score is the sum of its 2 largest sel; the
    topk_group best groups kept, sel of the others' experts set to 0; top-k by sel; weights s there.
    V2: s = softmax(logits); greedy: top-k by s; group_limited_greedy: a group's score is its max s, the
    topk_group best kept, the others' s set to 0, then top-k; weights s there.
    Both: renormalised (sum + 1e-20) when norm_topk_prob (V2: and k > 1), then times routed_scaling_factor."""
    N, E = logits.shape
    k, G = c.num_experts_per_tok, c.n_group
    if c.model_type == "deepseek_v3":
        s = torch.sigmoid(logits)
        sel = s + bias[None, :]
        group_score = sel.view(N, G, E // G).topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
    else:
        s = torch.softmax(logits, dim=-1)
        sel = s
        group_score = sel.view(N, G, E // G).max(dim=-1).values
    if c.model_type == "deepseek_v3" or c.topk_method == "group_limited_greedy":
        kept = torch.zeros(N, G, dtype=torch.bool)
        kept.scatter_(1, group_score.topk(c.topk_group, dim=-1).indices, True)
        sel = sel.masked_fill(~kept.repeat_interleave(E // G, dim=1), 0.0)
    experts = sel.topk(k, dim=-1).indices
    weights = s.gather(1, experts)
    if c.norm_topk_prob and (c.model_type == "deepseek_v3" or k > 1):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * c.routed_scaling_factor, experts


class DeepseekGate(nn.Module):
    """mlp.gate: the router's weight (E, C) and, for V3, e_score_correction_bias (E), a buffer (saved, not trained:
    transformers updates it outside the optimizer, which a training step here never does)."""

    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size))
        if c.model_type == "deepseek_v3":
            self.register_buffer("e_score_correction_bias", torch.zeros(c.n_routed_experts))
        else:
            self.e_score_correction_bias = None


class DeepseekMoE(nn.Module):
    """out = sum_k w_k expert_{e_k}(x) + shared_experts(x); experts of width moe_intermediate_size, the shared
    expert of moe_intermediate_size * n_shared_experts (none when 0), all SwiGLU."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.gate = DeepseekGate(c)
        self.experts = nn.ModuleList(SwiGLU(c.hidden_size, c.moe_intermediate_size)
                                     for _ in range(c.n_routed_experts))
        self.shared_experts = (SwiGLU(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)
                               if c.n_shared_experts else None)

    def forward(self, x):
        B, T, C = x.shape
        x = x.reshape(B * T, C)
        rt = torch.promote_types(x.dtype, torch.float32)  # the router in f32 (f64 in an f64 run)
        bias = self.gate.e_score_correction_bias
        weights, experts = deepseek_route(F.linear(x.to(rt), self.gate.weight.to(rt)), self.c,
                                          None if bias is None else bias.to(rt))
        weights = weights.to(x.dtype)
        # Each expert on the tokens that chose it; one no token chose runs on no rows (zero gradients).
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(experts == e)
            out.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(B, T, C)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, c, index):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DeepseekAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DeepseekMoE(c) if c.deepseek_sparse(index) else LlamaMLP(c)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekSharedHead(nn.Module):
    """The MTP module's shared_head: its own norm; its head is the main lm_head (the file's shared_head.head.weight
    is a copy, not a parameter here)."""

    def __init__(self, c):
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """DeepSeek-V3's multi-token prediction module (depth 1), model.layers.{L} for L = num_hidden_layers: a whole
    decoder layer of index L (dense or sparse by first_k_dense_replace, its own router) plus enorm, hnorm, eh_proj
    (C, 2C) and shared_head.norm. Its embedding and output head are the main model's
    (DeepseekForCausalLM.mtp_logits)."""

    def __init__(self, c, index):
        super().__init__(c, index)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.shared_head = DeepseekSharedHead(c)


def mtp_copy_names(c):
    """The names of the copies DeepSeek's files hold of the tensors the MTP module shares with the main model:
    {copy: main} (embed_tokens; shared_head.head = lm_head, or the embedding when tied)."""
    p = f"model.layers.{c.num_hidden_layers}."
    head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    return {p + "embed_tokens.weight": "model.embed_tokens.weight", p + "shared_head.head.weight": head}


class DeepseekModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        L = c.num_hidden_layers  # the MTP module, when there is one, is layers[L]
        self.layers = nn.ModuleList([DeepseekDecoderLayer(c, i) for i in range(L)]
                                    + [DeepseekMTPLayer(c, L + d) for d in range(c.num_nextn_predict_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """DeepSeek-V2 / V3 with Hugging Face's parameter names; no balance loss (loss_terms' aux is None). With
    num_nextn_predict_layers 1, the MTP module (training only: forward and generate use the main head alone)."""

    def __init__(self, c):
        super().__init__()
        self.config = c
        self.model = DeepseekModel(c)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def hidden(self, tokens):
        """tokens (B, T) -> (the final normed hidden states h (B, T, C), the input of lm_head; cos, sin (T, dr))."""
        c = self.config
        T = tokens.shape[1]
        w = self.model.embed_tokens.weight
        cos, sin = rope_cos_sin(T, c.qk_rope_head_dim, c.rope_theta, w.dtype, c.rope_scaling)  # (T, dr)
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers[:c.num_hidden_layers]:  # not the MTP module
            h = layer(h, cos, sin)
        return self.model.norm(h), cos, sin

    def head(self, h):
        """lm_head (the embedding when tied): (B, T, C) -> (B, T, V); the MTP module's output head too."""
        return F.linear(h, self.model.embed_tokens.weight) if self.lm_head is None else self.lm_head(h)

    def forward(self, tokens, router_logits=None):
        return self.head(self.hidden(tokens)[0])

    def mtp_logits(self, h, next_tokens, cos, sin):
        """The MTP module's logits (B, T, V): h (B, T, C) the main model's final normed hidden states, next_tokens
        (B, T) the token after each position (u = the main targets). x = eh_proj([enorm(embed(u)), hnorm(h)]) (the
        embedding first), z = layer L over the whole sequence (causal, positions 0..T-1), lm_head(shared_head.norm
        z) with the main model's embedding and lm_head (one parameter each: their gradients sum both uses)."""
        m = self.model.layers[self.config.num_hidden_layers]
        x = m.eh_proj(torch.cat([m.enorm(self.model.embed_tokens(next_tokens)), m.hnorm(h)], dim=-1))  # (B, T, C)
        return self.head(m.shared_head.norm(m(x, cos, sin)))

    def mtp_terms(self, tokens, targets):
        """One forward of the main model and the MTP module: (the main cross-entropy summed over the B*T targets,
        the MTP cross-entropy summed over its B*(T-1) targets: position i < T-1 predicts targets[:, i+1], the
        token two ahead; position T-1 has none)."""
        h, cos, sin = self.hidden(tokens)
        logits = self.head(h)  # (B, T, V)
        V = logits.shape[-1]
        ce = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="sum")
        mtp = self.mtp_logits(h, targets, cos, sin)[:, :-1]  # (B, T-1, V)
        return ce, F.cross_entropy(mtp.reshape(-1, V), targets[:, 1:].reshape(-1), reduction="sum")


DeepseekForCausalLM.loss_terms = LlamaForCausalLM.loss_terms
DeepseekForCausalLM.total_loss = LlamaForCausalLM.total_loss
DeepseekForCausalLM.loss = LlamaForCausalLM.loss


ROUTER_INIT_STD = 0.5
E_SCORE_BIAS_INIT_STD = 0.1  # DeepSeek-V3's e_score_correction_bias: random so that it shows in the routing


def is_router(name):
    return name.endswith(("block_sparse_moe.gate.weight", ".mlp.gate.weight"))


GemmaForCausalLM.loss_terms = LlamaForCausalLM.loss_terms
GemmaForCausalLM.total_loss = LlamaForCausalLM.total_loss
GemmaForCausalLM.loss = LlamaForCausalLM.loss


def build_model(c):
    if c.deepseek:
        return DeepseekForCausalLM(c)
    return GemmaForCausalLM(c) if c.gemma else LlamaForCausalLM(c)


def init_weights(model, seed):
    """normal(0, 0.02) for every matrix and bias (non-zero, so that biases show in every check), ones for norm
    weights (q_norm and k_norm included); drawn in state_dict order from one generator so a seed always gives the
    same weights. The MoE routers (block_sparse_moe.gate, mlp.gate; not shared_expert_gate) are drawn with std
    ROUTER_INIT_STD = 0.5 instead, so that their logits spread widely and the top-k choices are far from ties
    (an f32 and an f64 run, or meshtrain and this reference, then route every token alike). DeepSeek-V3's
    e_score_correction_bias buffers are drawn after the parameters, std E_SCORE_BIAS_INIT_STD. DeepSeek-V3's MTP
    module (model.layers.{L}.*) is drawn last, parameters then buffer, so that the main model's weights of a seed
    are the same with and without it."""
    g = torch.Generator().manual_seed(seed)
    c = getattr(model, "config", None)
    mtp = f"model.layers.{c.num_hidden_layers}." if getattr(c, "num_nextn_predict_layers", 0) else None
    with torch.no_grad():
        for in_mtp in (False, True):  # the main model, then the MTP module
            for name, p in model.named_parameters():
                if bool(mtp and name.startswith(mtp)) != in_mtp:
                    continue
                if p.dim() == 1 and not name.endswith(".bias"):
                    if isinstance(model, GemmaForCausalLM):  # (1 + w): small random w, so that a wrong offset shows
                        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.1)
                    else:
                        p.fill_(1.0)
                else:
                    std = ROUTER_INIT_STD if is_router(name) else 0.02
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
            for name, b in model.named_buffers():  # DeepSeek-V3's e_score_correction_bias, after the parameters
                if name.endswith("e_score_correction_bias") and bool(mtp and name.startswith(mtp)) == in_mtp:
                    b.copy_(torch.randn(b.shape, generator=g, dtype=torch.float32) * E_SCORE_BIAS_INIT_STD)


def model_tensors(model):
    """The tensors `init` writes: the state dict, plus for DeepSeek-V3's MTP module the copies DeepSeek's files
    hold of the embedding and output head it shares (model.layers.{L}.embed_tokens.weight,
    model.layers.{L}.shared_head.head.weight), equal to the main ones."""
    sd = dict(model.state_dict())
    if getattr(model.config, "num_nextn_predict_layers", 0):
        for copy, main in mtp_copy_names(model.config).items():
            sd[copy] = sd[main]
    return sd


def load_model(model_dir, dtype=None, config=None):
    """Builds the model from DIR/config.json (or `config`) and loads DIR/model.safetensors or its sharded files
    (strict: names and shapes)."""
    c = config or LlamaConfig.load(model_dir)
    model = build_model(c)
    weights = read_model_weights(model_dir)
    if c.num_nextn_predict_layers:  # the MTP module's copies of the shared tensors: optional, equal if present
        for copy, main in mtp_copy_names(c).items():
            if copy in weights and main in weights and not np.array_equal(weights.pop(copy), weights[main]):
                sys.exit(f"llama_ref: {model_dir}: {copy} differs from {main}, which the MTP module shares "
                         "(the file's copy must equal it)")
    expected = dict(model.state_dict())
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        sys.exit(f"llama_ref: {model_dir}: missing tensors {missing}, unexpected tensors {extra}")
    for name, t in expected.items():
        if tuple(weights[name].shape) != tuple(t.shape):
            sys.exit(f"llama_ref: {name} has shape {weights[name].shape}, the model expects {tuple(t.shape)}")
    model.load_state_dict({n: torch.from_numpy(a) for n, a in weights.items()})
    return model.to(dtype or torch.get_default_dtype())

# ====================================================================== data


def shard_files(pattern):
    """The files matching `pattern` in sorted name order, the order their tokens (and masks) are concatenated in;
    exits naming the pattern when there is none."""
    files = sorted(glob.glob(pattern))
    if not files:
        sys.exit(f"llama_ref: no file matches {pattern}")
    return files


def read_tokens(pattern):
    """llm.c shards (256 x int32 header: magic 20240520, version 1, token count; then uint16 tokens),
    concatenated in sorted file-name order."""
    parts = []
    for path in shard_files(pattern):
        with open(path, "rb") as f:
            raw = f.read()
        if len(raw) < 1024:
            sys.exit(f"llama_ref: {path}: shorter than the 1024-byte header")
        header = np.frombuffer(raw[:1024], dtype="<i4")
        if header[0] != 20240520 or header[1] != 1:
            sys.exit(f"llama_ref: {path}: bad magic {header[0]} or version {header[1]}")
        if len(raw) != 1024 + 2 * int(header[2]):
            sys.exit(f"llama_ref: {path}: header says {header[2]} tokens, file holds {(len(raw) - 1024) / 2}")
        parts.append(np.frombuffer(raw[1024:], dtype="<u2").astype(np.int64))
    return torch.from_numpy(np.concatenate(parts))


def get_batch(tokens, step, B, T):
    """meshtrain's convention: consecutive B*T+1 windows, wrapping around by step % steps_per_epoch."""
    steps_per_epoch = (len(tokens) - 1) // (B * T)
    if steps_per_epoch < 1:
        sys.exit(f"llama_ref: {len(tokens)} tokens are fewer than one batch of {B}x{T}+1")
    b = step % steps_per_epoch
    buf = tokens[b * B * T: b * B * T + B * T + 1]
    return buf[:-1].view(B, T), buf[1:].view(B, T)


def write_shard(path, tokens):
    """Writes an llm.c shard (used by the tests; meshtrain's own shards come from scripts/prepare_data)."""
    tokens = np.asarray(tokens, dtype="<u2")
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, 1, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())

MASK_MAGIC = 20241127
MASK_VERSION = 1


def mask_path(shard):
    """The loss mask beside a token shard: X.bin -> X.mask (a name without .bin gets .mask appended)."""
    return (shard[:-4] if shard.endswith(".bin") else shard) + ".mask"


def read_masks(pattern, seq_len=None):
    """The loss masks of the shards matching `pattern`, concatenated in the shards' order as one float tensor
    parallel to read_tokens(pattern): value i is 1 when token i of the stream is a trained target. A shard's
    mask is X.mask beside X.bin: 256 little-endian int32 (magic 20241127, version 1, token count, packing length
    T_pack (0: not packed), the rest 0), then `count` uint8 values, each 0 or 1. A shard without one trains every
    token (ones). The count must equal the shard's; with seq_len, a T_pack > 0 must divide it."""
    parts = []
    for shard in shard_files(pattern):
        with open(shard, "rb") as f:
            count = int(np.frombuffer(f.read(1024), dtype="<i4")[2])
        path = mask_path(shard)
        if not os.path.exists(path):
            parts.append(np.ones(count, dtype=np.float64))
            continue
        with open(path, "rb") as f:
            raw = f.read()
        if len(raw) < 1024:
            sys.exit(f"llama_ref: {path}: shorter than the 1024-byte header")
        header = np.frombuffer(raw[:1024], dtype="<i4")
        if header[0] != MASK_MAGIC or header[1] != MASK_VERSION:
            sys.exit(f"llama_ref: {path}: bad magic {header[0]} or version {header[1]} "
                     f"(expected {MASK_MAGIC}, {MASK_VERSION})")
        if header[2] != count or len(raw) != 1024 + count:
            sys.exit(f"llama_ref: {path}: header says {header[2]} values, file holds {len(raw) - 1024}, "
                     f"the shard {shard} {count} tokens")
        t_pack = int(header[3])
        if t_pack < 0 or (seq_len and t_pack and seq_len % t_pack):
            sys.exit(f"llama_ref: {path}: packing length {t_pack} does not divide the sequence length {seq_len}")
        m = np.frombuffer(raw[1024:], dtype=np.uint8)
        if m.max(initial=0) > 1:
            sys.exit(f"llama_ref: {path}: value {int(m.max())} at offset {1024 + int(np.argmax(m > 1))} "
                     "(expected 0 or 1)")
        parts.append(m.astype(np.float64))
    return torch.from_numpy(np.concatenate(parts))


def get_weights(masks, step, B, T):
    """The (B, T) 0/1 weights of get_batch(tokens, step, B, T)'s targets: the mask at each target's position in
    the stream (offset + 1 onwards)."""
    steps_per_epoch = (len(masks) - 1) // (B * T)
    b = step % steps_per_epoch
    return masks[b * B * T + 1: b * B * T + B * T + 1].view(B, T)


def write_mask(path, mask, t_pack=0):
    """Writes a loss mask (used by the tests): the header, then one uint8 (0 or 1) per token."""
    mask = np.asarray(mask, dtype=np.uint8)
    header = np.zeros(256, dtype="<i4")
    header[:4] = [MASK_MAGIC, MASK_VERSION, len(mask), t_pack]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(mask.tobytes())

# ================================================================== training


def lr_at(step, lr, schedule, warmup, total, lr_min):
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    p = (step - warmup) / max(1, total - warmup)
    return lr_min + 0.5 * (lr - lr_min) * (1 + math.cos(math.pi * p))


def make_optimizer(model, lr, weight_decay, betas, eps):
    # Decay the matrices (embeddings, linears, lm_head) only; norm gains and biases (1-D) stay undecayed.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)


def grad_norm(params):
    # Same formula as clip_grad_norm_: the 2-norm of the per-tensor 2-norms.
    return torch.norm(torch.stack([p.grad.detach().norm(2) for p in params if p.grad is not None]), 2).item()


def masked_ce_sum(model, x, y, w):
    """The sum over the targets y of cross-entropy times their weights w (0 or 1): the loss of the counted
    targets only. A model whose loss has the balance loss in it is refused (what a mask does to it is not
    defined)."""
    if model.config.has_moe and model.config.output_router_logits:
        raise ConfigError("loss masks with output_router_logits true: the balance loss under a mask is not defined")
    # (A model with an MTP module: the main cross-entropy only, validation's loss; train refuses masks with MTP.)
    ce, _ = model.loss_terms(x, y, reduction="none")
    return (ce * w.reshape(-1).to(ce.dtype)).sum()


def train_step(model, opt, x, y, micro_batch, lr, grad_clip, stats=None, weights=None):
    """One optimizer step over the batch (x, y); returns (batch mean loss before the update, grad norm).
    With output_router_logits the loss is each micro-batch's mean ce + router_aux_loss_coef * its balance loss,
    averaged over the micro-batches (weighted by their token counts); a dict `stats` receives "aux", the balance
    loss averaged the same way (None for a model without MoE layers).
    weights (B, T) of 0 and 1 (a loss mask): the loss is the sum of the counted targets' cross-entropy over the
    number counted in the whole batch (every micro-batch's), so the gradients do not depend on the micro-batch
    size; stats then also receives "trained_tokens". A batch with none counted is an error.
    DeepSeek-V3 with an MTP module: the loss is L_main + mtp_loss_weight * L_mtp, each the micro-batches' summed
    cross-entropy over the whole batch's B*T main targets (L_mtp's B*(T-1) targets too: the paper's 1/T); stats
    receives "mtp", L_mtp alone."""
    B, T = x.shape
    opt.zero_grad(set_to_none=True)
    loss_sum, aux_sum, mtp_sum = 0.0, None, None
    mtp = getattr(model.config, "num_nextn_predict_layers", 0)
    if mtp and weights is not None:
        raise ConfigError("loss masks with num_nextn_predict_layers 1: the MTP loss under a mask is not defined")
    if mtp and model.config.mtp_loss_weight is None:
        raise ConfigError("num_nextn_predict_layers 1 needs the MTP loss weight (config.json's mtp_loss_weight or "
                          "--mtp-loss-weight)")
    if weights is not None:
        n = int(weights.sum().item())
        if n == 0:
            sys.exit("llama_ref: a batch with no trained target (every target masked)")
        for r in range(0, B, micro_batch):
            loss = masked_ce_sum(model, x[r:r + micro_batch], y[r:r + micro_batch], weights[r:r + micro_batch]) / n
            loss.backward()
            loss_sum += loss.item()
        if stats is not None:
            stats["aux"] = None
            stats["mtp"] = None
            stats["trained_tokens"] = n
        return finish_step(model, opt, loss_sum, lr, grad_clip)
    for r in range(0, B, micro_batch):
        # Each micro-batch's summed token loss over the whole batch's token count, so the accumulated
        # gradients are exactly those of the full-batch mean.
        xb, yb = x[r:r + micro_batch], y[r:r + micro_batch]
        if mtp:
            ce, mtp_ce = model.mtp_terms(xb, yb)
            loss = (ce + model.config.mtp_loss_weight * mtp_ce) / (B * T)
            mtp_sum = (mtp_sum or 0.0) + mtp_ce.item() / (B * T)
            aux = None
        else:
            ce, aux = model.loss_terms(xb, yb, reduction="sum")
            loss = model.total_loss(ce, aux, yb.numel()) / (B * T)
        loss.backward()
        loss_sum += loss.item()
        if aux is not None:
            aux_sum = (aux_sum or 0.0) + aux.item() * yb.numel() / (B * T)
    if stats is not None:
        stats["aux"] = aux_sum
        stats["mtp"] = mtp_sum
    return finish_step(model, opt, loss_sum, lr, grad_clip)


def finish_step(model, opt, loss_sum, lr, grad_clip):
    """The global gradient norm, clipping and the AdamW update after the backward passes; (loss_sum, norm)."""
    params = [p for p in model.parameters()]
    norm = grad_norm(params)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    for g in opt.param_groups:
        g["lr"] = lr
    opt.step()
    return loss_sum, norm

def evaluate(model, tokens, masks, B, T, steps):
    """Validation loss as meshtrain computes it: batches 0..steps-1 of the stream (get_batch's convention), the
    cross-entropy summed over the counted targets of all of them over the number counted (masks None: every
    target, so the mean over steps * B * T)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(steps):
            x, y = get_batch(tokens, i, B, T)
            w = torch.ones(B, T) if masks is None else get_weights(masks, i, B, T)
            total += masked_ce_sum(model, x, y, w).item()
            count += int(w.sum().item())
    if count == 0:
        sys.exit("llama_ref: the validation batches have no trained target (every target masked)")
    return total / count

# ================================================================== commands


def parse_rope_scaling(text, head_dim=0):
    """--rope-scaling: none | linear:FACTOR | llama3:FACTOR,LOW,HIGH,ORIG | longrope:ORIG -> None or the scaling
    dict. longrope's factor lists are made up, head_dim / 2 each: short 1 + 0.1 i, long 1 + 0.75 i."""
    kind, _, args = text.partition(":")
    try:
        if kind == "none" and not args:
            return None
        values = [float(v) for v in args.split(",")]
        if kind == "linear" and len(values) == 1:
            return {"rope_type": "linear", "factor": values[0]}
        if kind == "llama3" and len(values) == 4 and values[3] == int(values[3]):
            return {"rope_type": "llama3", "factor": values[0], "low_freq_factor": values[1],
                    "high_freq_factor": values[2], "original_max_position_embeddings": int(values[3])}
        if kind == "yarn" and len(values) == 6 and values[1] == int(values[1]):
            return {"type": "yarn", "rope_type": "yarn", "factor": values[0],
                    "original_max_position_embeddings": int(values[1]), "beta_fast": values[2],
                    "beta_slow": values[3], "mscale": values[4], "mscale_all_dim": values[5]}
        if kind == "longrope" and len(values) == 1 and values[0] == int(values[0]):
            half = range(head_dim // 2)
            return {"rope_type": "longrope", "short_factor": [1 + 0.1 * i for i in half],
                    "long_factor": [1 + 0.75 * i for i in half], "original_max_position_embeddings": int(values[0])}
    except ValueError:
        pass
    raise ConfigError(f"--rope-scaling {text}: expected none, linear:FACTOR, llama3:FACTOR,LOW,HIGH,ORIG, "
                      "longrope:ORIG or yarn:FACTOR,ORIG,BETA_FAST,BETA_SLOW,MSCALE,MSCALE_ALL_DIM")


def init_config(a):
    """config.json for `init`: the keys and architectures transformers writes for the family. Plain Llama with the
    default options gives exactly the file earlier versions of this script wrote."""
    mt, hd = a.model_type, a.head_dim
    moe_opts = {"--n-experts": a.n_experts, "--experts-per-token": a.experts_per_token,
                "--moe-ffn-dim": a.moe_ffn_dim, "--norm-topk-prob": a.norm_topk_prob or None}
    balance_opts = {"--router-aux-loss-coef": a.router_aux_loss_coef,
                    "--output-router-logits": a.output_router_logits or None}
    qwen_moe_opts = {"--decoder-sparse-step": a.decoder_sparse_step, "--mlp-only-layers": a.mlp_only_layers}
    deepseek_opts = {"--q-lora-rank": a.q_lora_rank, "--kv-lora-rank": a.kv_lora_rank,
                     "--qk-nope-head-dim": a.qk_nope_head_dim, "--qk-rope-head-dim": a.qk_rope_head_dim,
                     "--v-head-dim": a.v_head_dim, "--n-shared-experts": a.n_shared_experts, "--n-group": a.n_group,
                     "--topk-group": a.topk_group, "--routed-scaling-factor": a.routed_scaling_factor,
                     "--first-k-dense-replace": a.first_k_dense_replace}
    owned = [(moe_opts, MOE_TYPES + DEEPSEEK_TYPES), (balance_opts, MOE_TYPES),
             (qwen_moe_opts, ("qwen2_moe", "qwen3_moe")), ({"--shared-expert-ffn-dim": a.shared_expert_ffn_dim},
                                                          ("qwen2_moe",)),
             (deepseek_opts, DEEPSEEK_TYPES), ({"--topk-method": a.topk_method}, ("deepseek_v2",)),
             ({"--num-nextn-predict-layers": a.num_nextn_predict_layers, "--mtp-loss-weight": a.mtp_loss_weight},
              ("deepseek_v3",))]
    for opts, owners in owned:
        for opt, v in opts.items():
            if v is not None and mt not in owners:
                raise ConfigError(f"{opt} is for model types {', '.join(owners)}, not {mt}")
    if a.norm_topk_prob and mt == "mixtral":
        raise ConfigError("--norm-topk-prob: Mixtral always renormalises the top-k weights")
    if a.attention_bias and mt != "llama":
        raise ConfigError(f"--attention-bias is Llama's (model_type {mt}: "
                          + ("biases on q, k and v always)" if mt == "qwen2" else "no biases)"))
    if a.sliding_window is not None and mt not in ("mistral", "phi3") + GEMMA_TYPES:
        raise ConfigError(f"--sliding-window is Mistral's, Phi-3's and Gemma's, not {mt}'s")
    if mt in DEEPSEEK_TYPES:
        return deepseek_init_config(a)
    if a.n_heads % a.n_kv_heads or (hd or a.dim // a.n_heads) % 2 or (not hd and a.dim % a.n_heads):
        sys.exit("llama_ref: dim must divide into n_heads heads of even size (or --head-dim be even), n_heads into "
                 "n_kv_heads groups")
    scaling = parse_rope_scaling(a.rope_scaling, hd or a.dim // a.n_heads)
    if scaling is not None and scaling["rope_type"] == "longrope" and mt != "phi3":
        raise ConfigError(f"--rope-scaling longrope is Phi-3's, not {mt}'s")
    if scaling is not None and scaling["rope_type"] == "yarn":
        raise ConfigError(f"--rope-scaling yarn is DeepSeek's, not {mt}'s")
    dtype = "bfloat16" if a.dtype == "bf16" else "float32"
    cfg = {"architectures": [MODEL_TYPES[mt]], "model_type": mt,
           "hidden_act": "gelu_pytorch_tanh" if mt in GEMMA_TYPES else "silu",
           "hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
           "num_key_value_heads": a.n_kv_heads, "intermediate_size": a.ffn_dim, "vocab_size": a.vocab_size,
           "rms_norm_eps": a.norm_eps}
    if hd or mt in ("mistral",) + QK_NORM_TYPES + GEMMA_TYPES:  # MistralConfig and Qwen3's always write head_dim; the others
        cfg["head_dim"] = hd or a.dim // a.n_heads  # only when it is given
    if mt in QK_NORM_TYPES:
        cfg["attention_bias"] = False
    if a.rope_spelling == "v5":  # transformers 5: one rope_parameters object, rope_theta inside
        cfg["rope_parameters"] = dict({"rope_type": "default"} if scaling is None else scaling, rope_theta=a.rope_theta)
    elif scaling is not None and mt == "phi3":  # Phi-3's own files: three keys, the context at the top level
        cfg["rope_theta"] = a.rope_theta
        cfg["rope_scaling"] = {"type": "longrope", "short_factor": scaling["short_factor"],
                               "long_factor": scaling["long_factor"]}
        cfg["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    else:  # transformers 4: top-level rope_theta, rope_scaling only with scaling
        cfg["rope_theta"] = a.rope_theta
        if scaling is not None:
            cfg["rope_scaling"] = scaling
    cfg["max_position_embeddings"] = a.max_seq_len
    if mt == "llama" and a.attention_bias:
        cfg["attention_bias"] = True
    if mt == "mistral":
        cfg["sliding_window"] = a.sliding_window  # None: no window (an absent key means 4096)
    if mt == "phi3":  # Phi3Config's keys; pad_token_id is kept by meshtrain's checkpoints, used by neither
        cfg.update({"sliding_window": a.sliding_window, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                    "attention_dropout": 0.0, "pad_token_id": a.vocab_size - 1})
    if mt in GEMMA_TYPES:  # Gemma2Config's / Gemma3TextConfig's keys
        cfg.update({"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "attention_dropout": 0.0,
                    "query_pre_attn_scalar": a.query_pre_attn_scalar,
                    "sliding_window": 4096 if a.sliding_window is None else a.sliding_window,
                    "attn_logit_softcapping": a.attn_softcap, "final_logit_softcapping": a.final_softcap})
        if mt == "gemma3_text":
            cfg.update({"sliding_window_pattern": a.sliding_window_pattern,
                        "rope_local_base_freq": a.rope_local_theta})
        pattern = 2 if mt == "gemma2" else a.sliding_window_pattern
        cfg["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                              for i in range(a.n_layers)]
    if mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        cfg.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": a.n_layers})
    if mt in MOE_TYPES:
        experts = 4 if a.n_experts is None else a.n_experts
        moe_ffn = a.moe_ffn_dim or a.ffn_dim
        if mt == "mixtral":
            cfg.update({"intermediate_size": moe_ffn, "num_local_experts": experts, "router_jitter_noise": 0.0,
                        "sliding_window": None})
        else:
            try:
                only = [int(i) for i in a.mlp_only_layers.split(",") if i.strip()] if a.mlp_only_layers else []
            except ValueError:
                raise ConfigError(f"--mlp-only-layers {a.mlp_only_layers}: expected layer indices like 0,3") from None
            cfg.update({"num_experts": experts, "moe_intermediate_size": moe_ffn,
                        "norm_topk_prob": a.norm_topk_prob, "decoder_sparse_step": a.decoder_sparse_step or 1,
                        "mlp_only_layers": only})
            if mt == "qwen2_moe":
                cfg["shared_expert_intermediate_size"] = a.shared_expert_ffn_dim or a.ffn_dim
        cfg["num_experts_per_tok"] = 2 if a.experts_per_token is None else a.experts_per_token
        coef = a.router_aux_loss_coef
        cfg["router_aux_loss_coef"] = (0.02 if mt == "mixtral" else 0.001) if coef is None else coef
        cfg["output_router_logits"] = a.output_router_logits
    cfg["tie_word_embeddings"] = a.tie_embeddings
    cfg["dtype" if a.rope_spelling == "v5" else "torch_dtype"] = dtype
    return cfg


def deepseek_init_config(a):
    """config.json of a DeepSeek-V2 / V3 model, with DeepseekV2Config's / DeepseekV3Config's key names. Every head
    has its own key and value (num_key_value_heads = num_attention_heads; --n-kv-heads is not used); --ffn-dim is
    the dense layers' intermediate_size, --moe-ffn-dim (default --ffn-dim) the experts' width."""
    mt, v3 = a.model_type, a.model_type == "deepseek_v3"
    if a.head_dim:
        raise ConfigError("--head-dim: DeepSeek's head_dim is --qk-rope-head-dim")
    if a.rope_spelling != "v4":
        raise ConfigError("--rope-spelling v5: DeepSeek's files here use rope_theta + rope_scaling")
    if a.sliding_window is not None or a.attention_bias:
        raise ConfigError(f"--sliding-window and --attention-bias are not {mt}'s")
    if a.topk_method is not None and v3:
        raise ConfigError("--topk-method: deepseek_v3's is noaux_tc")
    scaling = parse_rope_scaling(a.rope_scaling)
    if scaling is not None and scaling["rope_type"] != "yarn":
        raise ConfigError(f"--rope-scaling {a.rope_scaling}: DeepSeek's RoPE here is plain (none) or yarn")

    def pick(v, default):
        return default if v is None else v

    dr = pick(a.qk_rope_head_dim, 4)
    cfg = {"architectures": [MODEL_TYPES[mt]], "model_type": mt, "hidden_act": "silu", "hidden_size": a.dim,
           "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_heads,
           "intermediate_size": a.ffn_dim, "moe_intermediate_size": a.moe_ffn_dim or a.ffn_dim,
           "n_routed_experts": pick(a.n_experts, 4), "n_shared_experts": pick(a.n_shared_experts, 1),
           "num_experts_per_tok": pick(a.experts_per_token, 2), "n_group": pick(a.n_group, 1),
           "topk_group": pick(a.topk_group, 1), "routed_scaling_factor": pick(a.routed_scaling_factor, 1.0),
           "norm_topk_prob": a.norm_topk_prob, "first_k_dense_replace": pick(a.first_k_dense_replace, 1),
           "moe_layer_freq": 1, "kv_lora_rank": pick(a.kv_lora_rank, 16), "q_lora_rank": a.q_lora_rank or None,
           "qk_nope_head_dim": pick(a.qk_nope_head_dim, 8), "qk_rope_head_dim": dr,
           "v_head_dim": pick(a.v_head_dim, 8), "rope_theta": a.rope_theta, "rope_scaling": scaling,
           "max_position_embeddings": a.max_seq_len, "rms_norm_eps": a.norm_eps, "vocab_size": a.vocab_size,
           "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": a.tie_embeddings}
    if v3:
        cfg.update({"head_dim": dr, "rope_interleave": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                    "num_nextn_predict_layers": pick(a.num_nextn_predict_layers, 0)})
        if a.mtp_loss_weight is not None:  # meshtrain's key: the weight train's loss gives the MTP loss
            if not cfg["num_nextn_predict_layers"]:
                raise ConfigError("--mtp-loss-weight: the model has no MTP module (--num-nextn-predict-layers 1)")
            cfg["mtp_loss_weight"] = a.mtp_loss_weight
    else:
        cfg.update({"scoring_func": "softmax", "topk_method": a.topk_method or "greedy"})
    cfg["torch_dtype"] = "bfloat16" if a.dtype == "bf16" else "float32"
    return cfg


def cmd_init(a):
    cfg = init_config(a)
    model = build_model(LlamaConfig(cfg))
    init_weights(model, a.seed)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    write_safetensors(os.path.join(a.out, "model.safetensors"), model_tensors(model),
                      dtype="BF16" if a.dtype == "bf16" else "F32", metadata={"format": "pt"})
    print(json.dumps({"out": a.out, "params": sum(p.numel() for p in model.parameters())}))


def cmd_train(a):
    torch.set_num_threads(a.threads)
    torch.set_default_dtype(torch.float64 if a.dtype == "f64" else torch.float32)
    model = load_model(a.model)
    model.config.check_seq_len(a.seq_len)
    mtp = set_mtp_weight(model.config, a)
    if mtp and a.masks:
        raise ConfigError("--masks with num_nextn_predict_layers 1: the MTP loss under a mask is not defined")
    tokens = read_tokens(a.data)
    M = a.micro_batch_size or a.batch_size
    if a.batch_size % M:
        sys.exit(f"llama_ref: --micro-batch-size {M} must divide --batch-size {a.batch_size}")
    masks = read_masks(a.data, a.seq_len) if a.masks else None
    val_tokens = val_masks = None
    if a.val_data and a.eval_interval > 0:
        val_tokens = read_tokens(a.val_data)
        val_masks = read_masks(a.val_data, a.seq_len) if a.masks else None
    opt = make_optimizer(model, a.lr, a.weight_decay, (a.beta1, a.beta2), a.eps)
    losses, norms, lrs, auxes, trained, vals, mtps = [], [], [], [], [], [], []
    moe = model.config.has_moe
    for s in range(a.steps):
        x, y = get_batch(tokens, s, a.batch_size, a.seq_len)
        w = None if masks is None else get_weights(masks, s, a.batch_size, a.seq_len)
        lr = lr_at(s, a.lr, a.schedule, a.warmup_steps, a.steps, a.lr_min)
        stats = {}
        loss, norm = train_step(model, opt, x, y, M, lr, a.grad_clip, stats, w)
        losses.append(loss)
        norms.append(norm)
        lrs.append(lr)
        auxes.append(stats["aux"])
        mtps.append(stats.get("mtp"))
        trained.append(stats.get("trained_tokens", a.batch_size * a.seq_len))
        print(f"step {s} loss {loss:.6f} grad_norm {norm:.6f} lr {lr:.4e}"
              + (f" aux {stats['aux']:.6f}" if moe else "")
              + (f" mtp_loss {stats['mtp']:.6f}" if mtp else "")
              + (f" trained_tokens {trained[-1]}" if masks is not None else ""), flush=True)
        # meshtrain's evaluation: after step s + 1 when it is a multiple of the interval, and after the last.
        if val_tokens is not None and ((s + 1) % a.eval_interval == 0 or s + 1 == a.steps):
            v = evaluate(model, val_tokens, val_masks, a.batch_size, a.seq_len, a.eval_steps)
            vals.append({"step": s + 1, "val_loss": v})
            print(f"eval step {s + 1} val_loss {v:.6f}", flush=True)
    out = {"losses": losses, "grad_norms": norms, "lrs": lrs}
    if moe:  # the balance loss of each step (in the loss only with output_router_logits)
        out["aux_losses"] = auxes
    if mtp:  # L_mtp of each step ("losses" are L_main + mtp_loss_weight * L_mtp)
        out["mtp_losses"] = mtps
    if masks is not None:  # the targets counted in each step's batch
        out["trained_tokens"] = trained
    if val_tokens is not None:
        out["val_losses"] = vals
    with open(a.out, "w") as f:
        json.dump(out, f)


MTP_LOSS_WEIGHT = 0.3  # DeepSeek-V3's MTP loss weight in the paper's first phase: train's and loss's default


def set_mtp_weight(c, a):
    """The MTP loss weight: config.json's mtp_loss_weight (meshtrain's key) when present, else --mtp-loss-weight.
    Returns whether the model has an MTP module."""
    if a.mtp_loss_weight < 0 or not math.isfinite(a.mtp_loss_weight):
        raise ConfigError(f"--mtp-loss-weight {a.mtp_loss_weight}: expected a number >= 0")
    if c.num_nextn_predict_layers and c.mtp_loss_weight is None:
        c.mtp_loss_weight = a.mtp_loss_weight
    return c.num_nextn_predict_layers > 0


def cmd_loss(a):
    torch.set_num_threads(a.threads)
    model = load_model(a.model)
    model.config.check_seq_len(a.seq_len)
    mtp = set_mtp_weight(model.config, a)
    x, y = get_batch(read_tokens(a.data), a.step, a.batch_size, a.seq_len)
    with torch.no_grad():
        if mtp:  # the training objective L_main + w * L_mtp and L_mtp, each over the batch's B*T main targets
            ce, mtp_ce = model.mtp_terms(x, y)
            n = y.numel()
            print(json.dumps({"loss": (ce + model.config.mtp_loss_weight * mtp_ce).item() / n,
                              "mtp_loss": mtp_ce.item() / n}))
            return
        ce, aux = model.loss_terms(x, y)
        out = {"loss": model.total_loss(ce, aux).item()}
        if aux is not None:
            out["aux"] = aux.item()
        print(json.dumps(out))


def cmd_generate(a):
    """Greedy decoding as `meshtrain generate --temperature 0` does it: prompt bytes as tokens, the context the
    last max_seq_len tokens at positions 0.., the next token the first maximum of the last row's logits. In f64;
    margins[i] is the gap between the best and second-best logit at step i (a near tie may go either way in
    f32)."""
    torch.set_num_threads(a.threads)
    meta = os.path.join(a.model, "meta.json")
    config = None
    if not os.path.exists(os.path.join(a.model, "config.json")) and os.path.exists(meta):
        m = json.load(open(meta))["model"]  # a meshtrain checkpoint
        config = LlamaConfig({"hidden_size": m["dim"], "num_hidden_layers": m["n_layers"],
                              "num_attention_heads": m["n_heads"], "num_key_value_heads": m["n_kv_heads"],
                              "intermediate_size": m["ffn_dim"], "vocab_size": m["vocab_size"],
                              "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
                              "max_position_embeddings": a.max_seq_len,
                              "tie_word_embeddings": "lm_head.weight" not in read_model_weights(a.model)})
    model = load_model(a.model, torch.float64, config)
    c = model.config
    ctx_max = a.max_seq_len or c.max_position_embeddings
    toks = [b % c.vocab_size for b in a.prompt.encode()] or [ord("\n") % c.vocab_size]
    out, margins = [], []
    with torch.no_grad():
        for _ in range(a.tokens):
            row = model(torch.tensor([toks[-ctx_max:]]))[0, -1]
            top = torch.topk(row, 2)
            nxt = int(torch.argmax(row))  # the first maximum, as std::max_element
            out.append(nxt)
            margins.append(float(top.values[0] - top.values[1]))
            toks.append(nxt)
    print(json.dumps({"tokens": out, "margins": margins}))


def blas_name():
    """A short name for the BLAS torch calls. Debian's torch reports BLAS_INFO=generic and calls the system
    libblas.so.3, which the alternatives system points at OpenBLAS or the (slow) reference BLAS."""
    m = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    info = m.group(1) if m else "unknown"
    if info == "generic":
        lib = os.path.realpath("/usr/lib/x86_64-linux-gnu/libblas.so.3")
        if os.path.exists(lib):
            flavour = os.path.basename(os.path.dirname(lib))  # e.g. openblas-pthread, blas (reference)
            return f"generic -> {flavour}"
    return info


def cmd_bench(a):
    torch.set_num_threads(a.threads)
    if a.model:  # any family, from its directory (an MoE model runs transformers' per-expert loop)
        model = load_model(a.model)
        a.vocab_size = model.config.vocab_size
        if model.config.num_nextn_predict_layers and model.config.mtp_loss_weight is None:
            model.config.mtp_loss_weight = MTP_LOSS_WEIGHT  # times the MTP module's work too
    else:
        cfg = {"hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
               "num_key_value_heads": a.n_kv_heads, "intermediate_size": a.ffn_dim, "vocab_size": a.vocab_size,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
        model = LlamaForCausalLM(LlamaConfig(cfg))
        init_weights(model, 0)
    opt = make_optimizer(model, 3e-4, 0.1, (0.9, 0.95), 1e-8)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, a.vocab_size, (a.batch_size, a.seq_len), generator=g)
    y = torch.randint(0, a.vocab_size, (a.batch_size, a.seq_len), generator=g)
    times = []
    for s in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        train_step(model, opt, x, y, a.batch_size, 3e-4, 1.0)  # same work as a real step: clip included
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
    step = sorted(times)[len(times) // 2]  # median: robust to a noisy neighbour on shared VMs
    print(json.dumps({"tokens_per_s": round(a.batch_size * a.seq_len / step, 1), "step_ms": round(1e3 * step, 2),
                      "threads": a.threads, "torch": torch.__version__, "blas": blas_name()}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def sizes(p, dim, layers, heads, kv, ffn):
        p.add_argument("--dim", type=int, default=dim)
        p.add_argument("--n-layers", type=int, default=layers)
        p.add_argument("--n-heads", type=int, default=heads)
        p.add_argument("--n-kv-heads", type=int, default=kv)
        p.add_argument("--ffn-dim", type=int, default=ffn)
        p.add_argument("--vocab-size", type=int, default=256)

    p = sub.add_parser("init", help="write DIR/config.json and DIR/model.safetensors with random weights")
    sizes(p, 64, 2, 4, 2, 160)
    p.add_argument("--out", required=True)
    p.add_argument("--norm-eps", type=float, default=1e-5)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--model-type", choices=list(MODEL_TYPES), default="llama")
    p.add_argument("--head-dim", type=int, default=0, help="default: dim / n_heads (and head_dim not written)")
    p.add_argument("--rope-scaling", default="none",
                   help="none | linear:FACTOR | llama3:FACTOR,LOW,HIGH,ORIG | longrope:ORIG (phi3) | "
                        "yarn:FACTOR,ORIG,BETA_FAST,BETA_SLOW,MSCALE,MSCALE_ALL_DIM (deepseek)")
    p.add_argument("--rope-spelling", choices=["v4", "v5"], default="v4",
                   help="config.json's RoPE keys: v4 rope_theta + rope_scaling, v5 rope_parameters")
    p.add_argument("--attention-bias", action="store_true", help="llama: biases on q, k, v and o_proj")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="mistral, phi3: sliding_window (default null); gemma: (default 4096)")
    p.add_argument("--query-pre-attn-scalar", type=float, default=256.0, help="gemma: query_pre_attn_scalar")
    p.add_argument("--attn-softcap", type=float, default=None, help="gemma: attn_logit_softcapping (default null)")
    p.add_argument("--final-softcap", type=float, default=None, help="gemma: final_logit_softcapping (default null)")
    p.add_argument("--sliding-window-pattern", type=int, default=6, help="gemma3_text: sliding_window_pattern")
    p.add_argument("--rope-local-theta", type=float, default=10000.0, help="gemma3_text: rope_local_base_freq")
    p.add_argument("--n-experts", type=int, default=None, help="MoE: num_local_experts / num_experts (default 4)")
    p.add_argument("--experts-per-token", type=int, default=None, help="MoE: num_experts_per_tok (default 2)")
    p.add_argument("--moe-ffn-dim", type=int, default=None,
                   help="MoE expert width (default --ffn-dim): mixtral's intermediate_size, the qwen MoEs' "
                        "moe_intermediate_size (their --ffn-dim is the dense layers' intermediate_size)")
    p.add_argument("--shared-expert-ffn-dim", type=int, default=None,
                   help="qwen2_moe: shared_expert_intermediate_size (default --ffn-dim)")
    p.add_argument("--norm-topk-prob", action="store_true", help="qwen MoEs: renormalise the top-k weights")
    p.add_argument("--decoder-sparse-step", type=int, default=None, help="qwen MoEs (default 1)")
    p.add_argument("--mlp-only-layers", default=None, help="qwen MoEs: dense layers, e.g. 0,3")
    p.add_argument("--router-aux-loss-coef", type=float, default=None,
                   help="MoE (default 0.02 mixtral, 0.001 qwen)")
    p.add_argument("--output-router-logits", action="store_true",
                   help="MoE: train on ce + router_aux_loss_coef * balance loss")
    p.add_argument("--q-lora-rank", type=int, default=None, help="deepseek: q_lora_rank (0 or absent: null, q_proj)")
    p.add_argument("--kv-lora-rank", type=int, default=None, help="deepseek: kv_lora_rank (default 16)")
    p.add_argument("--qk-nope-head-dim", type=int, default=None, help="deepseek: qk_nope_head_dim (default 8)")
    p.add_argument("--qk-rope-head-dim", type=int, default=None, help="deepseek: qk_rope_head_dim (default 4)")
    p.add_argument("--v-head-dim", type=int, default=None, help="deepseek: v_head_dim (default 8)")
    p.add_argument("--n-shared-experts", type=int, default=None, help="deepseek: n_shared_experts (default 1)")
    p.add_argument("--n-group", type=int, default=None, help="deepseek: n_group (default 1)")
    p.add_argument("--topk-group", type=int, default=None, help="deepseek: topk_group (default 1)")
    p.add_argument("--routed-scaling-factor", type=float, default=None,
                   help="deepseek: routed_scaling_factor (default 1)")
    p.add_argument("--first-k-dense-replace", type=int, default=None,
                   help="deepseek: the first K layers dense (default 1)")
    p.add_argument("--topk-method", choices=["greedy", "group_limited_greedy"], default=None,
                   help="deepseek_v2: topk_method (default greedy; V3's is noaux_tc)")
    p.add_argument("--num-nextn-predict-layers", type=int, default=None,
                   help="deepseek_v3: num_nextn_predict_layers, the MTP module (0 or 1; default 0)")
    p.add_argument("--mtp-loss-weight", type=float, default=None,
                   help="deepseek_v3 with MTP: written as config.json's mtp_loss_weight (meshtrain's key)")

    p = sub.add_parser("train", help="train from DIR's weights; write per-step losses, grad norms, lrs as JSON")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, default=0, help="default: the batch size")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--schedule", choices=["constant", "cosine"], default="cosine")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--lr-min", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 = off")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["f32", "f64"], default="f32")
    p.add_argument("--masks", action="store_true",
                   help="loss masks: X.mask beside each shard X.bin of --data and --val-data (none: all ones)")
    p.add_argument("--val-data", default="", help="validation shards (with --eval-interval)")
    p.add_argument("--eval-interval", type=int, default=0, help="validation loss every N steps and after the last")
    p.add_argument("--eval-steps", type=int, default=1, help="validation batches (0..K-1 of the stream)")
    p.add_argument("--mtp-loss-weight", type=float, default=MTP_LOSS_WEIGHT,
                   help="DeepSeek-V3 MTP: the MTP loss's weight when config.json has no mtp_loss_weight")
    p.add_argument("--out", required=True)

    p = sub.add_parser("loss", help="print the mean loss of step S's batch")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mtp-loss-weight", type=float, default=MTP_LOSS_WEIGHT,
                   help="DeepSeek-V3 MTP: the MTP loss's weight when config.json has no mtp_loss_weight")

    p = sub.add_parser("generate", help="greedy continuation of a prompt, as JSON tokens and logit margins")
    p.add_argument("--model", required=True, help="a Hugging Face directory or a meshtrain step_XXXXXXXX checkpoint")
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--max-seq-len", type=int, default=0, help="context kept (0: the model's max_position_embeddings)")
    p.add_argument("--norm-eps", type=float, default=1e-5, help="for a meshtrain checkpoint")
    p.add_argument("--rope-theta", type=float, default=10000.0, help="for a meshtrain checkpoint")
    p.add_argument("--threads", type=int, default=2)

    p = sub.add_parser("bench", help="time full training steps on random tokens")
    sizes(p, 256, 4, 8, 4, 768)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--model", default="", help="a Hugging Face directory (any family) instead of the sizes")

    a = ap.parse_args()
    try:
        {"init": cmd_init, "train": cmd_train, "loss": cmd_loss, "generate": cmd_generate, "bench": cmd_bench}[a.cmd](a)
    except ConfigError as e:  # a model or option the reference does not compute: the reason, not a traceback
        sys.exit(f"llama_ref: {e}")


if __name__ == "__main__":
    main()
