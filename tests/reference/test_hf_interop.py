#!/usr/bin/python3
"""Hugging Face interoperability of meshtrain (issue 17), end to end.

  python3 tests/reference/test_hf_interop.py --meshtrain BUILD/meshtrain [--mpirun scripts/mpirun.sh]
                                              [--device cpu|cuda]

Each check runs against two implementations of Llama: scripts/reference/llama_ref.py (whenever torch imports)
and transformers' LlamaForCausalLM (counted as skipped, never as passed, where transformers does not import).
  a. meshtrain trains a tiny fp32 model a few steps (untied and tied embeddings) and checkpoints it; the
     checkpoint directory holds a config.json beside model.safetensors; the implementation loads the directory as
     it is (transformers: from_pretrained) and its logits on 24 tokens equal `meshtrain logits` on the same
     checkpoint within 1e-4 relative (max abs difference / max abs logit).
  b. a model saved by the implementation (llama_ref's `init`; transformers' save_pretrained), untied and tied:
     `meshtrain logits --checkpoint DIR` gives the implementation's logits within 1e-4 relative, and
     `meshtrain train --set model.init_from=DIR` runs 6 steps with finite losses, the first within 1e-4 relative
     of the implementation's loss on the same first batch (meshtrain's batch of step 0: the first B*T+1 tokens of
     the shards, llama_ref.get_batch's convention, checked against meshtrain by tests/cli/test_train.sh).
Plus: `meshtrain logits` on 2 ranks writes what 1 rank writes (bit for bit on the CPU; on one GPU, shared by
the two ranks, within 1e-6).
--device is passed to every meshtrain command as --set comm.device=...; the implementations run on the CPU.
Ends with "N passed, N failed, N skipped"; exits 77 when nothing could run (no torch), 1 on a failure.
"""
import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import traceback

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
except ImportError as e:  # counted as skipped, never as passed (exit 77: meson's "skipped")
    print(f"skipped: {e} (scripts/setup.sh installs python3-numpy and python3-torch)")
    print("0 passed, 0 failed, 1 skipped")
    sys.exit(77)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REF = os.path.join(ROOT, "scripts", "reference", "llama_ref.py")
sys.path.insert(0, os.path.dirname(REF))
import llama_ref as L  # noqa: E402

try:
    import transformers
    HF_ERROR = None
except Exception as e:  # ImportError, or a transformers that fails on this torch
    transformers, HF_ERROR = None, f"transformers does not import here ({type(e).__name__}: {e})"

# The tiny model: GQA (4 heads over 2 kv heads), and a norm eps and RoPE base that are not meshtrain's defaults,
# so a config.json that lost them would show in the logits.
SIZES = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48, "vocab_size": 96,
         "max_seq_len": 32, "norm_eps": 1e-6, "rope_theta": 500.0}
BATCH, SEQ = 4, 16
TOL = 1e-4
TOKENS = [int(t) for t in np.random.default_rng(7).integers(0, SIZES["vocab_size"], 24)]


class Skip(Exception):
    pass


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max() / np.abs(want).max())


# ------------------------------------------------------------------ meshtrain


class Meshtrain:
    def __init__(self, args, tmp):
        # --mpirun may carry its own options ("$MPIRUN" of a packed Open MPI): split like a shell.
        self.bin, self.mpirun, self.device, self.tmp = args.meshtrain, shlex.split(args.mpirun), args.device, tmp
        self.data = os.path.join(tmp, "data")
        os.makedirs(self.data, exist_ok=True)
        # Random tokens: the checks compare numbers, they need no learnable text.
        self.tokens = np.random.default_rng(3).integers(0, SIZES["vocab_size"], 4000)
        L.write_shard(os.path.join(self.data, "train_000.bin"), self.tokens)
        self.yaml = os.path.join(tmp, "tiny.yaml")
        s = SIZES
        with open(self.yaml, "w") as f:
            f.write(f"""model: {{dim: {s['dim']}, n_layers: {s['n_layers']}, n_heads: {s['n_heads']},
         n_kv_heads: {s['n_kv_heads']}, ffn_dim: {s['ffn_dim']}, vocab_size: {s['vocab_size']},
         max_seq_len: {s['max_seq_len']}, norm_eps: {s['norm_eps']}, rope_theta: {s['rope_theta']}}}
training: {{steps: 3, batch_size: {BATCH}, seq_len: {SEQ}, lr: 1.0e-2, warmup_steps: 0, schedule: constant,
           dtype: fp32, threads: 1}}
data: {{train: "{self.data}/train_*.bin", val: ""}}
eval: {{interval: 0}}
sample: {{interval: 0}}
log: {{interval: 1}}
""")
        self.trained = {}

    def run(self, *args, np_=1):
        cmd = [*self.mpirun, "-np", str(np_), self.bin, "--config", self.yaml, "--set", f"comm.device={self.device}",
               *map(str, args)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, f"{' '.join(cmd)}: exit {r.returncode}\n{(r.stdout + r.stderr)[-3000:]}"
        return r.stdout

    def logits(self, ckpt, tokens=TOKENS, np_=1):
        out = os.path.join(self.tmp, "logits.npy")
        if os.path.exists(out):
            os.remove(out)
        self.run("logits", "--checkpoint", ckpt, "--tokens", ",".join(map(str, tokens)), "--out", out, np_=np_)
        a = np.load(out)
        assert a.dtype == np.float32 and a.shape == (len(tokens), SIZES["vocab_size"]), (a.dtype, a.shape)
        return a

    def train(self, name, *sets, steps=3):
        """Trains the tiny model; returns (the checkpoint directory, the per-step losses)."""
        ckpt, metrics = os.path.join(self.tmp, name + ".ckpt"), os.path.join(self.tmp, name + ".jsonl")
        self.run("--set", f"checkpoint.dir={ckpt}", "--set", f"log.metrics_file={metrics}",
                 "--set", f"training.steps={steps}", *sets, "train")
        losses = [r["loss"] for r in map(json.loads, open(metrics)) if "loss" in r and "step" in r]
        return os.path.join(ckpt, f"step_{steps:08d}"), losses

    def trained_checkpoint(self, tied):
        """A checkpoint of the tiny model after 3 steps (trained once per tie setting, shared by the checks)."""
        if tied not in self.trained:
            ckpt, losses = self.train(f"mt_tied{int(tied)}", "--set", f"model.tie_embeddings={str(tied).lower()}")
            assert len(losses) == 3 and all(map(math.isfinite, losses)), losses
            self.trained[tied] = ckpt
        return self.trained[tied]

    def first_batch(self):
        """meshtrain's batch of step 0 (llama_ref.get_batch: meshtrain's convention)."""
        return L.get_batch(torch.from_numpy(self.tokens.astype(np.int64)), 0, BATCH, SEQ)


# ------------------------------------------------------------ implementations


def perturb_norms(model, seed):
    """Norm gains away from 1, so a gain lost on the way would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


class LlamaRef:
    name = "llama_ref"

    def available(self):
        return None

    def load(self, d):
        return L.load_model(d, torch.float32).eval()

    def logits(self, model, tokens):
        with torch.no_grad():
            return model(torch.tensor([tokens]))[0].numpy()

    def save(self, d, tied, seed):
        s = SIZES
        args = [sys.executable, REF, "init", "--out", d, "--dim", s["dim"], "--n-layers", s["n_layers"],
                "--n-heads", s["n_heads"], "--n-kv-heads", s["n_kv_heads"], "--ffn-dim", s["ffn_dim"],
                "--vocab-size", s["vocab_size"], "--norm-eps", s["norm_eps"], "--rope-theta", s["rope_theta"],
                "--max-seq-len", s["max_seq_len"], "--seed", seed] + (["--tie-embeddings"] if tied else [])
        r = subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr


class Transformers:
    name = "transformers"

    def available(self):
        return HF_ERROR

    def major(self):
        return int(transformers.__version__.split(".")[0])

    def load(self, d):
        kw = {"attn_implementation": "eager", "output_loading_info": True}
        # transformers 5 renamed torch_dtype to dtype (4.56+ takes both).
        kw["dtype" if self.major() >= 5 else "torch_dtype"] = torch.float32
        model, info = transformers.LlamaForCausalLM.from_pretrained(d, **kw)
        tied = json.load(open(os.path.join(d, "config.json")))["tie_word_embeddings"]
        # Loaded cleanly: nothing missing (a tied lm_head is the embedding), nothing unexpected, nothing reshaped.
        missing = [k for k in info.get("missing_keys", []) if not (tied and k == "lm_head.weight")]
        bad = {"missing": missing, "unexpected": list(info.get("unexpected_keys", [])),
               "mismatched": list(info.get("mismatched_keys", []))}
        assert not any(bad.values()), f"{d}: from_pretrained: {bad}"
        assert all(p.dtype == torch.float32 for p in model.parameters())
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        assert (emb.data_ptr() == head.data_ptr()) == bool(tied), ("lm_head tied?", tied)
        return model.eval()

    def logits(self, model, tokens):
        with torch.no_grad():
            return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float().numpy()

    def save(self, d, tied, seed):
        s = SIZES
        kw = dict(vocab_size=s["vocab_size"], hidden_size=s["dim"], intermediate_size=s["ffn_dim"],
                  num_hidden_layers=s["n_layers"], num_attention_heads=s["n_heads"],
                  num_key_value_heads=s["n_kv_heads"], max_position_embeddings=s["max_seq_len"],
                  rms_norm_eps=s["norm_eps"], tie_word_embeddings=tied, hidden_act="silu")
        if self.major() >= 5:
            kw["rope_parameters"] = {"rope_type": "default", "rope_theta": s["rope_theta"]}
        else:
            kw["rope_theta"] = s["rope_theta"]
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).float()
        perturb_norms(model, seed)
        try:
            model.save_pretrained(d, safe_serialization=True)
        except TypeError:  # a transformers that dropped the argument: safetensors is its only format
            model.save_pretrained(d)
        assert any(f.endswith(".safetensors") for f in os.listdir(d)), os.listdir(d)


def impl_loss(impl, model, x, y):
    """Mean token cross-entropy of the batch (x, y) under the implementation, in fp32."""
    with torch.no_grad():
        logits = torch.stack([torch.from_numpy(impl.logits(model, row.tolist())) for row in x])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


# --------------------------------------------------------------------- checks


def check_config_json(ckpt, tied):
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    s = SIZES
    want = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["dim"],
            "intermediate_size": s["ffn_dim"], "num_hidden_layers": s["n_layers"],
            "num_attention_heads": s["n_heads"], "num_key_value_heads": s["n_kv_heads"],
            "head_dim": s["dim"] // s["n_heads"], "vocab_size": s["vocab_size"], "rms_norm_eps": s["norm_eps"],
            "rope_theta": s["rope_theta"], "max_position_embeddings": s["max_seq_len"], "tie_word_embeddings": tied,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}
    for k, v in want.items():
        assert cfg.get(k) == v, (k, cfg.get(k), v)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": s["rope_theta"]}, cfg["rope_parameters"]
    # A tied lm_head is not stored: transformers ties it to the embedding.
    names = set(L.read_model_weights(ckpt))
    assert ("lm_head.weight" in names) == (not tied), sorted(names)


def check_loads_meshtrain_checkpoint(mt, impl, tied):
    ckpt = mt.trained_checkpoint(tied)
    check_config_json(ckpt, tied)
    want = mt.logits(ckpt)
    err = rel_err(impl.logits(impl.load(ckpt), TOKENS), want)
    assert err < TOL, f"logits differ by {err:.3g} relative"
    return f"logits (24, {SIZES['vocab_size']}) within {err:.2g}"


def check_meshtrain_loads_saved(mt, impl, tied):
    d = os.path.join(mt.tmp, f"{impl.name}_saved_tied{int(tied)}")
    impl.save(d, tied, seed=11 + int(tied))
    model = impl.load(d)
    err = rel_err(mt.logits(d), impl.logits(model, TOKENS))
    assert err < TOL, f"logits differ by {err:.3g} relative"
    return f"logits within {err:.2g}"


def check_meshtrain_trains_saved(mt, impl, tied):
    d = os.path.join(mt.tmp, f"{impl.name}_saved_tied{int(tied)}")
    if not os.path.exists(d):
        impl.save(d, tied, seed=11 + int(tied))
    x, y = mt.first_batch()
    want = impl_loss(impl, impl.load(d), x, y)
    _, losses = mt.train(f"{impl.name}_init_tied{int(tied)}", "--set", f"model.init_from={d}",
                         "--set", f"model.tie_embeddings={str(tied).lower()}", steps=6)
    assert len(losses) == 6 and all(map(math.isfinite, losses)), losses
    err = abs(losses[0] - want) / abs(want)
    assert err < TOL, f"first loss {losses[0]} vs {impl.name}'s {want}: {err:.3g} relative"
    return f"6 steps, loss {losses[0]:.5f} -> {losses[-1]:.5f}, step 1 within {err:.2g} of {want:.5f}"


def check_logits_ranks(mt):
    """Replicated: rank 0 of 2 writes what 1 rank writes (on a GPU both ranks share it)."""
    ckpt = mt.trained_checkpoint(False)
    one, two = mt.logits(ckpt), mt.logits(ckpt, np_=2)
    if mt.device == "cpu":
        assert np.array_equal(one, two), rel_err(two, one)
        return "bit for bit"
    err = rel_err(two, one)
    assert err < 1e-6, err
    return f"within {err:.2g}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--meshtrain", default=os.path.join(ROOT, "build", "meshtrain"))
    ap.add_argument("--mpirun", default=os.path.join(ROOT, "scripts", "mpirun.sh"))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    args.meshtrain = os.path.abspath(args.meshtrain)
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}; "
          + (f"transformers {transformers.__version__}" if transformers else HF_ERROR)
          + f"; meshtrain on {args.device}")

    passed = failed = skipped = 0
    with tempfile.TemporaryDirectory() as tmp:
        mt = Meshtrain(args, tmp)
        cases = [("meshtrain logits on 2 ranks equal 1 rank's", lambda: check_logits_ranks(mt))]
        for impl in (LlamaRef(), Transformers()):
            for tied in (False, True):
                t = f"tied={int(tied)}"
                cases += [
                    (f"{impl.name} loads a meshtrain checkpoint (config.json): its logits ({t})",
                     impl, lambda impl=impl, tied=tied: check_loads_meshtrain_checkpoint(mt, impl, tied)),
                    (f"meshtrain logits of a model {impl.name} saved ({t})",
                     impl, lambda impl=impl, tied=tied: check_meshtrain_loads_saved(mt, impl, tied)),
                    (f"meshtrain trains from a model {impl.name} saved, init_from ({t})",
                     impl, lambda impl=impl, tied=tied: check_meshtrain_trains_saved(mt, impl, tied)),
                ]
        for case in cases:
            name, fn = case[0], case[-1]
            why = case[1].available() if len(case) == 3 else None
            try:
                if why:
                    raise Skip(why)
                what = fn()
                passed += 1
                print(f"ok   {name}: {what}")
            except Skip as e:
                skipped += 1
                print(f"skip {name}: {e}")
            except Exception:
                failed += 1
                print(f"FAIL {name}")
                traceback.print_exc()
                sys.stdout.flush()
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    sys.exit(1 if failed else 77 if passed == 0 else 0)


if __name__ == "__main__":
    main()
