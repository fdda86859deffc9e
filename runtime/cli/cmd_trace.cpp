// `meshtrain trace merge DIR`: joins the per-rank traces a run with profile.steps wrote (trace_rank{R}.json) into
// DIR/trace.json, one process per rank. The run does this itself at the end of its traced steps; the
// command is for a run that stopped before, or files copied from several machines. Runs on rank 0 alone.
#include <fmt/format.h>

#include "runtime/cli/command.h"
#include "runtime/train/trace_file.h"

namespace mt {

namespace {
struct TraceArgs {
  std::string action, dir;
};
}  // namespace

Command trace_command() {
  return command_with<TraceArgs>(
      "trace", "merge the per-rank Chrome traces of a run (profile.steps, profile.dir): trace merge DIR; no config",
      [](CLI::App* app, TraceArgs& a) {
        app->add_option("action", a.action, "merge")->required()->check(CLI::IsMember({"merge"}));
        app->add_option("dir", a.dir, "the run's profile.dir, holding trace_rank{R}.json")->required();
      },
      [](RunContext&, const TraceArgs& a) {
        int ranks = 0;
        const std::string out = merge_traces(a.dir, &ranks);
        fmt::print("merged {} rank(s) into {}\n", ranks, out);
        return 0;
      },
      /*needs_config=*/false);
}

}  // namespace mt
