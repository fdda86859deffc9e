// `meshtrain logits`: the fp32 logits (T, vocab) of one token sequence under a meshtrain checkpoint or a Hugging
// Face directory of a family meshtrain implements, written as .npy by rank 0; on whatever ranks it is given (replicated, like generate) and on
// comm.device. Plain causal attention over the whole sequence at positions 0 ... T-1 (no document masks), as
// transformers' *ForCausalLM computes it: what the interoperability test compares.
#include "runtime/cli/command.h"
#include <string>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "runtime/io/npy.h"
#include "runtime/train/agree.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/generate.h"
#include "runtime/train/lora_export.h"
#include "runtime/train/run.h"

namespace fs = std::filesystem;

namespace mt {

struct LogitsArgs {
  std::string checkpoint, tokens, prompt, tokenizer, out, adapter;
};


void add_logits_options(CLI::App* app, LogitsArgs& a) {
  app->add_option("--checkpoint", a.checkpoint,
                  "checkpoint directory (step_XXXXXXXX), a checkpoint.dir, or a Hugging Face model directory "
                  "(config.json and *.safetensors)")
      ->required();
  auto* tokens = app->add_option("--tokens", a.tokens, "the token ids, comma-separated: 1,2,3");
  auto* prompt = app->add_option("--prompt", a.prompt, "text, encoded by the model's tokenizer (no BOS added)");
  tokens->excludes(prompt);
  app->add_option("--tokenizer", a.tokenizer,
                  "with --prompt: tokenizer.json, tokenizer.model or a directory holding one (default: the "
                  "model directory's or the run's)");
  app->add_option("--out", a.out, "the .npy file written: float32, shape (tokens, vocab_size)")->required();
  app->add_option("--adapter", a.adapter,
                  "a PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) on the Hugging Face "
                  "model --checkpoint names");
}

namespace {

std::vector<int64_t> parse_tokens(const std::string& s) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at <= s.size()) {
    size_t end = s.find(',', at);
    if (end == std::string::npos) end = s.size();
    std::string item = s.substr(at, end - at);
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MT_CHECK(used > 0 && used == item.size() && v >= 0, "logits",
             "--tokens: '{}' (item {}) is not a token id: expected comma-separated integers >= 0", item, out.size());
    out.push_back(v);
    at = end + 1;
  }
  return out;
}

}  // namespace

int run_logits_command(RunContext& ctx, const LogitsArgs& a) {
  std::string path = a.checkpoint;
  bool hf = false;
  Config cfg;
  std::vector<int64_t> tokens;
  // Every rank reads the same files alone: an error every rank has alike is printed once.
  run_agreed(*ctx.env, "the checkpoint and tokens", [&] {
    std::error_code ec;
    MT_CHECK(fs::is_directory(path, ec), "logits", "--checkpoint {}: no such directory", path);
    if (!fs::exists(fs::path(path) / "meta.json")) {
      if (auto latest = latest_checkpoint(path)) {
        path = *latest;
      } else {
        MT_CHECK(fs::exists(fs::path(path) / "config.json"), "logits",
                 "--checkpoint {}: neither a checkpoint (meta.json), a directory holding one, nor a Hugging Face "
                 "model (config.json)",
                 path);
        hf = true;
      }
    }
    MT_CHECK(a.adapter.empty() || hf, "logits",
             "--adapter {}: a LoRA adapter goes on a Hugging Face base directory; {} is a meshtrain checkpoint (a LoRA "
             "run's holds its adapter already)",
             a.adapter, path);
    if (hf) {
      cfg = ctx.config;  // the command line's comm and threads; the model from config.json
      cfg.model = model_config_from_hf((fs::path(path) / "config.json").string());
      if (!a.adapter.empty()) cfg.lora = lora_config_from_adapter(a.adapter);
    } else {
      cfg = checkpoint_config(path);
      cfg.comm = ctx.config.comm;
      cfg.training.threads = ctx.config.training.threads;
      cfg.training.memory_limit_mb = ctx.config.training.memory_limit_mb;  // this run's cap, not the training run's
    }
    MT_CHECK(!a.tokens.empty() || !a.prompt.empty(), "logits", "give --tokens or --prompt");
    if (!a.prompt.empty()) {
      // The model directory's (or checkpoint's) tokenizer unless --tokenizer names one; bytes without any.
      for (int32_t id : text_codec(cfg, a.tokenizer, path).encode(a.prompt))
        tokens.push_back(id);
      MT_CHECK(!tokens.empty(), "logits", "--prompt '{}' encodes to no tokens", a.prompt);
    } else {
      tokens = parse_tokens(a.tokens);
    }
    for (size_t i = 0; i < tokens.size(); ++i)
      MT_CHECK(tokens[i] < cfg.model.vocab_size, "logits", "--tokens: token {} (item {}) is >= vocab_size {} of {}",
               tokens[i], i, cfg.model.vocab_size, path);
    MT_CHECK(int64_t(tokens.size()) <= cfg.model.max_seq_len, "logits",
             "--tokens: {} tokens, more than the model's {} positions ({} of {})", tokens.size(), cfg.model.max_seq_len,
             hf ? "max_position_embeddings" : "model.max_seq_len", path);
    // One sequence of T tokens, replicated on every rank, in fp32.
    cfg.parallel = ParallelConfig{};
    cfg.training.dtype = "fp32";
    cfg.training.seq_len = int64_t(tokens.size());
    cfg.training.batch_size = ctx.env->size();  // dp = every rank
    cfg.training.micro_batch_size = 0;
    cfg.data.document_separator = -1;
    if (!cfg.lora.enabled()) cfg.model.init_from.clear();  // a LoRA checkpoint's base is there
    cfg.lora.dropout = 0;
  });
  TrainRun run = make_train_run(cfg, *ctx.env, false);
  run_agreed(*ctx.env, "loading the weights", [&] {
    if (hf) load_hf_weights(path, *run.model);
    else load_checkpoint_weights(path, cfg, *run.model);
    if (!a.adapter.empty()) load_lora_adapter(a.adapter, *run.model, cfg.lora);
  });
  const int64_t T = int64_t(tokens.size());
  Tensor ids = empty({1, T}, DType::i32);
  for (int64_t t = 0; t < T; ++t) ids.data<int32_t>()[t] = int32_t(tokens[size_t(t)]);
  Tensor pos = empty({T}, DType::i64);
  for (int64_t t = 0; t < T; ++t) pos.at<int64_t>(t) = t;
  run.model->set_positions(pos);
  run.model->set_documents(Tensor());
  Tensor logits = run.model->call(ids.to(run.device)).reshape({T, -1});  // (T, V)
  if (ctx.env->rank() == 0) {
    write_npy(a.out, logits);
    std::printf("logits (%lld, %lld) of %s written to %s\n", (long long)T, (long long)logits.size(1), path.c_str(),
                a.out.c_str());
  }
  return 0;
}

Command logits_command() {
  return command_with<LogitsArgs>("logits", "write the fp32 logits of a token sequence under a checkpoint or a Hugging Face model as .npy",
      add_logits_options, run_logits_command);
}

}  // namespace mt
