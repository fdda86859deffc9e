// `meshtrain generate`: text from a checkpoint, on whatever ranks it is given
// (replicated; the same text on every rank, printed by rank 0).
#include "runtime/cli/command.h"
#include <cstdint>
#include <string>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <string>

#include "runtime/train/agree.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/trainer.h"

namespace mt {

struct GenerateArgs {
  std::string checkpoint, prompt = "The ", tokenizer;
  int64_t tokens = 128;
  double temperature = 0.8;
  int64_t seed = 0;
};


void add_generate_options(CLI::App* app, GenerateArgs& a) {
  app->add_option("--checkpoint", a.checkpoint, "checkpoint directory (step_XXXXXXXX) or a checkpoint.dir")->required();
  app->add_option("--prompt", a.prompt, "text to continue")->capture_default_str();
  app->add_option("--tokenizer", a.tokenizer,
                  "tokenizer.json, tokenizer.model or a directory holding one (default: the run's data.tokenizer, "
                  "else model.init_from's, else the checkpoint's; bytes when there is none)");
  app->add_option("--tokens", a.tokens, "tokens to generate")->capture_default_str();
  app->add_option("--temperature", a.temperature, "sampling temperature (0 = greedy)")->capture_default_str();
  app->add_option("--seed", a.seed, "sampling seed")->capture_default_str();
}

int run_generate_command(RunContext& ctx, const GenerateArgs& a) {
  std::string path = a.checkpoint;
  if (!std::filesystem::exists(std::filesystem::path(path) / "meta.json")) {
    auto latest = latest_checkpoint(path);
    MT_CHECK(latest.has_value(), "checkpoint", "--checkpoint {}: neither a checkpoint nor a directory holding one",
             path);
    path = *latest;
  }
  Config cfg = checkpoint_config(path);
  cfg.parallel = ParallelConfig{};  // generation runs on whatever ranks it is given, replicated
  cfg.comm = ctx.config.comm;
  cfg.training.memory_limit_mb = ctx.config.training.memory_limit_mb;  // this run's cap, not the training run's
  TextCodec codec;
  run_agreed(*ctx.env, "the tokenizer", [&] { codec = text_codec(cfg, a.tokenizer, path); });
  TrainRun run = make_train_run(cfg, *ctx.env, false);
  run_agreed(*ctx.env, "loading the checkpoint", [&] { load_checkpoint(path, *run.model, nullptr); });
  std::vector<int32_t> prompt = codec.encode(a.prompt);
  // A tokenizer's BOS starts the prompt, as the model saw every document start in training.
  if (codec.tokenizer && codec.tokenizer->bos_id() >= 0) prompt.insert(prompt.begin(), codec.tokenizer->bos_id());
  std::vector<int32_t> ids = generate(*run.model, *run.executor, prompt, a.tokens, a.temperature, uint64_t(a.seed),
                                      0, sequence_pad(run), cfg.data.document_separator, codec.eos_id());
  if (ctx.env->rank() == 0) {
    std::string text = codec.decode(ids);
    std::fwrite(a.prompt.data(), 1, a.prompt.size(), stdout);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::printf("\n");
  }
  return 0;
}

Command generate_command() {
  return command_with<GenerateArgs>("generate", "sample a continuation of a prompt from a checkpoint",
      add_generate_options, run_generate_command);
}

}  // namespace mt
