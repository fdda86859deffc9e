#!/usr/bin/python3
"""The two Python halves of scripts/bench/bench_chat_data.sh (data preparation for chat fine-tuning):

  chat_data_baseline.py generate --n N --out FILE.jsonl [--seed 1]
    N synthetic conversations, one a line ({"messages": [...]}, some with a top-level "system"), seeded: a system
    prompt in about 40%, 1 to 4 user/assistant turns (about 5% end on the user), message lengths from a few words
    to several hundred (log-uniform), in English with accents, CJK, Cyrillic, Greek, emoji, numbers and code.

  chat_data_baseline.py baseline --tokenizer DIR --in FILE.jsonl --node-server CMD [--pack T] [--render-only]
                                 [--out PREFIX]
    A plain Python loop in the style of transformers' apply_chat_template, doing what prepare_data --chat does for
    the loss masks: for each conversation, the renderings the mask rule needs (the full conversation; per assistant
    message i, messages 0..i-1 with add_generation_prompt and messages 0..i, the full one reused for the last), each
    rendered by a Jinja2 ImmutableSandboxedEnvironment template compiled once (transformers caches it with
    lru_cache), with the environment, filters and globals transformers gives it, then tokenized one call at a time
    as apply_chat_template(..., tokenize=True) does (one tokenizer call per rendering, no special tokens added).
    The tokenizer is Hugging Face's Rust `tokenizers`, in ONE long-lived node process (CMD, run through the shell:
    tests/reference/tokenizers/encode_hf_lines.mjs) spoken to in JSON lines, so that no process starts per call.
    The mask: 1 on the tokens of render(0..i) beyond render(0..i-1, generation prompt), each cut to the longest
    common prefix (as prepare_data). --pack T: a conversation longer than T tokens cut to its first T (tokens and
    mask), as prepare_data --pack T --long cut does, before it is counted and written. --render-only: the
    renderings alone, not tokenized (the lower bound of any such loop). --out PREFIX: PREFIX.ids (u32) and
    PREFIX.mask (u8) of all the conversations.
    Prints one JSON line: the counts, the loop's times (render, tokenize, the loop, the set-up before it) and the
    median round trip of a call on an empty text (measured in the set-up: what a call costs beyond the encode)."""
import argparse
import json
import math
import random
import subprocess
import sys
import time

import numpy as np

# ---------------------------------------------------------------- generate

WORDS = """the of and to in is that for it as was with be by on not he this are or his from at which but have an they
you were her she there been one all we their has would when if so what out up more will into some them time can
only other new could these two may first then do any like my now over such our man me even most made after also
did many before must through back years where much your way well down should because each just those people how
too little state good very make world still own see men work long get here between both life being under never
day same another know while last might us great old year off come since against go came right used take three
model training data token gradient loss batch layer tensor memory compute shard rank mesh parallel pipeline expert
attention kernel cache checkpoint optimizer schedule warmup learning rate sequence vocabulary prompt answer question
explain example function variable result value number list string file error output input system user assistant
please thanks sure because however therefore perhaps indeed quickly carefully simply exactly probably""".split()
ACCENTED = ["café", "naïve", "déjà vu", "Straße", "façade", "über", "señor", "crème brûlée", "Ærø", "São Paulo",
            "Zürich", "résumé", "coöperate", "Ångström", "jalapeño", "élève", "garçon", "Kraków", "smörgåsbord"]
FOREIGN = ["東京都の天気は晴れです。", "我们在北京学习机器学习。", "中文分词测试", "한국어 문장입니다.", "русский текст",
           "Привет, как дела?", "Ελληνικά γράμματα", "日本語のテキスト", "これはテストです", "Γειά σου κόσμε",
           "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีครับ"]
EMOJI = ["🚀", "👍🏽", "🇫🇷", "😀", "🎉", "👩‍💻", "✅", "🔥", "1️⃣", "❤️"]
CODE = ["```python\ndef f(x):\n    return x * 2\n```", "```cpp\nfor (int i = 0; i < n; ++i) sum += a[i];\n```",
        "`np.zeros((4, 4))`", "```bash\nls -la | grep .json\n```", "```json\n{\"a\": 1, \"b\": [2, 3]}\n```"]
SYSTEM = ["You are a helpful assistant.", "Be brief.", "You are a careful reviewer of C++ code. Answer precisely.",
          "Réponds en français, s'il te plaît.", "You are an assistant that explains machine learning to beginners.",
          "Always answer with a list.", "你是一个乐于助人的助手。", "  Leading and trailing spaces.  "]


def text(rng, lo, hi):
    n = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    out = []
    for k in range(n):
        r = rng.random()
        w = (rng.choice(ACCENTED) if r < 0.05 else rng.choice(FOREIGN) if r < 0.08 else rng.choice(EMOJI)
             if r < 0.10 else str(rng.randrange(100000)) if r < 0.13 else rng.choice(CODE) if r < 0.135
             else rng.choice(WORDS))
        if k == 0 or out[-1].endswith((".", "?", "!", "\n")):
            w = w[:1].upper() + w[1:]
        out.append(w)
        if rng.random() < 0.08:
            out[-1] += rng.choice([".", ".", ",", "?", "!", ":", ".\n\n"])
    s = " ".join(out).replace("\n ", "\n")
    return s + ("." if rng.random() < 0.7 else "")


def generate(a):
    rng = random.Random(a.seed)
    with open(a.out, "w", encoding="utf-8") as f:
        for _ in range(a.n):
            msgs = []
            for _ in range(rng.randint(1, 4)):
                msgs.append({"role": "user", "content": text(rng, 3, 150)})
                msgs.append({"role": "assistant", "content": text(rng, 5, 400)})
            if rng.random() < 0.05:
                msgs.append({"role": "user", "content": text(rng, 3, 60)})
            obj = {"messages": msgs}
            r = rng.random()
            if r < 0.3:
                msgs.insert(0, {"role": "system", "content": rng.choice(SYSTEM)})
            elif r < 0.4:
                obj = {"system": rng.choice(SYSTEM), "messages": msgs}
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------- baseline (transformers' style)

def compile_template(source):
    """As transformers' _compile_jinja_template (cached once): the same Jinja environment as prepare_data's
    (scripts/chat_template.py: the sandbox, trim/lstrip blocks, the {% generation %} block, loopcontrols, tojson,
    raise_exception, strftime_now), so the two sides differ in the loop around it, not in the rendering."""
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import chat_template
    return chat_template._environment().from_string(source)


class NodeTokenizer:
    """HF tokenizers in one node process: encode(text) -> ids, one request and its reply at a time."""

    def __init__(self, cmd):
        self.p = subprocess.Popen(cmd, shell=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  encoding="utf-8", bufsize=1)
        ready = json.loads(self.p.stdout.readline() or "{}")
        if "ready" not in ready:
            sys.exit(f"chat_data_baseline: the tokenizer process did not start: {cmd}")
        self.name = ready["ready"]

    def encode(self, s):
        self.p.stdin.write(json.dumps(s) + "\n")
        self.p.stdin.flush()
        r = json.loads(self.p.stdout.readline())
        if isinstance(r, dict):
            sys.exit(f"chat_data_baseline: the tokenizer process: {r.get('error')}")
        return r

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def lcp(a, b):
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def baseline(a):
    t_start = time.perf_counter()
    with open(f"{a.tokenizer}/tokenizer_config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    special = {}  # special_tokens_map: the tokens the config sets (a dict's content)
    for k in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        v = cfg.get(k)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            special[k] = v
    if isinstance(cfg.get("additional_special_tokens"), list):
        special["additional_special_tokens"] = cfg["additional_special_tokens"]
    template = compile_template(cfg["chat_template"])
    tok = None if a.render_only else NodeTokenizer(a.node_server)
    roundtrip = None
    if tok is not None:  # the cost of a call itself: the round trip of an empty text, the median of 200
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            tok.encode("")
            times.append(time.perf_counter() - t0)
        roundtrip = sorted(times)[len(times) // 2]
    t_render = t_tok = 0.0
    n_render = n_conv = n_bytes = n_tokens = n_trained = n_cut = 0
    all_ids, all_mask = [], []

    def apply_chat_template(messages, add_generation_prompt=False):
        # apply_chat_template(messages, tools=None, add_generation_prompt=..., tokenize=True): render, then
        # self(rendered, add_special_tokens=False)["input_ids"].
        nonlocal t_render, t_tok, n_render
        t0 = time.perf_counter()
        rendered = template.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **special)
        t1 = time.perf_counter()
        t_render += t1 - t0
        n_render += 1
        if tok is None:
            return rendered
        ids = tok.encode(rendered)
        t_tok += time.perf_counter() - t1
        return ids

    t_loop = time.perf_counter()
    with open(a.input, encoding="utf-8") as f:
        for line in f:
            n_bytes += len(line.encode("utf-8"))
            obj = json.loads(line)
            msgs = obj["messages"]
            if obj.get("system") is not None:
                msgs = [{"role": "system", "content": obj["system"]}] + msgs
            full = apply_chat_template(msgs)
            mask = [0] * len(full)
            for i, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                before = apply_chat_template(msgs[:i], add_generation_prompt=True)
                up_to = full if i == len(msgs) - 1 else apply_chat_template(msgs[:i + 1])
                if tok is not None:
                    start, end = lcp(before, up_to), lcp(up_to, full)
                    mask[start:end] = [1] * (end - start)
            n_conv += 1
            if tok is None:
                continue
            if a.pack and len(full) > a.pack:  # prepare_data --pack T --long cut keeps the first T tokens
                n_cut += 1
                full, mask = full[:a.pack], mask[:a.pack]
            n_tokens += len(full)
            n_trained += sum(mask)
            if a.out:
                all_ids.append(np.array(full, dtype=np.uint32))
                all_mask.append(np.array(mask, dtype=np.uint8))
    if a.out and all_ids:
        np.concatenate(all_ids).tofile(a.out + ".ids")
        np.concatenate(all_mask).tofile(a.out + ".mask")
    t_end = time.perf_counter()
    if tok is not None:
        tok.close()
    print(json.dumps({"conversations": n_conv, "bytes": n_bytes, "renders": n_render, "tokens": n_tokens,
                      "trained": n_trained, "cut": n_cut, "render_s": t_render, "tokenize_s": t_tok,
                      "loop_s": t_end - t_loop, "setup_s": t_loop - t_start,
                      "roundtrip_s": roundtrip, "tokenizer": tok.name if tok else None}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--n", type=int, required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--seed", type=int, default=1)
    b = sub.add_parser("baseline")
    b.add_argument("--tokenizer", required=True, metavar="DIR")
    b.add_argument("--in", dest="input", required=True)
    b.add_argument("--node-server", default=None, metavar="CMD")
    b.add_argument("--pack", type=int, default=0)
    b.add_argument("--render-only", action="store_true")
    b.add_argument("--out", default=None, metavar="PREFIX")
    a = ap.parse_args()
    if a.cmd == "generate":
        generate(a)
    else:
        if not a.render_only and not a.node_server:
            sys.exit("chat_data_baseline: baseline needs --node-server CMD (or --render-only)")
        baseline(a)


if __name__ == "__main__":
    main()
