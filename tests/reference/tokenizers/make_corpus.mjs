#!/usr/bin/env node
// Writes a deterministic mixed UTF-8 corpus (at least --min-bytes, 1 MiB by default) for the tokenizer
// comparisons, from the same inputs always the same bytes:
//   - Debian fortunes (/usr/share/games/fortunes, the plain-text files): the first ~16 KB of each, whole fortunes;
//     where they are absent, the repository's docs/*.md instead;
//   - code: this repository's own C++/CUDA/Python sources (the start of each, sorted by path);
//   - generated with a fixed seed: words and sentences in CJK, kana, Hangul, Cyrillic, Greek, Arabic, Hebrew,
//     Devanagari, Thai, accented Latin (precomposed and combining), emoji (ZWJ families, skin tones, flags,
//     keycaps, variation selectors); whitespace runs (tabs, up to 80 spaces, \r\n, lone \r, trailing spaces,
//     form feed, vertical tab, no-break and ideographic spaces); numbers (digit runs up to 300 long, decimals,
//     separators, non-ASCII digits); special-token strings and near misses, between text.
// The result is checked to be valid UTF-8. U+0085 and U+FEFF are left out on purpose: JavaScript's \s (used by
// llama3-tokenizer-js's pre-tokenizer regex) disagrees with Unicode White_Space (Rust, Oniguruma, PCRE2) on both.
//   node make_corpus.mjs --out FILE [--root REPO] [--min-bytes N]
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const args = process.argv.slice(2);
const opt = (k, d) => { const i = args.indexOf(k); return i >= 0 ? args[i + 1] : d; };
const outFile = opt('--out');
if (!outFile) { console.error('usage: make_corpus.mjs --out FILE [--root REPO] [--min-bytes N]'); process.exit(2); }
const root = opt('--root', path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../..'));
const minBytes = Number(opt('--min-bytes', 1 << 20));

// A small fixed-seed generator (xorshift32): the same corpus on every machine with the same inputs.
let state = 0x9e3779b9;
const rnd = () => { state ^= state << 13; state >>>= 0; state ^= state >>> 17; state ^= state << 5; state >>>= 0; return state / 4294967296; };
const int = (a, b) => a + Math.floor(rnd() * (b - a + 1));  // inclusive
const pick = (xs) => xs[Math.floor(rnd() * xs.length)];
const range = (a, b) => Array.from({ length: b - a + 1 }, (_, i) => String.fromCodePoint(a + i));
const utf8 = (s) => Buffer.byteLength(s, 'utf8');

const parts = [];
let size = 0;
const add = (s) => { parts.push(s); size += utf8(s); };
const valid = (buf) => { try { new TextDecoder('utf-8', { fatal: true }).decode(buf); return true; } catch { return false; } };
const clean = (s) => s.replace(/[\u0085\uFEFF]/g, ' ');

// ---- fortunes (or docs)
function fortunes(budget) {
  const dir = '/usr/share/games/fortunes';
  let files = [];
  if (fs.existsSync(dir)) {
    files = fs.readdirSync(dir).sort().map((f) => path.join(dir, f))
      .filter((f) => !f.endsWith('.dat') && !f.endsWith('.u8') && fs.lstatSync(f).isFile());
  }
  let per = 16384;
  if (!files.length) {
    const docs = path.join(root, 'docs');
    files = fs.existsSync(docs) ? fs.readdirSync(docs).sort().filter((f) => f.endsWith('.md')).map((f) => path.join(docs, f)) : [];
    per = 65536;
  }
  let used = 0;
  for (const f of files) {
    const buf = fs.readFileSync(f);
    if (!valid(buf)) continue;
    let s = buf.toString('utf8');
    if (utf8(s) > per) {  // whole fortunes (ended by a line "%") up to about `per` bytes
      const cut = s.indexOf('\n%\n', Math.floor(per * 0.9));
      s = s.slice(0, cut < 0 ? per : cut + 3);
    }
    add(clean(s));
    used += utf8(s);
    if (used >= budget) break;
  }
}

// ---- code
function code(budget) {
  const exts = ['.cpp', '.h', '.hpp', '.cu', '.py'];
  const found = [];
  const walk = (d) => {
    for (const e of fs.readdirSync(d, { withFileTypes: true }).sort((a, b) => (a.name < b.name ? -1 : 1))) {
      if (e.name.startsWith('.') || e.name.startsWith('build') || e.name === 'node_modules' || e.name === 'data') continue;
      const p = path.join(d, e.name);
      if (e.isDirectory()) walk(p);
      else if (e.isFile() && exts.some((x) => e.name.endsWith(x))) found.push(p);
    }
  };
  if (fs.existsSync(root)) walk(root);
  let used = 0;
  for (const f of found) {
    const buf = fs.readFileSync(f);
    if (!valid(buf)) continue;
    let s = buf.toString('utf8');
    if (s.length > 6000) s = s.slice(0, s.indexOf('\n', 6000) + 1 || 6000);
    s = clean(`// ---- ${path.relative(root, f)}\n${s}`);
    add(s);
    used += utf8(s);
    if (used >= budget) break;
  }
}

// ---- many scripts
const SCRIPTS = {
  cjk: range(0x4e00, 0x9fa5), hira: range(0x3041, 0x3096), kata: range(0x30a1, 0x30fa), hangul: range(0xac00, 0xd7a3),
  cyr: [...range(0x0410, 0x044f), 'ё', 'Ё', 'і', 'ї', 'є', 'ґ'], greek: [...range(0x0391, 0x03a1), ...range(0x03a3, 0x03a9), ...range(0x03b1, 0x03c9), 'ά', 'έ', 'ή', 'ί', 'ό', 'ύ', 'ώ'],
  arabic: range(0x0621, 0x064a), hebrew: range(0x05d0, 0x05ea), thai: range(0x0e01, 0x0e2e),
  deva: [...range(0x0905, 0x0939), ...range(0x093e, 0x094c)],
  latin: [...'abcdefghijklmnopqrstuvwxyz', ...'àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿœšžłńśźżßđăşţ', ...'ÀÉÎÕÜÇŁŚŽ'],
};
const COMBINING = ['\u0301', '\u0300', '\u0308', '\u0303', '\u0327', '\u030c', '\u0323', '\u0336'];
const EMOJI = ['😀', '😂', '🥲', '🤖', '🚀', '🔥', '✨', '🎉', '❤️', '👍🏽', '👋🏿', '🙏🏻', '🤷‍♀️', '🧑‍💻', '👩🏽‍💻',
  '👨‍👩‍👧‍👦', '👩‍❤️‍💋‍👨', '🧑‍🤝‍🧑', '🏳️‍🌈', '🏴‍☠️', '🐻‍❄️', '🇯🇵', '🇫🇷', '🇺🇦', '🇧🇷', '1️⃣', '#️⃣', '©️', '☕', '⌚', '🫠', '🪿',
  '𝔘𝔫𝔦𝔠𝔬𝔡𝔢', '𝕏', '🀄', '♠️', '⚽'];
const PUNCT = [' ', ' ', ' ', ' ', ', ', '. ', '! ', '? ', '; ', ': ', ' - ', ' — ', '… ', '，', '。', '、', '！', '？', '「', '」', '：', ' (', ') ', '"', "'", '« ', ' »', '¿', '¡'];
const SENTENCES = [
  '日本語のテキストと English が混ざった文です。東京は晴れ、気温は23℃でした。',
  '我们在训练一个大型语言模型，它使用字节级的分词器。今天是2024年12月31日。',
  '한국어 문장도 포함됩니다. 토크나이저는 모든 바이트를 정확하게 복원해야 합니다!',
  'Съешь же ещё этих мягких французских булок, да выпей чаю. Привет, мир!',
  'Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Γειά σου Κόσμε!',
  'نص عربي للاختبار: مرحبا بالعالم، كيف حالك اليوم؟ ١٢٣٤٥٦٧٨٩٠',
  'עברית: שלום עולם! זהו טקסט לבדיקה.',
  'हिन्दी पाठ: नमस्ते दुनिया। यह एक परीक्षण है। १२३४५',
  'ภาษาไทย: สวัสดีชาวโลก นี่คือการทดสอบ',
  'Voix ambiguë d’un cœur qui, au zéphyr, préfère les jattes de kiwis. Çà et là, «naïveté» façon Noël.',
  'Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. Ärger, Öl, Übermut; STRASSE/Straße.',
  'Pchnąć w tę łódź jeża lub ośm skrzyń fig. Příliš žluťoučký kůň úpěl ďábelské ódy.',
  'El pingüino Wenceslao hizo kilómetros bajo exhaustiva lluvia y frío, añoraba a su querido cachorro.',
  'Decomposed: e\u0301 a\u0308 n\u0303 c\u0327 o\u0302 — Z\u0336a\u0337l\u0338g\u0335o\u0334.',
  'Mixed: naïve café résumé coöperate façade jalapeño Ångström Øresund ĳ ﬁ ﬂ ẞ ǅ Ⅻ ½ ² ³ µ ℃ № ™.',
  "Contractions: don't, I'm, we've, they'll, she'd, it's, DON'T, I'M, WE'VE, THEY'LL, SHE'D, IT'S, 's 'S 'Re.",
  'Emoji: 👨‍👩‍👧‍👦 family, 👩🏽‍💻 coder, 🏳️‍🌈 flag, 🇯🇵🇫🇷🇺🇦 flags, 1️⃣2️⃣3️⃣ keycaps, ❤️‍🔥 heart on fire, 🫶🏼.',
  'Full-width: ＡＢＣ１２３！？ ｈｅｌｌｏ　ｗｏｒｌｄ　（全角）　半角ｶﾀｶﾅ',
];

function words(budget) {
  const names = Object.keys(SCRIPTS);
  let used = 0;
  while (used < budget) {
    let line = '';
    const mode = int(0, 9);
    if (mode === 0) line = pick(SENTENCES);
    else {
      const script = SCRIPTS[pick(names)];
      const n = int(3, 25);
      for (let w = 0; w < n; w++) {
        let word = '';
        const len = int(1, 9);
        for (let i = 0; i < len; i++) {
          word += pick(script);
          if (rnd() < 0.04) word += pick(COMBINING);
        }
        if (rnd() < 0.1) word = word[0].toUpperCase() + word.slice(1);
        if (rnd() < 0.08) word += pick(EMOJI);
        if (rnd() < 0.05) word += String(int(0, 99999));
        line += word + (w + 1 < n ? pick(PUNCT) : '');
      }
      if (rnd() < 0.2) line += pick(EMOJI) + pick(EMOJI);
    }
    line += rnd() < 0.1 ? '\r\n' : '\n';
    add(line);
    used += utf8(line);
  }
}

// ---- whitespace runs
function whitespace(budget) {
  const WS = [' ', '\t', '\n', '\r\n', '\u00a0', '\u3000', '\u2003', '\u2009', '\u200b', '\f', '\v', '\r'];
  const TEXT = ['word', 'x', 'foo(bar)', '值', 'é', '😀', '42', '//', '-', 'if (a) {', '}', 'return 0;', 'Ünïcödé'];
  let used = 0;
  while (used < budget) {
    let s = '';
    const kind = int(0, 7);
    if (kind === 0) s = ' '.repeat(int(1, 80)) + pick(TEXT) + ' '.repeat(int(0, 20)) + '\n';        // indent, trailing
    else if (kind === 1) s = '\t'.repeat(int(1, 12)) + pick(TEXT) + '\t'.repeat(int(0, 3)) + '\n';
    else if (kind === 2) s = pick(TEXT) + '\r\n'.repeat(int(1, 6));
    else if (kind === 3) s = '\n'.repeat(int(2, 20));
    else if (kind === 4) { for (let i = int(1, 15); i > 0; i--) s += pick(WS); s += pick(TEXT); }
    else if (kind === 5) s = pick(TEXT) + ' '.repeat(int(1, 40)) + '\n' + ' '.repeat(int(1, 40)) + '\n';  // blank lines of spaces
    else if (kind === 6) s = ' \t \t  \t'.slice(0, int(1, 7)) + pick(TEXT) + ' \r\n';
    else s = pick(TEXT) + ' '.repeat(int(2, 9)) + pick(TEXT) + '\t' + pick(TEXT) + '\n';
    add(s);
    used += utf8(s);
  }
  add('\n');
}

// ---- numbers
function numbers(budget) {
  const digits = (n) => { let s = String(int(1, 9)); for (let i = 1; i < n; i++) s += String(int(0, 9)); return s; };
  let used = 0;
  while (used < budget) {
    const k = int(0, 9);
    let s;
    if (k === 0) s = digits(int(20, 300));
    else if (k === 1) s = `${digits(int(1, 7))}.${digits(int(1, 12))}`;
    else if (k === 2) s = digits(int(4, 12)).replace(/\B(?=(\d{3})+$)/g, ',');
    else if (k === 3) s = `-${digits(int(1, 5))}e-${int(1, 300)}`;
    else if (k === 4) s = `0x${int(0, 0xffffffff).toString(16).padStart(8, '0')}`;
    else if (k === 5) s = `${int(1900, 2099)}-${String(int(1, 12)).padStart(2, '0')}-${String(int(1, 28)).padStart(2, '0')}T${int(10, 23)}:${int(10, 59)}:${int(10, 59)}Z`;
    else if (k === 6) s = `${int(1, 255)}.${int(0, 255)}.${int(0, 255)}.${int(0, 255)}:${int(1, 65535)}`;
    else if (k === 7) s = pick(['٠١٢٣٤٥٦٧٨٩', '１２３４５６７８９０', '०१२३४५६७८९', '௧௨௩', 'ⅠⅡⅢⅣⅫ', '¹²³⁴', '½¾⅓']) + digits(int(1, 6));
    else if (k === 8) s = `v${int(0, 20)}.${int(0, 99)}.${int(0, 999)}-rc${int(1, 9)}`;
    else s = `+1 (${digits(3)}) ${digits(3)}-${digits(4)}`;
    s += pick([' ', ' ', ', ', '\n', '; ', '']);
    add(s);
    used += utf8(s);
  }
  add('\n');
}

// ---- special-token strings and near misses, between text
function specials() {
  add([
    'Special tokens of cl100k: <|endoftext|>The next document.<|endoftext|>',
    '<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n    return c<|fim_middle|>c = a + b<|endofprompt|>',
    'Llama 3 chat: <|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>',
    '<|start_header_id|>user<|end_header_id|>\n\nHi there 👋<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
    'Hello!<|eom_id|><|python_tag|>print(1)<|finetune_right_pad_id|><|reserved_special_token_0|> <|reserved_special_token_247|>',
    'Not special: <|reserved_special_token_248|> <|im_start|>user<|im_end|> <|endoftext| <|end of text|> <| endoftext |>',
    'Llama 2 chat: <s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat is 2+2? [/INST] 4 </s><s>[INST] and 3+3? [/INST] 6</s>',
    'Unknown <unk> token, nested <<s>> and </s></s>, the byte-token name <0x0A> and the piece mark ▁ typed as text.',
    'Adjacent: <s><s></s><|endoftext|><|endoftext|><|begin_of_text|><|end_of_text|> end.',
    // Gemma's: its control tokens (Gemma 3's as added tokens; Gemma's tokenizer.json adds only <pad> <eos> <bos>
    // <unk>, so the rest are pieces), near misses, literal "▁" runs (Gemma 3's added "▁▁" ... tokens match them as
    // typed) and newline and tab runs longer than Gemma 3's longest added run (31).
    'Gemma chat: <bos><start_of_turn>user\nWho are you?<end_of_turn>\n<start_of_turn>model\nA model.<end_of_turn>\n<eos>',
    '<pad><mask>[multimodal]<unused0> <unused6241><start_of_image><image_soft_token><end_of_image><h1>T</h1>',
    'Not Gemma tokens: <start_of_turn <end_of_turn > <unused6242> <bos <image_soft_token/> [multimodal ]',
    'Literal runs: ▁▁ a▁▁▁b ▁▁▁▁▁▁\t▁▁ c ▁ d▁',
    'Runs past 31:' + '\n'.repeat(40) + '\t'.repeat(40) + 'x' + ' \t\n'.repeat(3),
    // Words that are Llama 3 tokens whose merges would not build them (tokenizer.json's ignore_merges: true).
    'Tiếng Việt: Việc này hợp với nhiều điều ở Việt Nam, ngoài ra tự nhiên và đặc biệt, và việc học. Czech: a jeho dům.',
    'Persian: در ایران. Turkish after digits: 2mektedir 3ektedir 4ıldı 5lardan; характер: аракт.',
    '\n',
  ].join('\n'));
}

// Layout: fortunes, code, words, whitespace, numbers, specials; again (smaller) until the size is reached.
fortunes(Math.max(minBytes * 0.5, 1));
specials();
code(minBytes * 0.2);
words(minBytes * 0.2);
whitespace(minBytes * 0.05);
numbers(minBytes * 0.04);
specials();
while (size < minBytes) { words(Math.min(65536, minBytes - size)); specials(); }
const text = parts.join('');
const buf = Buffer.from(text, 'utf8');
if (!valid(buf)) throw new Error('corpus is not valid UTF-8');
fs.writeFileSync(outFile, buf);
console.log(`${outFile}: ${buf.length} bytes, ${[...text].length} code points`);
