// The detail of the Hugging Face tokenizer.json tokenizer, shared by its three files; not public API (the rest of the
// tree knows only make_hf_tokenizer, tokenizer_internal.h). hf_text.cpp: the text primitives (UTF-8, the byte-level
// alphabet, PCRE2, split behaviors); hf_tokenizer.cpp: loading; hf_tokenizer_codec.cpp: encoding and decoding.
#pragma once
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/io/tokenizer_internal.h"

namespace mt::tokenizer_detail {

using json = nlohmann::json;

// ---- UTF-8 ----

// The length of the valid UTF-8 character at s[i] and its code point; an invalid byte is length 1, cp -1.
// Inline: the encoder calls it on each character.
inline size_t utf8_char(std::string_view s, size_t i, int32_t* cp) {
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

void append_utf8(std::string& out, uint32_t cp);

// ---- the byte-level alphabet: each byte as a printable character ----

struct ByteAlphabet {
  std::string to_char[256];                   // byte -> its character (UTF-8)
  std::unordered_map<int32_t, uint8_t> back;  // code point -> byte
  ByteAlphabet();
};
const ByteAlphabet& byte_alphabet();

// ---- PCRE2 ----

class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& file, const std::string& key);
  ~Regex();
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
  Matcher();
  ~Matcher();
  Matcher(const Matcher&) = delete;
  Matcher& operator=(const Matcher&) = delete;

  // The non-empty matches of re in s, as [begin, end) byte offsets.
  void matches(const Regex& re, std::string_view s, std::vector<std::pair<size_t, size_t>>& out);
};

// ---- the pieces a section is cut into ----

enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

Behavior parse_behavior(const std::string& s, const std::string& file, const std::string& key);

// Splits `piece` by the matches (segments alternate between matched and not), appending the pieces kept.
void split_piece(std::string_view piece, const std::vector<std::pair<size_t, size_t>>& m, Behavior behavior,
                 bool invert, std::vector<std::string_view>& out);

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

class HfTokenizer : public Tokenizer {
 public:
  HfTokenizer(const json& j, const std::string& file, const std::string& dir);

  std::vector<int32_t> encode(std::string_view text) const override { return encode_chunk(text, true); }
  std::vector<int32_t> encode_chunk(std::string_view text, bool text_start) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int64_t vocab_size() const override { return int64_t(id_to_token_.size()); }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }
  std::string describe() const override;
  bool splits_at_newlines() const override { return splits_; }
  bool added_token_at(std::string_view text, size_t at) const override;

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
  State& state() const;

  // ---- loading (hf_tokenizer.cpp) ----

  template <typename... Args>
  [[noreturn]] void bad(const std::string& key, fmt::format_string<Args...> f, Args&&... args) const {
    fail("tokenizer", "{}: {}: {}", file_, key, fmt::format(f, std::forward<Args>(args)...));
  }
  const json& at(const json& j, const char* k, const std::string& key) const;
  std::string str(const json& j, const char* k, const std::string& key) const;
  bool flag(const json& j, const char* k, bool dflt) const;
  void set_token(int32_t id, const std::string& s);
  void load_model(const json& m);
  void load_added(const json& j);
  void load_normalizer(const json& n, const std::string& key);
  void load_pre(const json& p, const std::string& key);
  void load_decoder(const json& d, const std::string& key);
  // BOS and EOS: tokenizer_config.json next to the file, else the post-processor's template, else the usual
  // names among the added tokens.
  void find_specials(const json& j, const std::string& dir);

  static uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

  // ---- encoding (hf_tokenizer_codec.cpp) ----

  // The added token matching at byte i (longest first), with the span it covers after lstrip/rstrip
  // (lstrip never reaches before `floor`).
  const AddedToken* match_added(std::string_view text, size_t i, size_t floor, size_t* b, size_t* e) const;
  // at_start: the section begins the text; continues: it begins a chunk that continues a text cut by
  // encode_parallel (nothing is prepended to it).
  void encode_section(std::string_view text, bool at_start, bool continues, State& st, std::vector<int32_t>& out) const;
  void encode_word(std::string_view w, State& st, std::vector<int32_t>& out) const;
  void bpe(std::string_view w, State& st, std::vector<int32_t>& out) const;

  // ---- decoding (hf_tokenizer_codec.cpp) ----

  void apply_decoder(const DecodeStep& d, std::vector<std::string>& toks) const;

  inline static std::atomic<uint64_t> next_serial_{1};
  const uint64_t serial_ = next_serial_.fetch_add(1);
  std::string file_, name_;
  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<int32_t, int32_t> char_ids_;                     // code point -> id of the one-character token
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

}  // namespace mt::tokenizer_detail
