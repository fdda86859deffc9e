#!/usr/bin/python3
"""PyTorch on the same Llama, batch and sequence as meshtrain's GPU benchmark.

The model is scripts/reference/llama_ref.py's (Hugging Face names and semantics),
with its attention swapped for torch.nn.functional.scaled_dot_product_attention
(is_causal, GQA by repeating kv heads) where that exists. bf16 is PyTorch's usual
mixed precision: fp32 parameters and AdamW state (fused AdamW on CUDA) under
torch.autocast(bfloat16) -- the same split meshtrain makes (bf16 compute, fp32
master weights, optimizer state, softmax and loss). A step is forward, backward,
clip_grad_norm_(1.0), AdamW, zero_grad; the median step after --warmup is timed.
Prints one JSON line per mode: tokens/s, MFU against --peak-tflops (989, dense bf16 of an
H100 or H200 SXM; FLOPs per token = 6 N + 12 L d T with meshtrain's N), peak memory.
  torch_llama_bench.py [--mode eager|compile|both] [--device cuda|cpu] [--dtype bf16|fp32] ...
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
import llama_ref  # noqa: E402

DEVICE = "cpu"


def sdpa_attention(q, k, v):
    """q (B, H, T, hd), k and v (B, KV, T, hd): causal, kv heads repeated for their query groups."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def patch_reference():
    if hasattr(F, "scaled_dot_product_attention"):
        llama_ref.gqa_attention = sdpa_attention
    orig = llama_ref.rope_cos_sin  # builds its tables on the CPU: move them to the model's device

    def rope_on_device(*a, **k):
        return tuple(t.to(DEVICE) for t in orig(*a, **k))
    llama_ref.rope_cos_sin = rope_on_device


def flops_per_token(a):
    hd = a.dim // a.n_heads
    attn = a.dim * a.n_heads * hd * 2 + a.dim * a.n_kv_heads * hd * 2
    n = a.n_layers * (attn + 3 * a.dim * a.ffn_dim + 2 * a.dim) + a.dim + a.vocab_size * a.dim
    return 6.0 * n + 12.0 * a.n_layers * a.dim * a.seq_len


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run(a, mode):
    result = {"impl": f"torch_{mode}", "batch": a.batch_size, "seq": a.seq_len, "dtype": a.dtype,
              "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"}
    if mode == "compile" and not hasattr(torch, "compile"):
        result["error"] = "torch.compile unavailable"
        return result
    cfg = {"hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
           "num_key_value_heads": a.n_kv_heads, "intermediate_size": a.ffn_dim, "vocab_size": a.vocab_size,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    try:
        torch.manual_seed(0)
        model = llama_ref.LlamaForCausalLM(llama_ref.LlamaConfig(cfg)).to(DEVICE)
        for p in model.parameters():
            torch.nn.init.normal_(p, 0.0, 0.02) if p.dim() >= 2 else torch.nn.init.ones_(p)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        kw = {"fused": True} if DEVICE == "cuda" else {}
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=3e-4, betas=(0.9, 0.95), eps=1e-8, **kw)
        fwd = torch.compile(model) if mode == "compile" else model
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, a.vocab_size, (a.batch_size, a.seq_len), generator=g).to(DEVICE)
        y = torch.randint(0, a.vocab_size, (a.batch_size, a.seq_len), generator=g).to(DEVICE)
        mb = a.micro_batch_size or a.batch_size
        use_autocast = a.dtype == "bf16"

        def step():
            for r in range(0, a.batch_size, mb):
                with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16, enabled=use_autocast):
                    logits = fwd(x[r:r + mb])
                loss = F.cross_entropy(logits.float().reshape(-1, a.vocab_size), y[r:r + mb].reshape(-1)) * (
                    mb / a.batch_size)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for s in range(a.warmup + a.steps):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            if s >= a.warmup:
                times.append(time.perf_counter() - t0)
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
        if "out of memory" not in str(e).lower():
            raise
        result["error"] = "oom"
        return result
    t = sorted(times)[len(times) // 2]
    tps = a.batch_size * a.seq_len / t
    if mb != a.batch_size:
        result["micro_batch"] = mb
    result.update({"tokens_per_s": round(tps, 1), "step_ms": round(1e3 * t, 2),
                   "mfu": round(tps * flops_per_token(a) / (a.peak_tflops * 1e12), 6)})
    if DEVICE == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


def main():
    global DEVICE
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in [("dim", 2048), ("n-layers", 16), ("n-heads", 16), ("n-kv-heads", 8), ("ffn-dim", 5632),
                          ("vocab-size", 32000), ("seq-len", 2048), ("batch-size", 8), ("micro-batch-size", 0),
                          ("steps", 10), ("warmup", 3)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--mode", choices=["eager", "compile", "both"], default="both")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    a = p.parse_args()
    DEVICE = a.device
    if DEVICE == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, as in meshtrain
    patch_reference()
    for mode in (["eager", "compile"] if a.mode == "both" else [a.mode]):
        print(json.dumps(run(a, mode)), flush=True)


if __name__ == "__main__":
    main()
