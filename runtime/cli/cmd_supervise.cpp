// `meshtrain supervise [options] -- LAUNCH...`: the supervisor's command line. The supervisor itself, which runs
// the launch and relaunches it from its newest checkpoint when a rank dies or hangs, is runtime/supervise
// (supervisor.h). It is not one of the job's ranks: it starts no MPI (Command::needs_mpi), like torchrun's agent.
#include "runtime/cli/command.h"
#include "runtime/supervise/supervisor.h"

namespace mt {

namespace {
void add_supervise_options(CLI::App* app, SuperviseOptions& a) {
  // Every count (an integer) and duration (seconds): anything else, or a negative value, is a usage error.
  auto count = [app](const char* name, int& value, const char* help) {
    app->add_option(name, value, help)->check(whole_number(0));
  };
  auto seconds = [app](const char* name, double& value, const char* help) {
    app->add_option(name, value, help)->check(number_at_least(0));
  };
  count("--max-restarts", a.max_restarts, "relaunches after failures before giving up (default 3)");
  seconds("--backoff", a.backoff_s,
          "seconds to wait before the first relaunch, doubled per consecutive failure without progress (default 5)");
  seconds("--backoff-max", a.backoff_max_s, "the longest wait between launches in seconds (default 60)");
  seconds("--hang-timeout", a.hang_timeout_s,
          "kill the launch when the metrics file gets no new step for this many seconds after its first "
          "(0: off, default; the ranks' own watchdog, comm.timeout_s, ends stuck collectives)");
  app->add_option("--metrics", a.metrics,
                  "the run's metrics file (log.metrics_file), for the failure lines and the goodput (default: the "
                  "launch's --set log.metrics_file=...); its folder must exist and be writable");
  count("--exclude-after", a.exclude_after,
        "srun launches: leave out (srun --exclude) a node that failed this many times (0: never, default)");
  app->add_option("launch", a.launch, "the launch command, after --: mpirun -np 4 meshtrain ... train")->required();
}
}  // namespace

Command supervise_command() {
  return command_with<SuperviseOptions>(
      "supervise",
      "run a launch (after --: mpirun ... meshtrain ... train) and relaunch it from its newest checkpoint when a rank "
      "dies or hangs; goodput at the end; no config, no MPI",
      add_supervise_options, [](RunContext&, const SuperviseOptions& a) { return supervise(a); },
      /*needs_config=*/false, /*needs_mpi=*/false);
}

}  // namespace mt
