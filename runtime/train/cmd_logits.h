// meshtrain logits: the logits of a token sequence under a checkpoint, as .npy.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

#include "runtime/train/run_context.h"

namespace mt {

struct LogitsArgs {
  std::string checkpoint, tokens, prompt, tokenizer, out;
};
void add_logits_options(CLI::App* app, LogitsArgs& args);
int run_logits_command(RunContext& ctx, const LogitsArgs& args);

}  // namespace mt
