#!/usr/bin/python3
"""The parsing and tables of scripts/bench/bench_gpu.sh (issue 17 part 5). Subcommands:
  meshtrain METRICS LOG --batch B --seq T --model d,L,H,KV,F,V [--smi FILE] [--skip 5] [--until N]
      one JSON line for the 1B run (median tokens/s, MFU and step time of steps --skip + 1 to --until: the
      profiled steps after those are left out; peak memory), then one
      for the memory check: the measured peak beside the expected bytes (how: see expected_memory)
  profile METRICS [--cpu]    the kernel-profile record of a run with MT_PROFILE_KERNELS=1 as one JSON line
  summary RESULTS            the summary table of every JSON line in RESULTS
  error KEY=VALUE... MESSAGE a JSON error row with those keys
  tag PART                   copies the JSON lines of stdin with "part": PART added (other lines dropped)
Only the standard library: runs with any python3.
"""
import json
import re
import sys

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16
PEAK_BW = 4.8e12     # H200 HBM3e


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else None


def arg(argv, name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def expected_memory(d, L, H, KV, F, V, B, T, state_bytes):
    """Expected peak device bytes of a bf16 step (no recompute, one micro-batch), as a dict of terms.
    state: 18 B per parameter (f32 master, bf16 copy, f32 gradient, AdamW m and v), or the run's own count.
    Saved for backward per token and layer, bf16: the layer input, the two normed inputs, q, k, v (after RoPE),
    the attention output, the residual sum, gate, up and their product: 6 d + 2 KV hd + 3 F elements; f32: the
    attention log-sum-exp (H) and two RMSNorm rstd. Beside the layers: the final norm's input and output (2 d),
    the logits (V, bf16; they hold their gradient during backward and live until the step's end), f32 losses.
    The peak is in the last layer's MLP backward: everything above plus its gradient temporaries (3 F + 2 d).
    Plus cuBLASLt's 32 MiB workspace. Not counted: the caching allocator's rounding (2 MiB blocks; a cached
    block up to twice the request is reused) and NCCL's buffers."""
    N = B * T
    hd = d // H
    n_params = L * (2 * d * d + 2 * d * KV * hd + 3 * d * F + 2 * d) + d + 2 * V * d
    terms = {
        "model state (18 B x params)": state_bytes if state_bytes else 18 * n_params,
        "saved activations": N * L * (2 * (6 * d + 2 * KV * hd + 3 * F) + 4 * H + 8),
        "final norm, logits, losses": N * (2 * 2 * d + 4 + 2 * V + 4) + 2 * N * 4,
        "backward temporaries (last MLP)": N * 2 * (3 * F + 2 * d),
        "cuBLASLt workspace": 32 << 20,
    }
    return terms


def cmd_meshtrain(argv):
    metrics, log = argv[0], argv[1]
    B, T = int(arg(argv, "--batch")), int(arg(argv, "--seq"))
    d, L, H, KV, F, V = (int(x) for x in arg(argv, "--model").split(","))
    skip = int(arg(argv, "--skip", "5"))
    rows, extra = [], {}
    for line in open(metrics):
        r = json.loads(line)
        if "tokens_per_s" in r:
            rows.append(r)
        else:
            extra.update(r)
    until = int(arg(argv, "--until", "0")) or None
    rows = [r for r in rows if until is None or r["step"] <= until] or rows
    timed = rows[skip:] or rows
    out = {"part": "1b", "impl": "meshtrain", "batch": B, "seq": T, "steps_timed": len(timed),
           "tokens_per_s": round(median([r["tokens_per_s"] for r in timed]), 1),
           "mfu": round(median([r["mfu"] for r in timed]), 4),
           "step_ms": round(median([r["step_ms"] for r in timed]), 2),
           "peak_mem_bytes": max(r["peak_mem_bytes"] for r in rows)}
    if "reserved_bytes" in extra:
        out["reserved_bytes"] = extra["reserved_bytes"]
    state = None
    text = open(log, errors="replace").read()
    m = re.search(r"model state on rank 0: ([0-9.]+) MiB", text)
    if m:
        state = float(m.group(1)) * 2**20
        out["model_state_bytes"] = state
    smi = arg(argv, "--smi")
    if smi:
        try:
            used = [float(x) for x in open(smi).read().split() if re.fullmatch(r"[0-9.]+", x)]
            if used:
                out["nvidia_smi_peak_mib"] = max(used)
        except OSError:
            pass
    print(json.dumps(out))
    terms = expected_memory(d, L, H, KV, F, V, B, T, state)
    expected = sum(terms.values())
    mem = {"part": "memory", "device": "cuda" if "--cpu" not in argv else "cpu",
           "measured_bytes": out["peak_mem_bytes"], "expected_bytes": expected,
           "ratio": round(out["peak_mem_bytes"] / expected, 3),
           "terms_gib": {k: round(v / 2**30, 3) for k, v in terms.items()},
           "how": "measured: the caching allocator's peak of bytes in live tensors (metrics peak_mem_bytes); "
                  "expected: " + " + ".join(terms)}
    if "--cpu" in argv:
        mem["note"] = "CPU run: measured is the process's peak resident memory (everything), not a device figure"
    for k in ("reserved_bytes", "nvidia_smi_peak_mib"):
        if k in out:
            mem[k] = out[k]
    print(json.dumps(mem))


def cmd_profile(argv):
    gpu = "--cpu" not in argv  # the H200's ridge point applies to a GPU run only
    rec = None
    for line in open(argv[0]):
        r = json.loads(line)
        if "kernel_profile" in r:
            rec = r
    if rec is None:
        print(json.dumps({"part": "profile", "error": "no kernel_profile record in the metrics"}))
        return
    ops = rec["kernel_profile"]
    total = sum(o["ms"] for o in ops) or 1
    top = []
    for o in ops[:10]:
        s = o["ms"] * 1e-3
        e = {"op": o["op"], "calls": o["calls"], "ms": round(o["ms"], 3), "share": round(o["ms"] / total, 4)}
        if o["flops"] > 0 and s > 0:
            e["tflops"] = round(o["flops"] / s / 1e12, 2)
        if o["bytes"] > 0 and s > 0:
            e["gbps"] = round(o["bytes"] / s / 1e9, 1)
        if o["bytes"] > 0 and gpu:
            ai = o["flops"] / o["bytes"]
            e["flop_per_byte"] = round(ai, 1)
            e["bound_estimate"] = ("communication" if o["op"].startswith("nccl:") else
                                   "compute" if ai >= PEAK_FLOPS / PEAK_BW else "memory")
        top.append(e)
    print(json.dumps({"part": "profile", "profiled_steps": rec.get("profiled_steps"), "wall_ms": rec.get("wall_ms"),
                      "timed_ms": round(total, 3), "top": top}))


def fmt(v, f="{:.1f}"):
    return "-" if v is None else f.format(v)


def cmd_summary(argv):
    rows = []
    for line in open(argv[0]):
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    out = []

    def add(item, ours, ref, ratio, target, note=""):
        out.append((item, ours, ref, ratio, target, note))

    def err(r):
        return "error: " + str(r["error"])[:56]

    one = {r.get("impl"): r for r in rows if r.get("part") == "1b"}
    m, e, c = one.get("meshtrain"), one.get("torch_eager"), one.get("torch_compile")

    def tps(r):
        if r is None:
            return "not run"
        return err(r) if "error" in r else f"{r['tokens_per_s']:.0f} tok/s"

    ok = lambda r: r is not None and "error" not in r  # noqa: E731
    add("1B: meshtrain tokens/s vs torch.compile", tps(m), tps(c),
        fmt(m["tokens_per_s"] / c["tokens_per_s"], "{:.2f}x") if ok(m) and ok(c) else "-", ">= 1.1x",
        (f"batch {m['batch']} x {m['seq']}; peak memory meshtrain {m['peak_mem_bytes'] / 2**30:.1f} GiB"
         + (f", compile {c['peak_mem_gib']:.1f} GiB" if ok(c) and "peak_mem_gib" in c else "")
         + (f", eager {e['peak_mem_gib']:.1f} GiB" if ok(e) and "peak_mem_gib" in e else "")) if ok(m) else "")
    add("1B: meshtrain vs PyTorch eager (SDPA)", tps(m), tps(e),
        fmt(m["tokens_per_s"] / e["tokens_per_s"], "{:.2f}x") if ok(m) and ok(e) else "-", "",
        ("eager micro-batch " + str(e.get("micro_batch"))) if ok(e) and e.get("micro_batch") else "")
    add("1B: MFU (989 TFLOP/s, 6N + 12LdT)", fmt(m["mfu"] * 100, "{:.1f}%") if ok(m) else tps(m),
        fmt(c["mfu"] * 100, "{:.1f}% (compile)") if ok(c) else "-", "", ">= 50%")
    att = [r for r in rows if r.get("part") == "attention"]
    for T, hd in sorted({(r.get("T"), r.get("hd")) for r in att if r.get("T")}, reverse=True):
        at = {r.get("kernel"): r for r in att if r.get("T") == T and r.get("hd") == hd}
        ours, fl, cu = at.get("meshtrain"), at.get("torch_sdpa_flash"), at.get("torch_sdpa_cudnn")

        def tf(r):
            if r is None:
                return "not run"
            return err(r) if "error" in r else f"{r['fwdbwd_tflops']:.1f} TFLOP/s"
        add(f"attention T {T} hd {hd} fwd+bwd (causal half)", tf(ours), "flash " + tf(fl),
            fmt(ours["fwdbwd_tflops"] / fl["fwdbwd_tflops"], "{:.2f}x") if ok(ours) and ok(fl) else "-",
            ">= 1.0x flash", "cuDNN " + tf(cu))
        mc = at.get("meshtrain_cudnn")  # meshtrain's attention through cuDNN (attention.kernel: cudnn)
        if mc is not None:
            add(f"attention T {T} hd {hd} through cuDNN (attention.kernel cudnn)", tf(mc), "SDPA cuDNN " + tf(cu),
                fmt(mc["fwdbwd_tflops"] / cu["fwdbwd_tflops"], "{:.2f}x") if ok(mc) and ok(cu) else "-",
                ">= 0.9x SDPA cuDNN", "")
    for r in [r for r in att if not r.get("T") and "error" in r]:
        add(f"attention ({r.get('kernel')})", err(r), "", "", "")
    red = [r for r in rows if r.get("bench") == "redistribute"]
    for r in red:
        if "error" in r:
            add(f"redistribution ({r.get('ranks', '?')} rank(s))", err(r), "", "", "")
    for kase in sorted({r["case"] for r in red if "case" in r}):
        for ranks in sorted({r["ranks"] for r in red if r.get("case") == kase}):
            rs = [r for r in red if r.get("case") == kase and r["ranks"] == ranks]
            # One rank exchanges nothing: its device figure is the device half of a tp = 2 change (pack/unpack).
            is_dev = ((lambda r: " pack_blocks" in r["path"] or " unpack_blocks" in r["path"]) if ranks == 1
                      else (lambda r: r["path"].startswith("redistribute")))
            dev = next((r for r in rs if is_dev(r)), None)
            host = next((r for r in rs if r["path"].startswith("host")), None)
            est = next((r for r in rs if r.get("estimate")), None)
            if dev is None:
                continue
            share = (lambda r: f", {100 * r['ms'] / r['step_ms']:.2f}% of a step" if r and r.get("step_ms") else "")
            what = "device pack/unpack of tp = 2" if ranks == 1 else f"redistribute, {dev['backend']}"
            add(f"{kase}, {ranks} rank(s): {what} (ratio: host-staged / it)",
                f"{dev['ms']:.3f} ms{share(dev)}", f"host-staged {host['ms']:.3f} ms{share(host)}" if host else "-",
                fmt(host["ms"] / dev["ms"], "{:.1f}x") if host and dev["ms"] > 0 else "-", "",
                f"2-GPU estimate {est['ms']:.3f} ms{share(est)}" if est else "")
    mem = next((r for r in rows if r.get("part") == "memory"), None)
    if mem is not None:
        if "error" in mem:
            add("peak memory vs expected", err(mem), "", "", "")
        else:
            add("peak memory vs expected", f"{mem['measured_bytes'] / 2**30:.2f} GiB",
                f"{mem['expected_bytes'] / 2**30:.2f} GiB", f"{mem['ratio']:.2f}", "~1",
                mem.get("note", "") or (f"reserved {mem['reserved_bytes'] / 2**30:.2f} GiB" if "reserved_bytes" in mem
                                         else ""))
    prof = next((r for r in rows if r.get("part") == "profile"), None)
    if prof is not None:
        if "error" in prof:
            add("kernel profile", err(prof), "", "", "")
        else:
            for i, o in enumerate(prof["top"][:3]):
                add(f"kernel #{i + 1}: {o['op']}", f"{100 * o['share']:.1f}% of op time",
                    fmt(o.get("tflops"), "{:.1f} TFLOP/s") if o.get("tflops") else fmt(o.get("gbps"), "{:.0f} GB/s"),
                    "", "", "bound (estimate): " + o.get("bound_estimate", "-"))
    w = [max(len(str(x[i])) for x in out + [("item", "meshtrain", "reference", "ratio", "target", "note")])
         for i in range(6)]
    line = lambda x: " | ".join(str(v).ljust(w[i]) for i, v in enumerate(x))  # noqa: E731
    print(line(("item", "meshtrain", "reference", "ratio", "target", "note")))
    print("-+-".join("-" * n for n in w))
    for x in out:
        print(line(x))


def cmd_error(argv):
    d = dict(a.split("=", 1) for a in argv[:-1])
    for k in ("ranks", "T", "hd"):
        if k in d and d[k].isdigit():
            d[k] = int(d[k])
    d["error"] = " ".join(argv[-1].split())[:300] or "failed (no message)"
    print(json.dumps(d))


def cmd_tag(argv):
    for line in sys.stdin:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
        except ValueError:
            continue
        r.setdefault("part", argv[0])
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    {"meshtrain": cmd_meshtrain, "profile": cmd_profile, "summary": cmd_summary, "error": cmd_error,
     "tag": cmd_tag}[sys.argv[1]](sys.argv[2:])
