// `meshtrain trace merge DIR`: joins the per-rank traces a run with profile.steps wrote (trace_rank{R}.json) into
// DIR/trace.json, one process per rank, once the files are known to come from one run (their run id) and to hold
// every rank of it. The run does this itself at the end of its traced steps; the
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
        const MergedTraces m = merge_traces(a.dir);
        fmt::print("merged {} rank(s) of run {} into {}{}\n", m.ranks, m.run_id, m.path,
                   m.dropped ? fmt::format(" ({} events past profile.max_events were dropped)", m.dropped) : "");
        return 0;
      },
      /*needs_config=*/false);
}

}  // namespace mt
