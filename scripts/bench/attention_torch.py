#!/usr/bin/python3
"""PyTorch's scaled_dot_product_attention on the shapes of meshtrain's attention
benchmarks (scripts/bench/bench_attention.cpp, bench_attention_gpu.cpp), same JSON line and FLOP count:
forward 4 B H T^2 hd (halved when causal), backward 2.5x the forward.
  attention_torch.py [--device cuda|cpu] [--dtype bf16|fp32] [--B 4] [--H 16] [--KV 16] [--T 8192] [--hd 128]
                     [--causal 1] [--iters 10] [--backend default|flash|cudnn|efficient|math]
--KV below --H: grouped-query, k and v repeated to H heads inside the timed step (as a GQA model does).
--backend picks SDPA's implementation through torch.nn.attention.sdpa_kernel (torch >= 2.3; 2.0-2.2:
torch.backends.cuda.sdp_kernel, without cudnn); default lets PyTorch choose. One JSON line always: the
figures, or {"kernel": "torch_sdpa_<backend>", "error": ...} when the backend cannot run here (older torch,
no such kernel for this device, dtype or shape, out of memory).
"""
import argparse
import contextlib
import json
import time

import torch
import torch.nn.functional as F

BACKENDS = ("default", "flash", "cudnn", "efficient", "math")


def backend_context(name):
    """A context manager restricting SDPA to one backend, or raising RuntimeError saying why it cannot."""
    if name == "default":
        return contextlib.nullcontext()
    if not hasattr(F, "scaled_dot_product_attention"):
        raise RuntimeError(f"torch {torch.__version__} has no scaled_dot_product_attention (needs >= 2.0)")
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # torch >= 2.3
        member = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                  "math": "MATH"}[name]
        if not hasattr(SDPBackend, member):
            raise RuntimeError(f"torch {torch.__version__} has no SDPBackend.{member}")
        return sdpa_kernel([getattr(SDPBackend, member)])
    except ImportError:
        if name == "cudnn":
            raise RuntimeError(f"torch {torch.__version__} has no cuDNN SDPA backend (needs >= 2.3)")
        flags = {"enable_flash": name == "flash", "enable_mem_efficient": name == "efficient",
                 "enable_math": name == "math"}
        return torch.backends.cuda.sdp_kernel(**flags)


def attention(q, k, v, causal):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # torch < 2.0: the naive form
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in [("B", 4), ("H", 16), ("KV", 0), ("T", 8192), ("hd", 128), ("causal", 1), ("iters", 10)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--backend", choices=BACKENDS, default="default")
    a = p.parse_args()
    a.KV = a.KV or a.H
    assert a.H % a.KV == 0, "H must be a multiple of KV"
    row = {"kernel": "torch_sdpa" if a.backend == "default" else f"torch_sdpa_{a.backend}", "backend": a.backend,
           "device": a.device, "dtype": a.dtype, "causal": bool(a.causal), "B": a.B, "H": a.H, "KV": a.KV, "T": a.T,
           "hd": a.hd, "torch": torch.__version__}
    if not hasattr(F, "scaled_dot_product_attention"):
        row["sdpa"] = False  # the naive form stands in (default backend only)
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32

    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()

    try:
        ctx = backend_context(a.backend)
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(a.B, h, a.T, a.hd, generator=g).to(a.device, dt) for h in (a.H, a.KV, a.KV, a.H))
        for t in (q, k, v):
            t.requires_grad_(True)

        def time_it(backward):
            def once():
                kk, vv = (k, v) if a.KV == a.H else (x.repeat_interleave(a.H // a.KV, dim=1) for x in (k, v))
                o = attention(q, kk, vv, bool(a.causal))
                if backward:
                    o.backward(do)
            once()
            sync()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                once()
            sync()
            return (time.perf_counter() - t0) / a.iters

        with ctx:
            fwd_s, all_s = time_it(False), time_it(True)
    except (RuntimeError, NotImplementedError) as e:  # no kernel for this backend, device, dtype or shape; OOM
        row["error"] = " ".join(str(e).split())[:300]
        print(json.dumps(row), flush=True)
        return
    flops = 4.0 * a.B * a.H * a.T * a.T * a.hd * (0.5 if a.causal else 1.0)
    row.update({"fwd_ms": round(1e3 * fwd_s, 3), "fwdbwd_ms": round(1e3 * all_s, 3),
                "fwd_tflops": round(flops / fwd_s / 1e12, 2), "fwdbwd_tflops": round(3.5 * flops / all_s / 1e12, 2)})
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
