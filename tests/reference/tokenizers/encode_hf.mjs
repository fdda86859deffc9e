#!/usr/bin/env node
// Hugging Face's own tokenizer (the Rust `tokenizers` crate through its Node bindings) on a tokenizer.json, for
// the throughput benchmark (scripts/bench/bench_tokenizer.sh): the file's text as one string, or with
// --batch-lines N as batches of N lines (encodeBatch, which the crate runs on all cores).
//   node encode_hf.mjs --tokenizer-json PATH --in TEXT --out IDS.u32 [--batch-lines N] [--stats]
// Ids: little-endian u32, no special tokens added. --stats prints MB/s of the encode alone on stderr.
import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';
import { nodeModules, packageVersion, writeU32 } from './lib.mjs';

const args = process.argv.slice(2);
const opt = (k) => { const i = args.indexOf(k); return i >= 0 ? args[i + 1] : undefined; };
const tj = opt('--tokenizer-json'), inFile = opt('--in'), outFile = opt('--out');
if (!tj || !inFile || !outFile) {
  console.error('usage: encode_hf.mjs --tokenizer-json PATH --in TEXT --out IDS.u32 [--batch-lines N] [--stats]');
  process.exit(2);
}
const { Tokenizer } = createRequire(path.join(nodeModules, '_'))('tokenizers');
const tok = Tokenizer.fromFile(tj);
const text = fs.readFileSync(inFile, 'utf8');
const bytes = Buffer.byteLength(text, 'utf8');
const batch = Number(opt('--batch-lines') || 0);
const t0 = process.hrtime.bigint();
let ids = [];
if (batch > 0) {
  // Lines keep their "\n" so that the batches' texts join back into the file.
  const lines = text.split(/(?<=\n)/);
  for (let i = 0; i < lines.length; i += batch) {
    const encs = await tok.encodeBatch(lines.slice(i, i + batch), { addSpecialTokens: false });
    for (const e of encs) for (const id of e.getIds()) ids.push(id);
  }
} else {
  ids = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
}
const t1 = process.hrtime.bigint();
writeU32(outFile, Uint32Array.from(ids));
const s = Number(t1 - t0) / 1e9;
if (args.includes('--stats'))
  console.error(`tokenizers@${packageVersion('tokenizers')} (Rust) encode: ${bytes} bytes -> ${ids.length} ids in ` +
    `${s.toFixed(3)} s, ${(bytes / 1e6 / s).toFixed(2)} MB/s${batch ? `, batches of ${batch} lines` : ''}`);
