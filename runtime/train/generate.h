// Sampling from a run's model (samples during training, `meshtrain generate`), and how text becomes token ids and
// back: the model's tokenizer, or bytes.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/io/tokenizer.h"
#include "runtime/train/run_config.h"
#include "runtime/train/step_executor.h"

namespace mt {

class CausalLM;

// Continues `prompt` (token ids) by up to `n` sampled tokens, stopping after stop_id (-1: never); every rank
// computes the same tokens (collective under tensor parallel). Contexts are padded to a multiple of pad_multiple.
// The executor runs each context (StepExecutor::sample_logits: through the stages in turn under pipeline
// parallel) and gives every rank the sampled token.
std::vector<int32_t> generate(CausalLM& model, const StepExecutor& executor, std::vector<int32_t> prompt, int64_t n,
                              double temperature, uint64_t seed, uint64_t stream, int64_t pad_multiple = 1,
                              int64_t document_separator = -1, int32_t stop_id = -1);

// How text becomes token ids and back for prompts and samples: the model's tokenizer, or bytes (each byte one
// token id, modulo the vocabulary) when there is none.
struct TextCodec {
  std::shared_ptr<const Tokenizer> tokenizer;  // null: bytes
  std::string file;  // where the tokenizer was read (empty: bytes)
  int64_t vocab_size = 256;
  std::vector<int32_t> encode(const std::string& text) const;
  // Ids the tokenizer does not have (a model's vocabulary padded past its tokenizer's) decode as U+FFFD.
  std::string decode(const std::vector<int32_t>& ids) const;
  int32_t eos_id() const { return tokenizer ? tokenizer->eos_id() : -1; }
  std::string describe() const;
};
// The tokenizer of a run: `path` when given (a tokenizer.json, tokenizer.model or a directory holding one), else
// data.tokenizer, else model.init_from's directory's, else `fallback_dir`'s (a checkpoint's) when it holds one;
// bytes otherwise. A tokenizer with more ids than model.vocab_size is an error naming both.
TextCodec text_codec(const Config& cfg, const std::string& path = "", const std::string& fallback_dir = "");
// The tokenizer file of a directory ('' = none): tokenizer.json, else tokenizer.model.
std::string tokenizer_file_in(const std::string& dir);

}  // namespace mt
