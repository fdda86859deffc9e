// Hugging Face tokenizer.json (tokenizer.h): byte-level BPE on PCRE2 and SentencePiece-style BPE with byte
// fallback. Follows the semantics of the `tokenizers` library as its documentation describes them: added tokens
// are split off first, each remaining section is normalized, pre-tokenized into words and each word encoded by
// BPE; decoding maps ids to token strings and runs them through the decoder chain. Written from those semantics,
// not from its code.
//
// This file: the tokenizer loaded from tokenizer.json (its model, added tokens, normalizer, pre-tokenizer,
// decoder and special tokens); hf_tokenizer_codec.cpp encodes and decodes, hf_text.cpp holds the text primitives.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "runtime/core/error.h"
#include "runtime/io/hf_tokenizer.h"

namespace fs = std::filesystem;

namespace mt::tokenizer_detail {

namespace {

// GPT-2's pre-tokenizer regex: ByteLevel with use_regex true.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace

HfTokenizer::HfTokenizer(const json& j, const std::string& file, const std::string& dir) : file_(file) {
  name_ = fs::path(file).filename().string();
  const json& model = at(j, "model", "model");
  std::string type = model.value("type", std::string("BPE"));
  if (type != "BPE") bad("model.type", "model type '{}' is not supported (supported: BPE)", type);
  load_model(model);
  load_added(j);
  load_normalizer(j.contains("normalizer") ? j["normalizer"] : json(), "normalizer");
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) load_pre(j["pre_tokenizer"], "pre_tokenizer");
  // Added tokens are matched in the text as written (tokenizers matches "normalized" ones in the normalized
  // text): the same unless the normalizer rewrites a character of the token.
  for (const AddedToken& a : added_)
    for (const NormStep& n : norm_)
      if (a.normalized && n.kind == NormStep::replace && !n.a.empty() && a.content.find(n.a) != std::string::npos)
        bad("added_tokens",
            "token {} '{}' is \"normalized\" and holds '{}', which the normalizer replaces: not "
            "supported",
            a.id, a.content, n.a);
  for (const PreStep& p : pre_)
    if (p.kind == PreStep::byte_level) byte_level_ = true;
  if (byte_level_) {
    for (int b = 0; b < 256; ++b) {
      int32_t cp;
      utf8_char(byte_alphabet().to_char[b], 0, &cp);
      auto it = char_ids_.find(cp);
      byte_char_ids_[b] = it != char_ids_.end() ? it->second : unk_;
    }
  }
  load_decoder(j.contains("decoder") ? j["decoder"] : json(), "decoder");
  find_specials(j, dir);
  // SentencePiece-style words: the text may be cut before each "▁" that follows another character when no
  // merge joins a left side ending in another character to a right side starting with "▁" (SentencePiece
  // never makes such pieces): the merges of the parts are then those of the whole.
  const std::string nl_char = byte_level_ ? byte_alphabet().to_char['\n'] : "\n";
  bool merges_cross_newline = false;
  ws_split_ = !byte_level_ && !ignore_merges_;
  for (const auto& [key, rank_id] : merges_) {
    const std::string& a = id_to_token_[size_t(key >> 32)];
    const std::string& b = id_to_token_[size_t(uint32_t(key))];
    bool a_ws_end = a.size() >= kSpace.size() && a.compare(a.size() - kSpace.size(), kSpace.size(), kSpace) == 0;
    if (b.compare(0, kSpace.size(), kSpace) == 0 && !a_ws_end) ws_split_ = false;
    if (a == "<0x0A>" ||
        (a.size() >= nl_char.size() && a.compare(a.size() - nl_char.size(), nl_char.size(), nl_char) == 0))
      merges_cross_newline = true;
  }
  // encode_parallel's rule (tokenizer.h). A cut after "\n" between printable ASCII: no pre-token crosses it
  // when the regexes are of GPT-2's kind (their only look-around "(?!\S)"), or, with no regex, no merge
  // joins across a newline; the normalizers act per character (NFC's check, " " -> "▁") or prepend (not done
  // at a cut); no added token holds a newline; no byte-level prefix space.
  splits_ = !(ignore_merges_ && !byte_level_) && !(patterns_.empty() && merges_cross_newline);
  for (const NormStep& n : norm_)
    if (n.kind == NormStep::replace && n.a != " ") splits_ = false;
  for (const PreStep& p : pre_)
    if (p.kind == PreStep::byte_level && p.add_prefix_space) splits_ = false;
  for (const std::string& pat : patterns_) {
    std::string rest = pat;
    for (size_t k; (k = rest.find("(?!\\S)")) != std::string::npos;) rest.erase(k, 6);
    for (size_t k; (k = rest.find("[^")) != std::string::npos;) rest.erase(k, 2);  // a negated class
    if (rest.find("(?=") != std::string::npos || rest.find("(?!") != std::string::npos ||
        rest.find("(?<") != std::string::npos || rest.find("\\b") != std::string::npos ||
        rest.find("\\B") != std::string::npos || rest.find("\\G") != std::string::npos ||
        rest.find('^') != std::string::npos || rest.find('$') != std::string::npos)
      splits_ = false;
  }
  for (const AddedToken& a : added_)
    if (a.content.find('\n') != std::string::npos) splits_ = false;
}

std::string HfTokenizer::describe() const {
  return fmt::format("{}BPE, {}, {} tokens",
                     byte_level_      ? "byte-level "
                     : byte_fallback_ ? "byte-fallback "
                                      : "",
                     name_, with_commas(vocab_size()));
}

const json& HfTokenizer::at(const json& j, const char* k, const std::string& key) const {
  if (!j.is_object() || !j.contains(k)) bad(key, "missing");
  return j[k];
}

std::string HfTokenizer::str(const json& j, const char* k, const std::string& key) const {
  const json& v = at(j, k, key + "." + k);
  if (!v.is_string()) bad(key + "." + k, "expected a string, got {}", v.dump());
  return v.get<std::string>();
}

bool HfTokenizer::flag(const json& j, const char* k, bool dflt) const {
  if (!j.contains(k) || j[k].is_null()) return dflt;
  return j[k].get<bool>();
}

void HfTokenizer::set_token(int32_t id, const std::string& s) {
  if (id < 0) bad("model.vocab", "negative id {} for '{}'", id, s);
  if (size_t(id) >= id_to_token_.size()) {
    id_to_token_.resize(size_t(id) + 1);
    has_token_.resize(size_t(id) + 1, 0);
  }
  id_to_token_[size_t(id)] = s;
  has_token_[size_t(id)] = 1;
}

void HfTokenizer::load_model(const json& m) {
  const json& vocab = at(m, "vocab", "model.vocab");
  if (!vocab.is_object()) bad("model.vocab", "expected an object of token: id");
  vocab_.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    int32_t id = it.value().get<int32_t>();
    vocab_[it.key()] = id;
    set_token(id, it.key());
  }
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0)
    bad("model.dropout", "BPE dropout is not supported (expected null or 0)");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(k) && !m[k].is_null() && !m[k].get<std::string>().empty())
      bad(std::string("model.") + k, "'{}' is not supported (expected null)", m[k].get<std::string>());
  byte_fallback_ = flag(m, "byte_fallback", false);
  ignore_merges_ = flag(m, "ignore_merges", false);
  fuse_unk_ = flag(m, "fuse_unk", false);
  if (m.contains("unk_token") && !m["unk_token"].is_null()) {
    std::string u = m["unk_token"].get<std::string>();
    auto it = vocab_.find(u);
    if (it == vocab_.end()) bad("model.unk_token", "'{}' is not in model.vocab", u);
    unk_ = it->second;
  }
  if (byte_fallback_) {
    for (int b = 0; b < 256; ++b) {
      auto it = vocab_.find(fmt::format("<0x{:02X}>", b));
      byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
    }
  }
  const json& merges = m.contains("merges") ? m["merges"] : json::array();
  if (!merges.is_array()) bad("model.merges", "expected a list");
  merges_.reserve(merges.size());
  int32_t rank = 0;
  for (const json& mj : merges) {
    std::string a, b;
    if (mj.is_string()) {
      std::string s = mj.get<std::string>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        bad("model.merges", "merge {} '{}' is not two tokens separated by one space", rank, s);
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (mj.is_array() && mj.size() == 2 && mj[0].is_string() && mj[1].is_string()) {
      a = mj[0].get<std::string>();
      b = mj[1].get<std::string>();
    } else {
      bad("model.merges", "merge {} is {}: expected \"a b\" or [\"a\", \"b\"]", rank, mj.dump());
    }
    auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
    if (ia == vocab_.end() || ib == vocab_.end() || iab == vocab_.end())
      bad("model.merges", "merge {} ('{}' '{}'): '{}' is not in model.vocab", rank, a, b,
          ia == vocab_.end()   ? a
          : ib == vocab_.end() ? b
                               : a + b);
    merges_.emplace(pair_key(ia->second, ib->second), std::make_pair(rank, iab->second));
    ++rank;
  }
  // Single characters of the vocabulary, for the first symbols of a word.
  for (const auto& [tok, id] : vocab_) {
    int32_t cp;
    if (!tok.empty() && utf8_char(tok, 0, &cp) == tok.size() && cp >= 0) char_ids_[cp] = id;
  }
}

void HfTokenizer::load_added(const json& j) {
  if (!j.contains("added_tokens") || j["added_tokens"].is_null()) return;
  for (const json& a : j["added_tokens"]) {
    AddedToken t;
    t.content = str(a, "content", "added_tokens");
    t.id = at(a, "id", "added_tokens.id").get<int32_t>();
    t.special = flag(a, "special", false);
    t.single_word = flag(a, "single_word", false);
    t.lstrip = flag(a, "lstrip", false);
    t.rstrip = flag(a, "rstrip", false);
    t.normalized = flag(a, "normalized", !t.special);
    if (t.content.empty()) bad("added_tokens", "token {} has empty content", t.id);
    auto it = vocab_.find(t.content);
    if (it != vocab_.end() && it->second != t.id)
      bad("added_tokens", "'{}' has id {} but model.vocab gives it {}", t.content, t.id, it->second);
    set_token(t.id, t.content);
    added_ids_.push_back(t.id);
    added_.push_back(std::move(t));
  }
  // Longest first, so that the first match at a position is the longest.
  std::stable_sort(added_.begin(), added_.end(),
                   [](const AddedToken& x, const AddedToken& y) { return x.content.size() > y.content.size(); });
  for (const AddedToken& t : added_) first_byte_[uint8_t(t.content[0])] = true;
}

void HfTokenizer::load_normalizer(const json& n, const std::string& key) {
  if (n.is_null()) return;
  std::string type = str(n, "type", key);
  if (type == "Sequence") {
    const json& list = at(n, "normalizers", key + ".normalizers");
    for (size_t i = 0; i < list.size(); ++i) load_normalizer(list[i], fmt::format("{}.normalizers[{}]", key, i));
  } else if (type == "Prepend") {
    norm_.push_back({NormStep::prepend, str(n, "prepend", key), ""});
  } else if (type == "Replace") {
    const json& p = at(n, "pattern", key + ".pattern");
    if (!p.contains("String")) bad(key + ".pattern", "only a String pattern is supported, got {}", p.dump());
    norm_.push_back({NormStep::replace, p["String"].get<std::string>(), str(n, "content", key)});
  } else if (type == "NFC") {
    norm_.push_back({NormStep::nfc, "", ""});
  } else {
    bad(key,
        "normalizer type '{}' is not supported (supported: null, Sequence, Prepend, Replace with a String "
        "pattern, NFC on text that is already NFC)",
        type);
  }
}

void HfTokenizer::load_pre(const json& p, const std::string& key) {
  std::string type = str(p, "type", key);
  if (type == "Sequence") {
    const json& list = at(p, "pretokenizers", key + ".pretokenizers");
    for (size_t i = 0; i < list.size(); ++i) load_pre(list[i], fmt::format("{}.pretokenizers[{}]", key, i));
    return;
  }
  for (const PreStep& s : pre_)
    if (s.kind == PreStep::byte_level || s.kind == PreStep::metaspace)
      bad(key, "a {} pre-tokenizer after ByteLevel or Metaspace is not supported", type);
  PreStep s;
  if (type == "Split") {
    s.kind = PreStep::split;
    const json& pat = at(p, "pattern", key + ".pattern");
    bool literal = pat.contains("String");
    if (!literal && !pat.contains("Regex")) bad(key + ".pattern", "expected String or Regex, got {}", pat.dump());
    std::string text = literal ? pat["String"].get<std::string>() : pat["Regex"].get<std::string>();
    s.re = std::make_unique<Regex>(text, literal, file_, key + ".pattern");
    if (!literal) patterns_.push_back(text);
    s.behavior = parse_behavior(str(p, "behavior", key), file_, key + ".behavior");
    s.invert = flag(p, "invert", false);
  } else if (type == "ByteLevel") {
    s.kind = PreStep::byte_level;
    s.add_prefix_space = flag(p, "add_prefix_space", false);
    if (flag(p, "use_regex", true)) {
      s.re = std::make_unique<Regex>(kGpt2Pattern, false, file_, key);
      patterns_.push_back(kGpt2Pattern);
    }
  } else if (type == "Metaspace") {
    s.kind = PreStep::metaspace;
    s.replacement = p.value("replacement", std::string(kSpace));
    if (p.contains("prepend_scheme")) s.prepend_scheme = p["prepend_scheme"].get<std::string>();
    else s.prepend_scheme = flag(p, "add_prefix_space", true) ? "always" : "never";
    if (s.prepend_scheme != "always" && s.prepend_scheme != "first" && s.prepend_scheme != "never")
      bad(key + ".prepend_scheme", "'{}' is unknown (always, first, never)", s.prepend_scheme);
    s.metaspace_split = flag(p, "split", true);
    s.re = std::make_unique<Regex>(s.replacement, true, file_, key);
  } else {
    bad(key, "pre-tokenizer type '{}' is not supported (supported: ByteLevel, Split, Metaspace, Sequence)", type);
  }
  pre_.push_back(std::move(s));
}

void HfTokenizer::load_decoder(const json& d, const std::string& key) {
  if (d.is_null()) {
    if (!byte_level_) bad(key, "missing: only a byte-level tokenizer may leave the decoder out");
    decoder_.push_back({DecodeStep::byte_level, "", ""});
    return;
  }
  std::string type = str(d, "type", key);
  if (type == "Sequence") {
    const json& list = at(d, "decoders", key + ".decoders");
    for (size_t i = 0; i < list.size(); ++i) load_decoder(list[i], fmt::format("{}.decoders[{}]", key, i));
  } else if (type == "ByteLevel") {
    decoder_.push_back({DecodeStep::byte_level, "", ""});
  } else if (type == "Replace") {
    const json& p = at(d, "pattern", key + ".pattern");
    if (!p.contains("String")) bad(key + ".pattern", "only a String pattern is supported, got {}", p.dump());
    decoder_.push_back({DecodeStep::replace, p["String"].get<std::string>(), str(d, "content", key)});
  } else if (type == "ByteFallback") {
    decoder_.push_back({DecodeStep::byte_fallback, "", ""});
  } else if (type == "Fuse") {
    decoder_.push_back({DecodeStep::fuse, "", ""});
  } else if (type == "Strip") {
    DecodeStep s{DecodeStep::strip, str(d, "content", key), ""};
    s.start = d.value("start", 0);
    s.stop = d.value("stop", 0);
    decoder_.push_back(s);
  } else if (type == "Metaspace") {
    DecodeStep s{DecodeStep::metaspace, d.value("replacement", std::string(kSpace)), ""};
    std::string scheme = d.contains("prepend_scheme")        ? d["prepend_scheme"].get<std::string>()
                         : flag(d, "add_prefix_space", true) ? "always"
                                                             : "never";
    s.prepend = scheme != "never";
    decoder_.push_back(s);
  } else {
    bad(key,
        "decoder type '{}' is not supported (supported: ByteLevel, Replace, ByteFallback, Fuse, Strip, "
        "Metaspace, Sequence)",
        type);
  }
}

void HfTokenizer::find_specials(const json& j, const std::string& dir) {
  auto id_of = [&](const std::string& s) -> int32_t {
    for (const AddedToken& a : added_)
      if (a.content == s) return a.id;
    auto it = vocab_.find(s);
    return it == vocab_.end() ? -1 : it->second;
  };
  fs::path cfg = fs::path(dir) / "tokenizer_config.json";
  bool from_config = false;
  if (fs::is_regular_file(cfg)) {
    try {
      std::ifstream in(cfg);
      json c = json::parse(in);
      auto name = [](const json& v) -> std::string {
        if (v.is_string()) return v.get<std::string>();
        if (v.is_object() && v.contains("content")) return v["content"].get<std::string>();
        return "";
      };
      if (c.contains("bos_token") || c.contains("eos_token")) {
        from_config = true;
        bos_ = c.contains("bos_token") ? id_of(name(c["bos_token"])) : -1;
        eos_ = c.contains("eos_token") ? id_of(name(c["eos_token"])) : -1;
      }
    } catch (const json::exception& e) {
      fail("tokenizer", "{}: {}", cfg.string(), e.what());
    }
  }
  if (from_config) return;
  // TemplateProcessing (alone or in a Sequence): the special tokens before and after "$A" of `single`.
  std::function<void(const json&)> visit = [&](const json& p) {
    if (!p.is_object()) return;
    std::string type = p.value("type", std::string());
    if (type == "Sequence" && p.contains("processors"))
      for (const json& q : p["processors"]) visit(q);
    if (type != "TemplateProcessing" || !p.contains("single")) return;
    bool seen_a = false;
    for (const json& item : p["single"]) {
      if (item.contains("Sequence")) seen_a = true;
      if (!item.contains("SpecialToken")) continue;
      int32_t id = id_of(item["SpecialToken"].value("id", std::string()));
      if (!seen_a && bos_ < 0) bos_ = id;
      if (seen_a && eos_ < 0) eos_ = id;
    }
  };
  if (j.contains("post_processor")) visit(j["post_processor"]);
  for (const char* s : {"<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>"})
    if (bos_ < 0) bos_ = id_of(s);
  for (const char* s : {"<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>"})
    if (eos_ < 0) eos_ = id_of(s);
}

std::unique_ptr<Tokenizer> make_hf_tokenizer(const json& j, const std::string& file, const std::string& dir) {
  return std::make_unique<HfTokenizer>(j, file, dir);
}

}  // namespace mt::tokenizer_detail
