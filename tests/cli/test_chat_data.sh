#!/usr/bin/env bash
# End-to-end tests of `scripts/prepare_data --chat` (conversations rendered by the model's chat template, token
# shards with loss masks beside them, packing) and of scripts/chat_template.py:
#  - against Hugging Face's own implementations from the npm registry, installed for the tests only (never used by
#    the runtime) into ${XDG_CACHE_HOME:-$HOME/.cache}/meshtrain-npm (MT_NPM_CACHE overrides; the same install as
#    tests/cli/test_tokenizer.sh, from tests/reference/tokenizers/package-lock.json): the templates of Llama 3.1 8B
#    Instruct, Qwen2.5 Instruct and Mistral 7B Instruct as @huggingface/ollama-utils ships them, rendered by
#    @huggingface/jinja (Hugging Face's Jinja for JavaScript) and tokenized by HF tokenizers (Rust bindings) with
#    the tokenizers the tokenizer test exports: Llama 3's for Llama 3.1; Llama 2's for Mistral (Mistral 7B v0.1
#    has the same 32,000 pieces); for Qwen2.5, whose tokenizer is not on npm, Llama 3's with Qwen's special
#    tokens <|endoftext|> <|im_start|> <|im_end|> appended (tests/reference/chat/chat_ref.mjs). The ids and masks
#    of prepare_data's shards equal the reference's exactly, on conversations with system prompts (and without),
#    several turns, empty contents, non-ASCII text (accents, CJK, emoji), tools, a plain {"text"} line;
#    chat_template.py prints the reference's rendering;
#  - without npm, on a small byte-level tokenizer and a template written here: the masks cover exactly the
#    assistant's content and end of turn, --train-on-prompt, the separator (the BOS, or the pad token written before
#    each conversation), --pack rows (whole conversations, padding masked, a too long one cut or dropped and
#    counted, shards of whole rows), the validation split, bad lines named by line number (skipped and fatal), the
#    mask file's header, the config line printed, stale masks removed by a plain run; data that would train nothing
#    (no assistant message, --pack 1, an empty validation split asked for) refused naming the file and why.
# The npm-dependent checks are skipped (never passed) when node, npm or the registry is unavailable.
# Prints "chat_data: N passed, N failed[, N skipped]" last.
#   tests/cli/test_chat_data.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_chat_data.sh BUILD_DIR}
source "$(dirname "$0")/common.sh"
refdir="$root/tests/reference/tokenizers"
chatref="$root/tests/reference/chat"
check="$root/tests/cli/check_chat_data.py"
cache=${MT_NPM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshtrain-npm}
export MT_TOK_NODE_MODULES="$cache/node_modules"

# prep NAME ARGS...: prepare_data --chat with the build's meshtrain; output in $tmp/NAME.log, exit status kept.
prep() {
  local n=$1
  shift
  timeout 300 "$py" "$root/scripts/prepare_data" --chat --meshtrain "$mt" --threads 2 "$@" >"$tmp/$n.log" 2>&1
}
# has WHAT LOG TEXT...: each TEXT is in LOG.
has() {
  local what=$1 log=$2 t
  shift 2
  for t in "$@"; do
    if ! grep -qF -- "$t" "$log"; then bad "$what" "no '$t' in the output:" "$(tail -n 12 "$log")"; return 1; fi
  done
  ok "$what"
}

if ! "$py" -c "import jinja2" 2>/dev/null; then
  bad "python3-jinja2 is installed" "prepare_data --chat and scripts/chat_template.py need it: run scripts/setup.sh" \
    "(apt-get install python3-jinja2); every other check is skipped"
  summary chat_data
  exit 1
fi

# ---------------------------------------------------------------- without npm: a byte-level tokenizer and a template
# tiny: every byte is a token (ids 0..255, GPT-2's byte alphabet, no merges) and 7 added special tokens
# <|begin|>=256 <|end|>=257 <|user|>=258 <|assistant|>=259 <|system|>=260 <|tool|>=261 <|pad|>=262; the template
# writes the BOS, then <|role|>content<|end|> per message (a system message other than the first raises).
# tinyq: the same without a BOS (eos <|end|>, pad <|pad|>), as Qwen's: the pad token becomes the separator.
"$py" - "$tmp" <<'PY'
import json, os, sys
keep = lambda b: 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255
chars, n = [], 256
for b in range(256):
    chars.append(chr(b) if keep(b) else chr(n))
    n += 0 if keep(b) else 1
specials = ["<|begin|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>", "<|pad|>"]
bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
tj = {"version": "1.0", "added_tokens": [{"id": 256 + i, "content": s, "single_word": False, "lstrip": False,
      "rstrip": False, "normalized": False, "special": True} for i, s in enumerate(specials)],
      "normalizer": None, "pre_tokenizer": bl, "post_processor": None, "decoder": bl,
      "model": {"type": "BPE", "vocab": {c: i for i, c in enumerate(chars)}, "merges": []}}
template = ("{{ bos_token }}{% for m in messages %}"
            "{% if m.role == 'system' and not loop.first %}{{ raise_exception('a system message must come first') }}"
            "{% endif %}{{ '<|' + m.role + '|>' + m.content + '<|end|>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
for name, cfg in (("tiny", {"bos_token": "<|begin|>", "eos_token": "<|end|>"}),
                  ("tinyq", {"bos_token": None, "eos_token": {"content": "<|end|>"}, "pad_token": "<|pad|>",
                             "chat_template": template.replace("{{ bos_token }}", "")})):
    d = os.path.join(sys.argv[1], name)
    os.makedirs(d)
    json.dump(tj, open(os.path.join(d, "tokenizer.json"), "w"))
    json.dump({"chat_template": template, **cfg}, open(os.path.join(d, "tokenizer_config.json"), "w"))
W = lambda f, rows: open(os.path.join(sys.argv[1], f), "w", encoding="utf-8").write(
    "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows))
msg = lambda r, c: {"role": r, "content": c}
good = [
    {"messages": [msg("system", "Be brief."), msg("user", "Hi?"), msg("assistant", "Hello.")]},
    {"messages": [msg("user", "2+2?"), msg("assistant", "4"), msg("user", "And 3+3, très vite? 日本"), msg("assistant", "6 🚀")]},
    {"text": "plain text, every token trained"},
    {"system": "Top-level system.", "messages": [msg("user", ""), msg("assistant", "")]},
    {"messages": [msg("user", "a question left open")]},
]
W("good.jsonl", good)
long = {"messages": [msg("user", "Tell me a long story."), msg("assistant", "Once upon a time. " * 30)]}
W("pack.jsonl", good * 3 + [long] + good)
W("noasst.jsonl", [good[4]] * 3 + [{"messages": [msg("system", "S"), msg("user", "no answer")]}])
W("single.jsonl", [good[1]])
W("bad.jsonl", [good[0], "{not json", {"foo": 1}, {"messages": [msg("narrator", "x")]}, "",
                {"messages": [msg("user", "u"), msg("system", "late")]}, good[1], {"messages": []},
                {"text": 5}, '{"messages": [{"role": "user", "content": "\\ud800"}]}'])
PY

# 1. The masks cover exactly each assistant message's content and the <|end|> after it; {"text"}: all of it.
if prep tiny --tokenizer "$tmp/tiny" --out "$tmp/tiny_out" --val-fraction 0 "$tmp/good.jsonl"; then
  ok "prepare_data --chat (byte-level tokenizer, own template): $(grep -F 'trained, in' "$tmp/tiny.log" | cut -c15-)"
  what="the masks: the assistant's content and <|end|>, all of a {\"text\"} line, nothing else; separator = BOS"
  if out=$("$py" - "$tmp/tiny_out" <<'PY' 2>&1
import sys, numpy as np
d = sys.argv[1]
t = np.fromfile(d + "/chat_train_000000.bin", np.uint16, offset=1024).astype(int)
m = np.fromfile(d + "/chat_train_000000.mask", np.uint8, offset=1024)
want = np.zeros(len(t), np.uint8)
docs = np.flatnonzero(t == 256).tolist()
assert len(docs) == 6 and docs[0] == 0 and t[-1] == 256, docs   # 5 lines, one more BOS at the end
for a, b in zip(docs, docs[1:]):
    if t[a + 1] not in (258, 259, 260, 261):  # the text line: all but its separator
        want[a + 1:b] = 1
        continue
    inside = False
    for i in range(a, b):
        if t[i] == 259:
            inside = True
        elif inside:
            want[i] = 1
            inside = t[i] != 257
if not (m == want).all():
    i = int(np.flatnonzero(m != want)[0])
    sys.exit(f"mask differs at {i}: got {m[i-3:i+5].tolist()} want {want[i-3:i+5].tolist()}, tokens {t[i-3:i+5].tolist()}")
print(f"{len(t)} tokens, {int(m.sum())} trained")
PY
  ); then ok "$what: $out"; else bad "$what" "$out"; fi
  has "the config line for the BOS separator" "$tmp/tiny.log" "data.document_separator: 256" \
    "the BOS, which starts every rendering"
else
  bad "prepare_data --chat (byte-level tokenizer)" "$(tail -n 10 "$tmp/tiny.log")"
fi

# 2. --train-on-prompt: every token 1 but the separators.
what="--train-on-prompt: every mask value 1 but the separators'"
if prep top --tokenizer "$tmp/tiny" --out "$tmp/tiny_top" --val-fraction 0 --train-on-prompt "$tmp/good.jsonl" &&
  out=$("$py" -c '
import sys, numpy as np
t = np.fromfile(sys.argv[1] + "/chat_train_000000.bin", np.uint16, offset=1024)
m = np.fromfile(sys.argv[1] + "/chat_train_000000.mask", np.uint8, offset=1024)
assert ((t == 256) == (m == 0)).all(), (t[:8], m[:8])
print(f"{int(m.sum())} of {len(m)} tokens, 0 on the {int((t == 256).sum())} separators")' "$tmp/tiny_top" 2>&1); then
  ok "$what: $out"
else bad "$what" "${out:-$(tail -n 8 "$tmp/top.log")}"; fi

# 3. No BOS in the rendering: the pad token (the eos, <|end|>, is inside every conversation) before each.
if prep tinyq --tokenizer "$tmp/tinyq" --out "$tmp/tinyq_out" --val-fraction 0 "$tmp/good.jsonl"; then
  has "no BOS: the pad token <|pad|> (262) written before each conversation, and the config line" "$tmp/tinyq.log" \
    "data.document_separator: 262" "the pad token, which no conversation holds"
  what="no BOS: the same masks as with the BOS, the separators at mask 0"
  if out=$("$py" -c '
import sys, numpy as np
r = lambda d, e: np.fromfile(f"{d}/chat_train_000000.{e}", np.uint16 if e == "bin" else np.uint8, offset=1024)
a, am, b, bm = r(sys.argv[1], "bin"), r(sys.argv[1], "mask"), r(sys.argv[2], "bin"), r(sys.argv[2], "mask")
assert ((a == 256) == (b == 262)).all() and (a[a != 256] == b[b != 262]).all() and (am == bm).all()
print(f"{int((b == 262).sum())} separators")' "$tmp/tiny_out" "$tmp/tinyq_out" 2>&1); then ok "$what: $out"; else bad "$what" "$out"; fi
else
  bad "prepare_data --chat without a BOS" "$(tail -n 10 "$tmp/tinyq.log")"
fi

# 4. Packing: rows of whole conversations, padding masked, the long conversation cut or dropped and counted; shards
# of whole rows (3 a shard), the last one token more; the validation split. Against an unpacked run of the same data.
T=96
if prep unpacked --tokenizer "$tmp/tiny" --out "$tmp/unpacked" --val-fraction 0 "$tmp/pack.jsonl"; then
  for rule in cut drop; do
    what="--pack $T --long $rule (first-fit, --shard-tokens 300, --val-fraction 0.25)"
    if prep pack_$rule --tokenizer "$tmp/tiny" --out "$tmp/pack_$rule" --pack $T --long $rule --shard-tokens 300 \
      --val-fraction 0.25 "$tmp/pack.jsonl"; then
      count=$([ $rule = cut ] && echo "1 conversations longer than $T tokens cut, 0 dropped" ||
        echo "0 conversations longer than $T tokens cut, 1 dropped")
      if out=$("$py" "$check" packed "$tmp/pack_$rule" chat $T 257 --docs-from "$tmp/unpacked" --long $rule \
        --rows-per-shard 3 2>&1) && grep -qF "$count" "$tmp/pack_$rule.log"; then
        ok "$what: $out; counted: $count"
      else bad "$what" "$out" "$(grep -F -- '--pack' "$tmp/pack_$rule.log")"; fi
    else bad "$what" "$(tail -n 10 "$tmp/pack_$rule.log")"; fi
  done
  what="--val-fraction 0.3 without --pack: train then val is the whole stream, cut before a conversation"
  if prep split --tokenizer "$tmp/tiny" --out "$tmp/split" --val-fraction 0.3 "$tmp/pack.jsonl" &&
    out=$("$py" "$check" split "$tmp/split" chat "$tmp/unpacked" 2>&1); then ok "$what: $out"; else
    bad "$what" "${out:-$(tail -n 8 "$tmp/split.log")}"; fi
else
  bad "prepare_data --chat (the packing data, unpacked)" "$(tail -n 10 "$tmp/unpacked.log")"
fi

# 5. Bad lines: each named by its line number and reason; skipped, or the first one fatal (exit 1, nothing written).
if prep bad_skip --tokenizer "$tmp/tiny" --out "$tmp/bad_skip" --val-fraction 0 "$tmp/bad.jsonl"; then
  has "--bad-lines skip: each bad line named by its number and reason, the rest kept, counted" "$tmp/bad_skip.log" \
    "bad.jsonl:2: not JSON" "bad.jsonl:3: no 'messages'" "bad.jsonl:4: message 1: unknown role \"narrator\"" \
    "bad.jsonl:6: the template raised on the conversation: a system message must come first" \
    "bad.jsonl:8: 'messages' is not a non-empty list" "bad.jsonl:9: 'text' is not a string (int)" \
    "bad.jsonl:10: the text holds '\\ud800'" "9 lines read: 2 conversations (2 chat, 0 text), 7 bad lines skipped" \
    "1 blank lines ignored"
else
  bad "--bad-lines skip" "exit status $?" "$(tail -n 12 "$tmp/bad_skip.log")"
fi
prep bad_fatal --tokenizer "$tmp/tiny" --out "$tmp/bad_fatal" --val-fraction 0 --bad-lines fatal "$tmp/bad.jsonl"
rc=$?
if [ $rc -eq 1 ] && grep -qF "bad.jsonl:2: not JSON" "$tmp/bad_fatal.log" && ! grep -qF "bad.jsonl:3" "$tmp/bad_fatal.log" &&
  [ ! -e "$tmp/bad_fatal/chat_train_000000.bin" ]; then
  ok "--bad-lines fatal: exit 1 at line 2, named, nothing written"
else bad "--bad-lines fatal" "exit status $rc" "$(tail -n 6 "$tmp/bad_fatal.log")"; fi

# 6. chat_template.py prints the rendering; a plain run over the same name removes the stale masks.
printf '%s' '{"system": "S", "messages": [{"role": "user", "content": "é"}]}' >"$tmp/one.json"
want=$(printf '<|begin|><|system|>S<|end|><|user|>é<|end|><|assistant|>')
got=$("$py" "$root/scripts/chat_template.py" --tokenizer "$tmp/tiny" --add-generation-prompt <"$tmp/one.json" 2>&1)
if [ "$got" = "$want" ]; then ok "chat_template.py --add-generation-prompt prints the rendering"; else
  bad "chat_template.py" "got '$got'" "want '$want'"; fi
expect "chat_template.py: a template that raises exits 1 with its message" nonzero "a system message must come first" -- \
  "$py" "$root/scripts/chat_template.py" --tokenizer "$tmp/tiny" <<<'[{"role": "user", "content": "u"}, {"role": "system", "content": "s"}]'
what="a plain prepare_data run with the same name removes the stale masks"
if "$py" "$root/scripts/prepare_data" --out "$tmp/tiny_out" --name chat "$tmp/good.jsonl" >"$tmp/plain.log" 2>&1 &&
  [ -f "$tmp/tiny_out/chat_train_000000.bin" ] && ! ls "$tmp/tiny_out"/*.mask >/dev/null 2>&1; then ok "$what"; else
  bad "$what" "$(ls "$tmp/tiny_out")" "$(tail -n 5 "$tmp/plain.log")"; fi

# 7. Data that would train nothing is an error naming the input and why, nothing written; an empty split is said so.
# nothing_written WHAT NAME RC TEXT...: prep NAME exited with RC = 1, its output holds each TEXT, and no
# shard was written into $tmp/NAME.
nothing_written() {
  local what=$1 n=$2 rc=$3 t
  shift 3
  if [ "$rc" -ne 1 ] || [ -e "$tmp/$n/chat_train_000000.bin" ]; then
    bad "$what" "exit $rc, expected 1 and no shard" "$(tail -n 4 "$tmp/$n.log")"
    return
  fi
  has "$what" "$tmp/$n.log" "$@"
}
prep noasst --tokenizer "$tmp/tiny" --out "$tmp/noasst" "$tmp/noasst.jsonl"
nothing_written "no assistant message anywhere: exit 1" noasst $? \
  "no trained token in $tmp/noasst.jsonl: none of its 4 conversations has an assistant message"
prep pack1 --tokenizer "$tmp/tiny" --out "$tmp/pack1" --pack 1 "$tmp/pack.jsonl"
nothing_written "--pack 1 leaves no assistant token: exit 1" pack1 $? \
  "no trained token in $tmp/pack.jsonl after --pack 1" "21 conversations cut"
prep single --tokenizer "$tmp/tiny" --out "$tmp/single" --val-fraction 0.1 "$tmp/single.jsonl"
nothing_written "--val-fraction 0.1 on one conversation: an empty validation split is an error" single $? \
  "--val-fraction 0.1: the validation split of $tmp/single.jsonl is empty"
what="--pack 96 --val-fraction 0: the empty validation split said so"
if prep packval0 --tokenizer "$tmp/tiny" --out "$tmp/packval0" --pack 96 --val-fraction 0 "$tmp/pack.jsonl" &&
  ! grep -q '\[\]' "$tmp/packval0.log"; then
  has "$what" "$tmp/packval0.log" "val: no conversations (--val-fraction 0): its one shard is empty: train with data.val: ''"
else bad "$what" "$(grep -F 'val:' "$tmp/packval0.log")" "$(tail -n 3 "$tmp/packval0.log")"; fi

# ---------------------------------------------------------------- use: fine-tune on the packed chat data, chat with it
# A tiny model trained from scratch on tiny's packed conversations (rows of 32, the BOS as document separator, the
# masks), saved; then `generate --chat` renders a user's message with the template and prints the reply, on 1 and 2
# ranks alike; a conversation the template refuses is one clear error, printed once.
if prep use --tokenizer "$tmp/tiny" --out "$tmp/use" --val-fraction 0.2 --pack 32 "$tmp/pack.jsonl"; then
  cat >"$tmp/use.yaml" <<YAML
model: {dim: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 64, vocab_size: 264, max_seq_len: 64}
training: {steps: 6, batch_size: 2, seq_len: 32, lr: 3.0e-3, warmup_steps: 1, grad_clip: 1.0, threads: 1}
data: {train: "$tmp/use/chat_train_*.bin", val: "$tmp/use/chat_val_*.bin", tokenizer: "$tmp/tiny", document_separator: 256}
eval: {interval: 3, steps: 1}
sample: {interval: 0}
checkpoint: {dir: "$tmp/use_ck", interval: 6}
log: {interval: 1, metrics_file: "$tmp/use.jsonl"}
YAML
  if mpi_logged "$tmp/use_train.log" "$mpirun" -np 2 "$mt" --config "$tmp/use.yaml" train &&
    grep -q "loss masks on 1 of 1 shard(s)" "$tmp/use_train.log" && grep -q '"trained_tokens"' "$tmp/use.jsonl"; then
    ok "training on the packed chat data (2 ranks): $(grep -o 'loss masks on.*trained ([0-9.]*%)' "$tmp/use_train.log" | head -n 1)"
  else bad "training on the packed chat data" "$(tail -n 8 "$tmp/use_train.log")"; fi
  gen() {  # gen NAME NP ARGS...: generate from the checkpoint
    local n=$1 np=$2
    shift 2
    mpi_logged "$tmp/$n.log" "$mpirun" -np "$np" "$mt" generate --checkpoint "$tmp/use_ck" --tokenizer "$tmp/tiny" \
      --tokens 12 --temperature 0 "$@"
  }
  if gen chat1 1 --chat --prompt "Hi?" && gen chat2 2 --chat --prompt "Hi?" && [ -s "$tmp/chat1.log" ] &&
    cmp -s <(tail -n 1 "$tmp/chat1.log") <(tail -n 1 "$tmp/chat2.log"); then
    ok "generate --chat: the reply to a user's message rendered by the template, 1 and 2 ranks alike: '$(tail -n 1 "$tmp/chat1.log")'"
  else bad "generate --chat" "$(tail -n 4 "$tmp/chat1.log")" "$(tail -n 4 "$tmp/chat2.log")"; fi
  printf '%s' '{"messages": [{"role": "user", "content": "u"}, {"role": "system", "content": "late"}]}' >"$tmp/late.json"
  if ! gen chatbad 2 --chat-file "$tmp/late.json" && [ "$(grep -c 'a system message must come first' "$tmp/chatbad.log")" = 1 ]; then
    ok "generate --chat-file: a conversation the template refuses is one error: $(grep -m1 -o 'the chat template.*first' "$tmp/chatbad.log")"
  else bad "generate --chat-file with a refused conversation" "$(tail -n 6 "$tmp/chatbad.log")"; fi
else
  bad "prepare_data --chat --pack 32 for training" "$(tail -n 6 "$tmp/use.log")"
fi

# ---------------------------------------------------------------- against Hugging Face's implementations (npm)
ref_checks=(
  "llama31: the ids and masks equal the reference's" "qwen25: the ids and masks equal the reference's"
  "mistral: the ids and masks equal the reference's" "llama31: chat_template.py prints the reference's rendering"
  "qwen25: chat_template.py prints the reference's rendering" "mistral: chat_template.py prints the reference's rendering"
  "qwen25: --train-on-prompt equals the reference's" "mistral: the conversation with a system message is a bad line"
)
skip_refs() { local c; for c in "${ref_checks[@]}"; do skip "$c" "$1"; done; }
npm_references "$refdir" "$cache"  # sets have_node and npm_error
missing=
for p in @huggingface/jinja @huggingface/ollama-utils llama3-tokenizer-js llama-tokenizer-js; do
  [ -f "$MT_TOK_NODE_MODULES/$p/package.json" ] || missing="$missing $p"
done
if [ $have_node = 0 ]; then
  skip_refs "node or npm is not installed"
elif [ -n "$missing" ]; then
  skip_refs "npm packages not installed:$missing${npm_error:+ ($npm_error)}"
elif ! node "$refdir/export.mjs" --out "$tmp/exp" --only llama3,llama2 >"$tmp/export.log" 2>&1 ||
  ! node "$chatref/chat_ref.mjs" models --tokenizers "$tmp/exp" --out "$tmp/models" >"$tmp/models.log" 2>&1; then
  for c in "${ref_checks[@]}"; do bad "$c" "the reference's model directories:" "$(tail -n 5 "$tmp/export.log" "$tmp/models.log")"; done
else
  sed 's/^/reference model: /' "$tmp/models.log"
  declare -A sep=([llama31]=128000 [qwen25]=128256 [mistral]=1)
  for m in llama31 qwen25 mistral; do
    data="$chatref/conversations.jsonl"
    [ $m = mistral ] && data="$chatref/conversations_mistral.jsonl"
    what="$m: the ids and masks equal the reference's"
    if ! node "$chatref/chat_ref.mjs" render --model "$tmp/models/$m" --in "$data" --out "$tmp/$m.ref.json" >"$tmp/$m.ref.log" 2>&1; then
      bad "$what" "the reference failed:" "$(tail -n 8 "$tmp/$m.ref.log")"
    elif ! prep $m --tokenizer "$tmp/models/$m" --out "$tmp/out_$m" --val-fraction 0 "$data"; then
      bad "$what" "prepare_data failed:" "$(tail -n 8 "$tmp/$m.log")"
    elif ! grep -qF "data.document_separator: ${sep[$m]} " "$tmp/$m.log"; then
      bad "$what" "no 'data.document_separator: ${sep[$m]}' line:" "$(tail -n 4 "$tmp/$m.log")"
    elif out=$("$py" "$check" compare "$tmp/$m.ref.json" "$tmp/out_$m" chat "${sep[$m]}" 2>&1); then
      ok "$what, separator ${sep[$m]} (the config line printed): $out; reference: $(cat "$tmp/$m.ref.log")"
    else
      bad "$what" "$out"
    fi
    # The second conversation (several turns, non-ASCII) with the generation prompt, both ways.
    what="$m: chat_template.py prints the reference's rendering"
    sed -n 2p "$data" >"$tmp/$m.one.json"
    if node "$chatref/chat_ref.mjs" text --model "$tmp/models/$m" --in "$tmp/$m.one.json" --add-generation-prompt >"$tmp/$m.want.txt" 2>&1 &&
      "$py" "$root/scripts/chat_template.py" --tokenizer "$tmp/models/$m" --add-generation-prompt <"$tmp/$m.one.json" >"$tmp/$m.got.txt" 2>&1 &&
      cmp -s "$tmp/$m.got.txt" "$tmp/$m.want.txt"; then
      ok "$what (add_generation_prompt; $(wc -c <"$tmp/$m.want.txt") bytes)"
    else bad "$what" "got: $(head -c 300 "$tmp/$m.got.txt")" "want: $(head -c 300 "$tmp/$m.want.txt")"; fi
  done
  what="qwen25: --train-on-prompt equals the reference's"
  if prep qwen25_top --tokenizer "$tmp/models/qwen25" --out "$tmp/out_qwen25_top" --val-fraction 0 --train-on-prompt \
      "$chatref/conversations.jsonl" &&
    out=$("$py" "$check" compare "$tmp/qwen25.ref.json" "$tmp/out_qwen25_top" chat 128256 --train-on-prompt 2>&1); then
    ok "$what (every mask 1 but the separators'): $out"
  else bad "$what" "${out:-}" "$(tail -n 5 "$tmp/qwen25_top.log")"; fi
  # Mistral's template raises on a system message: the reference errs on the same line, prepare_data names it.
  n=$(grep -n '"role": "system"' "$chatref/conversations_mistral.jsonl" | cut -d: -f1 | head -n 1)
  what="mistral: the conversation with a system message is a bad line"
  if [ -n "$n" ] && grep -qF "conversations_mistral.jsonl:$n: the template raised on the conversation: Conversation roles must alternate user/assistant" "$tmp/mistral.log" &&
    "$py" -c 'import json, sys; e = [l["line"] for l in json.load(open(sys.argv[1]))["lines"] if "error" in l]; sys.exit(e != [int(sys.argv[2])])' "$tmp/mistral.ref.json" "$n"; then
    ok "$what (line $n: the reference's template raises there too)"
  else bad "$what" "line '$n'" "$(grep -F 'jsonl:' "$tmp/mistral.log")"; fi
fi

echo "reference packages: node $(node --version 2>/dev/null); $(cd "$MT_TOK_NODE_MODULES" 2>/dev/null && for p in @huggingface/jinja @huggingface/ollama-utils tokenizers llama3-tokenizer-js llama-tokenizer-js; do
  v=$(node -p "require('./$p/package.json').version" 2>/dev/null) && printf '%s@%s ' "$p" "$v" || printf '%s (missing) ' "$p"; done)"
summary chat_data
[ $failed -eq 0 ]
