// Hugging Face tokenizer.json (tokenizer.h): byte-level BPE on PCRE2 and SentencePiece-style BPE with byte
// fallback. Follows the semantics of the `tokenizers` library as its documentation describes them: added tokens
// are split off first, each remaining section is normalized, pre-tokenized into words and each word encoded by
// BPE; decoding maps ids to token strings and runs them through the decoder chain. Written from those semantics,
// not from its code.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "runtime/core/error.h"
#include "runtime/io/tokenizer_internal.h"

namespace fs = std::filesystem;

namespace mt::tokenizer_detail {

namespace {

using json = nlohmann::json;

// GPT-2's pre-tokenizer regex: ByteLevel with use_regex true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---- UTF-8 ----

// The length of the valid UTF-8 character at s[i] and its code point; an invalid byte is length 1, cp -1.
size_t utf8_char(std::string_view s, size_t i, int32_t* cp) {
  const auto b = [&](size_t k) { return uint8_t(s[i + k]); };
  uint8_t c = b(0);
  *cp = -1;
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  size_t n = c >= 0xf0 && c <= 0xf4 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c < 0xe0 ? 2 : 0;
  if (n == 0 || i + n > s.size()) return 1;
  int32_t v = c & (n == 2 ? 0x1f : n == 3 ? 0x0f : 0x07);
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xc0) != 0x80) return 1;
    v = (v << 6) | (b(k) & 0x3f);
  }
  if ((n == 3 && (v < 0x800 || (v >= 0xd800 && v < 0xe000))) || (n == 4 && (v < 0x10000 || v > 0x10ffff))) return 1;
  *cp = v;
  return n;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xc0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += char(0xe0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3f));
    out += char(0x80 | (cp & 0x3f));
  } else {
    out += char(0xf0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3f));
    out += char(0x80 | ((cp >> 6) & 0x3f));
    out += char(0x80 | (cp & 0x3f));
  }
}

// ---- the byte-level alphabet: each byte as a printable character ----

struct ByteAlphabet {
  std::string to_char[256];                   // byte -> its character (UTF-8)
  std::unordered_map<int32_t, uint8_t> back;  // code point -> byte
  ByteAlphabet() {
    // Printable bytes stand for themselves; the others (controls, space, DEL, NBSP, soft hyphen) take the
    // code points from 256 up, in byte order.
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
      int cp = printable ? b : next++;
      append_utf8(to_char[b], uint32_t(cp));
      back[cp] = uint8_t(b);
    }
  }
};
const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet a;
  return a;
}

// ---- PCRE2 ----

class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& file, const std::string& key) {
    int err = 0;
    PCRE2_SIZE at = 0;
    uint32_t opts = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts, &err, &at, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      fail("tokenizer", "{}: {}: regex '{}' does not compile at offset {}: {}", file, key, pattern, size_t(at),
           reinterpret_cast<const char*>(msg));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  const pcre2_code* code() const { return code_; }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// Per-call match state (pcre2 match data is not shareable between threads).
struct Matcher {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mc = nullptr;
  pcre2_jit_stack* stack = nullptr;
  Matcher() {
    md = pcre2_match_data_create(4, nullptr);
    mc = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    if (stack) pcre2_jit_stack_assign(mc, nullptr, stack);
  }
  ~Matcher() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(mc);
    if (stack) pcre2_jit_stack_free(stack);
  }
  Matcher(const Matcher&) = delete;
  Matcher& operator=(const Matcher&) = delete;

  // The non-empty matches of re in s, as [begin, end) byte offsets.
  void matches(const Regex& re, std::string_view s, std::vector<std::pair<size_t, size_t>>& out) {
    out.clear();
    size_t at = 0;
    while (at <= s.size()) {
      int rc = pcre2_match(re.code(), reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), at, 0, md, mc);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        fail("tokenizer", "pre-tokenizer regex failed at byte {}: {}", at, reinterpret_cast<const char*>(msg));
      }
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      size_t b = ov[0], e = ov[1];
      if (e > b) {
        out.emplace_back(b, e);
        at = e;
      } else {
        if (b >= s.size()) break;
        int32_t cp;
        at = b + utf8_char(s, b, &cp);
      }
    }
  }
};

// ---- the pieces a section is cut into ----

enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

Behavior parse_behavior(const std::string& s, const std::string& file, const std::string& key) {
  if (s == "Removed") return Behavior::removed;
  if (s == "Isolated") return Behavior::isolated;
  if (s == "MergedWithPrevious") return Behavior::merged_with_previous;
  if (s == "MergedWithNext") return Behavior::merged_with_next;
  if (s == "Contiguous") return Behavior::contiguous;
  fail("tokenizer", "{}: {}: split behavior '{}' is unknown (Removed, Isolated, MergedWithPrevious, "
       "MergedWithNext, Contiguous)", file, key, s);
}

// Splits `piece` by the matches (segments alternate between matched and not), appending the pieces kept.
void split_piece(std::string_view piece, const std::vector<std::pair<size_t, size_t>>& m, Behavior behavior,
                 bool invert, std::vector<std::string_view>& out) {
  struct Seg {
    size_t b, e;
    bool match;
  };
  std::vector<Seg> segs;
  size_t at = 0;
  for (auto [b, e] : m) {
    if (b > at) segs.push_back({at, b, invert});
    segs.push_back({b, e, !invert});
    at = e;
  }
  if (at < piece.size()) segs.push_back({at, piece.size(), invert});
  std::vector<std::pair<size_t, size_t>> kept;
  switch (behavior) {
    case Behavior::removed:
      for (const Seg& s : segs)
        if (!s.match) kept.emplace_back(s.b, s.e);
      break;
    case Behavior::isolated:
      for (const Seg& s : segs) kept.emplace_back(s.b, s.e);
      break;
    case Behavior::merged_with_previous: {
      bool prev_match = false;
      for (const Seg& s : segs) {
        if (s.match && !prev_match && !kept.empty())
          kept.back().second = s.e;
        else
          kept.emplace_back(s.b, s.e);
        prev_match = s.match;
      }
      break;
    }
    case Behavior::merged_with_next: {
      bool next_match = false;
      for (size_t i = segs.size(); i-- > 0;) {
        const Seg& s = segs[i];
        if (s.match && !next_match && !kept.empty())
          kept.back().first = s.b;
        else
          kept.emplace_back(s.b, s.e);
        next_match = s.match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    }
    case Behavior::contiguous: {
      bool prev_match = false;
      for (const Seg& s : segs) {
        if (s.match && prev_match && !kept.empty())
          kept.back().second = s.e;
        else
          kept.emplace_back(s.b, s.e);
        prev_match = s.match;
      }
      break;
    }
  }
  for (auto [b, e] : kept)
    if (e > b) out.push_back(piece.substr(b, e - b));
}

// ---- Hugging Face tokenizer.json ----

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = false;
};

struct NormStep {
  enum Kind { prepend, replace, nfc } kind;
  std::string a, b;  // prepend: a; replace: a -> b
};

struct PreStep {
  enum Kind { split, byte_level, metaspace } kind;
  std::unique_ptr<Regex> re;  // split; byte_level with use_regex
  Behavior behavior = Behavior::isolated;
  bool invert = false;
  bool add_prefix_space = false;  // byte_level
  std::string replacement;        // metaspace
  std::string prepend_scheme;     // metaspace: always, first, never
  bool metaspace_split = true;
};

struct DecodeStep {
  enum Kind { byte_level, replace, byte_fallback, fuse, strip, metaspace } kind;
  std::string a, b;  // replace: a -> b; strip: a (the character); metaspace: a (replacement)
  int start = 0, stop = 0;
  bool prepend = true;  // metaspace: strip the first token's leading space
};

bool word_char(std::string_view s, size_t at, bool before) {
  // A letter, digit or '_' (ASCII), or any non-ASCII character: the side of an added token with
  // single_word must not be one.
  if (before) {
    if (at == 0) return false;
    unsigned char c = s[at - 1];
    return std::isalnum(c) || c == '_' || c >= 0x80;
  }
  if (at >= s.size()) return false;
  unsigned char c = s[at];
  return std::isalnum(c) || c == '_' || c >= 0x80;
}

// Code points that NFC leaves alone wherever they stand (no decomposition, never composed with a neighbour,
// combining class 0): below U+0300, kana (but the combining voiced marks), CJK ideographs, Hangul syllables
// followed by such a character, fullwidth forms. Text made only of these is already NFC.
bool nfc_stable(int32_t cp) {
  return (cp >= 0 && cp < 0x300) || (cp >= 0x3040 && cp <= 0x30ff && cp != 0x3099 && cp != 0x309a) ||
         (cp >= 0x4e00 && cp <= 0x9fff) || (cp >= 0xac00 && cp <= 0xd7a3) || (cp >= 0xff01 && cp <= 0xffef) ||
         (cp >= 0x3000 && cp <= 0x3029) || (cp >= 0x3030 && cp <= 0x303f);
}

class HfTokenizer : public Tokenizer {
 public:
  HfTokenizer(const json& j, const std::string& file, const std::string& dir) : file_(file) {
    name_ = fs::path(file).filename().string();
    const json& model = at(j, "model", "model");
    std::string type = model.value("type", std::string("BPE"));
    if (type != "BPE")
      bad("model.type", "model type '{}' is not supported (supported: BPE)", type);
    load_model(model);
    load_added(j);
    load_normalizer(j.contains("normalizer") ? j["normalizer"] : json(), "normalizer");
    if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) load_pre(j["pre_tokenizer"], "pre_tokenizer");
    // Added tokens are matched in the text as written (tokenizers matches "normalized" ones in the normalized
    // text): the same unless the normalizer rewrites a character of the token.
    for (const AddedToken& a : added_)
      for (const NormStep& n : norm_)
        if (a.normalized && n.kind == NormStep::replace && !n.a.empty() && a.content.find(n.a) != std::string::npos)
          bad("added_tokens", "token {} '{}' is \"normalized\" and holds '{}', which the normalizer replaces: not "
              "supported", a.id, a.content, n.a);
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

  std::vector<int32_t> encode(std::string_view text) const override { return encode_chunk(text, true); }

  std::vector<int32_t> encode_chunk(std::string_view text, bool text_start) const override {
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 16);
    State& st = state();
    size_t prev = 0;
    size_t i = 0;
    while (i < text.size()) {
      if (!first_byte_[uint8_t(text[i])]) {
        ++i;
        continue;
      }
      size_t b = 0, e = 0;
      const AddedToken* hit = match_added(text, i, prev, &b, &e);
      if (!hit) {
        ++i;
        continue;
      }
      encode_section(text.substr(prev, b - prev), prev == 0 && text_start, prev == 0 && !text_start, st, out);
      out.push_back(hit->id);
      prev = i = e;
    }
    encode_section(text.substr(prev), prev == 0 && text_start, prev == 0 && !text_start, st, out);
    return out;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::vector<std::string> toks;
    toks.reserve(ids.size());
    for (int32_t id : ids) {
      MT_CHECK(id >= 0 && id < int64_t(id_to_token_.size()) && has_token_[size_t(id)], "tokenizer",
               "decode: id {} is not in the vocabulary of {} (ids 0 ... {})", id, name_, id_to_token_.size() - 1);
      toks.push_back(id_to_token_[size_t(id)]);
    }
    for (const DecodeStep& d : decoder_) apply_decoder(d, toks);
    std::string out;
    for (const std::string& t : toks) out += t;
    return out;
  }

  int64_t vocab_size() const override { return int64_t(id_to_token_.size()); }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }
  std::string describe() const override {
    return fmt::format("{}BPE, {}, {} tokens", byte_level_ ? "byte-level " : byte_fallback_ ? "byte-fallback " : "",
                       name_, with_commas(vocab_size()));
  }
  bool splits_at_newlines() const override { return splits_; }
  bool added_token_at(std::string_view text, size_t at) const override {
    if (at >= text.size() || !first_byte_[uint8_t(text[at])]) return false;
    size_t b, e;
    return match_added(text, at, 0, &b, &e) != nullptr;
  }

 private:
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
  };
  struct State {
    Matcher m;
    std::vector<std::pair<size_t, size_t>> matches;
    std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StringHash, std::equal_to<>>
        cache;  // word -> (offset, count) in pool
    std::vector<int32_t> pool;
    std::deque<std::string> arena;  // pieces made by a step (prefix space, metaspace)
    std::string mapped;
  };

  // This thread's state for this tokenizer: its word cache lives on from call to call (encode_parallel's
  // chunks and --docs' documents on one thread share it); a thread that switches tokenizers starts afresh.
  State& state() const {
    thread_local std::unique_ptr<State> st;
    thread_local uint64_t owner = 0;
    if (!st || owner != serial_) {
      st = std::make_unique<State>();
      owner = serial_;
    }
    return *st;
  }

  template <typename... Args>
  [[noreturn]] void bad(const std::string& key, fmt::format_string<Args...> f, Args&&... args) const {
    fail("tokenizer", "{}: {}: {}", file_, key, fmt::format(f, std::forward<Args>(args)...));
  }
  const json& at(const json& j, const char* k, const std::string& key) const {
    if (!j.is_object() || !j.contains(k)) bad(key, "missing");
    return j[k];
  }
  std::string str(const json& j, const char* k, const std::string& key) const {
    const json& v = at(j, k, key + "." + k);
    if (!v.is_string()) bad(key + "." + k, "expected a string, got {}", v.dump());
    return v.get<std::string>();
  }
  bool flag(const json& j, const char* k, bool dflt) const {
    if (!j.contains(k) || j[k].is_null()) return dflt;
    return j[k].get<bool>();
  }

  void set_token(int32_t id, const std::string& s) {
    if (id < 0) bad("model.vocab", "negative id {} for '{}'", id, s);
    if (size_t(id) >= id_to_token_.size()) {
      id_to_token_.resize(size_t(id) + 1);
      has_token_.resize(size_t(id) + 1, 0);
    }
    id_to_token_[size_t(id)] = s;
    has_token_[size_t(id)] = 1;
  }

  void load_model(const json& m) {
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
            ia == vocab_.end() ? a : ib == vocab_.end() ? b : a + b);
      merges_.emplace(pair_key(ia->second, ib->second), std::make_pair(rank, iab->second));
      ++rank;
    }
    // Single characters of the vocabulary, for the first symbols of a word.
    for (const auto& [tok, id] : vocab_) {
      int32_t cp;
      if (!tok.empty() && utf8_char(tok, 0, &cp) == tok.size() && cp >= 0) char_ids_[cp] = id;
    }
  }

  void load_added(const json& j) {
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

  // The added token matching at byte i (longest first), with the span it covers after lstrip/rstrip
  // (lstrip never reaches before `floor`).
  const AddedToken* match_added(std::string_view text, size_t i, size_t floor, size_t* b, size_t* e) const {
    for (const AddedToken& t : added_) {
      if (t.content[0] != text[i] || text.compare(i, t.content.size(), t.content) != 0) continue;
      size_t end = i + t.content.size();
      if (t.single_word && (word_char(text, i, true) || word_char(text, end, false))) continue;
      size_t start = i;
      if (t.lstrip)
        while (start > floor && is_ascii_space(text[start - 1])) --start;
      if (t.rstrip)
        while (end < text.size() && is_ascii_space(text[end])) ++end;
      *b = start;
      *e = end;
      return &t;
    }
    return nullptr;
  }

  void load_normalizer(const json& n, const std::string& key) {
    if (n.is_null()) return;
    std::string type = str(n, "type", key);
    if (type == "Sequence") {
      const json& list = at(n, "normalizers", key + ".normalizers");
      for (size_t i = 0; i < list.size(); ++i) load_normalizer(list[i], fmt::format("{}.normalizers[{}]", key, i));
    } else if (type == "Prepend") {
      norm_.push_back({NormStep::prepend, str(n, "prepend", key), ""});
    } else if (type == "Replace") {
      const json& p = at(n, "pattern", key + ".pattern");
      if (!p.contains("String"))
        bad(key + ".pattern", "only a String pattern is supported, got {}", p.dump());
      norm_.push_back({NormStep::replace, p["String"].get<std::string>(), str(n, "content", key)});
    } else if (type == "NFC") {
      norm_.push_back({NormStep::nfc, "", ""});
    } else {
      bad(key, "normalizer type '{}' is not supported (supported: null, Sequence, Prepend, Replace with a String "
          "pattern, NFC on text that is already NFC)", type);
    }
  }

  void load_pre(const json& p, const std::string& key) {
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
      if (p.contains("prepend_scheme"))
        s.prepend_scheme = p["prepend_scheme"].get<std::string>();
      else
        s.prepend_scheme = flag(p, "add_prefix_space", true) ? "always" : "never";
      if (s.prepend_scheme != "always" && s.prepend_scheme != "first" && s.prepend_scheme != "never")
        bad(key + ".prepend_scheme", "'{}' is unknown (always, first, never)", s.prepend_scheme);
      s.metaspace_split = flag(p, "split", true);
      s.re = std::make_unique<Regex>(s.replacement, true, file_, key);
    } else {
      bad(key, "pre-tokenizer type '{}' is not supported (supported: ByteLevel, Split, Metaspace, Sequence)", type);
    }
    pre_.push_back(std::move(s));
  }

  void load_decoder(const json& d, const std::string& key) {
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
      std::string scheme = d.contains("prepend_scheme") ? d["prepend_scheme"].get<std::string>()
                           : flag(d, "add_prefix_space", true) ? "always" : "never";
      s.prepend = scheme != "never";
      decoder_.push_back(s);
    } else {
      bad(key, "decoder type '{}' is not supported (supported: ByteLevel, Replace, ByteFallback, Fuse, Strip, "
          "Metaspace, Sequence)", type);
    }
  }

  // BOS and EOS: tokenizer_config.json next to the file, else the post-processor's template, else the usual
  // names among the added tokens.
  void find_specials(const json& j, const std::string& dir) {
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

  static uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

  // ---- encoding ----

  // at_start: the section begins the text; continues: it begins a chunk that continues a text cut by
  // encode_parallel (nothing is prepended to it).
  void encode_section(std::string_view text, bool at_start, bool continues, State& st,
                      std::vector<int32_t>& out) const {
    if (text.empty()) return;
    std::string normalized;
    if (!norm_.empty()) {
      normalized = std::string(text);
      for (const NormStep& n : norm_) {
        if (n.kind == NormStep::prepend) {
          if (!normalized.empty() && !continues) normalized.insert(0, n.a);
        } else if (n.kind == NormStep::replace) {
          if (n.a.empty()) continue;
          std::string r;
          for (size_t k = 0; k < normalized.size();) {
            if (normalized.compare(k, n.a.size(), n.a) == 0) {
              r += n.b;
              k += n.a.size();
            } else {
              r += normalized[k++];
            }
          }
          normalized.swap(r);
        } else {
          for (size_t k = 0; k < normalized.size();) {
            int32_t cp;
            k += utf8_char(normalized, k, &cp);
            MT_CHECK(nfc_stable(cp) || cp < 0, "tokenizer",
                     "{}: normalizer NFC: the text holds U+{:04X}, which may change under NFC; meshtrain has no "
                     "Unicode normalization tables (normalize the text to NFC first and use a tokenizer.json "
                     "without the normalizer)", name_, cp);
          }
        }
      }
      text = normalized;
    }
    st.arena.clear();
    std::vector<std::string_view> pieces{text}, next;
    for (const PreStep& p : pre_) {
      next.clear();
      for (std::string_view piece : pieces) {
        if (p.kind == PreStep::metaspace) {
          std::string s;
          bool prepend = !continues && (p.prepend_scheme == "always" || (p.prepend_scheme == "first" && at_start));
          if (prepend && piece.substr(0, p.replacement.size()) != p.replacement && piece.substr(0, 1) != " ")
            s = p.replacement;
          for (char c : piece)
            if (c == ' ')
              s += p.replacement;
            else
              s += c;
          st.arena.push_back(std::move(s));
          std::string_view v = st.arena.back();
          if (p.metaspace_split) {
            st.m.matches(*p.re, v, st.matches);
            split_piece(v, st.matches, Behavior::merged_with_next, false, next);
          } else {
            next.push_back(v);
          }
          continue;
        }
        if (p.kind == PreStep::byte_level && p.add_prefix_space && piece.substr(0, 1) != " ") {
          st.arena.push_back(" " + std::string(piece));
          piece = st.arena.back();
        }
        if (!p.re) {
          next.push_back(piece);
          continue;
        }
        st.m.matches(*p.re, piece, st.matches);
        split_piece(piece, st.matches, p.kind == PreStep::split ? p.behavior : Behavior::isolated,
                    p.kind == PreStep::split && p.invert, next);
      }
      pieces.swap(next);
    }
    if (ws_split_) {
      next.clear();
      for (std::string_view piece : pieces) {
        size_t begin = 0;
        for (size_t k = 1; k + kSpace.size() <= piece.size(); ++k)
          if (piece.compare(k, kSpace.size(), kSpace) == 0 &&
              !(k >= kSpace.size() && piece.compare(k - kSpace.size(), kSpace.size(), kSpace) == 0)) {
            next.push_back(piece.substr(begin, k - begin));
            begin = k;
          }
        next.push_back(piece.substr(begin));
      }
      pieces.swap(next);
    }
    for (std::string_view w : pieces) encode_word(w, st, out);
  }

  void encode_word(std::string_view w, State& st, std::vector<int32_t>& out) const {
    if (w.size() <= 64) {
      auto it = st.cache.find(w);
      if (it != st.cache.end()) {
        out.insert(out.end(), st.pool.begin() + it->second.first,
                   st.pool.begin() + it->second.first + it->second.second);
        return;
      }
    }
    size_t before = out.size();
    bpe(w, st, out);
    if (w.size() <= 64) {
      if (st.cache.size() > 500'000) {  // bounds the memory a thread keeps
        st.cache.clear();
        st.pool.clear();
      }
      st.cache.emplace(std::string(w), std::make_pair(uint32_t(st.pool.size()), uint32_t(out.size() - before)));
      st.pool.insert(st.pool.end(), out.begin() + before, out.end());
    }
  }

  struct Sym {
    int32_t id;
    int32_t prev, next;
  };

  void bpe(std::string_view w, State& st, std::vector<int32_t>& out) const {
    std::vector<Sym> syms;
    syms.reserve(w.size());
    auto push = [&](int32_t id) {
      if (id < 0) return;
      syms.push_back({id, int32_t(syms.size()) - 1, int32_t(syms.size()) + 1});
    };
    if (byte_level_) {
      const ByteAlphabet& a = byte_alphabet();
      if (ignore_merges_) {
        st.mapped.clear();
        for (char c : w) st.mapped += a.to_char[uint8_t(c)];
        auto it = vocab_.find(st.mapped);
        if (it != vocab_.end()) {
          out.push_back(it->second);
          return;
        }
      }
      for (char c : w) push(byte_char_ids_[uint8_t(c)]);
    } else {
      if (ignore_merges_) {
        auto it = vocab_.find(std::string(w));
        if (it != vocab_.end()) {
          out.push_back(it->second);
          return;
        }
      }
      bool last_unk = false;
      for (size_t k = 0; k < w.size();) {
        int32_t cp;
        size_t n = utf8_char(w, k, &cp);
        auto it = cp >= 0 ? char_ids_.find(cp) : char_ids_.end();
        if (it != char_ids_.end()) {
          push(it->second);
          last_unk = false;
        } else if (byte_fallback_ && std::all_of(w.begin() + long(k), w.begin() + long(k + n),
                                                 [&](char c) { return byte_ids_[uint8_t(c)] >= 0; })) {
          for (size_t q = k; q < k + n; ++q) push(byte_ids_[uint8_t(w[q])]);
          last_unk = false;
        } else if (unk_ >= 0) {
          if (!(fuse_unk_ && last_unk)) push(unk_);
          last_unk = true;
        }
        k += n;
      }
    }
    if (syms.empty()) return;
    syms.back().next = -1;
    // Merges by rank, leftmost first among equal ranks: a min-heap of (rank, left position).
    struct Cand {
      int32_t rank, pos, left, right;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    auto consider = [&](int32_t pos) {
      if (pos < 0 || syms[size_t(pos)].next < 0) return;
      int32_t nx = syms[size_t(pos)].next;
      auto it = merges_.find(pair_key(syms[size_t(pos)].id, syms[size_t(nx)].id));
      if (it != merges_.end()) heap.push({it->second.first, pos, syms[size_t(pos)].id, syms[size_t(nx)].id});
    };
    for (int32_t p = 0; p + 1 < int32_t(syms.size()); ++p) consider(p);
    while (!heap.empty()) {
      Cand c = heap.top();
      heap.pop();
      Sym& s = syms[size_t(c.pos)];
      if (s.id != c.left || s.next < 0 || syms[size_t(s.next)].id != c.right) continue;  // stale
      Sym& r = syms[size_t(s.next)];
      s.id = merges_.at(pair_key(c.left, c.right)).second;
      r.id = -1;  // gone
      s.next = r.next;
      if (r.next >= 0) syms[size_t(r.next)].prev = c.pos;
      consider(s.prev);
      consider(c.pos);
    }
    for (int32_t p = 0; p >= 0; p = syms[size_t(p)].next) out.push_back(syms[size_t(p)].id);
  }

  // ---- decoding ----

  static bool byte_token(const std::string& t, uint8_t* b) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return false;
    auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1; };
    int h = hex(t[3]), l = hex(t[4]);
    if (h < 0 || l < 0) return false;
    *b = uint8_t(h * 16 + l);
    return true;
  }

  void apply_decoder(const DecodeStep& d, std::vector<std::string>& toks) const {
    switch (d.kind) {
      case DecodeStep::byte_level: {
        const ByteAlphabet& a = byte_alphabet();
        for (std::string& t : toks) {
          std::string r;
          for (size_t k = 0; k < t.size();) {
            int32_t cp;
            size_t n = utf8_char(t, k, &cp);
            auto it = a.back.find(cp);
            if (it != a.back.end())
              r += char(it->second);
            else
              r.append(t, k, n);  // not a byte character: as it is
            k += n;
          }
          t.swap(r);
        }
        break;
      }
      case DecodeStep::replace:
        for (std::string& t : toks) {
          if (d.a.empty()) continue;
          std::string r;
          for (size_t k = 0; k < t.size();) {
            if (t.compare(k, d.a.size(), d.a) == 0) {
              r += d.b;
              k += d.a.size();
            } else {
              r += t[k++];
            }
          }
          t.swap(r);
        }
        break;
      case DecodeStep::byte_fallback:
        // <0xNN> becomes the byte NN, exactly (no U+FFFD for bytes that do not form UTF-8).
        for (std::string& t : toks) {
          uint8_t b;
          if (byte_token(t, &b)) t = std::string(1, char(b));
        }
        break;
      case DecodeStep::fuse: {
        std::string all;
        for (const std::string& t : toks) all += t;
        toks.assign(1, all);
        break;
      }
      case DecodeStep::strip:
        for (std::string& t : toks) {
          for (int k = 0; k < d.start && t.compare(0, d.a.size(), d.a) == 0 && !d.a.empty(); ++k)
            t.erase(0, d.a.size());
          for (int k = 0; k < d.stop && t.size() >= d.a.size() && !d.a.empty() &&
                          t.compare(t.size() - d.a.size(), d.a.size(), d.a) == 0;
               ++k)
            t.erase(t.size() - d.a.size());
        }
        break;
      case DecodeStep::metaspace:
        for (size_t i = 0; i < toks.size(); ++i) {
          std::string r;
          std::string& t = toks[i];
          for (size_t k = 0; k < t.size();) {
            if (t.compare(k, d.a.size(), d.a) == 0) {
              r += ' ';
              k += d.a.size();
            } else {
              r += t[k++];
            }
          }
          if (i == 0 && d.prepend && !r.empty() && r[0] == ' ') r.erase(0, 1);
          t.swap(r);
        }
        break;
    }
  }

  inline static std::atomic<uint64_t> next_serial_{1};
  const uint64_t serial_ = next_serial_.fetch_add(1);
  std::string file_, name_;
  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<int32_t, int32_t> char_ids_;  // code point -> id of the one-character token
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;  // (a, b) -> (rank, merged id)
  std::vector<std::string> id_to_token_;
  std::vector<uint8_t> has_token_;
  std::vector<AddedToken> added_;
  std::vector<int32_t> added_ids_;
  bool first_byte_[256] = {};
  std::vector<NormStep> norm_;
  std::vector<PreStep> pre_;
  std::vector<std::string> patterns_;
  std::vector<DecodeStep> decoder_;
  int32_t byte_ids_[256];
  int32_t byte_char_ids_[256];  // byte-level: byte -> id of its character
  int32_t unk_ = -1, bos_ = -1, eos_ = -1;
  bool byte_fallback_ = false, ignore_merges_ = false, fuse_unk_ = false, byte_level_ = false, splits_ = false;
  bool ws_split_ = false;
};

}  // namespace

std::unique_ptr<Tokenizer> make_hf_tokenizer(const json& j, const std::string& file, const std::string& dir) {
  return std::make_unique<HfTokenizer>(j, file, dir);
}

}  // namespace mt::tokenizer_detail
