#!/usr/bin/env node
// Hugging Face's own tokenizer (the Rust `tokenizers` crate through its Node bindings) as a long-lived process that
// encodes one text at a time, for the chat-data benchmark's Python baseline (scripts/bench/bench_chat_data.sh):
// each line on stdin is a JSON string; each line written to stdout is the JSON array of its ids (no special tokens
// added), in order, one reply before the next line is read. A request that is not a JSON string gets
// {"error": "..."}. Exits at the end of stdin. The first line written, before any request is read, is
// {"ready": "tokenizers@VERSION (Rust)"}, once the tokenizer is loaded.
//   node encode_hf_lines.mjs --tokenizer-json PATH
import path from 'node:path';
import readline from 'node:readline';
import { createRequire } from 'node:module';
import { nodeModules, packageVersion } from './lib.mjs';

const args = process.argv.slice(2);
const i = args.indexOf('--tokenizer-json');
if (i < 0 || !args[i + 1]) {
  console.error('usage: encode_hf_lines.mjs --tokenizer-json PATH');
  process.exit(2);
}
const { Tokenizer } = createRequire(path.join(nodeModules, '_'))('tokenizers');
const tok = Tokenizer.fromFile(args[i + 1]);
const out = (obj) => new Promise((resolve) => {
  if (process.stdout.write(JSON.stringify(obj) + '\n')) resolve();
  else process.stdout.once('drain', resolve);
});
await out({ ready: `tokenizers@${packageVersion('tokenizers')} (Rust)` });
const rl = readline.createInterface({ input: process.stdin, crlfDelay: Infinity });
for await (const line of rl) {
  let text;
  try {
    text = JSON.parse(line);
    if (typeof text !== 'string') throw new Error('not a JSON string');
  } catch (e) {
    await out({ error: String(e.message || e) });
    continue;
  }
  await out(Array.from((await tok.encode(text, null, { addSpecialTokens: false })).getIds()));
}
