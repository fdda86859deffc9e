// `meshtrain generate`: text from a checkpoint, on whatever ranks it is given
// (replicated; the same text on every rank, printed by rank 0).
#include "runtime/cli/command.h"
#include <cstdint>
#include <string>
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "runtime/train/agree.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/generate.h"
#include "runtime/train/run.h"

namespace mt {

struct GenerateArgs {
  std::string checkpoint, prompt = "The ", tokenizer;
  int64_t tokens = 128;
  double temperature = 0.8;
  int64_t seed = 0;
  bool chat = false;
  std::string chat_file;
};

namespace {

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// The chat renderer, scripts/chat_template.py (Jinja2, as transformers renders; python3-jinja2): MT_CHAT_TEMPLATE_PY,
// else beside the binary's source tree (build/meshtrain -> scripts/), else an installed share/meshtrain/scripts.
std::string chat_renderer() {
  namespace fs = std::filesystem;
  if (const char* e = std::getenv("MT_CHAT_TEMPLATE_PY")) return e;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec).parent_path();
  for (const fs::path& p : {exe.parent_path() / "scripts" / "chat_template.py", exe / "scripts" / "chat_template.py",
                            exe.parent_path() / "share" / "meshtrain" / "scripts" / "chat_template.py"})
    if (fs::exists(p, ec)) return p.string();
  fail("generate", "--chat: scripts/chat_template.py not found beside {} (set MT_CHAT_TEMPLATE_PY to its path)",
       exe.string());
}

// The conversation rendered by the model's chat template with the generation prompt: the text the model continues.
// conversation: {"messages": [...]} (or a bare list); the template reads tokenizer_dir's tokenizer_config.json.
std::string render_chat(const nlohmann::json& conversation, const std::string& tokenizer_dir) {
  char in_path[] = "/tmp/mt_chat_XXXXXX";
  const int fd = mkstemp(in_path);
  MT_CHECK(fd >= 0, "generate", "--chat: cannot create a temporary file in /tmp");
  close(fd);
  std::ofstream(in_path) << conversation.dump();
  const std::string python = std::filesystem::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  const std::string cmd = python + " " + shell_quote(chat_renderer()) + " --tokenizer " + shell_quote(tokenizer_dir) +
                          " --add-generation-prompt < " + shell_quote(in_path) + " 2>&1";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  MT_CHECK(p != nullptr, "generate", "--chat: cannot run {}", cmd);
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int rc = pclose(p);
  std::filesystem::remove(in_path);
  MT_CHECK(rc == 0, "generate", "--chat: the chat template of {} failed: {}", tokenizer_dir, out);
  return out;
}

}  // namespace


void add_generate_options(CLI::App* app, GenerateArgs& a) {
  app->add_option("--checkpoint", a.checkpoint, "checkpoint directory (step_XXXXXXXX) or a checkpoint.dir")->required();
  app->add_option("--prompt", a.prompt, "text to continue")->capture_default_str();
  app->add_option("--tokenizer", a.tokenizer,
                  "tokenizer.json, tokenizer.model or a directory holding one (default: the run's data.tokenizer, "
                  "else model.init_from's, else the checkpoint's; bytes when there is none)");
  app->add_option("--tokens", a.tokens, "tokens to generate")->capture_default_str();
  app->add_option("--temperature", a.temperature, "sampling temperature (0 = greedy)")->capture_default_str();
  app->add_option("--seed", a.seed, "sampling seed")->capture_default_str();
  app->add_flag("--chat", a.chat,
                "--prompt is a user's message, rendered with the tokenizer directory's chat template "
                "(tokenizer_config.json) and its generation prompt; prints the assistant's reply");
  app->add_option("--chat-file", a.chat_file,
                  "a conversation to continue (JSON: {\"messages\": [{\"role\", \"content\"}, ...]}), as --chat");
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
  run_agreed(*ctx.env, "loading the checkpoint", [&] { load_checkpoint_weights(path, cfg, *run.model); });
  const bool chat = a.chat || !a.chat_file.empty();
  std::vector<int32_t> prompt;
  if (chat) {
    // Every rank renders the same text itself (no broadcast needed); a failure is printed once.
    run_agreed(*ctx.env, "the chat template", [&] {
      MT_CHECK(codec.tokenizer, "generate", "--chat needs the model's tokenizer directory (--tokenizer DIR with "
               "tokenizer_config.json holding chat_template); the run has none");
      namespace fs = std::filesystem;
      const std::string dir = fs::is_directory(codec.file) ? codec.file : fs::path(codec.file).parent_path().string();
      nlohmann::json conversation;
      if (!a.chat_file.empty()) {
        std::ifstream f(a.chat_file);
        MT_CHECK(f.good(), "generate", "--chat-file {}: cannot read", a.chat_file);
        try {
          conversation = nlohmann::json::parse(f);
        } catch (const std::exception& e) {
          fail("generate", "--chat-file {}: not JSON ({})", a.chat_file, e.what());
        }
      } else {
        conversation = {{"messages", nlohmann::json::array({{{"role", "user"}, {"content", a.prompt}}})}};
      }
      // The template writes the BOS itself: none is added.
      prompt = codec.encode(render_chat(conversation, dir));
    });
  } else {
    prompt = codec.encode(a.prompt);
    // A tokenizer's BOS starts the prompt, as the model saw every document start in training.
    if (codec.tokenizer && codec.tokenizer->bos_id() >= 0) prompt.insert(prompt.begin(), codec.tokenizer->bos_id());
  }
  std::vector<int32_t> ids = generate(*run.model, *run.executor, prompt, a.tokens, a.temperature, uint64_t(a.seed),
                                      0, sequence_pad(run), cfg.data.document_separator, codec.eos_id());
  if (ctx.env->rank() == 0) {
    if (chat && !ids.empty() && ids.back() == codec.eos_id()) ids.pop_back();  // the reply, without its end of turn
    std::string text = codec.decode(ids);
    if (!chat) std::fwrite(a.prompt.data(), 1, a.prompt.size(), stdout);
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
