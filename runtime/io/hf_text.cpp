// The text primitives of the Hugging Face tokenizer (hf_tokenizer.h): UTF-8, the byte-level alphabet, the PCRE2
// regexes of the pre-tokenizers and the behaviors that cut a piece by their matches.
#include <algorithm>

#include "runtime/core/error.h"
#include "runtime/io/hf_tokenizer.h"

namespace mt::tokenizer_detail {

// ---- UTF-8 ----

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

ByteAlphabet::ByteAlphabet() {
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
const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet a;
  return a;
}

// ---- PCRE2 ----

Regex::Regex(const std::string& pattern, bool literal, const std::string& file, const std::string& key) {
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

Regex::~Regex() { pcre2_code_free(code_); }

Matcher::Matcher() {
  md = pcre2_match_data_create(4, nullptr);
  mc = pcre2_match_context_create(nullptr);
  stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
  if (stack) pcre2_jit_stack_assign(mc, nullptr, stack);
}

Matcher::~Matcher() {
  pcre2_match_data_free(md);
  pcre2_match_context_free(mc);
  if (stack) pcre2_jit_stack_free(stack);
}

void Matcher::matches(const Regex& re, std::string_view s, std::vector<std::pair<size_t, size_t>>& out) {
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

// ---- the pieces a section is cut into ----

Behavior parse_behavior(const std::string& s, const std::string& file, const std::string& key) {
  if (s == "Removed") return Behavior::removed;
  if (s == "Isolated") return Behavior::isolated;
  if (s == "MergedWithPrevious") return Behavior::merged_with_previous;
  if (s == "MergedWithNext") return Behavior::merged_with_next;
  if (s == "Contiguous") return Behavior::contiguous;
  fail("tokenizer",
       "{}: {}: split behavior '{}' is unknown (Removed, Isolated, MergedWithPrevious, "
       "MergedWithNext, Contiguous)",
       file, key, s);
}

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
        if (s.match && !prev_match && !kept.empty()) kept.back().second = s.e;
        else kept.emplace_back(s.b, s.e);
        prev_match = s.match;
      }
      break;
    }
    case Behavior::merged_with_next: {
      bool next_match = false;
      for (size_t i = segs.size(); i-- > 0;) {
        const Seg& s = segs[i];
        if (s.match && !next_match && !kept.empty()) kept.back().first = s.b;
        else kept.emplace_back(s.b, s.e);
        next_match = s.match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    }
    case Behavior::contiguous: {
      bool prev_match = false;
      for (const Seg& s : segs) {
        if (s.match && prev_match && !kept.empty()) kept.back().second = s.e;
        else kept.emplace_back(s.b, s.e);
        prev_match = s.match;
      }
      break;
    }
  }
  for (auto [b, e] : kept)
    if (e > b) out.push_back(piece.substr(b, e - b));
}

}  // namespace mt::tokenizer_detail
