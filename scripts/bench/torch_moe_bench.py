#!/usr/bin/python3
"""PyTorch on a Mixtral-style model, for meshtrain's MoE step on a GPU (issue 50, scripts/gpu_run.sh part 8).

The model is scripts/reference/llama_ref.py's Mixtral (Hugging Face names and semantics; attention through
scaled_dot_product_attention as in torch_llama_bench.py). Two ways to run the experts:
  loop        transformers' MixtralSparseMoeBlock: each expert on the tokens that chose it, one after the other
              (llama_ref.SparseMoeBlock is that loop);
  grouped_mm  the experts' weights stacked (E, F, C) and every expert matrix as one torch._grouped_mm over the rows
              sorted by expert (where this PyTorch has it: an error line otherwise).
bf16 under autocast with fp32 parameters and fused AdamW, as torch_llama_bench.py; a step is forward, backward,
clip_grad_norm_(1.0), AdamW, zero_grad; the median step after --warmup is timed. One JSON line per mode:
tokens/s, step ms, peak memory.
  torch_moe_bench.py [--mode loop|grouped_mm|both] [--device cuda|cpu] [--dim 1024] [--n-experts 8] ...
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
import llama_ref  # noqa: E402
import torch_llama_bench  # noqa: E402

DEVICE = "cpu"


class GroupedExperts(nn.Module):
    """The block's experts as three stacked weights, (E, F, C), (E, F, C), (E, C, F): rows sorted by expert, each
    matrix one torch._grouped_mm (offsets: the experts' cumulative row counts), SwiGLU between, scattered back with
    the routing weights."""

    def __init__(self, block):
        super().__init__()
        ex = block.experts
        names = ex[0].names  # (gate, up, down): Mixtral's w1, w3, w2
        self.k, self.renormalise, self.gate = block.k, block.renormalise, block.gate
        self.w_gate = nn.Parameter(torch.stack([getattr(e, names[0]).weight.detach() for e in ex]))  # (E, F, C)
        self.w_up = nn.Parameter(torch.stack([getattr(e, names[1]).weight.detach() for e in ex]))    # (E, F, C)
        self.w_down = nn.Parameter(torch.stack([getattr(e, names[2]).weight.detach() for e in ex]))  # (E, C, F)

    def forward(self, x, router_logits=None):
        B, T, C = x.shape
        x = x.reshape(B * T, C)
        logits = self.gate(x)
        weights, experts = llama_ref.route(logits, self.k, self.renormalise)  # (N, k) each
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.w_gate.shape[0])
        offs = torch.cumsum(counts, 0).to(torch.int32)
        tok = order // self.k
        xs = x[tok].to(torch.bfloat16)  # (N*k, C) by expert
        dt = torch.bfloat16
        g = torch._grouped_mm(xs, self.w_gate.to(dt).transpose(-2, -1), offs=offs)
        u = torch._grouped_mm(xs, self.w_up.to(dt).transpose(-2, -1), offs=offs)
        h = torch._grouped_mm(F.silu(g) * u, self.w_down.to(dt).transpose(-2, -1), offs=offs)  # (N*k, C)
        h = h * weights.reshape(-1)[order, None].to(h.dtype)
        out = torch.zeros(B * T, C, dtype=h.dtype, device=x.device).index_add_(0, tok, h)
        if router_logits is not None:
            router_logits.append(logits)
        return out.view(B, T, C).to(x.dtype)


def loop_forward(self, x, router_logits=None):
    """llama_ref.SparseMoeBlock.forward (transformers' loop) with each expert's output cast to the rows' dtype
    before it is added in, as transformers' MixtralSparseMoeBlock does (under autocast they differ)."""
    B, T, C = x.shape
    x = x.reshape(B * T, C)
    logits = self.gate(x)
    weights, experts = llama_ref.route(logits, self.k, self.renormalise)
    out = torch.zeros_like(x)
    for e, expert in enumerate(self.experts):
        slot, tok = torch.where(experts.t() == e)
        out.index_add_(0, tok, (expert(x[tok]) * weights[tok, slot, None]).to(out.dtype))
    if router_logits is not None:
        router_logits.append(logits)
    return out.view(B, T, C)


def run(a, mode):
    result = {"impl": f"torch_moe_{mode}", "batch": a.batch_size, "seq": a.seq_len, "dtype": "bf16",
              "torch": torch.__version__, "experts": a.n_experts, "top_k": a.top_k,
              "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"}
    if mode == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        result["error"] = f"torch._grouped_mm is not in PyTorch {torch.__version__}"
        return result
    cfg = {"model_type": "mixtral", "hidden_size": a.dim, "num_hidden_layers": a.n_layers,
           "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "intermediate_size": a.ffn_dim,
           "num_local_experts": a.n_experts, "num_experts_per_tok": a.top_k, "router_jitter_noise": 0.0,
           "sliding_window": None, "vocab_size": a.vocab_size, "rms_norm_eps": 1e-5, "rope_theta": 1e6}
    try:
        torch.manual_seed(0)
        model = llama_ref.LlamaForCausalLM(llama_ref.LlamaConfig(cfg))
        for p in model.parameters():
            torch.nn.init.normal_(p, 0.0, 0.02) if p.dim() >= 2 else torch.nn.init.ones_(p)
        if mode == "loop":
            llama_ref.SparseMoeBlock.forward = loop_forward
        if mode == "grouped_mm":
            for m in list(model.modules()):
                for name, child in list(m.named_children()):
                    if isinstance(child, llama_ref.SparseMoeBlock):
                        setattr(m, name, GroupedExperts(child))
        model = model.to(DEVICE)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        kw = {"fused": True} if DEVICE == "cuda" else {}
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=3e-4, betas=(0.9, 0.95), eps=1e-8, **kw)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, a.vocab_size, (a.batch_size, a.seq_len), generator=g).to(DEVICE)
        y = torch.randint(0, a.vocab_size, (a.batch_size, a.seq_len), generator=g).to(DEVICE)

        def step():
            with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, a.vocab_size), y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, loss = [], None
        for s in range(a.warmup + a.steps):
            torch_llama_bench.sync()
            t0 = time.perf_counter()
            loss = step()
            torch_llama_bench.sync()
            if s >= a.warmup:
                times.append(time.perf_counter() - t0)
    except RuntimeError as e:
        if "out of memory" not in str(e).lower():
            result["error"] = str(e).splitlines()[0][:300]
            return result
        result["error"] = "oom"
        return result
    t = sorted(times)[len(times) // 2]
    result.update({"tokens_per_s": round(a.batch_size * a.seq_len / t, 1), "step_ms": round(1e3 * t, 2),
                   "last_loss": round(float(loss), 4)})
    if DEVICE == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


def main():
    global DEVICE
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in [("dim", 1024), ("n-layers", 8), ("n-heads", 16), ("n-kv-heads", 8), ("ffn-dim", 3584),
                          ("n-experts", 8), ("top-k", 2), ("vocab-size", 32000), ("seq-len", 2048),
                          ("batch-size", 8), ("steps", 6), ("warmup", 2)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--mode", choices=["loop", "grouped_mm", "both"], default="both")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = p.parse_args()
    DEVICE = a.device
    torch_llama_bench.DEVICE = DEVICE
    torch_llama_bench.patch_reference()
    for mode in (["loop", "grouped_mm"] if a.mode == "both" else [a.mode]):
        print(json.dumps(run(a, mode)), flush=True)


if __name__ == "__main__":
    main()
