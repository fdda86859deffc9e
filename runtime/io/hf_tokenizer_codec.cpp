// The Hugging Face tokenizer's encoding and decoding (hf_tokenizer.h): added tokens split off, each section
// normalized, pre-tokenized and its words encoded by BPE (a word cache per thread); ids back to text through the
// decoder chain.
#include <algorithm>
#include <cctype>
#include <functional>
#include <queue>

#include "runtime/core/error.h"
#include "runtime/io/hf_tokenizer.h"

namespace mt::tokenizer_detail {

namespace {

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

struct Sym {
  int32_t id;
  int32_t prev, next;
};

bool byte_token(const std::string& t, uint8_t* b) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return false;
  auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1; };
  int h = hex(t[3]), l = hex(t[4]);
  if (h < 0 || l < 0) return false;
  *b = uint8_t(h * 16 + l);
  return true;
}

// Every occurrence of a in s replaced by b, left to right (a not empty).
std::string replace_all(const std::string& s, const std::string& a, const std::string& b) {
  std::string r;
  for (size_t k = 0; k < s.size();) {
    if (s.compare(k, a.size(), a) == 0) {
      r += b;
      k += a.size();
    } else {
      r += s[k++];
    }
  }
  return r;
}

// The normalizer's steps on a section: prepend (not to a chunk that continues a text), replace, and NFC, which
// only checks that the text is already NFC.
std::string normalize(std::string_view text, const std::vector<NormStep>& norm, bool continues,
                      const std::string& name) {
  std::string normalized(text);
  for (const NormStep& n : norm) {
    if (n.kind == NormStep::prepend) {
      if (!normalized.empty() && !continues) normalized.insert(0, n.a);
    } else if (n.kind == NormStep::replace) {
      if (n.a.empty()) continue;
      normalized = replace_all(normalized, n.a, n.b);
    } else {
      for (size_t k = 0; k < normalized.size();) {
        int32_t cp;
        k += utf8_char(normalized, k, &cp);
        MT_CHECK(nfc_stable(cp) || cp < 0, "tokenizer",
                 "{}: normalizer NFC: the text holds U+{:04X}, which may change under NFC; meshtrain has no "
                 "Unicode normalization tables (normalize the text to NFC first and use a tokenizer.json "
                 "without the normalizer)",
                 name, cp);
      }
    }
  }
  return normalized;
}

// What a pre-tokenizer step works with (the encoding state's members): the regex matcher and its matches, and
// the arena that owns the pieces a step makes.
struct PreScratch {
  Matcher& m;
  std::vector<std::pair<size_t, size_t>>& matches;
  std::deque<std::string>& arena;
};

// One pre-tokenizer step on one piece: the pieces it is cut into, appended to next.
void pre_tokenize(const PreStep& p, std::string_view piece, bool at_start, bool continues, PreScratch& sc,
                  std::vector<std::string_view>& next) {
  if (p.kind == PreStep::metaspace) {
    std::string s;
    bool prepend = !continues && (p.prepend_scheme == "always" || (p.prepend_scheme == "first" && at_start));
    if (prepend && piece.substr(0, p.replacement.size()) != p.replacement && piece.substr(0, 1) != " ")
      s = p.replacement;
    for (char c : piece)
      if (c == ' ') s += p.replacement;
      else s += c;
    sc.arena.push_back(std::move(s));
    std::string_view v = sc.arena.back();
    if (p.metaspace_split) {
      sc.m.matches(*p.re, v, sc.matches);
      split_piece(v, sc.matches, Behavior::merged_with_next, false, next);
    } else {
      next.push_back(v);
    }
    return;
  }
  if (p.kind == PreStep::byte_level && p.add_prefix_space && piece.substr(0, 1) != " ") {
    sc.arena.push_back(" " + std::string(piece));
    piece = sc.arena.back();
  }
  if (!p.re) {
    next.push_back(piece);
    return;
  }
  sc.m.matches(*p.re, piece, sc.matches);
  split_piece(piece, sc.matches, p.kind == PreStep::split ? p.behavior : Behavior::isolated,
              p.kind == PreStep::split && p.invert, next);
}

// A piece cut before each run of kSpace ("\u2581"), the run kept whole at the start of its part: where no merge
// crosses such a cut (ws_split_), the parts encode apart and each is cached as a word.
void split_at_space_runs(std::string_view piece, std::vector<std::string_view>& next) {
  size_t begin = 0;
  for (size_t k = 1; k + kSpace.size() <= piece.size(); ++k)
    if (piece.compare(k, kSpace.size(), kSpace) == 0 &&
        !(k >= kSpace.size() && piece.compare(k - kSpace.size(), kSpace.size(), kSpace) == 0)) {
      next.push_back(piece.substr(begin, k - begin));
      begin = k;
    }
  next.push_back(piece.substr(begin));
}

}  // namespace

HfTokenizer::State& HfTokenizer::state() const {
  thread_local std::unique_ptr<State> st;
  thread_local uint64_t owner = 0;
  if (!st || owner != serial_) {
    st = std::make_unique<State>();
    owner = serial_;
  }
  return *st;
}

// ---- encoding ----

std::vector<int32_t> HfTokenizer::encode_chunk(std::string_view text, bool text_start) const {
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

bool HfTokenizer::added_token_at(std::string_view text, size_t at) const {
  if (at >= text.size() || !first_byte_[uint8_t(text[at])]) return false;
  size_t b, e;
  return match_added(text, at, 0, &b, &e) != nullptr;
}

const AddedToken* HfTokenizer::match_added(std::string_view text, size_t i, size_t floor, size_t* b, size_t* e) const {
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

void HfTokenizer::encode_section(std::string_view text, bool at_start, bool continues, State& st,
                                 std::vector<int32_t>& out) const {
  if (text.empty()) return;
  std::string normalized;
  if (!norm_.empty()) {
    normalized = normalize(text, norm_, continues, name_);
    text = normalized;
  }
  st.arena.clear();
  std::vector<std::string_view> pieces{text}, next;
  PreScratch scratch{st.m, st.matches, st.arena};
  for (const PreStep& p : pre_) {
    next.clear();
    for (std::string_view piece : pieces) pre_tokenize(p, piece, at_start, continues, scratch, next);
    pieces.swap(next);
  }
  if (ws_split_) {
    next.clear();
    for (std::string_view piece : pieces) split_at_space_runs(piece, next);
    pieces.swap(next);
  }
  for (std::string_view w : pieces) encode_word(w, st, out);
}

void HfTokenizer::encode_word(std::string_view w, State& st, std::vector<int32_t>& out) const {
  if (w.size() <= 64) {
    auto it = st.cache.find(w);
    if (it != st.cache.end()) {
      out.insert(out.end(), st.pool.begin() + it->second.first, st.pool.begin() + it->second.first + it->second.second);
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

void HfTokenizer::bpe(std::string_view w, State& st, std::vector<int32_t>& out) const {
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

std::string HfTokenizer::decode(std::span<const int32_t> ids) const {
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

void HfTokenizer::apply_decoder(const DecodeStep& d, std::vector<std::string>& toks) const {
  switch (d.kind) {
    case DecodeStep::byte_level: {
      const ByteAlphabet& a = byte_alphabet();
      for (std::string& t : toks) {
        std::string r;
        for (size_t k = 0; k < t.size();) {
          int32_t cp;
          size_t n = utf8_char(t, k, &cp);
          auto it = a.back.find(cp);
          if (it != a.back.end()) r += char(it->second);
          else r.append(t, k, n);  // not a byte character: as it is
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
        for (int k = 0; k < d.start && t.compare(0, d.a.size(), d.a) == 0 && !d.a.empty(); ++k) t.erase(0, d.a.size());
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

}  // namespace mt::tokenizer_detail
