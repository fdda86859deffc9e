#!/usr/bin/env node
// Compares the ids of a tokenizer under test with the reference's, or decoded bytes with the expected bytes.
//   node compare.mjs ids --tokenizer cl100k|llama3|llama2|llama2spm|gemma|gemma3 GOT.u32 WANT.u32
//   node compare.mjs bytes GOT WANT
// Prints "same: N ids" / "same: N bytes" and exits 0, or describes the first difference (index, the ids around
// it on both sides, each as the reference decodes it, and the text around it) and exits 1.
import fs from 'node:fs';
import { fileURLToPath } from 'node:url';
import { reference, readU32 } from './lib.mjs';

// The first index where two sequences differ, their common length when one is a prefix of the other, or null.
export function firstDifference(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return a.length === b.length ? null : n;
}

const show = (buf) => JSON.stringify(Buffer.from(buf).toString('utf8'));

async function main() {
  const [mode, ...rest] = process.argv.slice(2);
  if (mode === 'bytes' && rest.length === 2) {
    const got = fs.readFileSync(rest[0]), want = fs.readFileSync(rest[1]);
    const d = firstDifference(got, want);
    if (d === null) { console.log(`same: ${want.length} bytes`); return 0; }
    const line = want.subarray(0, d).toString('latin1').split('\n').length;
    console.log(`bytes differ at byte ${d} (line ${line}): got ${got.length} bytes, want ${want.length}`);
    console.log(`  got:  ${show(got.subarray(Math.max(0, d - 40), d + 40))}`);
    console.log(`  want: ${show(want.subarray(Math.max(0, d - 40), d + 40))}`);
    return 1;
  }
  if (mode === 'ids' && rest.length === 4 && rest[0] === '--tokenizer') {
    const got = readU32(rest[2]), want = readU32(rest[3]);
    const d = firstDifference(got, want);
    if (d === null) { console.log(`same: ${want.length} ids`); return 0; }
    const ref = await reference(rest[1]);  // only to show a difference (the Gemma packages take seconds to load)
    const vocabSize = ref.vocabSize ?? (rest[1] === 'cl100k' ? 100277 : rest[1] === 'llama3' ? 128256 : 32000);
    const piece = (id) => (id < vocabSize ? show(ref.decode([id])) : '<out of range>');
    const offset = ref.decode(want.slice(0, d)).length;  // where the difference starts in the text (bytes)
    console.log(`ids differ at index ${d} (text byte ~${offset}): got ${got.length} ids, reference ${want.length}`);
    const lo = Math.max(0, d - 4);
    console.log(`  got:       ${Array.from(got.slice(lo, d + 6)).map((id) => `${id}=${piece(id)}`).join(' ')}`);
    console.log(`  reference: ${Array.from(want.slice(lo, d + 6)).map((id) => `${id}=${piece(id)}`).join(' ')}`);
    console.log(`  text:      ${show(ref.decode(want.slice(Math.max(0, d - 12), d + 12)))}`);
    return 1;
  }
  console.error('usage: compare.mjs ids --tokenizer NAME GOT.u32 WANT.u32 | compare.mjs bytes GOT WANT');
  return 2;
}
if (process.argv[1] && fileURLToPath(import.meta.url) === fs.realpathSync(process.argv[1])) process.exit(await main());
