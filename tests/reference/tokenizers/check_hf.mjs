#!/usr/bin/env node
// Checks an exported tokenizer.json against the reference package's ids with Hugging Face's own implementations,
// independently of meshtrain: the Rust `tokenizers` (npm native bindings) and/or the pure-JS
// `@huggingface/tokenizers`. Encodes TEXT without added BOS/EOS and compares with IDS (the reference's
// encode.mjs output); decodes IDS (special tokens kept) and compares with BYTES when given.
//   node check_hf.mjs --impl rust|js --tokenizer-json PATH --in TEXT --ids IDS.u32 [--bytes DECODED]
// Prints "same ids: N" / "same bytes: N", or the first difference, and exits 1 on a difference;
// exits 3 when the implementation is not installed (a skip, not a pass).
import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';
import { nodeModules, packageVersion, readU32, readText } from './lib.mjs';
import { firstDifference } from './compare.mjs';

const args = process.argv.slice(2);
const opt = (k) => { const i = args.indexOf(k); return i >= 0 ? args[i + 1] : undefined; };
const impl = opt('--impl'), tjPath = opt('--tokenizer-json'), inFile = opt('--in'), idsFile = opt('--ids');
if (!impl || !tjPath || !inFile || !idsFile) {
  console.error('usage: check_hf.mjs --impl rust|js --tokenizer-json PATH --in TEXT --ids IDS.u32 [--bytes DECODED]');
  process.exit(2);
}
const text = readText(inFile);
const want = readU32(idsFile);
let encode, decode, label;
try {
  if (impl === 'rust') {
    const { Tokenizer } = createRequire(path.join(nodeModules, '_'))('tokenizers');
    const tok = Tokenizer.fromFile(tjPath);
    label = 'tokenizers@' + packageVersion('tokenizers') + ' (Rust)';
    encode = async (t) => (await tok.encode(t, null, { addSpecialTokens: false })).getIds();
    decode = async (ids) => tok.decode(Array.from(ids), false);
  } else {
    const mod = await import(pathToFileURL(path.join(nodeModules, '@huggingface/tokenizers/dist/tokenizers.mjs')).href);
    const cfgPath = path.join(path.dirname(tjPath), 'tokenizer_config.json');
    const cfg = fs.existsSync(cfgPath) ? JSON.parse(fs.readFileSync(cfgPath, 'utf8')) : {};
    const tok = new mod.Tokenizer(JSON.parse(fs.readFileSync(tjPath, 'utf8')), cfg);
    label = '@huggingface/tokenizers@' + packageVersion('@huggingface/tokenizers') + ' (JS)';
    encode = async (t) => tok.encode(t, { add_special_tokens: false }).ids;
    decode = async (ids) => tok.decode(Array.from(ids), { skip_special_tokens: false, clean_up_tokenization_spaces: false });
  }
} catch (e) {
  console.log(`not installed or not loadable: ${e.message.split('\n')[0]}`);
  process.exit(3);
}
let rc = 0;
const got = await encode(text);
const d = firstDifference(got, want);
if (d === null) console.log(`${label}: same ids: ${want.length}`);
else { console.log(`${label}: ids differ at ${d}: got ${got.length} ids, reference ${want.length}; ` +
  `got [${Array.from(got.slice(Math.max(0, d - 3), d + 5))}] reference [${Array.from(want.slice(Math.max(0, d - 3), d + 5))}]`); rc = 1; }
const bytesFile = opt('--bytes');
if (bytesFile) {
  const gotBytes = Buffer.from(await decode(want), 'utf8');
  const wantBytes = fs.readFileSync(bytesFile);
  const e = firstDifference(gotBytes, wantBytes);
  if (e === null) console.log(`${label}: same decoded bytes: ${wantBytes.length}`);
  else { console.log(`${label}: decoded bytes differ at byte ${e}: ${JSON.stringify(gotBytes.subarray(Math.max(0, e - 20), e + 20).toString())} vs ` +
    `${JSON.stringify(wantBytes.subarray(Math.max(0, e - 20), e + 20).toString())}`); rc = 1; }
}
process.exit(rc);
