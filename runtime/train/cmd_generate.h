// meshtrain generate: continues a prompt from a checkpoint.
#pragma once
#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

#include "runtime/train/run_context.h"

namespace mt {

struct GenerateArgs {
  std::string checkpoint, prompt = "The ", tokenizer;
  int64_t tokens = 128;
  double temperature = 0.8;
  int64_t seed = 0;
};
void add_generate_options(CLI::App* app, GenerateArgs& args);
int run_generate_command(RunContext& ctx, const GenerateArgs& args);

}  // namespace mt
