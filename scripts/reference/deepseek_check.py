#!/usr/bin/python3
"""Self-checks of llama_ref.py's DeepSeek-V2 / V3 (issue 53), each computed a second, plainer way:

  /usr/bin/python3 scripts/reference/deepseek_check.py      (about 10 s on one core; exit 0 when all pass)

- YaRN's frequencies from a scalar loop over the published formulas, and by hand for the tests' sizes;
- the multi-head latent attention with explicit per-token, per-head loops and DeepSeek-V2's complex-number RoPE
  on the interleaved pairs (2j, 2j+1), in f64, to 1e-12 (q_lora_rank set and null, YaRN and plain RoPE);
- the V3 router (sigmoid, correction bias, group-limited noaux_tc) and the V2 router (softmax, greedy and
  group_limited_greedy) on hand-made examples whose groups mask the overall best experts;
- the sparse layer against a per-token loop over every expert; the correction bias constant in training;
- config.json's refusals (each names its key);
- DeepSeek-V3's multi-token prediction (depth 1): L_mtp by a per-position loop (the per-head attention loops, a
  per-token loop over the experts, log-sum-exp by hand) to 1e-12, untied and tied; the shared embedding's and
  lm_head's gradients against a model whose MTP module has its own copies (their gradients summed), each shared
  parameter once in AdamW; weight 0 trains as the model without MTP; micro-batches; init's copies and
  mtp_loss_weight, loading's check of the copies, config.json's weight over --mtp-loss-weight, train's and loss's
  JSON (the command line, in subprocesses).
Plain asserts; prints one line per check.
"""
import cmath
import math
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref as r  # noqa: E402

torch.set_default_dtype(torch.float64)
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def tiny(model_type="deepseek_v3", **over):
    """A tiny config dict of the sizes the C++ tests use (yarn:4,16,32,1,1.0,0.8)."""
    d = {"model_type": model_type, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 4, "intermediate_size": 48, "moe_intermediate_size": 12, "n_routed_experts": 8,
         "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
         "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
         "kv_lora_rank": 16, "q_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
         "rope_theta": 10000.0, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "vocab_size": 256,
         "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}}
    if model_type == "deepseek_v3":
        d.update({"head_dim": 4, "rope_interleave": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc"})
    else:
        d.update({"scoring_func": "softmax", "topk_method": "group_limited_greedy"})
    d.update(over)
    return r.LlamaConfig(d)


def naive_yarn(d, base, f, L, beta_fast, beta_slow):
    """YaRN's d/2 frequencies, one scalar at a time."""
    corr = [d * math.log(L / (n * 2 * math.pi)) / (2 * math.log(base)) for n in (beta_fast, beta_slow)]
    low, high = max(math.floor(corr[0]), 0), min(math.ceil(corr[1]), d - 1)
    if low == high:
        high += 0.001
    out = []
    for j in range(d // 2):
        ramp = min(max((j - low) / (high - low), 0.0), 1.0)
        keep = 1 - ramp  # the share of the original (extrapolated) frequency
        theta_j = base ** (-2 * j / d)
        out.append(theta_j / f * (1 - keep) + theta_j * keep)
    return out


@check
def yarn_frequencies():
    got = r.yarn_inv_freq(4, 10000.0, tiny().rope_scaling).tolist()
    # By hand for d 4, base 1e4, f 4, L 16: corr(32) = -0.55 -> low 0, corr(1) = 0.20 -> high 1, so frequency 0
    # keeps 1 and frequency 1 is 1e4^-1/2 / 4.
    assert got == [1.0, 0.0025], got
    for d, base, f, L, bf, bs in ((64, 10000.0, 40.0, 4096, 32.0, 1.0), (16, 500.0, 8.0, 64, 16.0, 2.0),
                                  (8, 10000.0, 2.0, 1024, 32.0, 1.0)):
        sc = {"rope_type": "yarn", "factor": f, "original_max_position_embeddings": L, "beta_fast": bf,
              "beta_slow": bs, "mscale": None, "mscale_all_dim": None}
        want = naive_yarn(d, base, f, L, bf, bs)
        err = max(abs(a - b) / b for a, b in zip(r.yarn_inv_freq(d, base, sc).tolist(), want))
        assert err < 1e-15, (d, err)
    m = lambda s, k: 0.1 * k * math.log(s) + 1  # noqa: E731
    sc = tiny().rope_scaling
    assert abs(r.rope_attention_factor(sc) - m(4, 1.0) / m(4, 0.8)) < 1e-15
    assert abs(r.deepseek_softmax_mscale(sc) - m(4, 0.8)) < 1e-15
    assert r.rope_attention_factor(dict(sc, mscale=0.0)) == m(4, 1.0)  # one of them 0: yarn_mscale(factor)
    assert r.deepseek_softmax_mscale(dict(sc, mscale_all_dim=0.0)) == 1.0
    return "tests' sizes [1, 0.0025] by hand; 3 more against a scalar loop"


def rms(v, w, eps):
    return [w[i] * v[i] / math.sqrt(sum(x * x for x in v) / len(v) + eps) for i in range(len(v))]


def matvec(W, v):
    return [sum(W[i][j] * v[j] for j in range(len(v))) for i in range(len(W))]


def naive_attention(att, c, x):
    """x (B, T, C) -> (B, T, C) one token and one head at a time; RoPE as DeepSeek-V2 writes it: each pair
    (2j, 2j+1) a complex number times a e^(i t theta_j), a the attention factor."""
    H, dn, dr, dv, kvr = att.H, att.dn, att.dr, att.dv, att.kv_lora
    sc = c.rope_scaling
    if sc is None:
        freqs, a, m = [c.rope_theta ** (-2 * j / dr) for j in range(dr // 2)], 1.0, 1.0
    else:
        freqs = naive_yarn(dr, c.rope_theta, sc["factor"], sc["original_max_position_embeddings"], sc["beta_fast"],
                           sc["beta_slow"])
        ms = lambda k: 1.0 if sc["factor"] <= 1 else 0.1 * k * math.log(sc["factor"]) + 1  # noqa: E731
        a = ms(sc["mscale"]) / ms(sc["mscale_all_dim"]) if sc["mscale"] and sc["mscale_all_dim"] else ms(1)
        m = ms(sc["mscale_all_dim"]) if sc["mscale_all_dim"] else 1.0
    W = {n: p.tolist() for n, p in att.named_parameters()}
    eps = c.rms_norm_eps
    B, T, C = x.shape
    out = torch.zeros(B, T, C)
    for b in range(B):
        qs, ks, vs = [], [], []
        for t in range(T):
            xt = x[b, t].tolist()
            if "q_proj.weight" in W:
                q = matvec(W["q_proj.weight"], xt)
            else:
                q = matvec(W["q_b_proj.weight"], rms(matvec(W["q_a_proj.weight"], xt), W["q_a_layernorm.weight"], eps))
            ckv = matvec(W["kv_a_proj_with_mqa.weight"], xt)
            kv = matvec(W["kv_b_proj.weight"], rms(ckv[:kvr], W["kv_a_layernorm.weight"], eps))
            rot = [a * cmath.exp(1j * t * freqs[j]) for j in range(dr // 2)]
            kpe = [complex(ckv[kvr + 2 * j], ckv[kvr + 2 * j + 1]) * rot[j] for j in range(dr // 2)]
            qt, kt, vt = [], [], []
            for h in range(H):
                qh = q[h * (dn + dr):(h + 1) * (dn + dr)]
                qpe = [complex(qh[dn + 2 * j], qh[dn + 2 * j + 1]) * rot[j] for j in range(dr // 2)]
                qt.append((qh[:dn], qpe))
                kvh = kv[h * (dn + dv):(h + 1) * (dn + dv)]
                kt.append((kvh[:dn], kpe))
                vt.append(kvh[dn:])
            qs.append(qt)
            ks.append(kt)
            vs.append(vt)
        for t in range(T):
            o = []
            for h in range(H):
                scores = []
                for s in range(t + 1):
                    (qn, qp), (kn, kp) = qs[t][h], ks[s][h]
                    # the real dot product of two rotated pairs is Re(z_q conj(z_k))
                    dot = sum(u * w for u, w in zip(qn, kn)) + sum((u * w.conjugate()).real for u, w in zip(qp, kp))
                    scores.append(dot * m * m / math.sqrt(dn + dr))
                top = max(scores)
                p = [math.exp(v - top) for v in scores]
                z = sum(p)
                o += [sum(p[s] / z * vs[s][h][i] for s in range(t + 1)) for i in range(dv)]
            out[b, t] = torch.tensor(matvec(W["o_proj.weight"], o))
    return out


@check
def mla_attention_per_head_loops():
    worst = 0.0
    for c in (tiny(), tiny("deepseek_v2", q_lora_rank=None), tiny(rope_scaling=None, max_position_embeddings=4096),
              tiny("deepseek_v2", rope_scaling=dict(tiny().rope_scaling, mscale=0.707, mscale_all_dim=0.707))):
        g = torch.Generator().manual_seed(3)
        att = r.DeepseekAttention(c)
        with torch.no_grad():
            for n, p in att.named_parameters():  # large enough that the softmax is far from uniform
                p.copy_(torch.randn(p.shape, generator=g) * (0.4 if p.dim() == 2 else 1.0) + (p.dim() == 1))
        x = torch.randn(2, 7, c.hidden_size, generator=g)
        cos, sin = r.rope_cos_sin(7, c.qk_rope_head_dim, c.rope_theta, torch.float64, c.rope_scaling)
        with torch.no_grad():
            got = att(x, cos, sin)
        want = naive_attention(att, c, x)
        err = (got - want).abs().max().item() / want.abs().max().item()
        assert err < 1e-12, err
        worst = max(worst, err)
    return f"4 configs (q_lora / q_proj, yarn / plain, mscale pairs), relative error {worst:.1e}"


def logit(p):
    return math.log(p / (1 - p))


@check
def v3_router_hand_example():
    c = tiny()  # E 8 in 4 groups of 2, keep 2 groups, k 2, scaling 2.5, renormalised
    s = [0.90, 0.05, 0.60, 0.55, 0.50, 0.45, 0.92, 0.01]
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.30, 0.17, 0.0, 0.0])
    # sel = s + bias: groups' top-2 sums 0.95, 1.15, 1.42, 0.93: groups 2 and 1 kept, so the overall best s
    # (experts 6 and 0) are masked; top-2 by sel among the kept: expert 4 (0.80) and 5 (0.62), not 2 (0.60).
    w, e = r.deepseek_route(torch.tensor([[logit(p) for p in s]]), c, bias)
    got = dict(zip(e[0].tolist(), w[0].tolist()))
    want = {4: 2.5 * 0.50 / 0.95, 5: 2.5 * 0.45 / 0.95}
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-14 for k in want), got
    # Without norm_topk_prob: s itself, times the scaling factor.
    w, e = r.deepseek_route(torch.tensor([[logit(p) for p in s]]), tiny(norm_topk_prob=False), bias)
    got = dict(zip(e[0].tolist(), w[0].tolist()))
    assert all(abs(got[k] - 2.5 * s[k]) < 1e-14 for k in (4, 5)), got
    # Masked experts score 0, not -inf: a kept expert whose sel is negative loses to them. E 4 in 2 groups, keep 1:
    # sel [0.9, -0.2 | 0.3, 0.3]: group 0 kept (0.7 > 0.6), then [0.9, -0.2, 0, 0]: expert 0 and a masked one.
    c4 = tiny(n_routed_experts=4, n_group=2, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False)
    s4 = [0.9, 0.1, 0.3, 0.3]
    w, e = r.deepseek_route(torch.tensor([[logit(p) for p in s4]]), c4, torch.tensor([0.0, -0.3, 0.0, 0.0]))
    chosen = e[0].tolist()
    assert chosen[0] == 0 and chosen[1] in (2, 3), chosen
    assert abs(w[0, 1].item() - 0.3) < 1e-14
    return "groups mask the best experts; bias picks, s weighs; masked = 0 beats a negative kept score"


@check
def v2_router_hand_examples():
    # logits -> softmax s; E 8 in 4 groups of 2, keep 2, k 2, group score = max.
    logits = torch.tensor([[2.0, 0.0, 1.8, 1.7, 1.9, -1.0, 0.5, 0.4]])
    s = torch.softmax(logits, dim=-1)[0].tolist()
    # group maxima 2.0, 1.8, 1.9, 0.5 (in logits): groups 0 and 2 kept; top-2 by s: experts 0 and 4 (not 2).
    c = tiny("deepseek_v2", norm_topk_prob=False, routed_scaling_factor=16.0)
    w, e = r.deepseek_route(logits, c)
    got = dict(zip(e[0].tolist(), w[0].tolist()))
    assert got.keys() == {0, 4} and all(abs(got[k] - 16.0 * s[k]) < 1e-13 for k in got), got
    # group_limited_greedy keeping 1 group: expert 0 and its group mate 1 (s[1] > 0 beats the masked zeros).
    w, e = r.deepseek_route(logits, tiny("deepseek_v2", topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0))
    assert sorted(e[0].tolist()) == [0, 1], e
    # greedy: the plain top-2 (0 and 4), renormalised then scaled.
    c = tiny("deepseek_v2", topk_method="greedy", n_group=None, topk_group=None)
    w, e = r.deepseek_route(logits, c)
    got = dict(zip(e[0].tolist(), w[0].tolist()))
    want = {0: 2.5 * s[0] / (s[0] + s[4]), 4: 2.5 * s[4] / (s[0] + s[4])}
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-13 for k in want), got
    # k 1: no renormalisation even with norm_topk_prob (V2 renormalises only when k > 1).
    w, e = r.deepseek_route(logits, tiny("deepseek_v2", topk_method="greedy", num_experts_per_tok=1))
    assert e[0].tolist() == [0] and abs(w[0, 0].item() - 2.5 * s[0]) < 1e-13, (e, w)
    return "group_limited_greedy (2 groups and 1), greedy renormalised, k 1 not renormalised"


@check
def sparse_layer_per_token_loop():
    for mt in ("deepseek_v3", "deepseek_v2"):
        c = tiny(mt)
        model = r.build_model(c)
        r.init_weights(model, 7)
        moe = model.model.layers[2].mlp
        assert isinstance(moe, r.DeepseekMoE) and isinstance(model.model.layers[0].mlp, r.LlamaMLP)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 5, c.hidden_size, generator=g)
        with torch.no_grad():
            got = moe(x).reshape(10, -1)
            xs = x.reshape(10, -1)
            bias = moe.gate.e_score_correction_bias
            for t in range(10):
                w, e = r.deepseek_route(xs[t:t + 1] @ moe.gate.weight.t(), c, bias)
                want = moe.shared_experts(xs[t])
                for k in range(c.num_experts_per_tok):
                    ex = moe.experts[e[0, k].item()]
                    want = want + w[0, k] * ex.down_proj(torch.nn.functional.silu(ex.gate_proj(xs[t]))
                                                         * ex.up_proj(xs[t]))
                assert (got[t] - want).abs().max().item() < 1e-14, (mt, t)
    return "V3 and V2: 10 tokens each"


@check
def correction_bias_constant_in_training():
    with tempfile.TemporaryDirectory() as d:
        c = tiny()
        model = r.build_model(c)
        r.init_weights(model, 2)
        before = {n: b.clone() for n, b in model.named_buffers()}
        assert len(before) == 2 and all(b.abs().sum() > 0 for b in before.values())  # layers 1 and 2 are sparse
        names = {n for n, _ in model.named_parameters()}
        assert not any("e_score_correction_bias" in n for n in names)
        opt = r.make_optimizer(model, 1e-2, 0.1, (0.9, 0.95), 1e-8)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (2, 16), generator=g)
        y = torch.randint(0, 256, (2, 16), generator=g)
        for _ in range(3):
            r.train_step(model, opt, x, y, 2, 1e-2, 1.0)
        assert all(torch.equal(before[n], b) for n, b in model.named_buffers())
        # saved with the weights, and read back
        r.write_safetensors(os.path.join(d, "model.safetensors"), model.state_dict(), dtype="F32")
        w, _ = r.read_safetensors(os.path.join(d, "model.safetensors"))
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in w
    return "3 AdamW steps leave it unchanged; saved as mlp.gate.e_score_correction_bias"


@check
def config_spellings_and_defaults():
    # transformers 5's rope_parameters (rope_theta inside) reads as transformers 4's rope_scaling + rope_theta.
    v4 = tiny()
    yarn = {k: v for k, v in tiny().rope_scaling.items()}
    v5 = tiny(rope_scaling=None, rope_theta=None, rope_parameters=dict(yarn, rope_theta=10000.0))
    assert (v5.rope_theta, v5.rope_scaling) == (v4.rope_theta, v4.rope_scaling), v5.rope_scaling
    # DeepSeek-V2-Lite's shape of file: q_lora_rank null, greedy, yarn with mscale = mscale_all_dim, no head_dim.
    c = tiny("deepseek_v2", q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, aux_loss_alpha=0.001,
             seq_aux=True, rope_scaling=dict(yarn, mscale=0.707, mscale_all_dim=0.707))
    assert c.q_lora_rank is None and c.head_dim == 4 and r.rope_attention_factor(c.rope_scaling) == 1.0
    # V2 with n_routed_experts null: every layer dense.
    model = r.build_model(tiny("deepseek_v2", n_routed_experts=None, n_shared_experts=None))
    assert all(isinstance(layer.mlp, r.LlamaMLP) for layer in model.model.layers)
    # V3's defaults where the file is silent: sigmoid / noaux_tc, renormalised, scaling 2.5 as DeepseekV3Config.
    d = tiny(topk_method=None, scoring_func=None, norm_topk_prob=None, routed_scaling_factor=None)  # null: default
    assert (d.topk_method, d.norm_topk_prob, d.routed_scaling_factor) == ("noaux_tc", True, 2.5)
    d = tiny("deepseek_v2", topk_method=None, scoring_func=None, norm_topk_prob=None, routed_scaling_factor=None)
    assert (d.topk_method, d.norm_topk_prob, d.routed_scaling_factor) == ("greedy", False, 1.0)
    return "v5 rope_parameters = v4; V2-Lite-shaped file; V2 dense when n_routed_experts null"


@check
def refusals():
    cases = [(dict(q_lora_rank=0), "q_lora_rank"), (dict(moe_layer_freq=2), "moe_layer_freq"),
             (dict(qk_rope_head_dim=5, head_dim=5), "qk_rope_head_dim"), (dict(n_group=3), "n_group"),
             (dict(topk_group=5), "topk_group"), (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers"),
             (dict(num_nextn_predict_layers=1, mtp_loss_weight=-0.1), "mtp_loss_weight"),
             (dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers"),
             (dict(num_key_value_heads=2), "num_key_value_heads"), (dict(scoring_func="softmax"), "scoring_func"),
             (dict(topk_method="greedy"), "topk_method"), (dict(rope_interleave=False), "rope_interleave"),
             (dict(output_router_logits=True), "output_router_logits"), (dict(attention_bias=True), "attention_bias"),
             (dict(head_dim=8), "head_dim"), (dict(n_group=8), "n_group"),
             (dict(max_position_embeddings=128), "factor"), (dict(hidden_act="gelu"), "hidden_act"),
             (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type")]
    for over, key in cases:
        try:
            tiny(**over)
        except r.ConfigError as e:
            assert key in str(e), (over, str(e))
        else:
            raise AssertionError(f"{over} accepted")
    for over, key in ((dict(topk_method="noaux_tc"), "topk_method"), (dict(scoring_func="sigmoid"), "scoring_func"),
                      (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers")):
        try:
            tiny("deepseek_v2", **over)
        except r.ConfigError as e:
            assert key in str(e), (over, str(e))
        else:
            raise AssertionError(f"v2 {over} accepted")
    try:  # yarn stays refused for the other families
        r.LlamaConfig({"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 8,
                       "vocab_size": 8, "rope_scaling": tiny().rope_scaling})
    except r.ConfigError as e:
        assert "yarn" in str(e)
    else:
        raise AssertionError("llama with yarn accepted")
    return f"{len(cases) + 4} refused"


def mtp_model(seed=4, **over):
    """A V3 model of the tests' sizes with an MTP module (layer 3, sparse), its weights from init_weights."""
    c = tiny(num_nextn_predict_layers=1, **over)
    model = r.build_model(c)
    r.init_weights(model, seed)
    return c, model


def lse_ce(logits, target):
    """-log softmax(logits)[target] of one row, by its log-sum-exp."""
    top = max(logits)
    return top + math.log(sum(math.exp(v - top) for v in logits)) - logits[target]


def naive_mtp_sum(model, c, x, y):
    """L_mtp's numerator one position at a time: e_i = embed(y_i), x_i = eh_proj [enorm e_i, hnorm h_i], the
    decoder layer L by naive_attention and a per-token loop over its experts, then CE of lm_head(norm z_i) against
    y_{i+1} for i < T-1. h from the main model (checked on its own by the other checks and meshtrain's tests)."""
    L, eps = c.num_hidden_layers, c.rms_norm_eps
    m = model.model.layers[L]
    W = {n: p.tolist() for n, p in m.named_parameters()}
    E = model.model.embed_tokens.weight.tolist()
    head = E if model.lm_head is None else model.lm_head.weight.tolist()
    with torch.no_grad():
        h = model.hidden(x)[0]
    B, T = x.shape
    xs = torch.zeros(B, T, c.hidden_size)
    for b in range(B):
        for i in range(T):
            cat = rms(E[y[b, i].item()], W["enorm.weight"], eps) + rms(h[b, i].tolist(), W["hnorm.weight"], eps)
            xs[b, i] = torch.tensor(matvec(W["eh_proj.weight"], cat))
    normed = torch.tensor([[rms(xs[b, i].tolist(), W["input_layernorm.weight"], eps) for i in range(T)]
                           for b in range(B)])
    hs = xs + naive_attention(m.self_attn, c, normed)
    total, moe = 0.0, m.mlp
    bias = moe.gate.e_score_correction_bias
    for b in range(B):
        for i in range(T - 1):  # position T-1 has no MTP target
            v = torch.tensor(rms(hs[b, i].tolist(), W["post_attention_layernorm.weight"], eps))
            w, e = r.deepseek_route((v @ moe.gate.weight.t())[None], c, bias)
            z = hs[b, i] + moe.shared_experts(v)
            for k in range(c.num_experts_per_tok):
                ex = moe.experts[e[0, k].item()]
                z = z + w[0, k] * ex.down_proj(torch.nn.functional.silu(ex.gate_proj(v)) * ex.up_proj(v))
            logits = matvec(head, rms(z.tolist(), W["shared_head.norm.weight"], eps))
            total += lse_ce(logits, y[b, i + 1].item())
    return total


def batch(seed, B=2, T=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g)


@check
def mtp_loss_per_position_loop():
    worst = 0.0
    for tied in (False, True):
        c, model = mtp_model(tie_word_embeddings=tied, mtp_loss_weight=0.3)
        assert isinstance(model.model.layers[3].mlp, r.DeepseekMoE) and len(model.model.layers) == 4
        x, y = batch(1)
        with torch.no_grad():
            ce, mtp = model.mtp_terms(x, y)
            h = model.hidden(x)[0]
        want = naive_mtp_sum(model, c, x, y)
        err = abs(mtp.item() - want) / want
        assert err < 1e-12, (tied, err)
        worst = max(worst, err)
        # The main term by hand too, and train_step's loss = (sum CE_main + w sum CE_mtp) / (B T), L_mtp alone too.
        head = model.model.embed_tokens.weight if tied else model.lm_head.weight
        main = sum(lse_ce(matvec(head.tolist(), h[b, i].tolist()), y[b, i].item()) for b in range(2) for i in range(6))
        assert abs(ce.item() - main) / main < 1e-12
        stats = {}
        loss, _ = r.train_step(model, r.make_optimizer(model, 0.0, 0.0, (0.9, 0.95), 1e-8), x, y, 2, 0.0, 0.0, stats)
        assert abs(loss - (main + 0.3 * want) / 12) < 1e-13 and abs(stats["mtp"] - want / 12) < 1e-13, (loss, stats)
        # logits (generate, `logits`) are the main head's alone: the MTP module changes nothing in them.
        with torch.no_grad():
            assert torch.equal(model(x), model.head(h))
    return f"2 x 5 targeted positions, untied and tied, relative error {worst:.1e}; loss = (main + 0.3 mtp) / B T"


def separate_copies_objective(model, x, y, w):
    """The objective with the MTP module on its OWN copies of the embedding and output head (new leaves): returns
    (objective, embedding copy, head copy)."""
    c = model.config
    h, cos, sin = model.hidden(x)
    B, T = x.shape
    V = c.vocab_size
    ce = torch.nn.functional.cross_entropy(model.head(h).reshape(-1, V), y.reshape(-1), reduction="sum")
    E2 = model.model.embed_tokens.weight.detach().clone().requires_grad_()
    H2 = (E2 if model.lm_head is None else model.lm_head.weight).detach().clone().requires_grad_()
    m = model.model.layers[c.num_hidden_layers]
    xm = m.eh_proj(torch.cat([m.enorm(torch.nn.functional.embedding(y, E2)), m.hnorm(h)], dim=-1))
    lm = torch.nn.functional.linear(m.shared_head.norm(m(xm, cos, sin)), H2)[:, :-1]
    mtp = torch.nn.functional.cross_entropy(lm.reshape(-1, V), y[:, 1:].reshape(-1), reduction="sum")
    return (ce + w * mtp) / (B * T), E2, H2


@check
def mtp_shared_parameters_gradients():
    import copy
    for tied in (False, True):
        c, model = mtp_model(tie_word_embeddings=tied, mtp_loss_weight=0.7)
        other = copy.deepcopy(model)
        x, y = batch(2)
        ce, mtp = model.mtp_terms(x, y)
        ((ce + 0.7 * mtp) / 12).backward()
        obj, E2, H2 = separate_copies_objective(other, x, y, 0.7)
        obj.backward()
        emb = other.model.embed_tokens.weight.grad
        want = {"model.embed_tokens.weight": emb + E2.grad + (H2.grad if tied else 0)}
        if not tied:
            want["lm_head.weight"] = other.lm_head.weight.grad + H2.grad
        assert E2.grad.abs().max() > 0 and H2.grad.abs().max() > 0 and emb.abs().max() > 0  # both uses count
        got = dict(model.named_parameters())
        for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "mlp.gate", "self_attn.kv_b_proj"):
            assert got[f"model.layers.3.{n}.weight"].grad.abs().max() > 0, n  # the MTP module itself trains
        for n, p in other.named_parameters():
            ref = want.get(n, p.grad)
            err = (got[n].grad - ref).abs().max().item() / max(ref.abs().max().item(), 1e-300)
            assert err < 1e-12, (tied, n, err)
        # One parameter each: the optimizer sees every parameter once (one AdamW state), no copy among them.
        names = [n for n, _ in model.named_parameters()]
        assert not any(n.endswith(("layers.3.embed_tokens.weight", "shared_head.head.weight")) for n in names)
        opt = r.make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), 1e-8)
        in_opt = [id(p) for g in opt.param_groups for p in g["params"]]
        assert len(in_opt) == len(set(in_opt)) == len(names)
        decayed = {id(p) for p in opt.param_groups[0]["params"]}
        assert id(model.model.embed_tokens.weight) in decayed and id(model.model.layers[3].eh_proj.weight) in decayed
        assert id(model.model.layers[3].enorm.weight) not in decayed
        r.train_step(model, opt, x, y, 2, 1e-3, 1.0)
        assert len(opt.state) == len(names)
    return "embedding and lm_head grads = the sum of both uses' (untied; tied: 4 uses), 1e-12; each once in AdamW"


@check
def mtp_weight_zero_equals_no_mtp():
    _, with_mtp = mtp_model(seed=6, mtp_loss_weight=0.0)
    plain = r.build_model(tiny())
    r.init_weights(plain, 6)
    mine = dict(with_mtp.named_parameters())
    assert all(torch.equal(p, mine[n]) for n, p in plain.named_parameters())  # same seed: same main weights
    opts = [r.make_optimizer(m, 1e-2, 0.1, (0.9, 0.95), 1e-8) for m in (with_mtp, plain)]
    worst = 0.0
    for step in range(3):
        x, y = batch(10 + step, 2, 8)
        stats = {}
        a, na = r.train_step(with_mtp, opts[0], x, y, 1, 1e-2, 1.0, stats)
        b, nb = r.train_step(plain, opts[1], x, y, 1, 1e-2, 1.0)
        assert stats["mtp"] > 1.0 and abs(a - b) < 1e-14, (a, b)
        worst = max(worst, abs(na - nb))
    # The grad norm counts the MTP module's zero gradients: the same up to rounding.
    assert worst < 1e-14, worst
    for n, p in plain.named_parameters():
        assert (p - mine[n]).abs().max().item() < 1e-13, n
    return "3 AdamW steps (micro-batches of 1): losses and main weights equal the model without MTP"


@check
def mtp_micro_batches():
    c, model = mtp_model(seed=8, mtp_loss_weight=0.3)
    x, y = batch(3, 4, 8)
    results = []
    for M in (4, 1, 2):
        stats = {}
        loss, norm = r.train_step(model, r.make_optimizer(model, 0.0, 0.0, (0.9, 0.95), 1e-8), x, y, M, 0.0, 0.0,
                                  stats)
        results.append((loss, stats["mtp"], norm, [p.grad.clone() for p in model.parameters()]))
    for loss, mtp, norm, grads in results[1:]:
        assert abs(loss - results[0][0]) < 1e-13 and abs(mtp - results[0][1]) < 1e-13
        assert all((g - g0).abs().max().item() < 1e-14 for g, g0 in zip(grads, results[0][3]))
    return "micro-batches of 4, 1 and 2: the same loss, L_mtp and gradients (sums over the batch's B*T)"


@check
def mtp_files_and_cli():
    import json
    import subprocess
    ref = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_ref.py")
    with tempfile.TemporaryDirectory() as d:
        sizes = ["--model-type", "deepseek_v3", "--dim", "32", "--n-layers", "2", "--n-heads", "4", "--vocab-size",
                 "256", "--max-seq-len", "64", "--q-lora-rank", "12", "--v-head-dim", "6", "--n-experts", "8",
                 "--moe-ffn-dim", "12", "--n-group", "4", "--topk-group", "2", "--ffn-dim", "48", "--norm-topk-prob"]

        def run(*args, ok=True):
            p = subprocess.run([sys.executable, ref, *args], capture_output=True, text=True)
            assert (p.returncode == 0) == ok, (args, p.stdout, p.stderr)
            return p.stdout + p.stderr

        out = os.path.join(d, "m")
        run("init", "--out", out, *sizes, "--num-nextn-predict-layers", "1", "--mtp-loss-weight", "0.5")
        cfg = json.load(open(os.path.join(out, "config.json")))
        assert cfg["num_nextn_predict_layers"] == 1 and cfg["mtp_loss_weight"] == 0.5
        w, _ = r.read_safetensors(os.path.join(out, "model.safetensors"))
        assert (w["model.layers.2.embed_tokens.weight"] == w["model.embed_tokens.weight"]).all()
        assert (w["model.layers.2.shared_head.head.weight"] == w["lm_head.weight"]).all()
        model = r.load_model(out, torch.float64)  # the copies read, checked and dropped
        assert "model.layers.2.embed_tokens.weight" not in model.state_dict()
        data = os.path.join(d, "d.bin")
        r.write_shard(data, [(7 * i * i + 3 * i) % 256 for i in range(400)])
        common = ["--model", out, "--data", data, "--batch-size", "2", "--seq-len", "16"]
        # config.json's mtp_loss_weight wins over the option; without the key, the option.
        a = json.loads(run("loss", *common, "--mtp-loss-weight", "0.9"))
        cfg.pop("mtp_loss_weight")
        json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
        b = json.loads(run("loss", *common, "--mtp-loss-weight", "0.9"))
        assert a["mtp_loss"] == b["mtp_loss"] and abs(b["loss"] - a["loss"] - 0.4 * a["mtp_loss"]) < 1e-5, (a, b)
        res = os.path.join(d, "t.json")
        run("train", *common, "--steps", "2", "--dtype", "f64", "--mtp-loss-weight", "0.9", "--out", res)
        t = json.load(open(res))
        assert len(t["mtp_losses"]) == 2 and abs(t["losses"][0] - b["loss"]) < 1e-5, (t, b)
        assert "masks" in run("train", *common, "--steps", "1", "--masks", "--out", res, ok=False)
        # A copy that differs from the tensor it copies is refused naming it; absent copies are fine.
        w["model.layers.2.shared_head.head.weight"][0, 0] += 1.0
        r.write_safetensors(os.path.join(out, "model.safetensors"), w)
        assert "model.layers.2.shared_head.head.weight differs" in run("loss", *common, ok=False)
        del w["model.layers.2.shared_head.head.weight"], w["model.layers.2.embed_tokens.weight"]
        r.write_safetensors(os.path.join(out, "model.safetensors"), w)
        assert json.loads(run("loss", *common, "--mtp-loss-weight", "0.9")) == b
        for bad, key in ((["--num-nextn-predict-layers", "2"], "num_nextn_predict_layers"),
                         (["--mtp-loss-weight", "0.3"], "--num-nextn-predict-layers 1")):
            assert key in run("init", "--out", os.path.join(d, "bad"), *sizes, *bad, ok=False)
        v2 = ["--model-type", "deepseek_v2"] + sizes[2:] + ["--num-nextn-predict-layers", "1"]
        assert "deepseek_v3" in run("init", "--out", os.path.join(d, "bad"), *v2, ok=False)
    return "init writes the copies and mtp_loss_weight; load checks them; config's weight wins; train/loss JSON"


def main():
    failed = 0
    for fn in CHECKS:
        try:
            print(f"ok   {fn.__name__}: {fn()}", flush=True)
        except Exception as e:  # noqa: BLE001 (report every check)
            failed += 1
            print(f"FAIL {fn.__name__}: {type(e).__name__}: {e}", flush=True)
    print(f"{len(CHECKS) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
