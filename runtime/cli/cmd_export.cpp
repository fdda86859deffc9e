// `meshtrain export`: a LoRA checkpoint's adapter as PEFT writes it, or (--merge) folded into its base as a Hugging
// Face model directory that meshtrain and transformers load as is. Files only: no MPI, no config.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "runtime/cli/command.h"
#include "runtime/train/lora_export.h"

namespace mt {

struct ExportArgs {
  std::string checkpoint, base, out;
  bool merge = false;
};

namespace {

void add_export_options(CLI::App* app, ExportArgs& a) {
  app->add_option("--checkpoint", a.checkpoint,
                  "a LoRA run's checkpoint (step_XXXXXXXX) or any PEFT adapter directory (adapter_config.json, "
                  "adapter_model.safetensors)")
      ->required();
  app->add_flag("--merge", a.merge, "fold W + scale B A into the base and write a whole Hugging Face model");
  app->add_option("--base", a.base,
                  "with --merge: the base's Hugging Face directory (default: the adapter's base_model_name_or_path, "
                  "the run's model.init_from)");
  app->add_option("--out", a.out, "the directory written (replaced if it exists)")->required();
}

int run_export(RunContext&, const ExportArgs& a) {
  MT_CHECK(a.merge || a.base.empty(), "export", "--base is for --merge (the adapter alone needs no base)");
  if (a.merge) {
    const ExportReport r = export_merged(a.checkpoint, a.base, a.out);
    std::printf("merged %lld adapted weights of %lld tensors of %s with %s into %s\n", (long long)r.merged,
                (long long)r.tensors, r.base.c_str(), a.checkpoint.c_str(), a.out.c_str());
  } else {
    const ExportReport r = export_adapter(a.checkpoint, a.out);
    std::printf("adapter (%lld tensors) of %s written to %s\n", (long long)r.tensors, a.checkpoint.c_str(),
                a.out.c_str());
  }
  return 0;
}

}  // namespace

Command export_command() {
  return command_with<ExportArgs>("export",
                                  "a LoRA checkpoint's adapter (PEFT's files), or with --merge the base with the "
                                  "adapter folded in (a Hugging Face directory)",
                                  add_export_options, run_export, /*needs_config=*/false, /*needs_mpi=*/false);
}

}  // namespace mt
