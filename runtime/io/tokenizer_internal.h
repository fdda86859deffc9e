// What the tokenizer files share (tokenizer.cpp: loading and encode_parallel; hf_tokenizer.cpp: tokenizer.json;
// sentencepiece_tokenizer.cpp: tokenizer.model). Internal to runtime/io.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

#include "runtime/io/tokenizer.h"

namespace mt::tokenizer_detail {

constexpr std::string_view kSpace = "\xe2\x96\x81";  // "▁", U+2581: SentencePiece's word boundary

std::string with_commas(int64_t n);  // 128256 -> "128,256"
bool is_ascii_space(char c);

// j: the parsed tokenizer.json `file`; dir: its directory (for tokenizer_config.json). Errors name file and key.
std::unique_ptr<Tokenizer> make_hf_tokenizer(const nlohmann::json& j, const std::string& file, const std::string& dir);
// file: a SentencePiece tokenizer.model, read by libsentencepiece.
std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& file);

}  // namespace mt::tokenizer_detail
