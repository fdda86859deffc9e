// SentencePiece tokenizer.model files (tokenizer.h), through libsentencepiece; decoding gives the exact bytes.
#include <sentencepiece_processor.h>

#include <filesystem>
#include <string>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/io/tokenizer_internal.h"

namespace fs = std::filesystem;

namespace mt::tokenizer_detail {

namespace {

class SpTokenizer : public Tokenizer {
 public:
  explicit SpTokenizer(const std::string& file) : name_(fs::path(file).filename().string()) {
    auto s = sp_.Load(file);
    if (!s.ok()) fail("tokenizer", "{}: not a SentencePiece model: {}", file, s.ToString());
    std::vector<std::string> pieces;
    if (sp_.Encode("a", &pieces).ok() && !pieces.empty()) dummy_prefix_ = pieces[0].rfind(kSpace, 0) == 0;
  }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    auto s = sp_.Encode(text, &ids);
    if (!s.ok()) fail("tokenizer", "{}: encode: {}", name_, s.ToString());
    return std::vector<int32_t>(ids.begin(), ids.end());
  }
  std::string decode(std::span<const int32_t> ids) const override {
    // SentencePiece's own decoding, but bytes exactly (its Decode writes U+FFFD for bytes that are not UTF-8).
    std::string out;
    bool text_yet = false;
    for (int32_t id : ids) {
      MT_CHECK(id >= 0 && id < sp_.GetPieceSize(), "tokenizer",
               "decode: id {} is not in the vocabulary of {} (ids 0 ... {})", id, name_, sp_.GetPieceSize() - 1);
      if (sp_.IsControl(id)) continue;
      const std::string& p = sp_.IdToPiece(id);
      if (sp_.IsByte(id)) {
        out += char(std::stoi(p.substr(3, 2), nullptr, 16));
        text_yet = true;
        continue;
      }
      if (sp_.IsUnknown(id)) {
        out += " \xe2\x81\x87 ";  // SentencePiece's unk surface " ⁇ "
        text_yet = true;
        continue;
      }
      std::string r;
      for (size_t k = 0; k < p.size();) {
        if (p.compare(k, kSpace.size(), kSpace) == 0) {
          r += ' ';
          k += kSpace.size();
        } else {
          r += p[k++];
        }
      }
      if (!text_yet && dummy_prefix_ && !r.empty() && r[0] == ' ') r.erase(0, 1);
      text_yet = true;
      out += r;
    }
    return out;
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  int32_t bos_id() const override { return sp_.bos_id(); }
  int32_t eos_id() const override { return sp_.eos_id(); }
  std::string describe() const override {
    return fmt::format("SentencePiece, {}, {} tokens", name_, with_commas(vocab_size()));
  }

 private:
  std::string name_;
  sentencepiece::SentencePieceProcessor sp_;
  bool dummy_prefix_ = true;
};

}  // namespace

std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& file) {
  return std::make_unique<SpTokenizer>(file);
}

}  // namespace mt::tokenizer_detail
