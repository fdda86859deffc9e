"""The reference's Phi-3 (model_type phi3) checks, run by test_reference.py: its fused projections against Llama's
separate ones holding the same rows (q, k, v in that order; gate, then up), LongRoPE's tables by a per-frequency
loop of complex rotations with the attention factor in closed form (long factors above the original context,
short ones up to it), the top-level original_max_position_embeddings, and what is refused."""
import cmath
import math

from reference_env import L, torch

PHI3_TESTS = []


def test(fn):
    PHI3_TESTS.append(fn)
    return fn


def config(**over):
    d = {"model_type": "phi3", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 50, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "max_position_embeddings": 64}
    d.update(over)
    return d


def longrope(original=16):
    return {"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [1.0, 3.0, 5.0, 7.0]}, original


@test
def phi3_fused_projections_equal_llamas_split_rows():
    phi3 = L.LlamaForCausalLM(L.LlamaConfig(config()))
    L.init_weights(phi3, 3)
    c = dict(config(), model_type="llama")
    llama = L.LlamaForCausalLM(L.LlamaConfig(c))
    H, KV, hd, F = 4, 2, 8, 48
    w = {}
    for n, t in phi3.state_dict().items():
        if n.endswith("self_attn.qkv_proj.weight"):
            p = n[: -len("qkv_proj.weight")]
            w[p + "q_proj.weight"], w[p + "k_proj.weight"], w[p + "v_proj.weight"] = (
                t[: H * hd], t[H * hd: (H + KV) * hd], t[(H + KV) * hd:])
        elif n.endswith("mlp.gate_up_proj.weight"):
            p = n[: -len("gate_up_proj.weight")]
            w[p + "gate_proj.weight"], w[p + "up_proj.weight"] = t[:F], t[F:]
        else:
            w[n] = t
    llama.load_state_dict(w)
    x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        d = (phi3(x) - llama(x)).abs().max().item()
    assert d < 1e-12, d
    assert phi3.state_dict()["model.layers.0.self_attn.qkv_proj.weight"].shape == ((H + 2 * KV) * hd, 32)
    assert phi3.state_dict()["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * F, 32)
    return f"logits within {d:.1e}"


@test
def longrope_tables_by_complex_rotation():
    scaling, original = longrope()
    c = L.LlamaConfig(config(rope_scaling=scaling, original_max_position_embeddings=original))
    r = c.rope_scaling
    assert r["original_max_position_embeddings"] == 16 and r["max_position_embeddings"] == 64
    hd, theta = c.head_dim, c.rope_theta
    m = math.sqrt(1 + math.log(64 / 16) / math.log(16))  # transformers' rule: f = max positions / original
    for T, factors in ((16, scaling["short_factor"]), (17, scaling["long_factor"])):
        cos, sin = L.rope_cos_sin(T, hd, theta, torch.float64, r)
        for p in range(T):
            for i in range(hd // 2):
                z = m * cmath.exp(1j * p * theta ** (-2 * i / hd) / factors[i])
                for col in (i, i + hd // 2):
                    assert abs(cos[p, col].item() - z.real) < 1e-12 and abs(sin[p, col].item() - z.imag) < 1e-12
    given = L.LlamaConfig(config(rope_scaling=dict(scaling, attention_factor=1.25), original_max_position_embeddings=16))
    assert abs(L.rope_cos_sin(1, hd, theta, torch.float64, given.rope_scaling)[0][0, 0].item() - 1.25) < 1e-15
    return f"attention factor {m:.6f}; short up to 16 positions, long above"


@test
def phi3_refusals():
    scaling, _ = longrope()
    cases = [
        (config(model_type="llama", rope_scaling=dict(scaling, original_max_position_embeddings=16)),
         "longrope\" is Phi-3's"),
        (config(rope_scaling=dict(scaling, short_factor=[1.0, 1.0])), "rope_scaling.short_factor has 2 values"),
        (config(partial_rotary_factor=0.5), "partial_rotary_factor = 0.5"),
        (config(resid_pdrop=0.1), "resid_pdrop = 0.1"),
        (config(attention_bias=True), "attention_bias = true"),
    ]
    for d, want in cases:
        try:
            L.LlamaConfig(d)
        except L.ConfigError as e:
            assert want in str(e), (want, str(e))
        else:
            raise AssertionError(f"not refused: {want}")
    default = L.LlamaConfig(config(rope_scaling=scaling))
    assert default.rope_scaling["original_max_position_embeddings"] == 4096  # Phi3Config's default
    return f"{len(cases)} refused"
