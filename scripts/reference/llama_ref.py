#!/usr/bin/python3
"""An independent PyTorch reference for meshtrain's Llama: Hugging Face Llama's
parameter names and semantics, written plainly (no transformers import), used
by the tests to check meshtrain's losses and by the CPU benchmark.

  llama_ref.py init  --out DIR [model sizes] [--tie-embeddings] [--seed S]
  llama_ref.py train --model DIR --data GLOB --steps N --batch-size B --seq-len T [optimizer flags] --out losses.json
  llama_ref.py loss  --model DIR --data GLOB --batch-size B --seq-len T --step S
  llama_ref.py bench [model sizes] --seq-len T --batch-size B --threads N --steps N --warmup N
"""
import argparse
import glob
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

# ---------------------------------------------------------------- safetensors

ST_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I32": np.int32, "I64": np.int64}


def read_safetensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        buf = data[b:end]
        if e["dtype"] == "BF16":  # bf16 is the upper half of an f32
            u = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32)
        else:
            arr = np.frombuffer(buf, dtype=ST_DTYPES[e["dtype"]]).astype(np.float32 if e["dtype"] == "F16" else None)
        out[name] = torch.from_numpy(np.array(arr).reshape(e["shape"]))
    return out


def write_safetensors(path, tensors, dtype="f32"):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        a = t.detach().to(torch.float32).contiguous().numpy()
        if dtype == "bf16":  # round to nearest even, as torch does
            u = a.view(np.uint32).astype(np.uint64)
            b = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF).astype("<u2").tobytes()
            st = "BF16"
        else:
            b, st = a.astype("<f4").tobytes(), "F32"
        header[name] = {"dtype": st, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))

# ---------------------------------------------------------------- the model


class Config:
    def __init__(self, d):
        self.dim = d["hidden_size"]
        self.n_layers = d["num_hidden_layers"]
        self.n_heads = d["num_attention_heads"]
        self.n_kv_heads = d.get("num_key_value_heads", self.n_heads)
        self.ffn_dim = d["intermediate_size"]
        self.vocab_size = d["vocab_size"]
        self.eps = d.get("rms_norm_eps", 1e-5)
        self.theta = d.get("rope_theta", 10000.0)
        self.tied = d.get("tie_word_embeddings", False)
        self.head_dim = self.dim // self.n_heads


def param_shapes(c):
    hd = c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.dim)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (c.dim,),
            p + "self_attn.q_proj.weight": (c.n_heads * hd, c.dim),
            p + "self_attn.k_proj.weight": (c.n_kv_heads * hd, c.dim),
            p + "self_attn.v_proj.weight": (c.n_kv_heads * hd, c.dim),
            p + "self_attn.o_proj.weight": (c.dim, c.n_heads * hd),
            p + "post_attention_layernorm.weight": (c.dim,),
            p + "mlp.gate_proj.weight": (c.ffn_dim, c.dim),
            p + "mlp.up_proj.weight": (c.ffn_dim, c.dim),
            p + "mlp.down_proj.weight": (c.dim, c.ffn_dim),
        })
    shapes["model.norm.weight"] = (c.dim,)
    if not c.tied:
        shapes["lm_head.weight"] = (c.vocab_size, c.dim)
    return shapes


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(T, hd, theta, dtype):
    # Hugging Face: inv_freq_i = theta^(-2i/hd); cos/sin of pos * inv_freq, repeated twice along hd.
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).to(dtype) / hd))
    ang = torch.arange(T, dtype=dtype)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def attention(x, P, p, c, cos, sin):
    B, T, _ = x.shape
    hd = c.head_dim
    q = (x @ P[p + "q_proj.weight"].t()).view(B, T, c.n_heads, hd).transpose(1, 2)     # (B, H, T, hd)
    k = (x @ P[p + "k_proj.weight"].t()).view(B, T, c.n_kv_heads, hd).transpose(1, 2)  # (B, KV, T, hd)
    v = (x @ P[p + "v_proj.weight"].t()).view(B, T, c.n_kv_heads, hd).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    group = c.n_heads // c.n_kv_heads  # kv head j serves q heads j*group ... (j+1)*group-1
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    s = s.masked_fill(mask, float("-inf"))
    o = torch.softmax(s, dim=-1) @ v                                                      # (B, H, T, hd)
    return o.transpose(1, 2).reshape(B, T, c.n_heads * hd) @ P[p + "o_proj.weight"].t()


def forward(P, c, tokens):
    T = tokens.shape[1]
    cos, sin = rope_tables(T, c.head_dim, c.theta, P["model.norm.weight"].dtype)
    h = P["model.embed_tokens.weight"][tokens]
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        h = h + attention(rms_norm(h, P[p + "input_layernorm.weight"], c.eps), P, p + "self_attn.", c, cos, sin)
        x = rms_norm(h, P[p + "post_attention_layernorm.weight"], c.eps)
        m = F.silu(x @ P[p + "mlp.gate_proj.weight"].t()) * (x @ P[p + "mlp.up_proj.weight"].t())
        h = h + m @ P[p + "mlp.down_proj.weight"].t()
    h = rms_norm(h, P["model.norm.weight"], c.eps)
    head = P["model.embed_tokens.weight"] if c.tied else P["lm_head.weight"]
    return h @ head.t()

# ---------------------------------------------------------------- data


def read_tokens(pattern):
    files = sorted(glob.glob(pattern))
    if not files:
        sys.exit(f"llama_ref: no file matches {pattern}")
    parts = []
    for f in files:
        raw = open(f, "rb").read()
        magic, version, count = struct.unpack("<3i", raw[:12])
        assert magic == 20240520 and version == 1 and len(raw) == 1024 + 2 * count, f
        parts.append(np.frombuffer(raw[1024:], dtype="<u2").astype(np.int64))
    return torch.from_numpy(np.concatenate(parts))


def get_batch(tokens, step, B, T):
    per_epoch = (len(tokens) - 1) // (B * T)
    b = step % per_epoch
    buf = tokens[b * B * T: b * B * T + B * T + 1]
    return buf[:-1].view(B, T), buf[1:].view(B, T)

# ---------------------------------------------------------------- commands


def load_model(d, dtype):
    cfg = json.load(open(os.path.join(d, "config.json")))
    c = Config(cfg)
    w = read_safetensors(os.path.join(d, "model.safetensors"))
    P = {}
    for name, shape in param_shapes(c).items():
        assert tuple(w[name].shape) == shape, (name, w[name].shape, shape)
        P[name] = w[name].to(dtype).clone().requires_grad_(True)
    return c, P


def lr_at(a, s):
    if s < a.warmup_steps:
        return a.lr * (s + 1) / a.warmup_steps
    if a.schedule == "constant":
        return a.lr
    p = min(1.0, (s - a.warmup_steps) / max(1, a.steps - a.warmup_steps))
    return a.lr_min + 0.5 * (a.lr - a.lr_min) * (1 + math.cos(math.pi * p))


def cmd_init(a):
    os.makedirs(a.out, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.dim,
           "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
           "intermediate_size": a.ffn_dim, "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps,
           "rope_theta": a.rope_theta, "max_position_embeddings": a.max_seq_len,
           "tie_word_embeddings": a.tie_embeddings, "hidden_act": "silu"}
    json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=2)
    g = torch.Generator().manual_seed(a.seed)
    W = {}
    for name, shape in param_shapes(Config(cfg)).items():
        W[name] = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
    write_safetensors(os.path.join(a.out, "model.safetensors"), W, a.dtype)
    print(json.dumps({"out": a.out, "params": sum(t.numel() for t in W.values())}))


def cmd_train(a):
    torch.set_num_threads(a.threads)
    dtype = torch.float64 if a.dtype == "f64" else torch.float32
    c, P = load_model(a.model, dtype)
    tokens = read_tokens(a.data)
    decay = [p for n, p in P.items() if p.dim() >= 2]
    no_decay = [p for n, p in P.items() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    M = a.micro_batch_size or a.batch_size
    losses, norms, lrs = [], [], []
    for s in range(a.steps):
        x, y = get_batch(tokens, s, a.batch_size, a.seq_len)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(0, a.batch_size, M):
            logits = forward(P, c, x[r:r + M])
            # Sum of token losses over the global token count: micro-batches add up to the batch mean.
            loss = F.cross_entropy(logits.reshape(-1, c.vocab_size), y[r:r + M].reshape(-1), reduction="sum")
            loss = loss / (a.batch_size * a.seq_len)
            loss.backward()
            total += loss.item()
        params = list(P.values())
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).item()
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, a.grad_clip)
        lr = lr_at(a, s)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        losses.append(total)
        norms.append(norm)
        lrs.append(lr)
        print(f"step {s} loss {total:.6f} grad_norm {norm:.4f} lr {lr:.3e}")
    json.dump({"losses": losses, "grad_norms": norms, "lrs": lrs}, open(a.out, "w"))


def cmd_loss(a):
    c, P = load_model(a.model, torch.float32)
    x, y = get_batch(read_tokens(a.data), a.step, a.batch_size, a.seq_len)
    with torch.no_grad():
        loss = F.cross_entropy(forward(P, c, x).reshape(-1, c.vocab_size), y.reshape(-1))
    print(json.dumps({"loss": loss.item()}))


def cmd_bench(a):
    torch.set_num_threads(a.threads)
    cfg = {"hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
           "num_key_value_heads": a.n_kv_heads, "intermediate_size": a.ffn_dim, "vocab_size": a.vocab_size}
    c = Config(cfg)
    g = torch.Generator().manual_seed(0)
    P = {n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02).requires_grad_(True)
         for n, s in param_shapes(c).items()}
    opt = torch.optim.AdamW(list(P.values()), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    x = torch.randint(0, a.vocab_size, (a.batch_size, a.seq_len), generator=g)
    y = torch.randint(0, a.vocab_size, (a.batch_size, a.seq_len), generator=g)
    times = []
    for s in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(P, c, x).reshape(-1, c.vocab_size), y.reshape(-1))
        loss.backward()
        opt.step()
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
    step = sorted(times)[len(times) // 2]
    # Debian's torch calls the system libblas.so.3, which the alternatives system points at OpenBLAS or the
    # reference BLAS: name the library actually loaded.
    blas = os.path.realpath("/usr/lib/x86_64-linux-gnu/libblas.so.3")
    print(json.dumps({"tokens_per_s": a.batch_size * a.seq_len / step, "step_ms": 1e3 * step, "threads": a.threads,
                      "torch": torch.__version__, "blas": blas}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def sizes(p):
        p.add_argument("--dim", type=int, default=64)
        p.add_argument("--n-layers", type=int, default=2)
        p.add_argument("--n-heads", type=int, default=4)
        p.add_argument("--n-kv-heads", type=int, default=2)
        p.add_argument("--ffn-dim", type=int, default=160)
        p.add_argument("--vocab-size", type=int, default=256)

    p = sub.add_parser("init")
    sizes(p)
    p.add_argument("--out", required=True)
    p.add_argument("--norm-eps", type=float, default=1e-5)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")

    p = sub.add_parser("train")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--schedule", choices=["constant", "cosine"], default="cosine")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--lr-min", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=["f32", "f64"], default="f32")
    p.add_argument("--out", required=True)

    p = sub.add_parser("loss")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--step", type=int, default=0)

    p = sub.add_parser("bench")
    sizes(p)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)

    a = ap.parse_args()
    {"init": cmd_init, "train": cmd_train, "loss": cmd_loss, "bench": cmd_bench}[a.cmd](a)


if __name__ == "__main__":
    main()
