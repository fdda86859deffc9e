// The job's goodput accounting (runtime/supervise/goodput.h) on synthetic metrics records in the trainer's schema: a
// launch that fails after a committed checkpoint, a relaunch that redoes the lost steps, evaluations, stalls; and
// the output scanner's word that the launcher aborts the job (runtime/supervise/evidence.h).
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "runtime/supervise/evidence.h"
#include "runtime/supervise/goodput.h"

using namespace mt;
using nlohmann::json;

namespace {
json step(int64_t n, double ms, double t) { return {{"step", n}, {"loss", 1.0}, {"step_ms", ms}, {"time", t}}; }
}  // namespace

TEST_CASE("goodput: a failure after a committed checkpoint, the lost steps redone once") {
  GoodputAccount g;
  // Launch 1 at t=100: start record at 110 (10 s of launch and set-up), steps 1..6 of 1 s, a sync checkpoint of
  // step 4 (stall 0.5 s), an evaluation at step 5 (0.25 s), then the rank dies at 120 (step 6 recorded at 117).
  g.begin_attempt(100, 0);
  g.add_record({{"event", "start"}, {"time", 110}, {"start_step", 0}, {"setup_s", 8}, {"load_s", 0},
                {"resumed_from", nullptr}, {"world", 4}},
               110);
  for (int s = 1; s <= 4; ++s) g.add_record(step(s, 1000, 110 + s), 0);
  g.add_record({{"event", "checkpoint"}, {"step", 4}, {"mode", "sync"}, {"stall_s", 0.5}, {"snapshot_bytes", 10}}, 0);
  g.add_record({{"event", "checkpoint_committed"}, {"step", 4}, {"write_s", 0.5}, {"time", 114.5}}, 0);
  g.add_record(step(5, 1000, 115.5), 0);
  g.add_record({{"step", 5}, {"val_loss", 2.0}, {"eval_s", 0.25}}, 0);
  g.add_record(step(6, 1000, 117), 0);
  g.add_record({{"event", "failure"}, {"time", 500}}, 0);  // the supervisor's own records are not the launch's
  CHECK(g.current().last_step == 6);
  CHECK(g.last_committed() == 4);
  g.end_attempt(120, true);
  CHECK(g.steps_lost() == 2);
  // Launch 2 after a 2 s back-off, at 122: starts at 127 from step 4, redoes 5 and 6, goes on to 8, ends at 131.
  g.begin_attempt(122, 2);
  g.add_record({{"event", "start"}, {"time", 127}, {"start_step", 4}, {"setup_s", 4}, {"load_s", 1},
                {"resumed_from", "ckpt/step_00000004"}, {"world", 4}},
               127);
  for (int s = 5; s <= 8; ++s) g.add_record(step(s, 500, 127 + 0.5 * (s - 4)), 0);
  g.add_record({{"event", "goodput"}, {"scope", "run"}, {"wall_s", 9}}, 0);
  g.end_attempt(131, false);

  GoodputParts p = g.parts(31);  // 100 .. 131
  CHECK(p.steps == 8);
  CHECK(p.redone_steps == 2);
  CHECK(p.attempts == 2);
  CHECK(p.failures == 1);
  // The last record of each step: 1..4 at 1 s, 5..8 at 0.5 s.
  CHECK(p.productive_s == doctest::Approx(6.0));
  CHECK(p.checkpoint_s == doctest::Approx(0.5));
  CHECK(p.eval_s == doctest::Approx(0.25));
  // Steps 5 and 6 of launch 1 (2 s), and launch 1's 3 s after its last record (117 .. 120).
  CHECK(p.lost_s == doctest::Approx(5.0));
  // Launch 1's 10 s before its first step, the 2 s back-off, launch 2's 5 s.
  CHECK(p.restart_s == doctest::Approx(17.0));
  CHECK(p.other_s == doctest::Approx(31 - 6 - 0.5 - 0.25 - 5 - 17));
  CHECK(p.goodput == doctest::Approx(6.0 / 31));
  json r = goodput_record(p);
  CHECK(r["event"] == "goodput");
  CHECK(r["scope"] == "job");
  CHECK(r["lost_s"].get<double>() == doctest::Approx(5.0));
  const std::string line = goodput_line(p);
  CHECK(line.find("productive 6.0 s (19.4%)") != std::string::npos);
  CHECK(line.find("lost 5.0 s") != std::string::npos);
}

TEST_CASE("goodput: records without the start event or times, checkpoints seen only in the output") {
  GoodputAccount g;
  g.begin_attempt(50, 0);
  // No "start" record and no "time": the first step began when its record was read minus its step_ms.
  g.add_record({{"step", 1}, {"loss", 1.0}, {"step_ms", 2000}}, 60);
  g.add_record({{"step", 2}, {"loss", 1.0}, {"step_ms", 2000}}, 62);
  g.add_output_checkpoint(2, 0.75);
  g.add_record({{"step", 3}, {"loss", 1.0}, {"step_ms", 2000}}, 64.5);
  g.end_attempt(70, true);
  CHECK(g.last_committed() == 2);
  CHECK(g.steps_lost() == 1);
  GoodputParts p = g.parts(20);
  CHECK(p.restart_s == doctest::Approx(8.0));  // 50 .. 58
  CHECK(p.checkpoint_s == doctest::Approx(0.75));
  CHECK(p.lost_s == doctest::Approx(5.5));  // 64.5 .. 70: the last step is redone by no one (yet)
  CHECK(p.productive_s == doctest::Approx(6.0));
}

TEST_CASE("goodput: a launch that never reached a step is all restart time") {
  GoodputAccount g;
  g.begin_attempt(10, 0);
  g.end_attempt(25, true);
  g.begin_attempt(30, 5);
  g.add_record(step(1, 1000, 36), 36);
  g.end_attempt(37, false);
  GoodputParts p = g.parts(27);
  CHECK(p.restart_s == doctest::Approx(15 + 5 + 5));
  CHECK(p.lost_s == doctest::Approx(0));
  CHECK(p.productive_s == doctest::Approx(1));
}

TEST_CASE("FileTail: whole lines only, from where it stopped; a shrunk file from its start") {
  const std::string path = (std::filesystem::temp_directory_path() / fmt::format("tail_{}.jsonl", ::getpid())).string();
  std::ofstream(path) << "old\n";
  FileTail t(path, /*from_end=*/true);
  CHECK(t.read_lines().empty());
  std::ofstream(path, std::ios::app) << "a\nb";
  auto l = t.read_lines();
  REQUIRE(l.size() == 1);
  CHECK(l[0] == "a");
  std::ofstream(path, std::ios::app) << "c\n";
  l = t.read_lines();
  REQUIRE(l.size() == 1);
  CHECK(l[0] == "bc");
  std::ofstream(path) << "x\n";  // replaced, shorter
  l = t.read_lines();
  REQUIRE(l.size() == 1);
  CHECK(l[0] == "x");
  std::filesystem::remove(path);
}

// Open MPI's lines after a rank is killed, in the order mpirun prints them: the first says at once that it aborts the
// job (the supervisor ends the ranks then, launch.cpp); the rank and the signal come later and still win.
TEST_CASE("OutputScanner: Open MPI aborting the job after a failed rank, and an MPI_Abort that does not say so") {
  GoodputAccount g;
  supervisor::OutputScanner scan(g);
  scan.line("step 12/100 | loss 4.1");
  CHECK_FALSE(scan.launcher_aborting);
  scan.line("Primary job  terminated normally, but 1 process returned");
  CHECK_FALSE(scan.launcher_aborting);
  scan.line("a non-zero exit code. Per user-direction, the job has been aborted.");
  CHECK(scan.launcher_aborting);
  scan.line("mpirun noticed that process rank 2 with PID 0 on node vm exited on signal 9 (Killed).");
  CHECK(scan.ev.rank == 2);
  CHECK(scan.ev.signal == 9);

  supervisor::OutputScanner abort_scan(g);
  abort_scan.line("MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD with errorcode 124.");
  CHECK_FALSE(abort_scan.launcher_aborting);  // mpirun ends its ranks itself then; the late rank's line may follow
  CHECK(abort_scan.ev.rank == 0);
}
