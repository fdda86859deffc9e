// `meshtrain tokenize`: a file encoded to ids, or ids decoded back to text, by a tokenizer.json or tokenizer.model,
// on rank 0 alone and without a config. The formats and --docs' framing are runtime/io/tokenize_files.h's.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <string>

#include "runtime/cli/command.h"
#include "runtime/core/error.h"
#include "runtime/io/tokenize_files.h"

namespace mt {

namespace {

struct TokenizeArgs {
  std::string tokenizer, in = "-", out = "-", format = "u32";
  int threads = 1;
  bool decode = false, info = false, stats = false, docs = false;
};

void add_tokenize_options(CLI::App* app, TokenizeArgs& a) {
  app->add_option("--tokenizer", a.tokenizer,
                  "a Hugging Face tokenizer.json, a SentencePiece tokenizer.model, or a directory holding one")
      ->required();
  app->add_option("--in", a.in, "input file: text, or ids with --decode (default: stdin)");
  app->add_option("--out", a.out, "output file: ids, or text with --decode (default: stdout)");
  app->add_option("--format", a.format, "ids as u32 (little-endian, default), u16 or json")
      ->check(CLI::IsMember({"u32", "u16", "json"}));
  app->add_option("--threads", a.threads, "encoding threads (text cut at safe newlines, see tokenizer.h)")
      ->check(whole_number(1, 1024));
  app->add_flag("--decode", a.decode, "the input is ids; write the bytes they decode to");
  app->add_flag("--info", a.info, "print the tokenizer's description, vocab_size, bos_id, eos_id as one JSON line");
  app->add_flag("--stats", a.stats, "print sizes and throughput (MB/s) on stderr");
  app->add_flag("--docs", a.docs,
                "framed documents in and out: each a u32 byte count and the bytes; out a u32 id count and the ids "
                "(json: one array a line)");
}

int run_tokenize_command(const TokenizeArgs& a) {
  MT_CHECK(!(a.decode && a.docs), "tokenize", "--decode and --docs do not go together");
  auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<Tokenizer> tok = Tokenizer::load(a.tokenizer);
  auto t1 = std::chrono::steady_clock::now();
  if (a.info) {
    std::printf("%s\n", tokenizer_info_json(*tok).c_str());
    return 0;
  }
  std::string in = read_input(a.in);
  auto t2 = std::chrono::steady_clock::now();
  Tokenized c = a.decode ? decode_file(*tok, in, a.format, a.in == "-" ? "stdin" : a.in)
                : a.docs ? encode_docs(*tok, in, a.format, a.threads)
                         : encode_file(*tok, in, a.format, a.threads);
  auto t3 = std::chrono::steady_clock::now();
  write_output(a.out, c.out);
  if (a.stats) {
    auto sec = [](auto x, auto y) { return std::chrono::duration<double>(y - x).count(); };
    double s = sec(t2, t3);
    std::fprintf(stderr,
                 "tokenize: %s %zu bytes %s %zu ids in %.3f s, %.2f MB/s, %.3f bytes/token, %d thread%s%s "
                 "(%s; load %.3f s, read %.3f s)\n",
                 a.decode ? "decode:" : "encode:", c.n_bytes, a.decode ? "<-" : "->", c.n_ids, s,
                 s > 0 ? double(c.n_bytes) / 1e6 / s : 0.0, c.n_ids ? double(c.n_bytes) / double(c.n_ids) : 0.0,
                 a.threads, a.threads == 1 ? "" : "s",
                 a.threads > 1 && (a.decode || (!a.docs && !tok->splits_at_newlines()))
                     ? " given, 1 used (this tokenizer is not cut at newlines, see tokenizer.h)"
                     : "",
                 tok->describe().c_str(), sec(t0, t1), sec(t1, t2));
  }
  return 0;
}

}  // namespace

Command tokenize_command() {
  return command_with<TokenizeArgs>(
      "tokenize", "encode text to token ids (or --decode ids) with a tokenizer.json or tokenizer.model; no config",
      add_tokenize_options, [](RunContext&, const TokenizeArgs& a) { return run_tokenize_command(a); },
      /*needs_config=*/false);
}

}  // namespace mt
