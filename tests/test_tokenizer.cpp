// Tokenizers (runtime/io/tokenizer.h) on tiny tokenizer.json files built here: merges by rank, the byte-level
// alphabet, added tokens (longest first, lstrip, single_word), ignore_merges, byte fallback, exact decoding of
// a cut UTF-8 character, encode_parallel against encode, Gemma's shape (no dummy prefix, added newline runs), the
// errors; and a SentencePiece model trained here.
#include <doctest/doctest.h>

#include <sentencepiece_trainer.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "check_error.h"
#include "runtime/io/tokenizer.h"
#include "skip.h"
#include "test_util.h"

using namespace mt;
using json = nlohmann::json;

namespace {

void put_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xc0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3f));
  } else {
    s += char(0xe0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3f));
    s += char(0x80 | (cp & 0x3f));
  }
}

// GPT-2's byte alphabet, written out independently of the library: printable bytes stand for themselves,
// the other 68 take U+0100 ... U+0143 in byte order.
std::string byte_char(int b) {
  bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
  int next = 256;
  for (int k = 0; k < b; ++k)
    if (!((k >= 0x21 && k <= 0x7e) || (k >= 0xa1 && k <= 0xac) || (k >= 0xae && k <= 0xff))) ++next;
  std::string s;
  put_utf8(s, uint32_t(printable ? b : next));
  return s;
}
std::string mapped(std::string_view text) {
  std::string s;
  for (char c : text) s += byte_char(uint8_t(c));
  return s;
}

// A byte-level BPE tokenizer.json: ids 0 ... 255 are the bytes, then each merge's result in order.
json byte_level_json(const std::vector<std::pair<std::string, std::string>>& merges, json pre = nullptr) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  json m = json::array();
  int id = 256;
  for (const auto& [a, b] : merges) {
    std::string x = mapped(a), y = mapped(b);
    if (!vocab.contains(x + y)) vocab[x + y] = id++;
    m.push_back(x + " " + y);
  }
  if (pre.is_null()) pre = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  return {{"version", "1.0"},
          {"added_tokens", json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", m}, {"ignore_merges", false}}}};
}

int32_t id_of(const json& j, std::string_view text) { return j["model"]["vocab"][mapped(text)].get<int32_t>(); }

std::string write(const test::TempDir& d, const std::string& name, const json& j) {
  std::string path = d / name;
  std::ofstream(path) << j.dump(1);
  return path;
}

std::vector<int32_t> ids(std::initializer_list<int32_t> v) { return v; }

[[maybe_unused]] std::string bytes_of(std::initializer_list<int> v) {
  std::string s;
  for (int b : v) s += char(b);
  return s;
}

// Llama 3's Split regex.
const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

}  // namespace

TEST_CASE("tokenizer: byte-level BPE merges by rank, leftmost first among equals") {
  test::TempDir d("tok");
  // "e l" before "h e": hel -> h + el; the other order: he + l.
  json j1 = byte_level_json({{"e", "l"}, {"h", "e"}});
  json j2 = byte_level_json({{"h", "e"}, {"e", "l"}});
  auto t1 = Tokenizer::load(write(d, "a.json", j1));
  auto t2 = Tokenizer::load(write(d, "b.json", j2));
  CHECK(t1->encode("hel") == ids({'h', id_of(j1, "el")}));
  CHECK(t2->encode("hel") == ids({id_of(j2, "he"), 'l'}));
  // Chains: hello -> he ll -> hell o; " world" is its own pre-token (GPT-2's regex keeps the space).
  json j3 = byte_level_json({{"l", "l"}, {"h", "e"}, {"he", "ll"}, {"hell", "o"}, {" ", "w"}});
  auto t3 = Tokenizer::load(write(d, "c.json", j3));
  CHECK(t3->encode("hello world") == ids({id_of(j3, "hello"), id_of(j3, " w"), 'o', 'r', 'l', 'd'}));
  // Equal pairs: "aaa" with "a a" merges the leftmost pair first: aa + a.
  json j4 = byte_level_json({{"a", "a"}});
  auto t4 = Tokenizer::load(write(d, "d.json", j4));
  CHECK(t4->encode("aaa") == ids({id_of(j4, "aa"), 'a'}));
  CHECK(t4->encode("aaaa") == ids({id_of(j4, "aa"), id_of(j4, "aa")}));
  // The [a, b] pair form of newer files gives the same.
  json j5 = j3;
  json pairs = json::array();
  for (const json& m : j3["model"]["merges"]) {
    std::string s = m.get<std::string>();
    pairs.push_back({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  j5["model"]["merges"] = pairs;
  CHECK(Tokenizer::load(write(d, "e.json", j5))->encode("hello world") == t3->encode("hello world"));
  CHECK(t3->decode(t3->encode("hello world")) == "hello world");
  CHECK(t3->vocab_size() == 256 + 5);
  CHECK(t3->describe() == "byte-level BPE, c.json, 261 tokens");
  CHECK(t3->bos_id() == -1);
  CHECK(t3->eos_id() == -1);
}

TEST_CASE("tokenizer: the byte-level alphabet round trips all 256 bytes") {
  test::TempDir d("tok");
  // A few fixed points of GPT-2's alphabet: space is U+0120 'Ġ', newline U+010A 'Ċ', soft hyphen U+0143.
  CHECK(byte_char(' ') == "\xc4\xa0");
  CHECK(byte_char('\n') == "\xc4\x8a");
  CHECK(byte_char(0xad) == "\xc5\x83");
  auto t = Tokenizer::load(write(d, "t.json", byte_level_json({})));
  std::string all;
  std::vector<int32_t> want;
  for (int b = 0; b < 256; ++b) {
    all += char(b);
    want.push_back(b);
  }
  CHECK(t->encode(all) == want);
  CHECK(t->decode(want) == all);
  for (int b = 0; b < 256; ++b) {
    int32_t id = b;
    REQUIRE(t->decode(std::span<const int32_t>(&id, 1)) == std::string(1, char(b)));
  }
}

TEST_CASE("tokenizer: decoding a cut UTF-8 character gives exactly its bytes") {
  test::TempDir d("tok");
  auto t = Tokenizer::load(write(d, "t.json", byte_level_json({})));
  std::vector<int32_t> e = t->encode("\xc3\xa9\xe4\xb8\xad");  // "é中"
  REQUIRE(e.size() == 5);
  CHECK(t->decode(std::span<const int32_t>(e).first(1)) == "\xc3");
  CHECK(t->decode(std::span<const int32_t>(e).first(4)) == "\xc3\xa9\xe4\xb8");
  CHECK(t->decode(e) == "\xc3\xa9\xe4\xb8\xad");
}

TEST_CASE("tokenizer: added tokens are matched before pre-tokenization, longest first") {
  test::TempDir d("tok");
  json j = byte_level_json({{"h", "i"}});
  j["added_tokens"] = json::array({
      {{"id", 300}, {"content", "<|endoftext|>"}, {"special", true}, {"single_word", false}, {"lstrip", false},
       {"rstrip", false}, {"normalized", false}},
      {{"id", 301}, {"content", "<x>"}, {"special", true}},
      {{"id", 302}, {"content", "<x><y>"}, {"special", true}},
      {{"id", 303}, {"content", "<mask>"}, {"special", true}, {"lstrip", true}},
      {{"id", 304}, {"content", "cat"}, {"special", false}, {"single_word", true}},
      {{"id", 305}, {"content", "<|begin_of_text|>"}, {"special", true}},
  });
  auto t = Tokenizer::load(write(d, "t.json", j));
  const int32_t hi = id_of(j, "hi");
  CHECK(t->encode("hi<|endoftext|>hi") == ids({hi, 300, hi}));
  CHECK(t->encode("<x><y><x>") == ids({302, 301}));
  CHECK(t->encode("hi  <mask>") == ids({hi, 303}));  // lstrip takes the spaces
  CHECK(t->encode("a cat") == ids({'a', ' ', 304}));
  CHECK(t->encode("cats") == ids({'c', 'a', 't', 's'}));  // single_word: not inside a word
  CHECK(t->encode("<|endoftext") == ids({'<', '|', 'e', 'n', 'd', 'o', 'f', 't', 'e', 'x', 't'}));
  CHECK(t->decode(ids({305, hi, 300})) == "<|begin_of_text|>hi<|endoftext|>");
  CHECK(t->vocab_size() == 306);
  CHECK(t->bos_id() == 305);
  CHECK(t->eos_id() == 300);
  // tokenizer_config.json next to the file names them instead.
  std::ofstream(d / "tokenizer_config.json") << R"({"bos_token": "<x>", "eos_token": {"content": "<mask>"}})";
  auto t2 = Tokenizer::load(write(d, "tokenizer.json", j));
  CHECK(t2->bos_id() == 301);
  CHECK(t2->eos_id() == 303);
  CHECK(Tokenizer::load(d.path.string())->bos_id() == 301);  // the directory: its tokenizer.json
}

TEST_CASE("tokenizer: the post-processor's template gives BOS") {
  test::TempDir d("tok");
  json j = byte_level_json({});
  j["added_tokens"] = json::array({{{"id", 256}, {"content", "<|start|>"}, {"special", true}}});
  j["post_processor"] = {
      {"type", "Sequence"},
      {"processors", json::array({{{"type", "ByteLevel"}},
                                  {{"type", "TemplateProcessing"},
                                   {"single", json::array({{{"SpecialToken", {{"id", "<|start|>"}, {"type_id", 0}}}},
                                                           {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})}}})}};
  auto t = Tokenizer::load(write(d, "t.json", j));
  CHECK(t->bos_id() == 256);
  CHECK(t->eos_id() == -1);
}

TEST_CASE("tokenizer: ignore_merges makes a word of the vocabulary one token") {
  test::TempDir d("tok");
  json j = byte_level_json({{"a", "b"}});
  j["model"]["vocab"][mapped("xyz")] = 400;  // no merge reaches it
  auto without = Tokenizer::load(write(d, "a.json", j));
  CHECK(without->encode("xyz ab") == ids({'x', 'y', 'z', ' ', id_of(j, "ab")}));
  j["model"]["ignore_merges"] = true;
  auto with = Tokenizer::load(write(d, "b.json", j));
  CHECK(with->encode("xyz ab") == ids({400, ' ', id_of(j, "ab")}));
  CHECK(with->vocab_size() == 401);
}

TEST_CASE("tokenizer: Llama 3's Split regex before ByteLevel") {
  test::TempDir d("tok");
  json pre = {{"type", "Sequence"},
              {"pretokenizers",
               json::array({{{"type", "Split"},
                             {"pattern", {{"Regex", kLlama3Pattern}}},
                             {"behavior", "Isolated"},
                             {"invert", false}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                             {"use_regex", false}}})}};
  json j = byte_level_json({{"1", "2"}, {"12", "3"}, {"12", "34"}, {"3", "4"}, {".", "\n"}}, pre);
  auto t = Tokenizer::load(write(d, "t.json", j));
  // \p{N}{1,3}: "12345" is "123" + "45"; ".\n" is one pre-token.
  CHECK(t->encode("12345") == ids({id_of(j, "123"), '4', '5'}));
  CHECK(t->encode("a.\nb") == ids({'a', id_of(j, ".\n"), 'b'}));
  std::string text = "It's 1234 \xe4\xb8\xad\xe6\x96\x87!\n\n  x\t y";
  CHECK(t->decode(t->encode(text)) == text);
}

TEST_CASE("tokenizer: Split behaviors and invert") {
  test::TempDir d("tok");
  // With ignore_merges every piece in the vocabulary is one token: the ids show the pieces.
  auto pieces_of = [&](json split, const std::string& text) {
    json pre = {{"type", "Sequence"},
                {"pretokenizers", json::array({split, {{"type", "ByteLevel"}, {"add_prefix_space", false},
                                                       {"use_regex", false}}})}};
    json j = byte_level_json({}, pre);
    std::vector<std::string> words = {"the", "final", "countdown", "the-", "final-", "-final", "-countdown", "--",
                                      "ab", "cd", ", "};
    for (size_t i = 0; i < words.size(); ++i) j["model"]["vocab"][mapped(words[i])] = int(300 + i);
    j["model"]["ignore_merges"] = true;
    auto t = Tokenizer::load(write(d, "s.json", j));
    std::vector<std::string> out;
    for (int32_t id : t->encode(text)) out.push_back(t->decode(std::span<const int32_t>(&id, 1)));
    return out;
  };
  auto dash = [](const char* behavior) {
    return json{{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", behavior}, {"invert", false}};
  };
  using V = std::vector<std::string>;
  const std::string text = "the-final--countdown";
  CHECK(pieces_of(dash("Removed"), text) == V{"the", "final", "countdown"});
  CHECK(pieces_of(dash("Isolated"), text) == V{"the", "-", "final", "-", "-", "countdown"});
  CHECK(pieces_of(dash("MergedWithPrevious"), text) == V{"the-", "final-", "-", "countdown"});
  CHECK(pieces_of(dash("MergedWithNext"), text) == V{"the", "-final", "-", "-countdown"});
  CHECK(pieces_of(dash("Contiguous"), text) == V{"the", "-", "final", "--", "countdown"});
  json letters = {{"type", "Split"}, {"pattern", {{"Regex", "[a-z]+"}}}, {"behavior", "Removed"}, {"invert", true}};
  CHECK(pieces_of(letters, "ab, cd") == V{"ab", "cd"});
  letters["invert"] = false;
  CHECK(pieces_of(letters, "ab, cd") == V{", "});
}

TEST_CASE("tokenizer: encode_parallel gives encode's ids on a multi-line text") {
  test::TempDir d("tok");
  json j = byte_level_json({{"\n", "\n"}, {" ", "t"}, {" t", "h"}, {" th", "e"}, {"e", "."}, {" ", " "}});
  auto t = Tokenizer::load(write(d, "t.json", j));
  std::string text;
  const char* lines[] = {"The cat.\n", "\n", "  indented code();\n", "x\n", " the end.\n", "\xe4\xb8\xad\xe6\x96\x87\n",
                         "a\n\n\nb\n", "tabs\t\n", "end.\n"};
  for (int i = 0; text.size() < 3'000'000; ++i) text += lines[(i * 7 + i / 3) % 9];
  std::vector<int32_t> one = t->encode(text);
  CHECK(encode_parallel(*t, text, 2) == one);
  CHECK(encode_parallel(*t, text, 3) == one);
  // Why the rule wants no space before the newline: GPT-2's "\s+(?!\S)" looks past "\n\n".
  const int32_t nn = id_of(j, "\n\n");
  CHECK(t->encode("x\n\ny") == ids({'x', '\n', '\n', 'y'}));
  CHECK(t->encode("x\n\n") == ids({'x', nn}));
  // Llama 3's regex too.
  json pre = {{"type", "Sequence"},
              {"pretokenizers",
               json::array({{{"type", "Split"}, {"pattern", {{"Regex", kLlama3Pattern}}}, {"behavior", "Isolated"}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
  json j3 = byte_level_json({{"\n", "\n"}, {" ", "t"}, {"e", "."}, {".", "\n"}}, pre);
  auto t3 = Tokenizer::load(write(d, "t3.json", j3));
  CHECK(encode_parallel(*t3, text, 2) == t3->encode(text));
}

namespace {

// Llama 2's tokenizer.json shape: SentencePiece-style BPE with byte fallback.
json llama2_json() {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) vocab[fmt::format("<0x{:02X}>", b)] = 3 + b;
  int id = 259;
  for (const char* s : {"\xe2\x96\x81", "a", "b", "\xe2\x96\x81" "a", "\xe2\x96\x81" "ab"}) vocab[s] = id++;
  return {{"version", "1.0"},
          {"added_tokens", json::array({{{"id", 0}, {"content", "<unk>"}, {"special", true}},
                                        {{"id", 1}, {"content", "<s>"}, {"special", true}},
                                        {{"id", 2}, {"content", "</s>"}, {"special", true}}})},
          {"normalizer",
           {{"type", "Sequence"},
            {"normalizers", json::array({{{"type", "Prepend"}, {"prepend", "\xe2\x96\x81"}},
                                         {{"type", "Replace"}, {"pattern", {{"String", " "}}},
                                          {"content", "\xe2\x96\x81"}}})}}},
          {"pre_tokenizer", nullptr},
          {"post_processor", nullptr},
          {"decoder",
           {{"type", "Sequence"},
            {"decoders", json::array({{{"type", "Replace"}, {"pattern", {{"String", "\xe2\x96\x81"}}},
                                       {"content", " "}},
                                      {{"type", "ByteFallback"}},
                                      {{"type", "Fuse"}},
                                      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
          {"model",
           {{"type", "BPE"},
            {"unk_token", "<unk>"},
            {"byte_fallback", true},
            {"fuse_unk", true},
            {"vocab", vocab},
            {"merges", json::array({"\xe2\x96\x81 a", "\xe2\x96\x81" "a b"})}}}};
}

}  // namespace

TEST_CASE("tokenizer: SentencePiece-style BPE with byte fallback (Llama 2's tokenizer.json)") {
  test::TempDir d("tok");
  auto t = Tokenizer::load(write(d, "t.json", llama2_json()));
  const int32_t sp = 259, a = 260, b = 261, sp_ab = 263;
  // "ab é" -> "▁ab▁é": ▁ab, ▁, then é (unknown) as its bytes C3 A9.
  CHECK(t->encode("ab \xc3\xa9") == ids({sp_ab, sp, 3 + 0xc3, 3 + 0xa9}));
  CHECK(t->encode("ba") == ids({sp, b, a}));
  CHECK(t->decode(t->encode("ab \xc3\xa9")) == "ab \xc3\xa9");
  CHECK(t->decode(ids({3 + 0xc3})) == "\xc3");  // a cut character: its byte, no U+FFFD
  CHECK(t->encode("<s>ab") == ids({1, sp_ab}));
  CHECK(t->decode(ids({1, sp_ab})) == "<s> ab");  // as Hugging Face: the Strip only takes the very first space
  CHECK(t->bos_id() == 1);
  CHECK(t->eos_id() == 2);
  CHECK(t->describe() == "byte-fallback BPE, t.json, 264 tokens");
  // Metaspace as the pre-tokenizer (older files) gives the same ids.
  json j = llama2_json();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\xe2\x96\x81"}, {"add_prefix_space", true}};
  auto m = Tokenizer::load(write(d, "m.json", j));
  CHECK(m->encode("ab \xc3\xa9") == ids({sp_ab, sp, 3 + 0xc3, 3 + 0xa9}));
  CHECK(m->encode("ab ab") == ids({sp_ab, sp_ab}));
  // encode_parallel: no merge joins across a newline, the later chunks get no "▁" prepended.
  CHECK(t->splits_at_newlines());
  std::string text;
  for (int i = 0; text.size() < 2'500'000; ++i) text += i % 3 ? "ab ba.\nab\n" : " a \xc3\xa9\n\nb.\n";
  CHECK(encode_parallel(*t, text, 2) == t->encode(text));
  CHECK(t->decode(t->encode(text)) == text);
}

// Gemma's tokenizer.json shape (tests/cli/test_tokenizer.sh checks the real files against transformers.js's port):
// the normalizer only replaces " " by "▁" (no dummy prefix), Gemma 3's pre-tokenizer splits on " " after it
// (so never), newline runs and "▁▁" are added tokens matched as typed, and the decoder strips nothing.
TEST_CASE("tokenizer: Gemma's shape: no dummy prefix, added newline and ▁ runs, eos from tokenizer_config.json") {
  test::TempDir d("tok");
  const std::string sp = "\xe2\x96\x81";
  json j = llama2_json();
  const int32_t s = 259, a = 260, b = 261, sp_ab = 263, nl = 264, nl2 = 265, sp2 = 266, eot = 267;
  j["model"]["vocab"][sp + sp] = sp2;
  j["model"]["merges"].push_back(sp + " " + sp);
  for (auto [id, content] : {std::pair{nl, std::string("\n")}, {nl2, "\n\n"}, {sp2, sp + sp}, {eot, "<end_of_turn>"}})
    j["added_tokens"].push_back({{"id", id}, {"content", content}, {"special", id == eot}, {"normalized", false}});
  j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", sp}};
  j["pre_tokenizer"] = {
      {"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "MergedWithPrevious"}, {"invert", false}};
  j["decoder"]["decoders"].erase(3);  // no Strip: there is no dummy prefix to take off
  write(d, "tokenizer_config.json", {{"bos_token", "<s>"}, {"eos_token", {{"content", "<end_of_turn>"}}}});
  auto t = Tokenizer::load(write(d, "tokenizer.json", j));
  CHECK(t->encode("ab") == ids({a, b}));  // no "▁" prepended
  CHECK(t->encode(" ab") == ids({sp_ab}));
  // Longest first at each position: "\n\n\n" is "\n\n" then "\n"; the text after gets no "▁" either.
  CHECK(t->encode("ab\n\n\nab") == ids({a, b, nl2, nl, a, b}));
  CHECK(t->encode("a  b") == ids({a, sp2, b}));  // two spaces: "▁▁" by the merge
  CHECK(t->encode("x\xe2\x96\x81\xe2\x96\x81y") == ids({3 + 'x', sp2, 3 + 'y'}));  // typed "▁▁": the added token
  CHECK(t->decode(t->encode("a  b\n\n x")) == "a  b\n\n x");
  CHECK(t->decode(t->encode("x\xe2\x96\x81\xe2\x96\x81y")) == "x  y");  // a typed "▁" decodes to a space
  CHECK(t->decode(ids({eot, s, a})) == "<end_of_turn> a");
  CHECK(t->bos_id() == 1);
  CHECK(t->eos_id() == eot);
  CHECK(t->vocab_size() == 268);
  CHECK_FALSE(t->splits_at_newlines());  // added tokens hold newlines: one thread, the same ids
  std::string text;
  for (int i = 0; text.size() < 300'000; ++i) text += i % 2 ? "ab ba.\nab\n" : " a\n\n\nb.\n";
  CHECK(encode_parallel(*t, text, 2) == t->encode(text));
}

TEST_CASE("tokenizer: what is not supported is refused, naming the file and the key") {
  test::TempDir d("tok");
  json j = byte_level_json({});
  j["model"]["type"] = "WordPiece";
  CHECK_ERROR_CONTAINS(Tokenizer::load(write(d, "a.json", j)), "a.json: model.type: model type 'WordPiece'");
  j = byte_level_json({});
  j["normalizer"] = {{"type", "NFKC"}};
  CHECK_ERROR_CONTAINS(Tokenizer::load(write(d, "b.json", j)), "b.json: normalizer: normalizer type 'NFKC'");
  j = byte_level_json({});
  j["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array({{{"type", "Lowercase"}}})}};
  CHECK_ERROR_CONTAINS(Tokenizer::load(write(d, "c.json", j)), "normalizer.normalizers[0]: normalizer type 'Lowercase'");
  j = byte_level_json({});
  j["decoder"] = {{"type", "WordPiece"}};
  CHECK_ERROR_CONTAINS(Tokenizer::load(write(d, "d.json", j)), "decoder: decoder type 'WordPiece'");
  j = byte_level_json({});
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  CHECK_ERROR_CONTAINS(Tokenizer::load(write(d, "e.json", j)), "pre_tokenizer: pre-tokenizer type 'Whitespace'");
  j = byte_level_json({});
  j["model"]["merges"] = json::array({"q z"});
  CHECK_ERROR_CONTAINS(Tokenizer::load(write(d, "f.json", j)), "model.merges: merge 0 ('q' 'z'): 'qz' is not in");
  j = byte_level_json({});
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  CHECK_ERROR_CONTAINS(Tokenizer::load(write(d, "g.json", j)), "g.json: pre_tokenizer.pattern: regex '(unclosed'");
  CHECK_ERROR_CONTAINS(Tokenizer::load(d / "missing.json"), "missing.json");
  std::ofstream(d / "junk.json") << "{ not json";
  CHECK_ERROR_CONTAINS(Tokenizer::load(d / "junk.json"), "junk.json: not valid JSON");
  std::ofstream(d / "junk.model") << "not a model";
  CHECK_ERROR_CONTAINS(Tokenizer::load(d / "junk.model"), "junk.model: not a SentencePiece model");
  auto t = Tokenizer::load(write(d, "ok.json", byte_level_json({})));
  CHECK_ERROR_CONTAINS(t->decode(ids({7, 256})), "decode: id 256 is not in the vocabulary of ok.json (ids 0 ... 255)");
  CHECK_ERROR_CONTAINS(t->decode(ids({-1})), "id -1");
  // NFC (Qwen2) is accepted on text that no normalization changes, refused on text it might.
  j = byte_level_json({});
  j["normalizer"] = {{"type", "NFC"}};
  auto nfc = Tokenizer::load(write(d, "nfc.json", j));
  CHECK(nfc->encode("caf\xc3\xa9 \xe4\xb8\xad").size() == 9);
  CHECK_ERROR_CONTAINS(nfc->encode("e\xcc\x81"), "normalizer NFC: the text holds U+0301");
}

TEST_CASE("tokenizer: a SentencePiece model trained here round trips") {
  test::TempDir d("tok");
  {
    std::ofstream f(d / "corpus.txt");
    const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "home"};
    for (int i = 0; i < 400; ++i)
      f << words[i % 12] << ' ' << words[(i * 5 + 1) % 12] << ' ' << words[(i * 7 + 3) % 12] << ".\n";
  }
  auto s = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + (d / "corpus.txt") + " --model_prefix=" + (d / "sp") +
      " --vocab_size=300 --model_type=bpe --byte_fallback=true --minloglevel=2");
  if (!s.ok()) MT_SKIP("SentencePieceTrainer::Train failed: " + s.ToString());
  auto t = Tokenizer::load(d / "sp.model");
  CHECK(t->vocab_size() == 300);
  CHECK(t->bos_id() == 1);
  CHECK(t->eos_id() == 2);
  CHECK(t->describe() == "SentencePiece, sp.model, 300 tokens");
  for (std::string text : {"the cat sat on a mat.", "dog ran far away home", "x\xc3\xa9z \xe4\xb8\xad!"}) {
    std::vector<int32_t> e = t->encode(text);
    CHECK(!e.empty());
    CHECK(t->decode(e) == text);
  }
  // An unknown character (byte fallback) cut after its first byte.
  std::vector<int32_t> e = t->encode("\xe4\xb8\xad");
  REQUIRE(e.size() >= 3);
  CHECK(t->decode(std::span<const int32_t>(e).last(3).first(1)) == "\xe4");
  CHECK(encode_parallel(*t, "the cat\nsat", 2) == t->encode("the cat\nsat"));
}
