// Tokenizers: text to token ids and back, for preparing data and for prompts.
//   - Hugging Face tokenizer.json, byte-level BPE (GPT-2, Llama 3, Qwen2): pre-tokenizer ByteLevel (GPT-2's
//     regex when use_regex) and/or Sequence[Split(Regex or String; Isolated, Removed, MergedWithPrevious,
//     MergedWithNext, Contiguous; invert), ByteLevel]; the regexes run on PCRE2 (UTF, Unicode properties, JIT);
//     merges by rank ("a b" strings or [a, b] pairs); ignore_merges; a word cache per thread.
//   - Hugging Face tokenizer.json, SentencePiece-style BPE with byte fallback (Llama 2, Mistral): normalizer
//     Sequence[Prepend("▁"), Replace(" ", "▁")] or pre-tokenizer Metaspace; characters outside the vocabulary
//     become their <0xNN> byte tokens (else unk, fused with fuse_unk).
//   - SentencePiece tokenizer.model, through libsentencepiece.
// Added tokens are matched in the text first, longest first, as written (special or not; single_word takes
// ASCII letters, digits, '_' and any non-ASCII character as word characters; lstrip / rstrip take ASCII
// whitespace). Decoders: ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace and Sequences of them; added
// tokens go through them too, as in tokenizers. Normalizer NFC (Qwen2) is accepted on text that NFC leaves
// unchanged for certain (below U+0300, kana, CJK ideographs, Hangul syllables, fullwidth forms) and is an error
// naming the character otherwise (meshtrain has no Unicode normalization tables).
// Whatever a file asks for that is not implemented is refused when it is loaded, naming the file and key:
//   "[tokenizer] tok/tokenizer.json: normalizer: normalizer type 'NFKC' is not supported (supported: ...)"
// (other model types, other normalizers and pre-tokenizers, BPE dropout, subword prefixes and suffixes, a
// "normalized" added token the normalizer would rewrite, regexes PCRE2 does not compile).
// decode() gives the exact bytes: byte tokens and byte-level characters that do not form valid UTF-8 are
// written as they are (never U+FFFD), so decoding any prefix of a sequence gives a prefix of the bytes.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mt {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // path: a Hugging Face tokenizer.json, a SentencePiece tokenizer.model, or a directory holding one
  // (tokenizer.json preferred). A tokenizer_config.json next to a tokenizer.json names BOS and EOS.
  static std::unique_ptr<Tokenizer> load(const std::string& path);
  // Text -> ids, no BOS/EOS added; added (special) tokens written in the text are recognised.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Ids -> the exact bytes. An id outside the vocabulary is an error naming it.
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual int64_t vocab_size() const = 0;  // highest id + 1, added tokens included
  virtual int32_t bos_id() const = 0;      // -1 when there is none
  virtual int32_t eos_id() const = 0;      // -1 when there is none
  virtual std::string describe() const = 0;  // "byte-level BPE, tokenizer.json, 128,256 tokens"
  // Whether encode(a + b) == encode(a) + encode_chunk(b, false) whenever a ends with "\n" preceded by a
  // printable ASCII character other than space and b starts with one (the cut rule of encode_parallel).
  virtual bool splits_at_newlines() const { return false; }
  // encode() of a part of a text: text_start false for a part that continues the text (encode_parallel's
  // chunks after the first), where nothing is prepended (SentencePiece-style "▁").
  virtual std::vector<int32_t> encode_chunk(std::string_view text, bool text_start) const {
    (void)text_start;
    return encode(text);
  }
  // Whether `text` has an added token that starts at byte `at` (encode_parallel does not split there).
  virtual bool added_token_at(std::string_view text, size_t at) const {
    (void)text, (void)at;
    return false;
  }
};

// Encodes a large text on `threads` threads. The text is cut into chunks of about 1 MB, only just after a "\n"
// whose neighbours on both sides are printable ASCII other than space (0x21 ... 0x7e), e.g. "x.\nThe", and
// never where an added token starts; the chunks are encoded in parallel and their ids concatenated.
// For byte-level BPE whose pre-tokenizer regexes are of GPT-2's kind (no look-behind, no anchors, the only
// look-ahead "(?!\S)": GPT-2's, Llama 3's, Qwen2's) and no prefix space, no pre-token crosses such a cut and the
// scan restarts there in the same state, so the ids are those of encode(text): GPT-2's "\s+(?!\S)" makes a cut
// after "\n\n" or " \n" unsafe (it looks past the newline), which is why the byte before the "\n" must not be
// a space. SentencePiece-style BPE (no regex) qualifies when no merge joins a left side ending in a newline
// (or <0x0A>) to anything, the chunks after the first getting no "▁" prepended. Checked when the tokenizer is
// loaded (splits_at_newlines()); any other tokenizer, and SentencePiece .model files, run on one thread.
std::vector<int32_t> encode_parallel(const Tokenizer& t, std::string_view text, int threads);

}  // namespace mt
