// meshtrain tokenize: text to token ids and back with a Hugging Face tokenizer.json or a SentencePiece
// tokenizer.model (runtime/io/tokenizer.h). Single process (rank 0 of a launch does the work); no config needed.
//   meshtrain tokenize --tokenizer PATH [--in FILE] [--out FILE] [--format u32|u16|json] [--threads N] [--stats]
//   meshtrain tokenize --tokenizer PATH --decode [--in IDS] [--out FILE] [--format u32|u16|json]
//   meshtrain tokenize --tokenizer PATH --info
//   meshtrain tokenize --tokenizer PATH --docs [--in FRAMED] [--out FRAMED] [--format ...] [--threads N]
#pragma once
#include <string>

#include <CLI/CLI.hpp>

namespace mt {

struct TokenizeArgs {
  std::string tokenizer, in = "-", out = "-", format = "u32";
  int threads = 1;
  bool decode = false, info = false, stats = false, docs = false;
};
void add_tokenize_options(CLI::App* app, TokenizeArgs& args);
int run_tokenize_command(const TokenizeArgs& args);

}  // namespace mt
