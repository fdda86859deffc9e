#!/usr/bin/python3
"""Checks scripts/reference/llama_ref.py against independent computations.

  /usr/bin/python3 tests/reference/test_reference.py

Plain asserts, no pytest. Each check is written a different way from the code it
tests (complex numbers for RoPE, repeated kv heads and per-head loops for
attention, a NumPy forward for the whole model, finite differences for
gradients; Meta's per-frequency loop for llama3 RoPE scaling and divided positions
for linear) so that a shared misunderstanding is unlikely to pass unnoticed.
The Llama 3.x / Mistral / Qwen2 checks (issue 26) cover both config.json RoPE
spellings, biases, head_dim and what is refused. The Qwen3 / Mixtral / Qwen2-MoE /
Qwen3-MoE checks compare the experts' loop with a dense all-experts formulation and
a per-token NumPy loop, the balance loss with a count-based formula and finite
differences, and the dense/sparse layer pattern, init and refusals. The loss masks
(issue 41) against the counted targets picked out by index, in micro-batches, and
the mask files' checks. Phi-3's (issue 53): tests/reference/phi3_checks.py.
"""
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile

from reference_env import F, L, REF, np, run_check, torch  # exits 77 without NumPy and PyTorch

TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


def tiny_config(tied=False, **over):
    d = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 48, "vocab_size": 50, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "max_position_embeddings": 64, "tie_word_embeddings": tied}
    d.update(over)
    return L.LlamaConfig(d)


def tiny_model(tied=False, dtype=torch.float64, seed=0, **over):
    m = L.LlamaForCausalLM(tiny_config(tied, **over))
    L.init_weights(m, seed)
    with torch.no_grad():  # non-trivial norm gains, so a missing or misplaced gain would show
        g = torch.Generator().manual_seed(seed + 100)
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return m.to(dtype)

# ------------------------------------------------------------------- RoPE


def central_difference(m, x, y, p, idx, eps=1e-6):
    """d m.loss(x, y) / d p[idx] by central differences (p[idx] restored): the finite-difference checks' probe."""
    with torch.no_grad():
        old = p[idx].item()
        p[idx] = old + eps
        up = m.loss(x, y).item()
        p[idx] = old - eps
        down = m.loss(x, y).item()
        p[idx] = old
    return (up - down) / (2 * eps)


@test
def rope_matches_complex_rotation():
    B, H, T, hd, theta = 2, 3, 17, 16, 500.0
    x = np.random.default_rng(1).standard_normal((B, H, T, hd))
    # Independent: pair (x_i, x_{i+hd/2}) as the complex number x_i + j*x_{i+hd/2} and rotate it by
    # pos * theta^(-2i/hd).
    half = hd // 2
    z = x[..., :half] + 1j * x[..., half:]
    freq = theta ** (-2.0 * np.arange(half) / hd)
    z = z * np.exp(1j * np.arange(T)[:, None] * freq[None, :])
    want = np.concatenate([z.real, z.imag], axis=-1)
    cos, sin = L.rope_cos_sin(T, hd, theta, torch.float64)
    got = L.apply_rope(torch.from_numpy(x), cos, sin).numpy()
    err = np.abs(got - want).max()
    assert err < 1e-12, err
    # The rotation keeps each pair's length and leaves position 0 unchanged.
    assert np.allclose(got[:, :, 0], x[:, :, 0])


@test
def rope_f32_tables_close_to_f64():
    cos32, sin32 = L.rope_cos_sin(256, 32, 10000.0, torch.float32)
    cos64, sin64 = L.rope_cos_sin(256, 32, 10000.0, torch.float64)
    assert (cos32.double() - cos64).abs().max() < 1e-4 and (sin32.double() - sin64).abs().max() < 1e-4

# -------------------------------------------------------------- attention


def attention_repeat_kv(q, k, v):
    """Independent GQA: repeat each kv head for its group of q heads, then plain per-head causal attention
    with an explicit loop over query positions."""
    B, H, T, hd = q.shape
    G = H // k.shape[1]
    k = np.repeat(k, G, axis=1)  # head h uses kv head h // G
    v = np.repeat(v, G, axis=1)
    out = np.zeros_like(q)
    for t in range(T):
        s = np.einsum("bhd,bhsd->bhs", q[:, :, t], k[:, :, : t + 1]) / math.sqrt(hd)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, :, t] = np.einsum("bhs,bhsd->bhd", p, v[:, :, : t + 1])
    return out


@test
def gqa_matches_repeated_kv_heads():
    rng = np.random.default_rng(2)
    for H, KV in [(4, 2), (8, 2), (4, 4), (6, 1)]:
        B, T, hd = 2, 9, 8
        q, k, v = (rng.standard_normal(s) for s in [(B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd)])
        got = L.gqa_attention(*map(torch.from_numpy, (q, k, v))).numpy()
        err = np.abs(got - attention_repeat_kv(q, k, v)).max()
        assert err < 1e-12, (H, KV, err)


@test
def attention_is_causal():
    # Changing the last tokens must not change earlier logits.
    m = tiny_model()
    x = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(3))
    y = x.clone()
    y[:, 8:] = (y[:, 8:] + 7) % 50
    with torch.no_grad():
        a, b = m(x), m(y)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-12, rtol=0)
    assert not torch.allclose(a[:, 8:], b[:, 8:])

# ----------------------------------------------------- RoPE scaling


def meta_llama3_freqs(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Llama 3.1's frequency scaling as Meta publishes it: a plain loop over the frequencies."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def llama3(factor=8.0, low=1.0, high=4.0, old=8192):
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": old}


@test
def rope_llama3_by_hand_in_three_regimes():
    # hd 8, theta 1e4: inv_freq 1, 0.1, 0.01, 0.001, wavelengths 2 pi x (1, 10, 100, 1000). With old 1024, low 1,
    # high 4: high_freq_wavelen 256, low_freq_wavelen 1024, so 6.3 and 62.8 are unchanged, 6283 > 1024 is divided
    # by the factor 8 and 628.3 is blended with s = (1024 / 628.3 - 1) / (4 - 1) = 0.2099155...
    got = L.rope_inv_freq(8, 10000.0, llama3(8.0, 1.0, 4.0, 1024)).tolist()
    s = (1024 / (2 * math.pi * 100) - 1) / 3
    want = [1.0, 0.1, 0.01 * ((1 - s) / 8 + s), 0.001 / 8]
    assert abs(s - 0.2099155390870) < 1e-12 and abs(want[2] - 0.003086760967011) < 1e-15
    assert all(abs(g - w) <= 1e-15 * w for g, w in zip(got, want)), (got, want)
    # Llama 3.1's own numbers (theta 5e5, hd 128, factor 8, 1, 4, 8192): every frequency as Meta's loop gives it,
    # with all three regimes present.
    plain = L.rope_inv_freq(128, 500000.0)
    got = L.rope_inv_freq(128, 500000.0, llama3())
    want = meta_llama3_freqs(plain.tolist(), 8.0, 1.0, 4.0, 8192)
    assert got.dtype == torch.float64 and np.abs(got.numpy() - want).max() <= 1e-15 * max(want)
    ratio = (plain / got).numpy()
    assert (ratio == 1).sum() > 0 and (np.abs(ratio - 8) < 1e-12).sum() > 0 and ((ratio > 1) & (ratio < 8)).sum() > 0
    # Continuous at both edges of the blend.
    for wl in (8192 / 4, 8192 / 1):
        inv = torch.tensor([2 * math.pi / (wl * (1 - 1e-9)), 2 * math.pi / (wl * (1 + 1e-9))], dtype=torch.float64)
        a, b = L.scale_inv_freq(inv, llama3()).tolist()
        assert abs(a - b) < 1e-8 * a, (wl, a, b)


@test
def rope_linear_is_positions_over_factor():
    T, hd, theta, factor = 40, 16, 10000.0, 4.0
    cos, sin = L.rope_cos_sin(T, hd, theta, torch.float64, {"rope_type": "linear", "factor": factor})
    angle = (np.arange(T) / factor)[:, None] * theta ** (-2.0 * np.arange(hd // 2) / hd)[None, :]
    angle = np.concatenate([angle, angle], -1)
    assert np.abs(cos.numpy() - np.cos(angle)).max() < 1e-13 and np.abs(sin.numpy() - np.sin(angle)).max() < 1e-13
    # Position 4 under factor 4 is position 1 unscaled.
    cos1, _ = L.rope_cos_sin(2, hd, theta, torch.float64)
    assert torch.allclose(cos[4], cos1[1], atol=1e-14, rtol=0)


@test
def rope_tables_are_f64_rounded_once():
    # The f32 tables are the f64 ones rounded (not computed in f32), with and without scaling.
    for sc in (None, llama3(8.0, 1.0, 4.0, 64)):
        c32, s32 = L.rope_cos_sin(300, 32, 500000.0, torch.float32, sc)
        c64, s64 = L.rope_cos_sin(300, 32, 500000.0, torch.float64, sc)
        assert torch.equal(c32, c64.float()) and torch.equal(s32, s64.float())

# ----------------------------------------------------- whole forward in NumPy


def numpy_forward(sd, c, tokens):
    """The whole model again, from the state dict, in NumPy f64: per-head loops, complex RoPE."""
    W = {n: t.detach().double().numpy() for n, t in sd.items()}
    hd, H, KV = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    B, T = tokens.shape

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps) * w

    # RoPE scaling, independently: linear divides the positions (not the frequencies); llama3 is Meta's
    # element-by-element loop.
    freq = c.rope_theta ** (-2.0 * np.arange(hd // 2) / hd)
    pos = np.arange(T, dtype=np.float64)
    sc = c.rope_scaling
    if sc and sc["rope_type"] == "linear":
        pos = pos / sc["factor"]
    elif sc:
        freq = np.array(meta_llama3_freqs(freq, sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"],
                                          sc["original_max_position_embeddings"]))

    def rope(x):  # x: (B, T, hd)
        half = hd // 2
        z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * pos[:, None] * freq[None, :])
        return np.concatenate([z.real, z.imag], -1)

    def linear(x, name):  # the bias, where the state dict has one, after the projection
        y = x @ W[name + ".weight"].T
        return y + W[name + ".bias"] if name + ".bias" in W else y

    def swiglu(x, pre, gate, up, down):
        g = x @ W[pre + gate + ".weight"].T
        return ((g / (1 + np.exp(-g))) * (x @ W[pre + up + ".weight"].T)) @ W[pre + down + ".weight"].T

    def moe(x, pre):
        """Token by token: softmax over the experts, the k largest, their SwiGLUs summed with the weights."""
        names = ("w1", "w3", "w2") if c.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        X = x.reshape(-1, x.shape[-1])
        out = np.zeros_like(X)
        for t in range(X.shape[0]):
            z = W[pre + "gate.weight"] @ X[t]
            pr = np.exp(z - z.max())
            pr /= pr.sum()
            top = np.argsort(-pr)[:c.num_experts_per_tok]
            w = pr[top] / (pr[top].sum() if c.norm_topk_prob else 1.0)
            for e, we in zip(top, w):
                out[t] += we * swiglu(X[t], f"{pre}experts.{e}.", *names)
            if pre + "shared_expert_gate.weight" in W:
                sg = W[pre + "shared_expert_gate.weight"] @ X[t]
                out[t] += swiglu(X[t], pre + "shared_expert.", *names) / (1 + np.exp(-sg))
        return out.reshape(x.shape)

    h = W["model.embed_tokens.weight"][tokens]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        x = norm(h, W[p + "input_layernorm.weight"])
        q = linear(x, p + "self_attn.q_proj")
        k = linear(x, p + "self_attn.k_proj")
        v = linear(x, p + "self_attn.v_proj")
        heads = []
        for hh in range(H):
            j = hh * KV // H  # the kv head serving q head hh
            qh, kh = q[..., hh * hd:(hh + 1) * hd], k[..., j * hd:(j + 1) * hd]
            if p + "self_attn.q_norm.weight" in W:  # Qwen3: each head of q and k normalised before RoPE
                qh, kh = norm(qh, W[p + "self_attn.q_norm.weight"]), norm(kh, W[p + "self_attn.k_norm.weight"])
            qh, kh = rope(qh), rope(kh)
            s = qh @ kh.transpose(0, 2, 1) / math.sqrt(hd)
            s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            heads.append((pr / pr.sum(-1, keepdims=True)) @ v[..., j * hd:(j + 1) * hd])
        h = h + linear(np.concatenate(heads, -1), p + "self_attn.o_proj")
        x = norm(h, W[p + "post_attention_layernorm.weight"])
        if p + "block_sparse_moe.gate.weight" in W:
            h = h + moe(x, p + "block_sparse_moe.")
        elif p + "mlp.gate.weight" in W:
            h = h + moe(x, p + "mlp.")
        else:
            h = h + swiglu(x, p + "mlp.", "gate_proj", "up_proj", "down_proj")
    h = norm(h, W["model.norm.weight"])
    return h @ W["lm_head.weight" if "lm_head.weight" in W else "model.embed_tokens.weight"].T


def numpy_ce(logits, targets):
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    return (lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).mean()


@test
def forward_and_loss_match_numpy():
    for tied in (False, True):
        m = tiny_model(tied)
        x = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(4))
        y = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            logits, loss = m(x).numpy(), m.loss(x, y).item()
        want = numpy_forward(m.state_dict(), m.config, x.numpy())
        assert np.abs(logits - want).max() < 1e-10, (tied, np.abs(logits - want).max())
        assert abs(loss - numpy_ce(want, y.numpy())) < 1e-10


@test
def hf_parameter_names_and_shapes():
    c = tiny_config()
    sd = L.LlamaForCausalLM(c).state_dict()
    hd = c.head_dim
    want = {"model.embed_tokens.weight": (50, 32), "model.norm.weight": (32,), "lm_head.weight": (50, 32)}
    for i in range(2):
        p = f"model.layers.{i}."
        want.update({p + "input_layernorm.weight": (32,), p + "post_attention_layernorm.weight": (32,),
                     p + "self_attn.q_proj.weight": (4 * hd, 32), p + "self_attn.k_proj.weight": (2 * hd, 32),
                     p + "self_attn.v_proj.weight": (2 * hd, 32), p + "self_attn.o_proj.weight": (32, 4 * hd),
                     p + "mlp.gate_proj.weight": (48, 32), p + "mlp.up_proj.weight": (48, 32),
                     p + "mlp.down_proj.weight": (32, 48)})
    assert {n: tuple(t.shape) for n, t in sd.items()} == want
    tied = L.LlamaForCausalLM(tiny_config(tied=True)).state_dict()
    assert set(tied) == set(want) - {"lm_head.weight"}

# -------------------------------------------------------------- gradients


@test
def finite_difference_gradients_f64():
    for tied in (False, True):
        m = tiny_model(tied)
        x = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(6))
        y = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(7))
        m.zero_grad()
        m.loss(x, y).backward()
        P = dict(m.named_parameters())
        probes = [("model.layers.0.self_attn.q_proj.weight", (3, 5)), ("model.layers.1.self_attn.k_proj.weight", (9, 2)),
                  ("model.layers.0.input_layernorm.weight", (7,)), ("model.layers.1.mlp.down_proj.weight", (4, 30)),
                  ("model.embed_tokens.weight", (int(x[0, 3]), 1)), ("model.norm.weight", (11,))]
        if not tied:
            probes.append(("lm_head.weight", (int(y[1, 2]), 6)))
        for name, idx in probes:
            p = P[name]
            fd, ad = central_difference(m, x, y, p, idx), p.grad[idx].item()
            assert abs(fd - ad) <= 1e-7 + 1e-5 * abs(ad), (tied, name, idx, fd, ad)


@test
def micro_batches_add_up_to_the_batch():
    torch.manual_seed(0)
    grads, losses = [], []
    x = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(8))
    y = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(9))
    for M in (4, 2, 1):
        m = tiny_model()
        opt = L.make_optimizer(m, 1e-3, 0.1, (0.9, 0.95), 1e-8)
        loss, norm = L.train_step(m, opt, x, y, M, lr=0.0, grad_clip=0.0)  # lr 0: only the grads matter
        losses.append(loss)
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    for g, l in zip(grads[1:], losses[1:]):
        assert (g - grads[0]).abs().max() < 1e-12 and abs(l - losses[0]) < 1e-12
    with torch.no_grad():
        assert abs(losses[0] - tiny_model().loss(x, y).item()) < 1e-12


@test
def optimizer_groups_and_clipping():
    m = tiny_model()
    opt = L.make_optimizer(m, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(m.parameters()))
    x = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(10))
    _, norm = L.train_step(m, opt, x, x.roll(-1, 1), 2, lr=0.0, grad_clip=1e-3)
    after = math.sqrt(sum((p.grad ** 2).sum().item() for p in m.parameters()))
    assert norm > 1e-3 and abs(after - 1e-3) < 1e-9, (norm, after)  # reported norm is the pre-clip one


@test
def lr_schedule():
    f = L.lr_at
    assert [f(s, 1.0, "cosine", 4, 20, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4, 1.0, "cosine", 4, 20, 0.1) == 1.0
    assert abs(f(12, 1.0, "cosine", 4, 20, 0.1) - 0.55) < 1e-12  # half-way: the mean of lr and lr_min
    assert f(19, 1.0, "constant", 4, 20, 0.1) == 1.0
    assert f(0, 1.0, "cosine", 0, 1, 0.0) == 1.0

# ------------------------------------------- Llama 3.x, Mistral, Qwen2 configs

# Variants of the tiny model: biases, a head_dim that is not hidden / heads, RoPE scaling.
FAMILIES = {"qwen2": {"model_type": "qwen2"},
            "llama_bias": {"attention_bias": True},
            "llama3_hd12": {"head_dim": 12, "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0,
                                                                "factor": 8.0, "low_freq_factor": 1.0,
                                                                "high_freq_factor": 4.0,
                                                                "original_max_position_embeddings": 16}},
            "mistral_linear": {"model_type": "mistral", "sliding_window": None,
                               "rope_scaling": {"type": "linear", "factor": 3.0}}}


@test
def families_forward_and_loss_match_numpy():
    for name, over in FAMILIES.items():
        for tied in (False, True):
            m = tiny_model(tied, **over)
            x = torch.randint(0, 50, (2, 13), generator=torch.Generator().manual_seed(4))
            y = torch.randint(0, 50, (2, 13), generator=torch.Generator().manual_seed(5))
            with torch.no_grad():
                logits, loss = m(x).numpy(), m.loss(x, y).item()
            want = numpy_forward(m.state_dict(), m.config, x.numpy())
            assert np.abs(logits - want).max() < 1e-10, (name, tied, np.abs(logits - want).max())
            assert abs(loss - numpy_ce(want, y.numpy())) < 1e-10, name
    # The scaling and the biases change the logits (so the checks above could fail).
    x = torch.randint(0, 50, (1, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = tiny_model(head_dim=12)(x)
        assert not torch.allclose(plain, tiny_model(**FAMILIES["llama3_hd12"])(x), atol=1e-6)
        m = tiny_model(model_type="qwen2")
        before = m(x)
        for n, p in m.named_parameters():
            if n.endswith(".bias"):
                p.zero_()
        assert not torch.allclose(before, m(x), atol=1e-6)


@test
def families_parameter_names():
    def biases(**over):
        return sorted(n for n in L.LlamaForCausalLM(tiny_config(**over)).state_dict() if n.endswith(".bias"))
    qkv = [f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "kqv"]
    assert biases(model_type="qwen2") == sorted(qkv)  # Qwen2: q, k, v; none on o_proj
    assert biases(attention_bias=True) == sorted(qkv + [f"model.layers.{i}.self_attn.o_proj.bias" for i in range(2)])
    assert biases() == biases(model_type="mistral", attention_bias=True) == []  # Mistral's attention has none
    sd = L.LlamaForCausalLM(tiny_config(model_type="qwen2", head_dim=12)).state_dict()
    assert tuple(sd["model.layers.0.self_attn.q_proj.weight"].shape) == (48, 32)
    assert tuple(sd["model.layers.0.self_attn.k_proj.bias"].shape) == (24,)
    assert tuple(sd["model.layers.0.self_attn.o_proj.weight"].shape) == (32, 48)


@test
def bias_gradients_finite_difference_and_no_decay():
    for over in (FAMILIES["qwen2"], FAMILIES["llama_bias"]):
        m = tiny_model(**over)
        x = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(6))
        y = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(7))
        m.zero_grad()
        m.loss(x, y).backward()
        P = dict(m.named_parameters())
        names = [n for n in P if n.endswith(".bias")]
        assert names and all(P[n].grad.abs().max() > 0 for n in names)
        for name in names[:4]:
            p, idx = P[name], (5,)
            fd, ad = central_difference(m, x, y, p, idx), p.grad[idx].item()
            assert abs(fd - ad) <= 1e-7 + 1e-5 * abs(ad), (over, name, fd, ad)
        # AdamW: biases are 1-D, so in the undecayed group with the norm gains.
        decay, no_decay = L.make_optimizer(m, 1e-3, 0.1, (0.9, 0.95), 1e-8).param_groups
        ids = {id(p) for p in no_decay["params"]}
        assert no_decay["weight_decay"] == 0.0 and all(id(P[n]) in ids for n in names)


def refused(fn, *words):
    try:
        fn()
    except L.ConfigError as e:
        assert all(w in str(e) for w in words), (str(e), words)
        return
    raise AssertionError(f"not refused: {words}")


@test
def config_rope_spellings_and_refusals():
    base = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 48,
            "vocab_size": 50}

    def cfg(**over):
        return L.LlamaConfig(dict(base, **over))
    sc = llama3(32.0, 1.0, 4.0, 8192)
    spellings = [dict(rope_theta=5e5, rope_scaling=sc),  # transformers 4
                 dict(rope_theta=5e5, rope_scaling=dict({"type": "llama3"}, **{k: v for k, v in sc.items()
                                                                                if k != "rope_type"})),  # < 4.45
                 dict(rope_parameters=dict(sc, rope_theta=5e5)),  # transformers 5
                 dict(rope_theta=5e5, rope_scaling=sc, rope_parameters=dict(sc, rope_theta=5e5))]  # both
    # As meshtrain writes it: both spellings at once, rope_scaling null without scaling.
    spellings.append(dict(rope_theta=5e5, rope_scaling=sc, rope_parameters=dict(sc, rope_theta=5e5,
                                                                                  partial_rotary_factor=1.0)))
    for sp in spellings:
        c = cfg(**sp)
        assert (c.rope_theta, c.rope_scaling) == (5e5, sc), (sp, c.rope_theta, c.rope_scaling)
    for sp in (dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
               dict(rope_theta=500.0, rope_scaling=None),
               dict(rope_theta=500.0, rope_scaling={"rope_type": "default"})):
        assert (cfg(**sp).rope_theta, cfg(**sp).rope_scaling) == (500.0, None), sp
    assert cfg().rope_theta == 10000.0 and cfg(rope_scaling={"rope_type": "linear", "factor": 2}).rope_scaling == \
        {"rope_type": "linear", "factor": 2}
    refused(lambda: cfg(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
            "rope_parameters.rope_theta = 500000.0", "rope_theta = 10000.0")
    refused(lambda: cfg(rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_parameters={"rope_type": "default"}),
            "rope_type")
    refused(lambda: cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0}), '"yarn"', "default, linear, llama3")
    refused(lambda: cfg(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), '"dynamic"')
    refused(lambda: cfg(rope_scaling={"rope_type": "linear"}), "factor")
    refused(lambda: cfg(rope_scaling={"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}), "low_freq_factor")
    refused(lambda: cfg(rope_parameters={"rope_type": "default", "factor": 2.0}), "factor")
    refused(lambda: cfg(rope_scaling=dict(sc, high_freq_factor=1.0)), "high_freq_factor")
    refused(lambda: cfg(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
            "partial_rotary_factor")
    # Families and what is refused.
    refused(lambda: cfg(model_type="gpt2"), '"gpt2"', "llama, mistral, qwen2")
    refused(lambda: cfg(mlp_bias=True), "mlp_bias")
    refused(lambda: cfg(hidden_act="gelu"), "hidden_act")
    refused(lambda: cfg(head_dim=7), "head_dim")
    assert cfg(model_type="mistral").sliding_window == 4096  # MistralConfig's default when the key is absent
    assert cfg(model_type="mistral", sliding_window=None).sliding_window is None
    assert cfg(model_type="qwen2", sliding_window=64).sliding_window is None  # use_sliding_window false
    assert cfg(model_type="qwen2", use_sliding_window=True, sliding_window=64).sliding_window == 64
    c = cfg(model_type="mistral", sliding_window=16)
    c.check_seq_len(16)
    refused(lambda: c.check_seq_len(17), "sliding_window = 16", "sequence length 17")
    m = L.LlamaForCausalLM(c)
    refused(lambda: m(torch.zeros(1, 17, dtype=torch.long)), "sliding_window = 16")
    assert cfg(attention_bias=True).o_bias and not cfg(model_type="qwen2").o_bias and cfg(model_type="qwen2").qkv_bias

# --------------------------------------------------------- data and files


@test
def batches_follow_meshtrain_convention():
    with tempfile.TemporaryDirectory() as d:
        L.write_shard(os.path.join(d, "s_001.bin"), np.arange(50, 100))
        L.write_shard(os.path.join(d, "s_000.bin"), np.arange(0, 50))  # sorted order, not creation order
        tok = L.read_tokens(os.path.join(d, "s_*.bin"))
    assert tok.tolist() == list(range(100))
    # (100 - 1) // (2 * 8) = 6 steps per epoch; step 7 wraps to batch 1.
    x, y = L.get_batch(tok, 7, 2, 8)
    assert x.tolist() == [list(range(16, 24)), list(range(24, 32))]
    assert y.tolist() == [list(range(17, 25)), list(range(25, 33))]


@test
def safetensors_round_trip():
    rng = np.random.default_rng(11)
    t = {"a.weight": torch.from_numpy(rng.standard_normal((3, 5)).astype(np.float32)),
         "b": torch.from_numpy(rng.standard_normal(7).astype(np.float32)),
         "scalar_like": torch.tensor([1.5])}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.safetensors")
        L.write_safetensors(path, t, metadata={"format": "pt"})
        back, meta = L.read_safetensors(path)
        assert meta == {"format": "pt"} and set(back) == set(t)
        for n in t:
            assert back[n].dtype == np.float32 and np.array_equal(back[n], t[n].numpy()), n
        # Layout checks by hand: header length, 8-byte aligned data, offsets contiguous.
        raw = open(path, "rb").read()
        n = int.from_bytes(raw[:8], "little")
        hdr = json.loads(raw[8:8 + n])
        assert (8 + n) % 8 == 0 and hdr["a.weight"] == {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 60]}
        assert len(raw) == 8 + n + 4 * (15 + 7 + 1)
        # BF16: rounding must agree with torch's own f32 -> bf16 conversion (nearest, ties to even).
        L.write_safetensors(path, t, dtype="BF16")
        back, _ = L.read_safetensors(path)
        for k in t:
            assert np.array_equal(back[k], t[k].to(torch.bfloat16).float().numpy()), k
        L.write_safetensors(path, t, dtype="F16")
        back, _ = L.read_safetensors(path)
        for k in t:
            assert np.array_equal(back[k], t[k].half().float().numpy()), k
    # Ties to even on crafted bit patterns: 0x3F808000 is exactly half-way between 0x3F80 and 0x3F81.
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF], dtype="<u4")
    assert L.f32_to_bf16_bits(bits.view("<f4")).tolist() == [0x3F80, 0x3F82, 0x3F81, 0x3F80]


def cli(*args):
    """llama_ref.py's command line run in this process, as (exit code, stdout, stderr): a process per call would
    import torch again each time (2 s). The torch and NumPy state it sets (threads, default dtype, seeds) is put
    back; an exception other than the script's own exit propagates, as a traceback would have shown."""
    argv, threads, dtype = sys.argv, torch.get_num_threads(), torch.get_default_dtype()
    rng, np_rng = torch.get_rng_state(), np.random.get_state()
    out, err = io.StringIO(), io.StringIO()
    code = 0
    sys.argv = [REF, *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            L.main()
    except SystemExit as e:  # sys.exit("llama_ref: ...") prints its message and exits 1; argparse exits 2
        code = e.code if isinstance(e.code, int) else 1
        if e.code is not None and not isinstance(e.code, int):
            err.write(f"{e.code}\n")
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_rng_state(rng)
        np.random.set_state(np_rng)
    return code, out.getvalue(), err.getvalue()


def run_cli(*args):
    code, out, err = cli(*args)
    assert code == 0, err
    return out


@test
def the_script_runs_as_a_process():
    # The other checks call llama_ref.main in this process: here the script itself, as the tests' shell scripts and
    # users run it, succeeds and refuses with a message, not a traceback.
    with tempfile.TemporaryDirectory() as d:
        args = ["init", "--out", os.path.join(d, "m"), "--dim", 32, "--n-layers", 1, "--n-heads", 4, "--ffn-dim", 40,
                "--vocab-size", 64]
        r = subprocess.run([sys.executable, REF, *map(str, args)], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and os.path.exists(os.path.join(d, "m", "model.safetensors")), r.stderr
        r = subprocess.run([sys.executable, REF, "init", "--out", os.path.join(d, "x"), "--sliding-window", "8"],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode != 0 and "--sliding-window" in r.stderr and "Traceback" not in r.stderr, r.stderr


@test
def init_then_load_is_exact_and_deterministic():
    with tempfile.TemporaryDirectory() as d:
        for sub in ("a", "b"):
            run_cli("init", "--out", os.path.join(d, sub), "--dim", 32, "--n-layers", 1, "--n-heads", 4,
                    "--n-kv-heads", 2, "--ffn-dim", 40, "--vocab-size", 64, "--seed", 3)
        cfg = json.load(open(os.path.join(d, "a", "config.json")))
        assert cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] is False
        assert open(os.path.join(d, "a", "model.safetensors"), "rb").read() == \
            open(os.path.join(d, "b", "model.safetensors"), "rb").read()
        w, _ = L.read_safetensors(os.path.join(d, "a", "model.safetensors"))
        assert abs(w["model.layers.0.mlp.up_proj.weight"].std() - 0.02) < 0.002
        assert (w["model.norm.weight"] == 1).all()
        m = L.load_model(os.path.join(d, "a"), torch.float32)
        assert all(np.array_equal(t.numpy(), w[n]) for n, t in m.state_dict().items())


@test
def init_then_train_decreases_loss():
    with tempfile.TemporaryDirectory() as d:
        # A learnable stream: a short repeating pattern of random tokens.
        pattern = np.random.default_rng(12).integers(0, 64, 13)
        L.write_shard(os.path.join(d, "train_000.bin"), np.tile(pattern, 200))
        for tied in ([], ["--tie-embeddings"]):
            model = os.path.join(d, "m" + "".join(tied))
            run_cli("init", "--out", model, "--dim", 32, "--n-layers", 2, "--n-heads", 4, "--n-kv-heads", 2,
                    "--ffn-dim", 64, "--vocab-size", 64, "--max-seq-len", 32, "--seed", 0, *tied)
            out = os.path.join(d, "losses.json")
            run_cli("train", "--model", model, "--data", os.path.join(d, "train_*.bin"), "--steps", 5,
                    "--batch-size", 4, "--seq-len", 32, "--micro-batch-size", 2, "--lr", 1e-2,
                    "--schedule", "constant", "--threads", 1, "--out", out)
            r = json.load(open(out))
            assert len(r["losses"]) == len(r["grad_norms"]) == len(r["lrs"]) == 5
            assert abs(r["losses"][0] - math.log(64)) < 0.1, r["losses"]  # near-uniform at init
            assert r["losses"][-1] < r["losses"][0] - 0.3, r["losses"]
            # `loss` on the untrained weights agrees with train's step-0 loss.
            first = json.loads(run_cli("loss", "--model", model, "--data", os.path.join(d, "train_*.bin"),
                                       "--batch-size", 4, "--seq-len", 32, "--step", 0))["loss"]
            assert abs(first - r["losses"][0]) < 1e-5, (first, r["losses"][0])


def run_cli_fails(*args):
    code, out, err = cli(*args)  # a traceback would be an exception raised here
    assert code != 0, out
    return err


@test
def init_v4_and_v5_spellings_give_the_same_model():
    with tempfile.TemporaryDirectory() as d:
        common = ["--dim", 32, "--n-layers", 1, "--n-heads", 4, "--n-kv-heads", 2, "--ffn-dim", 40, "--vocab-size",
                  64, "--head-dim", 12, "--rope-theta", 500000, "--rope-scaling", "llama3:8,1,4,16", "--seed", 5]
        for sp in ("v4", "v5"):
            run_cli("init", "--out", os.path.join(d, sp), *common, "--rope-spelling", sp)
        v4, v5 = (json.load(open(os.path.join(d, sp, "config.json"))) for sp in ("v4", "v5"))
        assert v4["rope_theta"] == 500000 and v4["rope_scaling"] == llama3(8.0, 1.0, 4.0, 16) and \
            "rope_parameters" not in v4 and v4["head_dim"] == 12
        assert v5["rope_parameters"] == dict(llama3(8.0, 1.0, 4.0, 16), rope_theta=500000) and \
            "rope_theta" not in v5 and "rope_scaling" not in v5
        assert open(os.path.join(d, "v4", "model.safetensors"), "rb").read() == \
            open(os.path.join(d, "v5", "model.safetensors"), "rb").read()
        a, b = (L.load_model(os.path.join(d, sp), torch.float64) for sp in ("v4", "v5"))
        assert (a.config.rope_theta, a.config.rope_scaling) == (b.config.rope_theta, b.config.rope_scaling)
        x = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(a(x), b(x))
        # A plain v5 file: rope_type default, no top-level rope_theta.
        run_cli("init", "--out", os.path.join(d, "p5"), "--dim", 32, "--n-layers", 1, "--n-heads", 4,
                "--n-kv-heads", 2, "--ffn-dim", 40, "--vocab-size", 64, "--rope-spelling", "v5")
        p5 = json.load(open(os.path.join(d, "p5", "config.json")))
        assert p5["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0} and "head_dim" not in p5


@test
def qwen2_init_then_train_trains_the_biases():
    with tempfile.TemporaryDirectory() as d:
        pattern = np.random.default_rng(12).integers(0, 64, 13)
        L.write_shard(os.path.join(d, "train_000.bin"), np.tile(pattern, 200))
        model = os.path.join(d, "q")
        run_cli("init", "--out", model, "--model-type", "qwen2", "--dim", 32, "--n-layers", 2, "--n-heads", 4,
                "--n-kv-heads", 2, "--ffn-dim", 64, "--vocab-size", 64, "--max-seq-len", 32, "--tie-embeddings",
                "--rope-scaling", "linear:2")
        cfg = json.load(open(os.path.join(model, "config.json")))
        assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
        assert cfg["use_sliding_window"] is False and cfg["tie_word_embeddings"] is True
        w, _ = L.read_safetensors(os.path.join(model, "model.safetensors"))
        b = w["model.layers.1.self_attn.v_proj.bias"]
        assert b.shape == (16,) and 0.005 < b.std() < 0.05 and "model.layers.0.self_attn.o_proj.bias" not in w
        out = os.path.join(d, "losses.json")
        run_cli("train", "--model", model, "--data", os.path.join(d, "train_*.bin"), "--steps", 4,
                "--batch-size", 4, "--seq-len", 32, "--lr", 1e-2, "--schedule", "constant", "--threads", 1,
                "--out", out)
        r = json.load(open(out))
        assert len(r["losses"]) == 4 and r["losses"][-1] < r["losses"][0] - 0.2, r["losses"]
        # In process: a step moves every bias (their gradients are non-zero; no decay).
        m = L.load_model(model, torch.float64)
        opt = L.make_optimizer(m, 1e-2, 0.1, (0.9, 0.95), 1e-8)
        x, y = L.get_batch(L.read_tokens(os.path.join(d, "train_*.bin")), 0, 4, 32)
        before = {n: p.detach().clone() for n, p in m.named_parameters() if n.endswith(".bias")}
        L.train_step(m, opt, x, y, 4, 1e-2, 1.0)
        P = dict(m.named_parameters())
        assert len(before) == 6 and all((P[n] - t).abs().min() > 0 for n, t in before.items())


@test
def cli_refuses_what_it_does_not_compute():
    with tempfile.TemporaryDirectory() as d:
        L.write_shard(os.path.join(d, "train_000.bin"), np.arange(2000) % 64)
        data = os.path.join(d, "train_*.bin")
        m = os.path.join(d, "m")
        run_cli("init", "--out", m, "--model-type", "mistral", "--sliding-window", 16, "--dim", 32, "--n-layers", 1,
                "--n-heads", 4, "--n-kv-heads", 2, "--ffn-dim", 40, "--vocab-size", 64)
        cfg = json.load(open(os.path.join(m, "config.json")))
        assert cfg["architectures"] == ["MistralForCausalLM"] and cfg["sliding_window"] == 16 and cfg["head_dim"] == 8
        err = run_cli_fails("train", "--model", m, "--data", data, "--steps", 1, "--batch-size", 1, "--seq-len", 32,
                            "--out", os.path.join(d, "l.json"))
        assert "sliding_window = 16" in err and "sequence length 32" in err, err
        assert "loss" in json.loads(run_cli("loss", "--model", m, "--data", data, "--batch-size", 2, "--seq-len", 16))
        cfg["model_type"] = "gpt2"
        json.dump(cfg, open(os.path.join(m, "config.json"), "w"))
        err = run_cli_fails("loss", "--model", m, "--data", data, "--batch-size", 2, "--seq-len", 16)
        assert 'model_type = "gpt2"' in err and "llama, mistral, qwen2" in err and "config.json" in err, err
        err = run_cli_fails("init", "--out", os.path.join(d, "x"), "--sliding-window", 8)
        assert "--sliding-window" in err, err


# ------------------------------------------ Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE

MOE_FAMILIES = {
    "qwen3": {"model_type": "qwen3", "head_dim": 12},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                  "shared_expert_intermediate_size": 40, "mlp_only_layers": [0]},
    "qwen2_moe_norm": {"model_type": "qwen2_moe", "num_experts": 5, "num_experts_per_tok": 3,
                       "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40, "norm_topk_prob": True},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 5, "num_experts_per_tok": 3, "moe_intermediate_size": 24,
                  "head_dim": 12},
}


def moe_blocks(m):
    return [getattr(l, "block_sparse_moe", None) or l.mlp for l in m.model.layers if l.sparse]


def dense_moe(block, x):
    """Every expert on every token, weighted by an (N, E) matrix that is zero outside each token's top k
    (found by sorting, not topk), plus the gated shared expert."""
    probs = torch.softmax(block.gate(x), dim=-1)
    order = torch.argsort(probs, dim=-1, descending=True)
    keep = torch.zeros_like(probs).scatter_(1, order[:, :block.k], 1.0)
    w = probs * keep
    if block.renormalise:
        w = w / w.sum(-1, keepdim=True)
    out = sum(w[:, e:e + 1] * expert(x) for e, expert in enumerate(block.experts))
    if block.shared_expert is not None:
        out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out, probs.gather(1, order)


@test
def moe_block_loop_matches_dense_formulation():
    for name in ("mixtral", "qwen2_moe", "qwen2_moe_norm", "qwen3_moe"):
        m = tiny_model(**MOE_FAMILIES[name])
        block = moe_blocks(m)[0]
        with torch.no_grad():  # experts (std 0.02 at init) scaled up so that their outputs are of order 1
            for n, p in block.named_parameters():
                if "expert" in n:
                    p.mul_(20)
        x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(20))
        logits = []
        with torch.no_grad():
            got = block(x, logits).reshape(21, 32)
            want, sorted_probs = dense_moe(block, x.reshape(21, 32))
        err = (got - want).abs().max().item()
        assert err < 1e-12, (name, err)
        assert len(logits) == 1 and logits[0].shape == (21, block.gate.out_features)
        # The init's wide router: the k-th and (k+1)-th probabilities are well apart for every token.
        margin = (sorted_probs[:, block.k - 1] - sorted_probs[:, block.k]).min().item()
        assert margin > 1e-4, (name, margin)
        # Renormalising or not (and the shared expert) changes the output, so the comparison can fail.
        block.renormalise = not block.renormalise
        with torch.no_grad():
            assert (block(x).reshape(21, 32) - want).abs().max() > 1e-4, name
    # Every expert is used by some token and a token's k experts are distinct.
    m = tiny_model(**MOE_FAMILIES["qwen3_moe"])
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(21))
    _, experts = L.route(moe_blocks(m)[0].gate(x), 3, False)
    assert set(experts.flatten().tolist()) == set(range(5))
    assert all(len(set(r)) == 3 for r in experts.tolist())


def balance_loss_by_counts(logits_list, E, k):
    """E / R^2 * sum_e count_e * probsum_e, R the pooled rows, count_e over all k slots (NumPy)."""
    z = np.concatenate([t.detach().numpy() for t in logits_list])
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    R = len(z)
    count = np.zeros(E)
    for row in p:
        for e in np.argsort(-row)[:k]:
            count[e] += 1
    return E / R ** 2 * (count * p.sum(0)).sum()


@test
def balance_loss_matches_counts_and_finite_differences():
    g = torch.Generator().manual_seed(22)
    E, k = 5, 2
    logits = [torch.randn(9, E, generator=g) * 2, torch.randn(9, E, generator=g) * 2]
    got = L.load_balancing_loss(logits, E, k).item()
    assert abs(got - balance_loss_by_counts(logits, E, k)) < 1e-14, got
    # Perfectly balanced routing with uniform probabilities gives k.
    flat = [torch.zeros(10, E)]
    assert abs(L.load_balancing_loss(flat, E, 1).item() - 1.0) < 1e-14
    # Gradient with respect to the logits (top-k choices fixed locally: no near-ties).
    leaves = [t.clone().requires_grad_(True) for t in logits]
    L.load_balancing_loss(leaves, E, k).backward()
    for li, (r, c) in [(0, (0, 1)), (1, (4, 3)), (0, (8, 0)), (1, (2, 2))]:
        eps = 1e-6
        up, down = [t.clone() for t in logits], [t.clone() for t in logits]
        up[li][r, c] += eps
        down[li][r, c] -= eps
        fd = (balance_loss_by_counts(up, E, k) - balance_loss_by_counts(down, E, k)) / (2 * eps)
        ad = leaves[li].grad[r, c].item()
        assert abs(fd - ad) <= 1e-8 + 1e-6 * abs(ad), (li, r, c, fd, ad)
        assert abs(ad) > 1e-6


@test
def new_families_forward_and_loss_match_numpy():
    for name, over in MOE_FAMILIES.items():
        for tied in (False, True):
            m = tiny_model(tied, **over)
            x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(4))
            y = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(5))
            with torch.no_grad():
                logits, (ce, aux) = m(x).numpy(), m.loss_terms(x, y)
            want = numpy_forward(m.state_dict(), m.config, x.numpy())
            assert np.abs(logits - want).max() < 1e-10, (name, tied, np.abs(logits - want).max())
            assert abs(ce.item() - numpy_ce(want, y.numpy())) < 1e-10, name
            assert (aux is None) == (name == "qwen3"), name
    # q_norm / k_norm matter (so the per-head check above could fail).
    m = tiny_model(**MOE_FAMILIES["qwen3"])
    x = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = m(x)
        m.model.layers[0].self_attn.q_norm.weight.mul_(1.5)
        assert not torch.allclose(before, m(x), atol=1e-6)


def fd_check(m, x, y, names, idx=(1, 2), eps=1e-6):
    m.zero_grad()
    m.loss(x, y).backward()
    P = dict(m.named_parameters())
    for name in names:
        p = P[name]
        i = tuple(min(j, n - 1) for j, n in zip(idx, p.shape))
        fd, ad = central_difference(m, x, y, p, i, eps), p.grad[i].item()
        assert abs(fd - ad) <= 1e-8 + 1e-5 * abs(ad), (name, fd, ad)
        assert abs(ad) > 1e-9, name


@test
def new_families_finite_difference_gradients_with_aux():
    x = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(6))
    y = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(7))
    m = tiny_model(**MOE_FAMILIES["qwen3"])
    fd_check(m, x, y, ["model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
                       "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"])
    for name, params in [("qwen2_moe", ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.2.up_proj.weight",
                                        "model.layers.1.mlp.shared_expert_gate.weight",
                                        "model.layers.1.mlp.shared_expert.down_proj.weight",
                                        "model.layers.0.mlp.gate_proj.weight"]),
                         ("qwen3_moe", ["model.layers.0.mlp.gate.weight", "model.layers.1.self_attn.q_norm.weight",
                                        "model.layers.0.mlp.experts.4.down_proj.weight"]),
                         ("mixtral", ["model.layers.0.block_sparse_moe.gate.weight",
                                      "model.layers.1.block_sparse_moe.experts.1.w1.weight",
                                      "model.layers.1.block_sparse_moe.experts.3.w2.weight"])]:
        m = tiny_model(**MOE_FAMILIES[name], output_router_logits=True, router_aux_loss_coef=0.5)
        fd_check(m, x, y, params)
        # The aux term is in the loss: its value and the routers' gradients change with the coefficient.
        ce, aux = m.loss_terms(x, y)
        assert abs(m.loss(x, y).item() - (ce.item() + 0.5 * aux.item())) < 1e-12
        router = params[0]
        grad_with = dict(m.named_parameters())[router].grad.clone()
        m.config.output_router_logits = False
        m.zero_grad()
        m.loss(x, y).backward()
        assert abs(m.loss(x, y).item() - ce.item()) < 1e-12
        assert (dict(m.named_parameters())[router].grad - grad_with).abs().max() > 1e-8, name


@test
def moe_train_step_loss_is_ce_plus_aux_per_micro_batch():
    x = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(8))
    y = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(9))
    for out_logits in (True, False):
        m = tiny_model(**MOE_FAMILIES["qwen3_moe"], output_router_logits=out_logits, router_aux_loss_coef=0.3)
        with torch.no_grad():
            parts = [m.loss_terms(x[r:r + 2], y[r:r + 2]) for r in (0, 2)]
        want = sum(ce.item() + (0.3 * aux.item() if out_logits else 0) for ce, aux in parts) / 2
        stats = {}
        opt = L.make_optimizer(m, 0.0, 0.1, (0.9, 0.95), 1e-8)
        loss, _ = L.train_step(m, opt, x, y, 2, 0.0, 0.0, stats)
        assert abs(loss - want) < 1e-12, (out_logits, loss, want)
        assert abs(stats["aux"] - sum(aux.item() for _, aux in parts) / 2) < 1e-12
        # Every expert parameter has a gradient (zeros for an unused expert, not None), as transformers' loop.
        assert all(p.grad is not None for p in m.parameters())
    stats = {}
    m = tiny_model()
    L.train_step(m, L.make_optimizer(m, 0.0, 0.1, (0.9, 0.95), 1e-8), x, y, 4, 0.0, 0.0, stats)
    assert stats["aux"] is None


def init_args(out, mt, *extra):
    return ["init", "--out", out, "--model-type", mt, "--dim", 32, "--n-layers", 4, "--n-heads", 4, "--n-kv-heads", 2,
            "--ffn-dim", 48, "--vocab-size", 64, "--max-seq-len", 32, "--seed", 2, *extra]


@test
def moe_layer_pattern_in_init_directory():
    with tempfile.TemporaryDirectory() as d:
        run_cli(*init_args(os.path.join(d, "q2"), "qwen2_moe", "--n-layers", 6, "--decoder-sparse-step", 2,
                           "--mlp-only-layers", "3", "--n-experts", 3, "--moe-ffn-dim", 16,
                           "--shared-expert-ffn-dim", 20))
        w, _ = L.read_safetensors(os.path.join(d, "q2", "model.safetensors"))
        sparse = sorted({int(n.split(".")[2]) for n in w if ".mlp.gate.weight" in n})
        dense = sorted({int(n.split(".")[2]) for n in w if ".mlp.gate_proj.weight" in n and "expert" not in n})
        assert sparse == [1, 5] and dense == [0, 2, 3, 4], (sparse, dense)
        assert w["model.layers.1.mlp.experts.2.down_proj.weight"].shape == (32, 16)
        assert "model.layers.1.mlp.experts.3.down_proj.weight" not in w
        assert w["model.layers.5.mlp.shared_expert.up_proj.weight"].shape == (20, 32)
        assert w["model.layers.5.mlp.shared_expert_gate.weight"].shape == (1, 32)
        assert w["model.layers.2.mlp.up_proj.weight"].shape == (48, 32)
        assert not any(n.startswith("model.layers.2.mlp.") and "expert" in n for n in w)
        run_cli(*init_args(os.path.join(d, "q3"), "qwen3_moe", "--mlp-only-layers", "0,3", "--moe-ffn-dim", 16))
        w, _ = L.read_safetensors(os.path.join(d, "q3", "model.safetensors"))
        assert sorted({int(n.split(".")[2]) for n in w if ".mlp.gate.weight" in n}) == [1, 2]
        assert not any("shared_expert" in n for n in w)
        assert w["model.layers.0.self_attn.q_norm.weight"].shape == (8,)
        run_cli(*init_args(os.path.join(d, "mx"), "mixtral", "--moe-ffn-dim", 24, "--n-experts", 3))
        w, _ = L.read_safetensors(os.path.join(d, "mx", "model.safetensors"))
        assert sorted({int(n.split(".")[2]) for n in w if "block_sparse_moe.gate.weight" in n}) == [0, 1, 2, 3]
        assert not any(".mlp." in n for n in w)
        assert w["model.layers.3.block_sparse_moe.experts.2.w2.weight"].shape == (32, 24)
        assert w["model.layers.3.block_sparse_moe.experts.2.w3.weight"].shape == (24, 32)
        cfg = json.load(open(os.path.join(d, "mx", "config.json")))
        assert cfg["intermediate_size"] == 24 and cfg["num_local_experts"] == 3 and cfg["router_aux_loss_coef"] == 0.02


@test
def new_families_init_then_load_is_exact():
    with tempfile.TemporaryDirectory() as d:
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        for mt, arch in [("qwen3", "Qwen3ForCausalLM"), ("mixtral", "MixtralForCausalLM"),
                         ("qwen2_moe", "Qwen2MoeForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")]:
            out = os.path.join(d, mt)
            extra = ["--head-dim", 12] if mt.startswith("qwen3") else []
            if mt in ("mixtral", "qwen2_moe", "qwen3_moe"):
                extra += ["--n-experts", 4, "--experts-per-token", 2, "--output-router-logits"]
            run_cli(*init_args(out, mt, "--tie-embeddings", *extra))
            cfg = json.load(open(os.path.join(out, "config.json")))
            assert cfg["architectures"] == [arch] and cfg["model_type"] == mt and cfg["tie_word_embeddings"] is True
            if mt != "qwen3":
                assert cfg["output_router_logits"] is True and cfg["num_experts_per_tok"] == 2
                assert cfg["router_aux_loss_coef"] == (0.02 if mt == "mixtral" else 0.001)
            if mt.startswith("qwen3"):
                assert cfg["head_dim"] == 12 and cfg["attention_bias"] is False and cfg["use_sliding_window"] is False
            m = L.load_model(out, torch.float32)
            want = L.LlamaForCausalLM(L.LlamaConfig(cfg))
            L.init_weights(want, 2)
            want = want.to(torch.float32)
            with torch.no_grad():
                assert torch.equal(m(x), want(x)), mt
            w = dict(m.state_dict())
            for n, t in w.items():
                if L.is_router(n):
                    assert abs(t.std().item() - L.ROUTER_INIT_STD) < 0.1, (n, t.std())
                elif n.endswith("_norm.weight"):
                    assert (t == 1).all(), n
            assert any(L.is_router(n) for n in w) == (mt != "qwen3")


@test
def moe_init_then_train_cli():
    with tempfile.TemporaryDirectory() as d:
        pattern = np.random.default_rng(12).integers(0, 64, 13)
        L.write_shard(os.path.join(d, "train_000.bin"), np.tile(pattern, 200))
        data = os.path.join(d, "train_*.bin")
        for mt in ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3"):
            model = os.path.join(d, mt)
            extra = [] if mt == "qwen3" else ["--output-router-logits", "--router-aux-loss-coef", 0.1]
            run_cli(*init_args(model, mt, "--n-layers", 2, *extra))
            for dtype in ("f64", "f32"):
                out = os.path.join(d, f"{mt}.{dtype}.json")
                micro = 2 if dtype == "f64" else 4  # f32: one forward per step, as `loss` below
                run_cli("train", "--model", model, "--data", data, "--steps", 4, "--batch-size", 4, "--seq-len", 32,
                        "--micro-batch-size", micro, "--lr", 1e-2, "--schedule", "constant", "--threads", 1,
                        "--dtype", dtype, "--out", out)
                r = json.load(open(out))
                assert len(r["losses"]) == 4 and r["losses"][-1] < r["losses"][0] - 0.2, (mt, r["losses"])
                assert ("aux_losses" in r) == (mt != "qwen3"), mt
                if mt != "qwen3":
                    assert len(r["aux_losses"]) == 4 and all(1.0 <= a <= 4.0 for a in r["aux_losses"]), r
            first = json.loads(run_cli("loss", "--model", model, "--data", data, "--batch-size", 4, "--seq-len", 32))
            assert abs(first["loss"] - r["losses"][0]) < 1e-5, (mt, first, r["losses"][0])  # ce + 0.1 aux
            if mt != "qwen3":
                assert abs(first["aux"] - r["aux_losses"][0]) < 1e-5, (first, r["aux_losses"][0])
            json.loads(run_cli("generate", "--model", model, "--prompt", "ab", "--tokens", 2))


@test
def new_families_refusals():
    base = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
            "vocab_size": 50}

    def cfg(**over):
        return L.LlamaConfig(dict(base, **over))
    refused(lambda: cfg(model_type="mixtral", router_jitter_noise=0.01), "router_jitter_noise = 0.01")
    assert cfg(model_type="mixtral", router_jitter_noise=0.0).num_experts == 8
    refused(lambda: cfg(model_type="gpt_oss"), '"gpt_oss"', "qwen3, mixtral, qwen2_moe, qwen3_moe")
    refused(lambda: cfg(model_type="qwen3", use_sliding_window=True), "use_sliding_window")
    refused(lambda: cfg(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5), "num_experts_per_tok = 5")
    refused(lambda: cfg(model_type="qwen2_moe", mlp_only_layers=3), "mlp_only_layers")
    refused(lambda: cfg(model_type="qwen2_moe", decoder_sparse_step=0), "decoder_sparse_step")
    refused(lambda: cfg(model_type="qwen3_moe", norm_topk_prob="yes"), "norm_topk_prob")
    # Defaults as transformers' configs: Qwen3's head_dim 128, Mixtral renormalises, the Qwen MoEs do not.
    assert cfg(model_type="qwen3").head_dim == 128 and cfg(model_type="qwen3_moe").head_dim == 8
    assert cfg(model_type="mixtral").norm_topk_prob and not cfg(model_type="qwen3_moe").norm_topk_prob
    c = cfg(model_type="qwen2_moe", num_experts=0)  # no experts: every layer dense
    assert not c.has_moe and not any(l.sparse for l in L.LlamaForCausalLM(c).model.layers)
    with tempfile.TemporaryDirectory() as d:
        err = run_cli_fails(*init_args(os.path.join(d, "x"), "llama", "--n-experts", 4))
        assert "--n-experts" in err and "llama" in err, err
        err = run_cli_fails(*init_args(os.path.join(d, "x"), "mixtral", "--shared-expert-ffn-dim", 8))
        assert "--shared-expert-ffn-dim" in err and "qwen2_moe" in err, err
        run_cli(*init_args(os.path.join(d, "m"), "mixtral"))
        path = os.path.join(d, "m", "config.json")
        c = json.load(open(path))
        c["router_jitter_noise"] = 0.1
        json.dump(c, open(path, "w"))
        L.write_shard(os.path.join(d, "t_000.bin"), np.arange(2000) % 64)
        err = run_cli_fails("loss", "--model", os.path.join(d, "m"), "--data", os.path.join(d, "t_*.bin"),
                            "--batch-size", 2, "--seq-len", 16)
        assert "router_jitter_noise = 0.1" in err and "config.json" in err, err


# ------------------------------------------------------------ loss masks (issue 41)


@test
def masked_loss_is_the_mean_over_counted_targets():
    """train_step with a mask against the counted targets picked out by index and averaged by F.cross_entropy;
    micro-batches of 4, 2, 1 (one of them with no counted target) give the same loss and gradients; an all-ones
    mask gives the unmasked step's."""
    x = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(8))
    y = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(9))
    w = (torch.rand(4, 8, generator=torch.Generator().manual_seed(10)) < 0.3).double()
    w[1] = 0  # a row, and so a micro-batch of 1, with nothing counted
    w[3] = 1
    m = tiny_model()
    logits = m(x).reshape(-1, 50)
    keep = w.reshape(-1).nonzero().flatten()
    want = F.cross_entropy(logits[keep], y.reshape(-1)[keep])
    want.backward()
    want_grad = torch.cat([p.grad.flatten() for p in m.parameters()])
    for M in (4, 2, 1):
        m = tiny_model()
        stats = {}
        loss, _ = L.train_step(m, L.make_optimizer(m, 1e-3, 0.1, (0.9, 0.95), 1e-8), x, y, M, 0.0, 0.0, stats, w)
        grad = torch.cat([p.grad.flatten() for p in m.parameters()])
        assert abs(loss - want.item()) < 1e-12 and (grad - want_grad).abs().max() < 1e-12, (M, loss, want.item())
        assert stats["trained_tokens"] == int(w.sum()), stats
    losses = []
    for weights in (None, torch.ones(4, 8)):
        m = tiny_model()
        losses.append(L.train_step(m, L.make_optimizer(m, 1e-3, 0.1, (0.9, 0.95), 1e-8), x, y, 2, 0.0, 0.0, None,
                                   weights)[0])
    assert abs(losses[0] - losses[1]) < 1e-12, losses


@test
def masks_are_read_beside_the_shards_and_checked():
    """X.mask beside X.bin, a shard without one all ones, the weights of get_batch's targets, and each damaged
    header refused naming the file."""
    import contextlib
    import io
    with tempfile.TemporaryDirectory() as d:
        L.write_shard(os.path.join(d, "s_000.bin"), np.arange(0, 50))
        L.write_shard(os.path.join(d, "s_001.bin"), np.arange(50, 100))
        L.write_shard(os.path.join(d, "s_002.bin"), np.arange(100, 120))
        m0 = np.arange(50) % 3 == 0
        L.write_mask(os.path.join(d, "s_000.mask"), m0)
        L.write_mask(os.path.join(d, "s_002.mask"), np.zeros(20), t_pack=4)
        masks = L.read_masks(os.path.join(d, "s_*.bin"), 8)
        assert masks.tolist() == m0.tolist() + [1.0] * 50 + [0.0] * 20
        tok = L.read_tokens(os.path.join(d, "s_*.bin"))
        # (120 - 1) // 16 = 7 steps per epoch: step 8 is batch 1, targets 17..32.
        _, yb = L.get_batch(tok, 8, 2, 8)
        assert L.get_weights(masks, 8, 2, 8).tolist() == [[float(m0[t]) for t in row] for row in yb.tolist()]

        def refused(words, seq_len=8):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    L.read_masks(os.path.join(d, "s_*.bin"), seq_len)
                except SystemExit as e:
                    msg = str(e.code)
                    assert all(w in msg for w in words), (msg, words)
                    return
            raise AssertionError(f"not refused: {words}")

        refused(["s_002.mask", "packing length 4"], seq_len=6)
        L.write_mask(os.path.join(d, "s_002.mask"), np.zeros(19))
        refused(["s_002.mask", "19"])
        L.write_mask(os.path.join(d, "s_002.mask"), np.full(20, 2))
        refused(["s_002.mask", "value 2"])
        with open(os.path.join(d, "s_002.mask"), "r+b") as f:
            f.write(np.int32(20240520).tobytes())
        refused(["s_002.mask", "bad magic 20240520"])


@test
def masked_evaluate_sums_over_all_batches():
    """evaluate: the counted losses of every batch over the number counted in all of them (not a mean of the
    batches' means); without masks the plain mean."""
    m = tiny_model()
    tok = torch.randint(0, 50, (100,), generator=torch.Generator().manual_seed(3))
    masks = (torch.rand(100, generator=torch.Generator().manual_seed(4)) < 0.5).double()
    masks[:17] = 0  # batch 0 (targets 1..16) has nothing counted: a mean of batch means would fail or differ
    num, den = 0.0, 0
    for i in range(3):
        x, y = L.get_batch(tok, i, 2, 8)
        w = L.get_weights(masks, i, 2, 8).reshape(-1)
        with torch.no_grad():
            ce = F.cross_entropy(m(x).reshape(-1, 50), y.reshape(-1), reduction="none")
        num += float(ce[w == 1].sum())
        den += int(w.sum())
    assert abs(L.evaluate(m, tok, masks, 2, 8, 3) - num / den) < 1e-12
    with torch.no_grad():
        plain = sum(m.loss(*L.get_batch(tok, i, 2, 8)).item() for i in range(3)) / 3
    assert abs(L.evaluate(m, tok, None, 2, 8, 3) - plain) < 1e-12


def main():
    from phi3_checks import PHI3_TESTS  # model_type phi3: fused projections, LongRoPE
    TESTS.extend(PHI3_TESTS)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for fn in TESTS:
        run_check(counts, fn.__name__, fn)
    print(f"{counts['passed']} passed, {counts['failed']} failed")
    sys.exit(1 if counts["failed"] else 0)


if __name__ == "__main__":
    main()
