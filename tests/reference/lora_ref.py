#!/usr/bin/python3
"""An independent PyTorch LoRA reference for meshtrain's `lora:` fine-tuning (issue 52).

Written for the tests from the published definitions (LoRA: Hu et al. 2021; rsLoRA: Kalajdzievski 2023; PEFT's
file layout) and from the facts scripts/reference/llama_ref.py's docstring states about meshtrain (token shards and
batch order, loss normalisation, AdamW, LR schedule, clipping, RoPE, GQA, RMSNorm, safetensors). It does NOT import
llama_ref.py nor share its code: its own Llama forward (repeated kv heads, explicit causal mask, RoPE by pair
rotation, log-softmax cross-entropy), its own LoRA layer, its own AdamW and clipping, its own file readers. So the
check "meshtrain == this" is not "meshtrain == the project's reference with the same code paths".

Model: the `llama` family only (config.json model_type llama or absent, hidden_act silu, attention_bias and
mlp_bias false, no RoPE scaling; tie_word_embeddings honoured), in f32 or f64.

LoRA on a target Linear (W: out x in, frozen):  y = x W^T + scale * (x A^T) B^T,  A: r x in, B: out x r,
  scale = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora. Dropout must be 0 (a random mask cannot be
  matched): refused otherwise. Targets: q_proj k_proj v_proj o_proj (self_attn) gate_proj up_proj down_proj (mlp),
  in every layer. The base (embeddings, norms, every Linear, lm_head) is frozen: requires_grad False, never updated.
PEFT adapter directory: adapter_config.json + adapter_model.safetensors with F32 tensors
  base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight and
  base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight.
Training (meshtrain's semantics): batch of step s = the (s mod steps_per_epoch)-th window of B*T+1 consecutive
  tokens of the shards concatenated in sorted name order (steps_per_epoch = (N-1) // (B*T)); the loss is the sum
  of the targets' cross-entropy over the count of targets in the whole batch (with --masks: only the targets whose
  X.mask byte is 1, over their count in the whole batch), accumulated over micro-batches of rows; the logged loss is
  that value before the update. grad_norm = sqrt(sum of squares of every adapter gradient) before clipping;
  clipping: if grad_clip > 0 and grad_clip / (norm + 1e-6) < 1, every gradient times that factor. AdamW (torch's):
  p -= lr*wd*p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps),
  weight decay on parameters of dim >= 2 (lora_A and lora_B both are). lr: linear warmup lr*(s+1)/warmup for
  s < warmup, then constant or cosine lr_min + (lr-lr_min)/2 (1 + cos(pi (s-warmup)/max(1, steps-warmup))).

  lora_ref.py make-adapter --model BASE --rank R --alpha A [--targets q_proj,...] [--rslora] [--dropout 0]
                           --seed S [--b-std 0.02] --out DIR
      A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming_uniform_(a=sqrt(5))), B ~ N(0, b_std) (0: PEFT's zeros),
      drawn from one torch.Generator(seed) layer by layer, targets in the canonical order, A then B.
  lora_ref.py train --model BASE --adapter DIR --data GLOB --steps N --batch-size B --seq-len T
                    [--micro-batch-size M --lr 3e-4 --schedule constant|cosine --warmup-steps 0 --lr-min 0
                    --weight-decay 0.1 --beta1 0.9 --beta2 0.95 --eps 1e-8 --grad-clip 1.0 --threads 2]
                    [--dtype f32|f64] [--masks] --out losses.json [--adapter-out DIR]
      JSON {"losses", "grad_norms", "lrs"} (+ "trained_tokens" with --masks); the final adapter in PEFT format.
  lora_ref.py merge --model BASE --adapter DIR --out DIR2
      config.json (and tokenizer files) copied; model.safetensors: every base tensor, targets W + scale B A
      (computed in f64, stored F32).
  lora_ref.py loss --model BASE [--adapter DIR] --data GLOB --batch-size B --seq-len T [--step 0] [--dtype f32]
      JSON {"loss"}: step S's batch mean loss.
  lora_ref.py logits --model BASE [--adapter DIR] --tokens 1,2,3 --out X.npy   (f64 logits (T, V))
  lora_ref.py compare-adapters A_DIR B_DIR [--tol 1e-5]
  lora_ref.py compare-models A_DIR B_DIR [--tol 1e-6]
      exit 0 when equal within tol (max |a-b|), else exit 1 naming the first tensor or config field that differs.
"""
import argparse
import glob
import json
import math
import os
import shutil
import struct
import sys

import numpy as np
import torch
import torch.nn as nn

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS
PEFT_PREFIX = "base_model.model."


class RefError(Exception):
    """Bad input: printed as one line, exit status 1."""

# ================================================================ safetensors
# u64 LE header size, JSON header {name: {dtype, shape, data_offsets}, "__metadata__"}, then the data.


_DT = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2")}


def st_read(path):
    """{name: np.ndarray} (F64 kept f64, F32/F16/BF16 as f32) from one safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise RefError(f"{path}: not a safetensors file (too short)")
    hlen = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + hlen].decode("utf-8"))
    data = blob[8 + hlen:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        lo, hi = e["data_offsets"]
        raw = data[lo:hi]
        if e["dtype"] == "BF16":
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif e["dtype"] in _DT:
            a = np.frombuffer(raw, dtype=_DT[e["dtype"]])
            a = a.astype(np.float64 if e["dtype"] == "F64" else np.float32)
        else:
            raise RefError(f"{path}: {name}: dtype {e['dtype']} not supported")
        if a.size != int(np.prod(e["shape"], dtype=np.int64)):
            raise RefError(f"{path}: {name}: {a.size} values for shape {e['shape']}")
        out[name] = a.reshape(e["shape"]).copy()
    return out


def st_write(path, tensors, dtype="F32", metadata=None):
    """tensors {name: array or tensor}, all written as `dtype` (F32 or F64), in sorted name order."""
    npdt = _DT[dtype]
    header, chunks, off = {}, [], 0
    if metadata:
        header["__metadata__"] = dict(metadata)
    for name in sorted(tensors):
        t = tensors[name]
        a = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
        raw = np.ascontiguousarray(a.astype(npdt)).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    h = json.dumps(header).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for c in chunks:
            f.write(c)


def read_hf_weights(model_dir):
    """A Hugging Face directory's tensors: model.safetensors, or the files model.safetensors.index.json maps."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index):
        wmap = json.load(open(index))["weight_map"]
        out = {}
        for fname in sorted(set(wmap.values())):
            for k, v in st_read(os.path.join(model_dir, fname)).items():
                if wmap.get(k) == fname:
                    out[k] = v
        missing = sorted(set(wmap) - set(out))
        if missing:
            raise RefError(f"{index}: tensors {missing[:3]} not found in the files it names")
        return out
    if not os.path.exists(single):
        raise RefError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json")
    return st_read(single)

# ===================================================================== config


class Config:
    def __init__(self, d, where="config.json"):
        def val(k, default):
            return default if d.get(k) is None else d[k]

        if val("model_type", "llama") != "llama":
            raise RefError(f"{where}: model_type {d['model_type']!r}: lora_ref.py computes the llama family only")
        if val("hidden_act", "silu") != "silu":
            raise RefError(f"{where}: hidden_act {d['hidden_act']!r}: expected silu")
        if val("attention_bias", False) or val("mlp_bias", False):
            raise RefError(f"{where}: attention_bias / mlp_bias true: not computed here")
        scaling = d.get("rope_scaling")
        params = d.get("rope_parameters") or {}
        if scaling is not None or params.get("rope_type", "default") != "default":
            raise RefError(f"{where}: RoPE scaling is not computed here (rope_scaling / rope_parameters)")
        self.dim = int(d["hidden_size"])
        self.n_layers = int(d["num_hidden_layers"])
        self.n_heads = int(d["num_attention_heads"])
        self.n_kv = int(val("num_key_value_heads", self.n_heads))
        self.ffn = int(d["intermediate_size"])
        self.vocab = int(d["vocab_size"])
        self.eps = float(val("rms_norm_eps", 1e-6))
        self.theta = float(val("rope_theta", params.get("rope_theta", 10000.0)))
        self.tied = bool(val("tie_word_embeddings", False))
        self.head_dim = int(val("head_dim", self.dim // self.n_heads))
        if self.n_heads % self.n_kv or self.head_dim % 2:
            raise RefError(f"{where}: heads {self.n_heads} / kv heads {self.n_kv} / head_dim {self.head_dim}")

    @staticmethod
    def load(model_dir):
        p = os.path.join(model_dir, "config.json")
        if not os.path.exists(p):
            raise RefError(f"{p}: not found")
        return Config(json.load(open(p)), p)

    def target_shape(self, target):
        """(out_features, in_features) of a target Linear."""
        q, kv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        return {"q_proj": (q, self.dim), "k_proj": (kv, self.dim), "v_proj": (kv, self.dim),
                "o_proj": (self.dim, q), "gate_proj": (self.ffn, self.dim), "up_proj": (self.ffn, self.dim),
                "down_proj": (self.dim, self.ffn)}[target]


def module_path(layer, target):
    """The Hugging Face module name of a target in a layer."""
    return f"model.layers.{layer}.{'self_attn' if target in ATTN_TARGETS else 'mlp'}.{target}"

# ====================================================================== model


class LoRALinear(nn.Module):
    """A frozen Linear (weight out x in, no bias) with an optional low-rank adapter:
    y = x W^T + scale * (x A^T) B^T."""

    def __init__(self, out_f, in_f):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_f, in_f), requires_grad=False)
        self.lora_A = None
        self.lora_B = None
        self.scale = 0.0

    def add_adapter(self, A, B, scale):
        out_f, in_f = self.weight.shape
        if tuple(A.shape) != (A.shape[0], in_f) or tuple(B.shape) != (out_f, A.shape[0]):
            raise RefError(f"adapter shapes A {tuple(A.shape)}, B {tuple(B.shape)} do not fit a {out_f}x{in_f} "
                           "Linear (A: r x in, B: out x r)")
        self.lora_A = nn.Parameter(A.clone().to(self.weight.dtype))
        self.lora_B = nn.Parameter(B.clone().to(self.weight.dtype))
        self.scale = scale

    def forward(self, x):
        y = torch.matmul(x, self.weight.t())
        if self.lora_A is not None:
            y = y + self.scale * torch.matmul(torch.matmul(x, self.lora_A.t()), self.lora_B.t())
        return y


def rms_norm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def rope_tables(T, hd, theta, dtype):
    """cos, sin (T, hd/2): angle p * theta^(-2i/hd), computed in f64 and rounded once to dtype."""
    i = torch.arange(hd // 2, dtype=torch.float64)
    freq = torch.pow(torch.tensor(theta, dtype=torch.float64), -2.0 * i / hd)
    ang = torch.outer(torch.arange(T, dtype=torch.float64), freq)
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def rope(x, cos, sin):
    """x (B, T, H, hd): element i rotates with element i + hd/2 by angle(t, i)."""
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        q, kv = c.n_heads * c.head_dim, c.n_kv * c.head_dim
        self.input_layernorm = nn.Parameter(torch.ones(c.dim), requires_grad=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.dim), requires_grad=False)
        self.proj = nn.ModuleDict({t: LoRALinear(*c.target_shape(t)) for t in ALL_TARGETS})
        assert self.proj["q_proj"].weight.shape == (q, c.dim) and self.proj["k_proj"].weight.shape == (kv, c.dim)

    def forward(self, h, cos, sin):
        c, p = self.c, self.proj
        Bsz, T, _ = h.shape
        x = rms_norm(h, self.input_layernorm, c.eps)
        q = p["q_proj"](x).reshape(Bsz, T, c.n_heads, c.head_dim)
        k = p["k_proj"](x).reshape(Bsz, T, c.n_kv, c.head_dim)
        v = p["v_proj"](x).reshape(Bsz, T, c.n_kv, c.head_dim)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = c.n_heads // c.n_kv  # q head j uses kv head j // rep
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(c.head_dim)
        future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
        s = s.masked_fill(future, float("-inf"))
        o = torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1), v).reshape(Bsz, T, c.n_heads * c.head_dim)
        h = h + p["o_proj"](o)
        x = rms_norm(h, self.post_attention_layernorm, c.eps)
        g = p["gate_proj"](x)
        return h + p["down_proj"](g * torch.sigmoid(g) * p["up_proj"](x))


class LoRALlama(nn.Module):
    def __init__(self, c, dtype):
        super().__init__()
        self.c = c
        self.embed = nn.Parameter(torch.zeros(c.vocab, c.dim), requires_grad=False)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.n_layers))
        self.norm = nn.Parameter(torch.ones(c.dim), requires_grad=False)
        self.lm_head = None if c.tied else nn.Parameter(torch.zeros(c.vocab, c.dim), requires_grad=False)
        self.to(dtype)
        self.dtype = dtype
        self.lora_cfg = None

    # --- the Hugging Face names of the base tensors ---
    def base_tensors(self):
        """{HF name: frozen parameter}."""
        out = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head
        for i, L in enumerate(self.layers):
            out[f"model.layers.{i}.input_layernorm.weight"] = L.input_layernorm
            out[f"model.layers.{i}.post_attention_layernorm.weight"] = L.post_attention_layernorm
            for t in ALL_TARGETS:
                out[module_path(i, t) + ".weight"] = L.proj[t].weight
        return out

    def adapters(self):
        """[(module path, LoRALinear)] of the adapted targets, layer by layer in the canonical order."""
        return [(module_path(i, t), L.proj[t]) for i, L in enumerate(self.layers) for t in ALL_TARGETS
                if L.proj[t].lora_A is not None]

    def adapter_params(self):
        return [p for _, m in self.adapters() for p in (m.lora_A, m.lora_B)]

    def forward(self, tokens):
        T = tokens.shape[1]
        cos, sin = rope_tables(T, self.c.head_dim, self.c.theta, self.dtype)
        h = self.embed[tokens]
        for L in self.layers:
            h = L(h, cos, sin)
        h = rms_norm(h, self.norm, self.c.eps)
        return torch.matmul(h, (self.embed if self.lm_head is None else self.lm_head).t())


def token_ce(logits, targets):
    """Per-target cross-entropy: logsumexp(logits) - logits[target]."""
    lse = torch.logsumexp(logits, dim=-1)
    return lse - torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)


def load_base(model_dir, dtype):
    c = Config.load(model_dir)
    m = LoRALlama(c, dtype)
    w = read_hf_weights(model_dir)
    want = m.base_tensors()
    if set(w) != set(want):
        raise RefError(f"{model_dir}: missing tensors {sorted(set(want) - set(w))[:4]}, "
                       f"unexpected {sorted(set(w) - set(want))[:4]}")
    with torch.no_grad():
        for k, p in want.items():
            if tuple(w[k].shape) != tuple(p.shape):
                raise RefError(f"{model_dir}: {k} has shape {w[k].shape}, config.json gives {tuple(p.shape)}")
            p.copy_(torch.from_numpy(w[k]).to(dtype))
    return m

# ==================================================================== adapters


class AdapterConfig:
    def __init__(self, r, alpha, targets, dropout=0.0, rslora=False, base=""):
        self.r, self.alpha, self.targets = r, alpha, list(targets)
        self.dropout, self.rslora, self.base = dropout, rslora, base

    @property
    def scale(self):
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def to_json(self):
        alpha = int(self.alpha) if float(self.alpha).is_integer() else self.alpha  # PEFT writes an int
        return {"peft_type": "LORA", "r": self.r, "lora_alpha": alpha, "target_modules": self.targets,
                "lora_dropout": self.dropout, "use_rslora": self.rslora, "base_model_name_or_path": self.base,
                "bias": "none", "task_type": "CAUSAL_LM", "fan_in_fan_out": False, "init_lora_weights": True,
                "modules_to_save": None}

    @staticmethod
    def read(adapter_dir):
        p = os.path.join(adapter_dir, "adapter_config.json")
        if not os.path.exists(p):
            raise RefError(f"{p}: not found (a PEFT adapter directory holds adapter_config.json)")
        d = json.load(open(p))
        if d.get("peft_type", "LORA") != "LORA":
            raise RefError(f"{p}: peft_type {d['peft_type']!r}: expected LORA")
        for k in ("r", "lora_alpha", "target_modules"):
            if k not in d:
                raise RefError(f"{p}: no {k}")
        targets = d["target_modules"]
        if not isinstance(targets, list):
            raise RefError(f"{p}: target_modules {targets!r}: expected a list of module names (a regex is not "
                           "supported)")
        bad = [t for t in targets if t not in ALL_TARGETS]
        if bad:
            raise RefError(f"{p}: target_modules {bad}: the llama targets are {', '.join(ALL_TARGETS)}")
        for k, ok in (("bias", "none"), ("fan_in_fan_out", False), ("use_dora", False)):
            if d.get(k, ok) not in (ok, None):
                raise RefError(f"{p}: {k} = {d[k]!r}: only {ok!r} is computed here")
        for k in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
            if d.get(k):
                raise RefError(f"{p}: {k} = {d[k]!r}: not computed here")
        r, alpha = d["r"], d["lora_alpha"]
        if not isinstance(r, int) or r < 1 or not alpha > 0:
            raise RefError(f"{p}: r = {r!r}, lora_alpha = {alpha!r}: expected r >= 1 and lora_alpha > 0")
        return AdapterConfig(r, alpha, targets, float(d.get("lora_dropout") or 0.0), bool(d.get("use_rslora")),
                             d.get("base_model_name_or_path") or "")


def adapter_names(c, targets):
    """The PEFT tensor names of an adapter on every layer's targets: {name: (layer, target, "A"|"B")}."""
    out = {}
    for i in range(c.n_layers):
        for t in targets:
            for ab in "AB":
                out[f"{PEFT_PREFIX}{module_path(i, t)}.lora_{ab}.weight"] = (i, t, ab)
    return out


def read_adapter(adapter_dir, c):
    """(AdapterConfig, {PEFT name: np.ndarray}) checked against the base config c (names and shapes)."""
    cfg = AdapterConfig.read(adapter_dir)
    p = os.path.join(adapter_dir, "adapter_model.safetensors")
    if not os.path.exists(p):
        raise RefError(f"{p}: not found")
    w = st_read(p)
    want = adapter_names(c, cfg.targets)
    missing, extra = sorted(set(want) - set(w)), sorted(set(w) - set(want))
    if missing or extra:
        raise RefError(f"{p}: missing tensors {missing[:3]}, unexpected tensors {extra[:3]}")
    for name, (i, t, ab) in want.items():
        out_f, in_f = c.target_shape(t)
        shape = (cfg.r, in_f) if ab == "A" else (out_f, cfg.r)
        if tuple(w[name].shape) != shape:
            raise RefError(f"{p}: {name} has shape {list(w[name].shape)}, expected {list(shape)}")
    return cfg, w


def attach_adapter(model, cfg, tensors):
    for name, (i, t, ab) in adapter_names(model.c, cfg.targets).items():
        if ab == "A":
            A = torch.from_numpy(tensors[name])
            B = torch.from_numpy(tensors[name[:-len("lora_A.weight")] + "lora_B.weight"])
            model.layers[i].proj[t].add_adapter(A, B, cfg.scale)
    model.lora_cfg = cfg


def write_adapter(out_dir, cfg, tensors):
    """A PEFT directory: adapter_config.json and adapter_model.safetensors (F32)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg.to_json(), f, indent=2)
    st_write(os.path.join(out_dir, "adapter_model.safetensors"), tensors, "F32", {"format": "pt"})


def model_adapter_tensors(model):
    out = {}
    for path, m in model.adapters():
        out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = m.lora_A
        out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = m.lora_B
    return out


def load(model_dir, adapter_dir, dtype, allow_dropout=False):
    m = load_base(model_dir, dtype)
    if adapter_dir:
        cfg, w = read_adapter(adapter_dir, m.c)
        if cfg.dropout != 0 and not allow_dropout:
            raise RefError(f"{adapter_dir}/adapter_config.json: lora_dropout = {cfg.dropout}: the reference trains "
                           "with dropout 0 only (a random mask cannot match meshtrain's)")
        attach_adapter(m, cfg, w)
    return m

# ======================================================================== data


def shards(pattern):
    files = sorted(glob.glob(pattern))
    if not files:
        raise RefError(f"no file matches {pattern}")
    return files


def read_stream(pattern, masks=False):
    """(tokens int64, weights f64 or None): the shards' tokens concatenated in sorted name order; with masks the
    X.mask bytes beside each X.bin (absent: all ones)."""
    toks, ws = [], []
    for path in shards(pattern):
        raw = open(path, "rb").read()
        hdr = struct.unpack("<256i", raw[:1024])
        if hdr[0] != 20240520 or hdr[1] != 1 or len(raw) != 1024 + 2 * hdr[2]:
            raise RefError(f"{path}: not a token shard (magic {hdr[0]}, version {hdr[1]}, count {hdr[2]})")
        toks.append(np.frombuffer(raw, dtype="<u2", offset=1024).astype(np.int64))
        if masks:
            mp = (path[:-4] if path.endswith(".bin") else path) + ".mask"
            if os.path.exists(mp):
                mraw = open(mp, "rb").read()
                mh = struct.unpack("<256i", mraw[:1024])
                if mh[0] != 20241127 or mh[1] != 1 or mh[2] != hdr[2] or len(mraw) != 1024 + hdr[2]:
                    raise RefError(f"{mp}: bad mask header {mh[:4]} for a shard of {hdr[2]} tokens")
                m = np.frombuffer(mraw, dtype=np.uint8, offset=1024)
                if m.max(initial=0) > 1:
                    raise RefError(f"{mp}: a value other than 0 or 1")
                ws.append(m.astype(np.float64))
            else:
                ws.append(np.ones(hdr[2]))
    tokens = torch.from_numpy(np.concatenate(toks))
    return tokens, (torch.from_numpy(np.concatenate(ws)) if masks else None)


def batch(tokens, weights, step, B, T):
    """(x, y, w) of step `step`: window (step mod steps_per_epoch) of B*T+1 tokens; w the targets' weights."""
    per_epoch = (len(tokens) - 1) // (B * T)
    if per_epoch < 1:
        raise RefError(f"{len(tokens)} tokens: fewer than one batch of {B}x{T}+1")
    start = (step % per_epoch) * B * T
    x = tokens[start:start + B * T].reshape(B, T)
    y = tokens[start + 1:start + B * T + 1].reshape(B, T)
    w = torch.ones(B, T, dtype=torch.float64) if weights is None else weights[start + 1:start + B * T + 1].reshape(B, T)
    return x, y, w

# ==================================================================== training


def lr_at(s, a):
    if s < a.warmup_steps:
        return a.lr * (s + 1) / a.warmup_steps
    if a.schedule == "constant":
        return a.lr
    frac = (s - a.warmup_steps) / max(1, a.steps - a.warmup_steps)
    return a.lr_min + (a.lr - a.lr_min) * 0.5 * (1.0 + math.cos(math.pi * frac))


class AdamW:
    """torch.optim.AdamW's update written out (decoupled weight decay on tensors of dim >= 2)."""

    def __init__(self, params, beta1, beta2, eps, weight_decay):
        self.params = list(params)
        self.b1, self.b2, self.eps, self.wd = beta1, beta2, eps, weight_decay
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self, lr):
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for p, m, v in zip(self.params, self.m, self.v):
            g = p.grad
            if p.dim() >= 2 and self.wd:
                p.mul_(1 - lr * self.wd)
            m.mul_(self.b1).add_(g, alpha=1 - self.b1)
            v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            p.addcdiv_(m, v.sqrt() / math.sqrt(c2) + self.eps, value=-lr / c1)


def step_loss_and_grads(model, x, y, w, micro):
    """Backward of one batch in micro-batches of rows; returns the batch loss (sum of counted ce / count)."""
    n = float(w.sum())
    if n == 0:
        raise RefError("a batch with no trained target (every target masked)")
    total = 0.0
    for r in range(0, x.shape[0], micro):
        ce = token_ce(model(x[r:r + micro]), y[r:r + micro])
        loss = (ce * w[r:r + micro].to(ce.dtype)).sum() / n
        loss.backward()
        total += loss.item()
    return total


def global_norm(params):
    return math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))


def clip_grads(params, norm, max_norm):
    """clip_grad_norm_'s rule: when max_norm > 0 and max_norm / (norm + 1e-6) < 1, every gradient times it."""
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            for p in params:
                p.grad.mul_(coef)


def train(model, tokens, weights, a, log=None):
    """Trains model's adapters for a.steps steps; returns {"losses", "grad_norms", "lrs"[, "trained_tokens"]}."""
    params = model.adapter_params()
    if not params:
        raise RefError("no adapter to train")
    B = a.batch_size
    M = a.micro_batch_size or B
    if B % M:
        raise RefError(f"--micro-batch-size {M} must divide --batch-size {B}")
    opt = AdamW(params, a.beta1, a.beta2, a.eps, a.weight_decay)
    out = {"losses": [], "grad_norms": [], "lrs": []}
    counted = []
    for s in range(a.steps):
        x, y, w = batch(tokens, weights, s, B, a.seq_len)
        for p in params:
            p.grad = None
        loss = step_loss_and_grads(model, x, y, w, M)
        norm = global_norm(params)
        clip_grads(params, norm, a.grad_clip)
        lr = lr_at(s, a)
        opt.step(lr)
        out["losses"].append(loss)
        out["grad_norms"].append(norm)
        out["lrs"].append(lr)
        counted.append(int(w.sum()))
        if log:
            log(f"step {s} loss {loss:.6f} grad_norm {norm:.6f} lr {lr:.4e}")
    if weights is not None:
        out["trained_tokens"] = counted
    return out

# ===================================================================== merging


def merged_tensors(model_dir, adapter_dir):
    """The base's tensors (as read: f32, or f64 from an F64 file) with every target W + scale B A (f64)."""
    c = Config.load(model_dir)
    base = read_hf_weights(model_dir)
    cfg, ad = read_adapter(adapter_dir, c)
    out = dict(base)
    for name, (i, t, ab) in adapter_names(c, cfg.targets).items():
        if ab == "A":
            A = ad[name].astype(np.float64)
            Bm = ad[name[:-len("lora_A.weight")] + "lora_B.weight"].astype(np.float64)
            key = module_path(i, t) + ".weight"
            out[key] = base[key].astype(np.float64) + cfg.scale * (Bm @ A)
    return out

# ==================================================================== commands


def cmd_make_adapter(a):
    c = Config.load(a.model)
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    bad = [t for t in targets if t not in ALL_TARGETS]
    if bad or not targets:
        raise RefError(f"--targets {a.targets}: expected names among {', '.join(ALL_TARGETS)}")
    if a.rank < 1 or not a.alpha > 0:
        raise RefError("--rank must be >= 1 and --alpha > 0")
    targets = [t for t in ALL_TARGETS if t in targets]  # canonical order
    g = torch.Generator().manual_seed(a.seed)
    tensors = {}
    for i in range(c.n_layers):
        for t in targets:
            out_f, in_f = c.target_shape(t)
            bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)): sqrt(6/((1+5) in)) = 1/sqrt(in)
            A = (torch.rand(a.rank, in_f, generator=g, dtype=torch.float64) * 2 - 1) * bound
            B = torch.randn(out_f, a.rank, generator=g, dtype=torch.float64) * a.b_std
            tensors[f"{PEFT_PREFIX}{module_path(i, t)}.lora_A.weight"] = A
            tensors[f"{PEFT_PREFIX}{module_path(i, t)}.lora_B.weight"] = B
    cfg = AdapterConfig(a.rank, a.alpha, targets, a.dropout, a.rslora, os.path.abspath(a.model))
    write_adapter(a.out, cfg, tensors)
    print(json.dumps({"out": a.out, "tensors": len(tensors), "params": int(sum(v.numel() for v in tensors.values())),
                      "scale": cfg.scale}))


def dtype_of(s):
    return torch.float64 if s == "f64" else torch.float32


def cmd_train(a):
    torch.set_num_threads(a.threads)
    model = load(a.model, a.adapter, dtype_of(a.dtype))
    tokens, weights = read_stream(a.data, a.masks)
    out = train(model, tokens, weights, a, log=lambda s: print(s, flush=True))
    with open(a.out, "w") as f:
        json.dump(out, f)
    if a.adapter_out:
        write_adapter(a.adapter_out, model.lora_cfg, model_adapter_tensors(model))


def cmd_merge(a):
    tensors = merged_tensors(a.model, a.adapter)
    os.makedirs(a.out, exist_ok=True)
    for f in os.listdir(a.model):
        if f == "config.json" or f.startswith("tokenizer") or f in ("special_tokens_map.json",
                                                                    "generation_config.json"):
            shutil.copy(os.path.join(a.model, f), os.path.join(a.out, f))
    st_write(os.path.join(a.out, "model.safetensors"), tensors, "F32", {"format": "pt"})
    print(json.dumps({"out": a.out, "tensors": len(tensors)}))


def cmd_loss(a):
    torch.set_num_threads(a.threads)
    model = load(a.model, a.adapter, dtype_of(a.dtype), allow_dropout=True)  # eval: dropout is the identity
    tokens, weights = read_stream(a.data, a.masks)
    x, y, w = batch(tokens, weights, a.step, a.batch_size, a.seq_len)
    with torch.no_grad():
        ce = token_ce(model(x), y)
        print(json.dumps({"loss": float((ce * w.to(ce.dtype)).sum() / w.sum())}))


def cmd_logits(a):
    torch.set_num_threads(a.threads)
    model = load(a.model, a.adapter, torch.float64, allow_dropout=True)
    toks = torch.tensor([[int(t) for t in a.tokens.split(",")]])
    with torch.no_grad():
        np.save(a.out, model(toks)[0].numpy())
    print(json.dumps({"out": a.out, "shape": [toks.shape[1], model.c.vocab]}))


def compare_tensors(a, b, tol, what_a, what_b):
    """None when the two {name: array} agree within tol, else the first difference as a sentence."""
    for name in sorted(set(a) | set(b)):
        if name not in b:
            return f"{name}: in {what_a} only"
        if name not in a:
            return f"{name}: in {what_b} only"
        if a[name].shape != b[name].shape:
            return f"{name}: shape {list(a[name].shape)} vs {list(b[name].shape)}"
        d = float(np.max(np.abs(a[name].astype(np.float64) - b[name].astype(np.float64)), initial=0.0))
        if not d <= tol:
            return f"{name}: max |diff| {d:.3e} > {tol:g}"
    return None


def max_diff(a, b):
    return max((float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)), initial=0.0))
                for k in a), default=0.0)


def cmd_compare_adapters(a):
    ca, cb = AdapterConfig.read(a.a), AdapterConfig.read(a.b)
    for field, va, vb in (("r", ca.r, cb.r), ("lora_alpha", float(ca.alpha), float(cb.alpha)),
                          ("target_modules", sorted(ca.targets), sorted(cb.targets)),
                          ("use_rslora", ca.rslora, cb.rslora)):
        if va != vb:
            print(f"adapter_config.json: {field} {va!r} vs {vb!r}")
            sys.exit(1)
    ta = st_read(os.path.join(a.a, "adapter_model.safetensors"))
    tb = st_read(os.path.join(a.b, "adapter_model.safetensors"))
    diff = compare_tensors(ta, tb, a.tol, a.a, a.b)
    if diff:
        print(diff)
        sys.exit(1)
    print(f"{len(ta)} adapter tensors equal within {a.tol:g} (max |diff| {max_diff(ta, tb):.3e})")


def cmd_compare_models(a):
    ta, tb = read_hf_weights(a.a), read_hf_weights(a.b)
    diff = compare_tensors(ta, tb, a.tol, a.a, a.b)
    if diff:
        print(diff)
        sys.exit(1)
    print(f"{len(ta)} tensors equal within {a.tol:g} (max |diff| {max_diff(ta, tb):.3e})")


def train_options(p):
    """llama_ref.py train's options and defaults."""
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("make-adapter", help="write a PEFT adapter directory with drawn A and B")
    p.add_argument("--model", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--alpha", type=float, required=True)
    p.add_argument("--targets", default=",".join(ALL_TARGETS))
    p.add_argument("--rslora", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--b-std", type=float, default=0.02, help="0: PEFT's zero B")
    p.add_argument("--out", required=True)

    p = sub.add_parser("train", help="train the adapters on a frozen base; losses JSON and the final adapter")
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", required=True)
    train_options(p)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["f32", "f64"], default="f32")
    p.add_argument("--masks", action="store_true", help="X.mask beside each shard X.bin (absent: all ones)")
    p.add_argument("--out", required=True)
    p.add_argument("--adapter-out", default="")

    p = sub.add_parser("merge", help="a Hugging Face directory with W + scale B A folded in")
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", required=True)
    p.add_argument("--out", required=True)

    p = sub.add_parser("loss", help="step S's batch loss (base, or base + adapter)")
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", default="")
    p.add_argument("--data", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--dtype", choices=["f32", "f64"], default="f32")
    p.add_argument("--masks", action="store_true")
    p.add_argument("--threads", type=int, default=2)

    p = sub.add_parser("logits", help="f64 logits (T, V) of one sequence as .npy")
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", default="")
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=2)

    p = sub.add_parser("compare-adapters", help="two PEFT adapter directories within --tol")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tol", type=float, default=1e-5)

    p = sub.add_parser("compare-models", help="two Hugging Face directories' tensors within --tol")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tol", type=float, default=1e-6)

    a = ap.parse_args(argv)
    try:
        {"make-adapter": cmd_make_adapter, "train": cmd_train, "merge": cmd_merge, "loss": cmd_loss,
         "logits": cmd_logits, "compare-adapters": cmd_compare_adapters,
         "compare-models": cmd_compare_models}[a.cmd](a)
    except RefError as e:
        sys.exit(f"lora_ref: {e}")


if __name__ == "__main__":
    main()
