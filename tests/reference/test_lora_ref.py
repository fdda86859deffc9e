#!/usr/bin/python3
"""Checks tests/reference/lora_ref.py, the independent LoRA reference meshtrain's LoRA tests compare against.

  /usr/bin/python3 tests/reference/test_lora_ref.py

Each check can fail. The LoRA layer against finite differences (f64); the adapters' gradients against the chain
rule through the full gradient that scripts/reference/llama_ref.py (a separate implementation) computes on the
merged model; lora_ref's Llama forward against llama_ref's (f64 logits, f32 loss, masks, batch order, LR
schedule); B = 0 gives the base's loss and no gradient for A; the merged model's logits equal the base + adapter
logits (f64, 1e-10) and its weights W + scale B A (NumPy, f64); rsLoRA's scale; PEFT's names and shapes through
make-adapter and the reader; the base frozen (no gradient, unchanged) after training; the AdamW and clipping
against torch.optim.AdamW and clip_grad_norm_; the command line (compare-adapters / compare-models name what
differs; dropout, unknown targets and a directory without adapter_config.json are refused).
Prints "N passed, N failed" last; skipped (exit 77) without NumPy and PyTorch.
"""
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import shutil
import tempfile
import time

from reference_env import L, np, run_check, torch  # exits 77 without NumPy and PyTorch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import lora_ref as R  # noqa: E402

TESTS = []
TMP = tempfile.mkdtemp(prefix="lora_ref_test.")


def test(fn):
    TESTS.append(fn)
    return fn


def run_cli(*args):
    """lora_ref.main(args) in this process: (exit code, stdout + exit message)."""
    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            R.main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, int) and e.code is not None:
                out.write(str(e.code))
    return code, out.getvalue()


def make_base(name, tied=False, spread=True, seed=0):
    """A llama_ref-initialised Hugging Face directory; with spread, weights x8 and norm gains around 1 so that the
    logits are far from uniform (a misplaced term shows)."""
    d = os.path.join(TMP, name)
    if os.path.exists(d):
        return d
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
           "vocab_size": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
           "tie_word_embeddings": tied}
    m = L.LlamaForCausalLM(L.LlamaConfig(cfg))
    L.init_weights(m, seed)
    if spread:
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if p.dim() == 1:
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
                else:
                    p.mul_(8.0)
    os.makedirs(d)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    L.write_safetensors(os.path.join(d, "model.safetensors"), m.state_dict())
    return d


def make_data(vocab=64, n=2000):
    d = os.path.join(TMP, "data")
    if not os.path.exists(d):
        os.makedirs(d)
        g = np.random.default_rng(5)
        # two shards: the stream is their concatenation in name order
        L.write_shard(os.path.join(d, "s_001.bin"), g.integers(0, vocab, n // 2))
        L.write_shard(os.path.join(d, "s_000.bin"), g.integers(0, vocab, n - n // 2))
        mask = (g.random(n - n // 2) < 0.6).astype(np.uint8)
        L.write_mask(os.path.join(d, "s_000.mask"), mask)  # s_001 has none: all ones
    return os.path.join(d, "s_*.bin")


def make_adapter(base, name, rank=4, alpha=8, b_std=0.05, rslora=False, targets=None, seed=1):
    out = os.path.join(TMP, name)
    args = ["make-adapter", "--model", base, "--rank", rank, "--alpha", alpha, "--seed", seed, "--b-std", b_std,
            "--out", out]
    if rslora:
        args.append("--rslora")
    if targets:
        args += ["--targets", targets]
    code, text = run_cli(*args)
    assert code == 0, text
    return out


class Args:
    """train's options (llama_ref.py train's defaults) for in-process runs."""

    def __init__(self, **kw):
        self.steps, self.batch_size, self.seq_len, self.micro_batch_size = 4, 4, 16, 0
        self.lr, self.schedule, self.warmup_steps, self.lr_min = 3e-3, "cosine", 1, 3e-4
        self.weight_decay, self.beta1, self.beta2, self.eps, self.grad_clip = 0.1, 0.9, 0.95, 1e-8, 1.0
        self.__dict__.update(kw)


def tokens_1d(n=12, vocab=64, seed=3):
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(seed))

# ------------------------------------------------------------------ the layer


@test
def lora_layer_gradients_match_finite_differences():
    g = torch.Generator().manual_seed(0)
    lin = R.LoRALinear(6, 5).double()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(6, 5, generator=g, dtype=torch.float64))
    lin.add_adapter(torch.randn(3, 5, generator=g, dtype=torch.float64),
                    torch.randn(6, 3, generator=g, dtype=torch.float64), 1.7)
    x = torch.randn(2, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    proj = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)

    def f():
        return (torch.tanh(lin(x)) * proj).sum()

    f().backward()
    assert lin.weight.grad is None and not lin.weight.requires_grad, "the base weight got a gradient"
    worst = 0.0
    for t in (lin.lora_A, lin.lora_B, x):
        for idx in [(0, 0), (1, 2), (2, 1)] if t.dim() == 2 else [(0, 0, 0), (1, 3, 4), (0, 2, 1)]:
            with torch.no_grad():
                old = t[idx].item()
                t[idx] = old + 1e-6
                up = f().item()
                t[idx] = old - 1e-6
                down = f().item()
                t[idx] = old
            fd = (up - down) / 2e-6
            worst = max(worst, abs(fd - t.grad[idx].item()))
    assert worst < 1e-7, worst
    # And the forward is x W^T + scale (x A^T) B^T, written with the merged weight.
    with torch.no_grad():
        want = x @ (lin.weight + 1.7 * lin.lora_B @ lin.lora_A).t()
        assert torch.allclose(lin(x), want, rtol=0, atol=1e-12)
    return f"max |fd - autograd| {worst:.1e}"


@test
def adapter_gradients_are_the_chain_rule_of_llama_refs_full_gradient():
    """dL/dB = scale * dL/dW' A^T and dL/dA = scale * B^T dL/dW' with W' = W + scale B A, the dL/dW' from llama_ref's
    full training gradient of the merged model (another implementation), every target, f64."""
    base = make_base("chain")
    ad = make_adapter(base, "chain_ad", b_std=0.3)
    merged = os.path.join(TMP, "chain_merged")
    code, text = run_cli("merge", "--model", base, "--adapter", ad, "--out", merged)
    assert code == 0, text
    x = tokens_1d()
    y = tokens_1d(seed=4)
    m = R.load(base, ad, torch.float64)
    R.token_ce(m(x), y).mean().backward()
    # the merged file is F32: rebuild the merged weights in f64 for the full-gradient side
    ref = L.load_model(base, torch.float64)
    cfg, w = R.read_adapter(ad, m.c)
    sd = ref.state_dict()
    with torch.no_grad():
        for path, lin in m.adapters():
            A = torch.from_numpy(w[f"base_model.model.{path}.lora_A.weight"]).double()
            B = torch.from_numpy(w[f"base_model.model.{path}.lora_B.weight"]).double()
            sd[path + ".weight"].add_(cfg.scale * B @ A)
    ref.loss(x, y).backward()
    params = dict(ref.named_parameters())
    worst, n = 0.0, 0
    for path, lin in m.adapters():
        gw = params[path + ".weight"].grad
        worst = max(worst, float((lin.lora_B.grad - cfg.scale * gw @ lin.lora_A.detach().t()).abs().max()),
                    float((lin.lora_A.grad - cfg.scale * lin.lora_B.detach().t() @ gw).abs().max()))
        n += 1
    assert n == 14, n
    assert worst < 1e-10, worst
    return f"{n} targets, max diff {worst:.1e}"

# ------------------------------------------------------- the Llama forward


@test
def forward_matches_llama_ref_f64_logits():
    worst = 0.0
    for tied in (False, True):
        base = make_base("fwd_tied" if tied else "fwd", tied=tied, seed=2 if tied else 0)
        x = tokens_1d(n=20)
        with torch.no_grad():
            mine = R.load(base, "", torch.float64)(x)
            theirs = L.load_model(base, torch.float64)(x)
        assert mine.std() > 0.5, "logits too flat to test anything"
        worst = max(worst, float((mine - theirs).abs().max()))
    assert worst < 1e-10, worst
    return f"untied and tied, max |diff| {worst:.1e}"


@test
def base_loss_and_batches_match_llama_ref():
    """f32 loss of steps 0 and 7 (wrapped around) within 1e-6 of llama_ref's; the batch and mask windows equal
    llama_ref's get_batch / get_weights; the masked loss equals llama_ref's masked sum over the count."""
    base = make_base("fwd")
    data = make_data()
    toks, ws = R.read_stream(data, masks=True)
    ltoks, lws = L.read_tokens(data), L.read_masks(data, 16)
    assert torch.equal(toks, ltoks) and torch.equal(ws, lws)
    mine = R.load(base, "", torch.float32)
    theirs = L.load_model(base, torch.float32)
    worst = 0.0
    for step in (0, 7, 40):
        x, y, w = R.batch(toks, ws, step, 4, 16)
        lx, ly = L.get_batch(ltoks, step, 4, 16)
        assert torch.equal(x, lx) and torch.equal(y, ly) and torch.equal(w, L.get_weights(lws, step, 4, 16))
        with torch.no_grad():
            a = float(R.token_ce(mine(x), y).mean())
            b = theirs.loss(x, y).item()
            am = float((R.token_ce(mine(x), y) * w.float()).sum() / w.sum())
            bm = L.masked_ce_sum(theirs, x, y, w).item() / float(w.sum())
        worst = max(worst, abs(a - b), abs(am - bm))
    assert worst < 1e-6, worst
    return f"max |diff| {worst:.1e} (f32)"


@test
def lr_schedule_matches_llama_ref():
    for sched, warm in (("cosine", 0), ("cosine", 3), ("constant", 2)):
        a = Args(steps=10, schedule=sched, warmup_steps=warm, lr=1e-3, lr_min=1e-4)
        for s in range(10):
            assert abs(R.lr_at(s, a) - L.lr_at(s, 1e-3, sched, warm, 10, 1e-4)) < 1e-18, (sched, warm, s)

# ---------------------------------------------------------------- training


@test
def b_zero_gives_the_base_loss_and_no_gradient_for_a():
    base = make_base("fwd")
    data = make_data()
    ad = make_adapter(base, "zero_b", b_std=0)
    toks, _ = R.read_stream(data)
    x, y, _ = R.batch(toks, None, 0, 4, 16)
    with torch.no_grad():
        want = float(R.token_ce(R.load(base, "", torch.float32)(x), y).mean())
        ref = L.load_model(base, torch.float32).loss(x, y).item()
    m = R.load(base, ad, torch.float32)
    first = {}

    def log(line):  # after step 0: A had no gradient (B = 0), B had one
        if line.startswith("step 0"):
            first["A"] = max(float(p.grad.abs().max()) for _, l in m.adapters() for p in [l.lora_A])
            first["B"] = max(float(p.grad.abs().max()) for _, l in m.adapters() for p in [l.lora_B])
    out = R.train(m, toks, None, Args(steps=2), log)
    assert out["losses"][0] == want, (out["losses"][0], want)
    assert abs(out["losses"][0] - ref) < 1e-6, (out["losses"][0], ref)
    assert first["A"] == 0 and first["B"] > 0, first
    assert out["losses"][1] != want, "the adapters did not move"
    return f"loss {want:.7f} (llama_ref {ref:.7f})"


@test
def base_is_frozen_and_unchanged_after_training():
    base = make_base("fwd")
    data = make_data()
    ad = make_adapter(base, "frozen_ad", targets="q_proj,v_proj,down_proj")
    toks, ws = R.read_stream(data, masks=True)
    m = R.load(base, ad, torch.float32)
    before = {k: v.detach().clone() for k, v in m.base_tensors().items()}
    a0 = {k: v.detach().clone() for k, v in R.model_adapter_tensors(m).items()}
    R.train(m, toks, ws, Args(steps=3, micro_batch_size=2))
    trainable = {id(p) for p in m.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in m.adapter_params()}, "a base parameter is trainable"
    assert len(trainable) == 2 * 3 * m.c.n_layers
    for k, p in m.base_tensors().items():
        assert not p.requires_grad and p.grad is None, f"{k} has a gradient"
        assert torch.equal(p, before[k]), f"{k} changed"
    disk = R.read_hf_weights(base)
    assert all(np.array_equal(disk[k], before[k].numpy()) for k in disk)
    moved = [k for k, v in R.model_adapter_tensors(m).items() if not torch.equal(v, a0[k])]
    assert len(moved) == len(a0), f"{len(a0) - len(moved)} adapter tensors did not move"
    # untargeted projections have no adapter
    assert m.layers[0].proj["k_proj"].lora_A is None and m.layers[1].proj["gate_proj"].lora_B is None
    return f"{len(before)} base tensors unchanged, {len(moved)} adapter tensors trained"


@test
def micro_batches_give_the_full_batch_losses_f64():
    base = make_base("fwd")
    data = make_data()
    ad = make_adapter(base, "micro_ad")
    toks, ws = R.read_stream(data, masks=True)
    runs = []
    for micro in (0, 1):
        for masks in (None, ws):
            m = R.load(base, ad, torch.float64)
            runs.append(R.train(m, toks, masks, Args(steps=3, micro_batch_size=micro)))
    worst = max(abs(a - b) for i in (0, 1) for a, b in zip(runs[i]["losses"] + runs[i]["grad_norms"],
                                                            runs[i + 2]["losses"] + runs[i + 2]["grad_norms"]))
    assert worst < 1e-12, worst
    assert runs[0]["losses"] != runs[1]["losses"], "the masks changed nothing"
    assert "trained_tokens" in runs[1] and runs[1]["trained_tokens"][0] < 4 * 16
    return f"max |diff| {worst:.1e}"


@test
def adamw_and_clipping_match_torch():
    """R.AdamW + the clip against torch.optim.AdamW (decay on dim >= 2 only) + clip_grad_norm_, 6 steps, f64."""
    g = torch.Generator().manual_seed(9)
    init = [torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64),
            torch.randn(2, 6, generator=g, dtype=torch.float64)]
    grads = [[torch.randn(t.shape, generator=g, dtype=torch.float64) * (3.0 if s % 2 else 0.1) for t in init]
             for s in range(6)]
    mine = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    opt_a = R.AdamW(mine, 0.9, 0.95, 1e-8, 0.1)
    opt_b = torch.optim.AdamW([{"params": [theirs[0], theirs[2]], "weight_decay": 0.1},
                               {"params": [theirs[1]], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    clipped = 0
    for s in range(6):
        lr = 1e-2 * (1 - s / 10)
        for p, q, gr in zip(mine, theirs, grads[s]):
            p.grad, q.grad = gr.clone(), gr.clone()
        norm = R.global_norm(mine)
        clipped += norm > 1.0
        R.clip_grads(mine, norm, 1.0)
        tn = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        assert abs(norm - float(tn)) < 1e-12
        opt_a.step(lr)
        for grp in opt_b.param_groups:
            grp["lr"] = lr
        opt_b.step()
    worst = max(float((p - q).abs().max()) for p, q in zip(mine, theirs))
    assert worst < 1e-14 and clipped in range(1, 6), (worst, clipped)
    return f"max |diff| {worst:.1e}, {clipped} of 6 steps clipped"

@test
def train_loop_matches_a_torch_adamw_loop():
    """R.train (4 steps, warmup and cosine, clipping at every step, f64) against a loop written here with
    llama_ref's get_batch and lr_at, torch.optim.AdamW over the adapters and clip_grad_norm_: the same losses,
    norms and final adapters."""
    base = make_base("fwd")
    data = make_data()
    ad = make_adapter(base, "loop_ad", targets="k_proj,o_proj,gate_proj")
    a = Args(steps=4, warmup_steps=2, grad_clip=0.05, lr=5e-3, lr_min=1e-4)
    toks, _ = R.read_stream(data)
    m1 = R.load(base, ad, torch.float64)
    got = R.train(m1, toks, None, a)
    m2 = R.load(base, ad, torch.float64)
    params = m2.adapter_params()
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, weight_decay=a.weight_decay)
    ltoks = L.read_tokens(data)
    losses, norms = [], []
    for s in range(a.steps):
        x, y = L.get_batch(ltoks, s, a.batch_size, a.seq_len)
        opt.zero_grad(set_to_none=True)
        logits = m2(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, a.grad_clip)))
        losses.append(loss.item())
        for g in opt.param_groups:
            g["lr"] = L.lr_at(s, a.lr, a.schedule, a.warmup_steps, a.steps, a.lr_min)
        opt.step()
    assert min(norms) > a.grad_clip, norms  # every step clipped
    worst = max(abs(p - q) for p, q in zip(got["losses"] + got["grad_norms"], losses + norms))
    worst = max([worst] + [float((p - q).abs().max()) for p, q in zip(m1.adapter_params(), params)])
    assert worst < 1e-12, worst
    return f"max |diff| {worst:.1e}"

# ---------------------------------------------------------- merge and rsLoRA


@test
def merged_model_gives_the_adapter_logits_and_w_plus_scale_ba():
    base = make_base("fwd")
    ad = make_adapter(base, "merge_ad", rank=3, alpha=5, b_std=0.2, targets="q_proj,o_proj,up_proj,down_proj")
    # the merge in f64 kept in an F64 file for the 1e-10 logits check (the command writes F32)
    tensors = R.merged_tensors(base, ad)
    d64 = os.path.join(TMP, "merged64")
    os.makedirs(d64, exist_ok=True)
    R.st_write(os.path.join(d64, "model.safetensors"), tensors, "F64")
    json.dump(json.load(open(os.path.join(base, "config.json"))), open(os.path.join(d64, "config.json"), "w"))
    x = tokens_1d(n=24)
    with torch.no_grad():
        merged = R.load(d64, "", torch.float64)(x)
        adapted = R.load(base, ad, torch.float64)(x)
        plain = R.load(base, "", torch.float64)(x)
    d = float((merged - adapted).abs().max())
    assert d < 1e-10, d
    assert float((adapted - plain).abs().max()) > 1e-3, "the adapter changes nothing"
    # the command's F32 file: every base tensor, the targets W + (alpha / r) B A from NumPy
    out = os.path.join(TMP, "merged32")
    code, text = run_cli("merge", "--model", base, "--adapter", ad, "--out", out)
    assert code == 0, text
    got = R.read_hf_weights(out)
    w = R.st_read(os.path.join(base, "model.safetensors"))
    a = R.st_read(os.path.join(ad, "adapter_model.safetensors"))
    assert set(got) == set(w)
    changed = 0
    for k in w:
        want = w[k].astype(np.float64)
        parts = k.split(".")
        if parts[-2] in ("q_proj", "o_proj", "up_proj", "down_proj"):
            stem = "base_model.model." + k[:-len(".weight")]
            want = want + (5 / 3) * np.matmul(a[stem + ".lora_B.weight"].astype(np.float64),
                                              a[stem + ".lora_A.weight"].astype(np.float64))
            changed += 1
        assert np.array_equal(got[k], want.astype(np.float32)), k
    assert changed == 8 and os.path.exists(os.path.join(out, "config.json"))
    return f"logits max |diff| {d:.1e}; {changed} targets merged, {len(w) - changed} base tensors copied"


@test
def rslora_scales_by_alpha_over_sqrt_r():
    base = make_base("fwd")
    rs = make_adapter(base, "rs", rank=4, alpha=8, rslora=True, seed=3)
    plain = make_adapter(base, "rs_plain", rank=4, alpha=8, seed=3)
    equiv = make_adapter(base, "rs_equiv", rank=4, alpha=16, seed=3)  # alpha/sqrt(4) = 16/4
    c = R.AdapterConfig.read(rs)
    assert c.rslora and c.scale == 8 / 2 and R.AdapterConfig.read(plain).scale == 2.0
    x = tokens_1d()
    with torch.no_grad():
        lr, lp, le = (R.load(base, d, torch.float64)(x) for d in (rs, plain, equiv))
    assert float((lr - le).abs().max()) < 1e-12
    assert float((lr - lp).abs().max()) > 1e-3
    code, text = run_cli("compare-adapters", rs, plain)
    assert code == 1 and "use_rslora" in text, text

# ------------------------------------------------------------ files and CLI


@test
def peft_names_shapes_and_config_round_trip():
    base = make_base("fwd")
    ad = make_adapter(base, "names", rank=5, alpha=10, b_std=0.02)
    raw = open(os.path.join(ad, "adapter_model.safetensors"), "rb").read()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__", None)
    # PEFT's names, spelled out here: (out, in) of each target for dim 32, 4 heads, 2 kv heads of 8, ffn 48
    shapes = {"self_attn.q_proj": (32, 32), "self_attn.k_proj": (16, 32), "self_attn.v_proj": (16, 32),
              "self_attn.o_proj": (32, 32), "mlp.gate_proj": (48, 32), "mlp.up_proj": (48, 32),
              "mlp.down_proj": (32, 48)}
    want = {}
    for i in range(2):
        for mod, (o, n) in shapes.items():
            want[f"base_model.model.model.layers.{i}.{mod}.lora_A.weight"] = [5, n]
            want[f"base_model.model.model.layers.{i}.{mod}.lora_B.weight"] = [o, 5]
    assert {k: v["shape"] for k, v in header.items()} == want
    assert all(v["dtype"] == "F32" for v in header.values())
    cfg = json.load(open(os.path.join(ad, "adapter_config.json")))
    for k, v in {"peft_type": "LORA", "r": 5, "lora_alpha": 10, "lora_dropout": 0.0, "use_rslora": False,
                 "bias": "none", "task_type": "CAUSAL_LM", "fan_in_fan_out": False, "init_lora_weights": True,
                 "modules_to_save": None}.items():
        assert cfg[k] == v, (k, cfg[k])
    assert sorted(cfg["target_modules"]) == sorted(R.ALL_TARGETS) and cfg["base_model_name_or_path"]
    # A ~ U(-1/sqrt(in), 1/sqrt(in)), B ~ N(0, 0.02)
    t = R.st_read(os.path.join(ad, "adapter_model.safetensors"))
    for k, a in t.items():
        if "lora_A" in k:
            bound = 1 / math.sqrt(a.shape[1])
            assert np.abs(a).max() <= bound and np.abs(a).max() > 0.8 * bound, k
    bs = np.concatenate([a.ravel() for k, a in t.items() if "lora_B" in k])
    assert 0.017 < bs.std() < 0.023 and abs(bs.mean()) < 0.003, (bs.mean(), bs.std())
    # the reader, then the writer: the same bytes
    c, w = R.read_adapter(ad, R.Config.load(base))
    again = os.path.join(TMP, "names_again")
    R.write_adapter(again, c, w)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        assert open(os.path.join(ad, f), "rb").read() == open(os.path.join(again, f), "rb").read(), f
    # a model loaded from it holds exactly those values
    m = R.load(base, ad, torch.float32)
    assert all(np.array_equal(v.detach().numpy(), w[k]) for k, v in R.model_adapter_tensors(m).items())
    # the same seed draws the same adapter; another seed another
    same = make_adapter(base, "names_same", rank=5, alpha=10, b_std=0.02)
    assert run_cli("compare-adapters", ad, same, "--tol", 0)[0] == 0
    other = make_adapter(base, "names_other", rank=5, alpha=10, b_std=0.02, seed=2)
    assert run_cli("compare-adapters", ad, other)[0] == 1
    return f"{len(want)} tensors"


@test
def compare_commands_name_what_differs():
    base = make_base("fwd")
    ad = make_adapter(base, "cmp")
    cfg, w = R.read_adapter(ad, R.Config.load(base))
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"

    def variant(name, tensors=None, **over):
        c = R.AdapterConfig(cfg.r, cfg.alpha, cfg.targets, cfg.dropout, cfg.rslora, cfg.base)
        c.__dict__.update(over)
        d = os.path.join(TMP, name)
        R.write_adapter(d, c, w if tensors is None else tensors)
        return d

    near = dict(w)
    near[key] = w[key] + 5e-6
    assert run_cli("compare-adapters", ad, variant("cmp_near", near))[0] == 0
    far = dict(w)
    far[key] = w[key] + 1e-4
    code, text = run_cli("compare-adapters", ad, variant("cmp_far", far))
    assert code == 1 and key in text, text
    fewer = {k: v for k, v in w.items() if k != key}
    code, text = run_cli("compare-adapters", variant("cmp_fewer", fewer), ad)
    assert code == 1 and key in text and "only" in text, text
    code, text = run_cli("compare-adapters", ad, variant("cmp_alpha", alpha=9))
    assert code == 1 and "lora_alpha" in text, text
    code, text = run_cli("compare-adapters", ad, variant("cmp_order", targets=list(reversed(cfg.targets))))
    assert code == 0, text  # target_modules compare as sets
    # models: a copy equal, one element moved by 2e-6 named
    m1 = os.path.join(TMP, "cmp_m1")
    assert run_cli("merge", "--model", base, "--adapter", ad, "--out", m1)[0] == 0
    t = R.read_hf_weights(m1)
    t["model.layers.0.self_attn.k_proj.weight"][3, 4] += 2e-6
    m2 = os.path.join(TMP, "cmp_m2")
    os.makedirs(m2)
    # sharded with an index, as meshtrain writes from several ranks
    names = sorted(t)
    half = len(names) // 2
    R.st_write(os.path.join(m2, "a.safetensors"), {k: t[k] for k in names[:half]})
    R.st_write(os.path.join(m2, "b.safetensors"), {k: t[k] for k in names[half:]})
    json.dump({"weight_map": {k: ("a" if i < half else "b") + ".safetensors" for i, k in enumerate(names)}},
              open(os.path.join(m2, "model.safetensors.index.json"), "w"))
    assert run_cli("compare-models", m1, m2, "--tol", 1e-5)[0] == 0
    code, text = run_cli("compare-models", m1, m2)
    assert code == 1 and "model.layers.0.self_attn.k_proj.weight" in text, text
    code, text = run_cli("compare-models", m1, base)
    assert code == 1 and "proj.weight" in text, text  # merged targets differ from the base


@test
def bad_input_is_refused():
    base = make_base("fwd")
    data = make_data()
    ad = make_adapter(base, "bad")
    cfg, w = R.read_adapter(ad, R.Config.load(base))
    drop = os.path.join(TMP, "bad_dropout")
    R.write_adapter(drop, R.AdapterConfig(cfg.r, cfg.alpha, cfg.targets, 0.1), w)
    train = ["train", "--model", base, "--data", data, "--steps", 1, "--batch-size", 2, "--seq-len", 8,
             "--out", os.path.join(TMP, "bad.json")]
    code, text = run_cli(*train, "--adapter", drop)
    assert code == 1 and "lora_dropout" in text, text
    code, text = run_cli("make-adapter", "--model", base, "--rank", 2, "--alpha", 1, "--seed", 0,
                         "--targets", "q_proj,lm_head", "--out", os.path.join(TMP, "bad2"))
    assert code == 1 and "lm_head" in text, text
    empty = os.path.join(TMP, "bad_empty")
    os.makedirs(empty)
    code, text = run_cli(*train, "--adapter", empty)
    assert code == 1 and "adapter_config.json" in text, text
    wrong = os.path.join(TMP, "bad_rank")  # tensors of rank 4 under r = 3
    R.write_adapter(wrong, R.AdapterConfig(3, cfg.alpha, cfg.targets), w)
    code, text = run_cli(*train, "--adapter", wrong)
    assert code == 1 and "shape" in text, text


@test
def command_line_end_to_end():
    """make-adapter, train (losses JSON, adapter-out), merge as separate processes; the adapter written by train
    loads and is the trained one (its loss at step 0's batch is below the start)."""
    base = make_base("fwd")
    data = make_data()
    exe = [sys.executable, os.path.join(HERE, "lora_ref.py")]
    ad, out, js = (os.path.join(TMP, n) for n in ("e2e_ad", "e2e_out", "e2e.json"))
    subprocess.run(exe + ["make-adapter", "--model", base, "--rank", "4", "--alpha", "8", "--seed", "0",
                          "--out", ad], check=True, capture_output=True)
    r = subprocess.run(exe + ["train", "--model", base, "--adapter", ad, "--data", data, "--steps", "6",
                              "--batch-size", "4", "--seq-len", "16", "--lr", "1e-2", "--threads", "1",
                              "--schedule", "constant", "--out", js, "--adapter-out", out],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    j = json.load(open(js))
    assert len(j["losses"]) == len(j["grad_norms"]) == len(j["lrs"]) == 6 and j["lrs"] == [1e-2] * 6
    assert R.AdapterConfig.read(out).to_json() == R.AdapterConfig.read(ad).to_json()
    assert run_cli("compare-adapters", ad, out)[0] == 1  # trained
    code, text = run_cli("loss", "--model", base, "--adapter", out, "--data", data, "--batch-size", 4,
                         "--seq-len", 16)
    assert code == 0 and json.loads(text)["loss"] < j["losses"][0], (text, j["losses"][0])


def main():
    t0 = time.time()
    torch.set_num_threads(1)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    try:
        for fn in TESTS:
            run_check(counts, fn.__name__, fn)
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
    print(f"({time.time() - t0:.1f} s)")
    print(f"{counts['passed']} passed, {counts['failed']} failed")
    sys.exit(1 if counts["failed"] else 0)


if __name__ == "__main__":
    main()
