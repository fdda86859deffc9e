#!/usr/bin/python3
"""Checks scripts/reference/llama_ref.py against independent computations.

  /usr/bin/python3 tests/reference/test_reference.py

Plain asserts, no pytest. Each check is written a different way from the code it
tests (complex numbers for RoPE, repeated kv heads and per-head loops for
attention, a NumPy forward for the whole model, finite differences for
gradients) so that a shared misunderstanding is unlikely to pass unnoticed.
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import traceback

try:
    import numpy as np
    import torch
except ImportError as e:  # counted as skipped, never as passed (exit 77: meson's "skipped")
    print(f"skipped: {e} (scripts/setup.sh installs python3-numpy and python3-torch)")
    print("0 passed, 0 failed, 1 skipped")
    sys.exit(77)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REF = os.path.join(ROOT, "scripts", "reference", "llama_ref.py")
sys.path.insert(0, os.path.dirname(REF))
import llama_ref as L  # noqa: E402

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

# ----------------------------------------------------- whole forward in NumPy


def numpy_forward(sd, c, tokens):
    """The whole model again, from the state dict, in NumPy f64: per-head loops, complex RoPE."""
    W = {n: t.detach().double().numpy() for n, t in sd.items()}
    hd, H, KV = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    B, T = tokens.shape

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps) * w

    def rope(x):  # x: (B, T, hd)
        half = hd // 2
        z = (x[..., :half] + 1j * x[..., half:]) * np.exp(
            1j * np.arange(T)[:, None] * c.rope_theta ** (-2.0 * np.arange(half) / hd))
        return np.concatenate([z.real, z.imag], -1)

    h = W["model.embed_tokens.weight"][tokens]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        x = norm(h, W[p + "input_layernorm.weight"])
        q = x @ W[p + "self_attn.q_proj.weight"].T
        k = x @ W[p + "self_attn.k_proj.weight"].T
        v = x @ W[p + "self_attn.v_proj.weight"].T
        heads = []
        for hh in range(H):
            j = hh * KV // H  # the kv head serving q head hh
            qh = rope(q[..., hh * hd:(hh + 1) * hd])
            kh = rope(k[..., j * hd:(j + 1) * hd])
            s = qh @ kh.transpose(0, 2, 1) / math.sqrt(hd)
            s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            heads.append((pr / pr.sum(-1, keepdims=True)) @ v[..., j * hd:(j + 1) * hd])
        h = h + np.concatenate(heads, -1) @ W[p + "self_attn.o_proj.weight"].T
        x = norm(h, W[p + "post_attention_layernorm.weight"])
        g = x @ W[p + "mlp.gate_proj.weight"].T
        h = h + ((g / (1 + np.exp(-g))) * (x @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
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
            p, eps = P[name], 1e-6
            with torch.no_grad():
                old = p[idx].item()
                p[idx] = old + eps
                up = m.loss(x, y).item()
                p[idx] = old - eps
                down = m.loss(x, y).item()
                p[idx] = old
            fd, ad = (up - down) / (2 * eps), p.grad[idx].item()
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


def run_cli(*args):
    r = subprocess.run([sys.executable, REF, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout


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


def main():
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    passed = failed = 0
    for fn in TESTS:
        try:
            fn()
            passed += 1
            print(f"ok   {fn.__name__}")
        except Exception:
            failed += 1
            print(f"FAIL {fn.__name__}")
            traceback.print_exc()
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
