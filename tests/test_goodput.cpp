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
  CHECK(p.disk_save_s == doctest::Approx(0.5));
  CHECK(p.memory_save_s == 0);
  CHECK(p.eval_s == doctest::Approx(0.25));
  // Steps 5 and 6 of launch 1 (2 s), and of launch 1's 3 s after its last record (117 .. 120) the step in flight
  // (one typical step: the supervisor never said when it saw the failure, so at the exit at the latest).
  CHECK(p.lost_s == doctest::Approx(3.0));
  CHECK(p.detection_s == doctest::Approx(2.0));  // 118 .. 120
  // Launch 1's 10 s before its first step, the 2 s back-off, launch 2's 5 s: no setup records, so not timed.
  CHECK(p.restart_s == doctest::Approx(17.0));
  auto phase = [&](const std::string& name) {
    for (const auto& [n, s] : p.restart_parts)
      if (n == name) return s;
    return -1.0;
  };
  CHECK(phase("backoff") == doctest::Approx(2.0));
  CHECK(phase("not_timed") == doctest::Approx(15.0));
  CHECK(p.other_s == doctest::Approx(31 - 6 - 0.5 - 0.25 - 3 - 17 - 2));
  CHECK(p.goodput == doctest::Approx(6.0 / 31));
  json r = goodput_record(p);
  CHECK(r["event"] == "goodput");
  CHECK(r["scope"] == "job");
  CHECK(r["lost_s"].get<double>() == doctest::Approx(3.0));
  const std::string line = goodput_line(p);
  CHECK(line.find("productive 6.0 s (19.4%)") != std::string::npos);
  CHECK(line.find("lost 3.0 s") != std::string::npos);
  CHECK(line.find("detection 2.0 s") != std::string::npos);
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
  CHECK(p.disk_save_s == doctest::Approx(0.75));
  // 64.5 .. 70 after the last record (the last step is redone by no one yet): one typical step (2 s) in flight,
  // then detection.
  CHECK(p.lost_s == doctest::Approx(2.0));
  CHECK(p.detection_s == doctest::Approx(3.5));
  CHECK(p.productive_s == doctest::Approx(6.0));
}

TEST_CASE("goodput: side records and events without their own time, written or read late, do not shorten the detection") {
  GoodputAccount g;
  g.begin_attempt(0, 0);
  g.add_record({{"event", "start"}, {"time", 1.0}, {"start_step", 0}}, 1);
  g.add_record(step(1, 1000, 2), 2);
  g.add_record(step(2, 1000, 3), 3);
  g.failure_seen(3.5);
  // A loaded machine reads a checkpoint event (no "time") only at the exit: it is not dated 9.99.
  g.add_record({{"event", "checkpoint"}, {"step", 2}, {"mode", "sync"}, {"stall_s", 0.1}}, 9.99);
  // The step's "ranks" record, written once the stopped rank was woken by the launcher's abort: dated 9.98.
  g.add_record({{"event", "ranks"}, {"step", 2}, {"slowest_rank", 1}, {"time", 9.98}}, 9.99);
  g.add_record({{"step", 2}, {"pp_step_s", {1.0}}, {"time", 9.98}}, 9.99);
  // A step finished by a rank woken at the abort, after the failure was seen: lost, and no progress.
  g.add_record(step(3, 6000, 9.97), 9.99);
  g.end_attempt(10, true);
  const AttemptRecords::Tail tail = g.attempts().at(0).failure_tail();
  CHECK(tail.in_flight_s == doctest::Approx(0.5));  // 3 .. 3.5 (seen)
  CHECK(tail.detection_s == doctest::Approx(6.5));  // 3.5 .. 10
  CHECK(g.parts(10).disk_save_s == doctest::Approx(0.1));
  CHECK(g.parts(10).productive_s == doctest::Approx(2.0));  // steps 1 and 2
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

// Issue 54 part 5: every cause, the restart split by the ranks' set-up record, in-memory saves apart from disk ones,
// the failure seen by the supervisor ending the lost step in flight, and all of it adding up to the wall time.
TEST_CASE("goodput by cause: memory and disk saves, the restart's phases, detection; they add up to the wall") {
  GoodputAccount g;
  // Launch 1 at t=100; its ranks' processes start at 101 (1 s of launcher); set-up parts from there: exec 0.5,
  // mpi 1, config 0.25, mesh 0.25, model 1, load 0.5, peak 0.5, report 0 (to 105), then the first step (3 s,
  // against 1 s typical) recorded at 108 with the setup record.
  g.begin_attempt(100, 0);
  g.add_record({{"event", "start"}, {"time", 105}, {"start_step", 0}, {"setup_s", 4}}, 105);
  g.add_record(step(1, 3000, 108), 0);
  json parts = json::array();
  for (auto [n, sec] : std::vector<std::pair<const char*, double>>{{"exec", 0.5}, {"mpi", 1}, {"config", 0.25},
                                                                    {"mesh", 0.25}, {"model", 1}, {"load", 0.5},
                                                                    {"peak", 0.5}, {"report", 0},
                                                                    {"first_step", 3}})
    parts.push_back({{"part", n}, {"s", sec}});
  g.add_record({{"event", "setup"}, {"time", 108}, {"start_step", 0}, {"total_s", 7}, {"parts", parts}}, 108);
  for (int s = 2; s <= 4; ++s) g.add_record(step(s, 1000, 107 + s), 0);  // 109, 110, 111
  g.add_record({{"event", "checkpoint"}, {"step", 4}, {"mode", "memory"}, {"stall_s", 0.25}}, 0);
  CHECK(g.current().last_memory == 4);
  g.add_record({{"event", "checkpoint"}, {"step", 4}, {"mode", "async"}, {"stall_s", 0.5}}, 0);
  g.add_record({{"event", "checkpoint_committed"}, {"step", 4}, {"time", 111.75}}, 0);
  g.add_record(step(5, 1000, 112.75), 0);
  // A rank dies at 113.25; the supervisor sees it at 113.5; the launch is gone at 114.
  g.failure_seen(113.5);
  g.failure_seen(113.9);  // the first sight counts
  g.end_attempt(114, true);
  // Launch 2 after a 1 s back-off, at 115, without a setup record (an older binary): starts at 117, steps 5..6.
  g.begin_attempt(115, 1);
  g.add_record({{"event", "start"}, {"time", 117}, {"start_step", 4}}, 117);
  g.add_record(step(5, 1000, 118), 0);
  g.add_record(step(6, 1000, 119), 0);
  g.end_attempt(119.5, false);

  const GoodputParts p = g.parts(19.5);  // 100 .. 119.5
  auto phase = [&](const std::string& name) {
    for (const auto& [n, s] : p.restart_parts)
      if (n == name) return s;
    return -1.0;
  };
  CHECK(phase("launcher") == doctest::Approx(1.0));
  CHECK(phase("mpi") == doctest::Approx(1.5));   // exec and MPI start-up
  CHECK(phase("mesh") == doctest::Approx(0.5));  // config and mesh
  CHECK(phase("model") == doctest::Approx(1.0));
  CHECK(phase("load") == doctest::Approx(0.5));
  CHECK(phase("peak") == doctest::Approx(0.5));
  CHECK(phase("first_step") == doctest::Approx(2.0));  // 3 s against a typical 1 s
  CHECK(phase("backoff") == doctest::Approx(1.0));
  CHECK(phase("not_timed") == doctest::Approx(2.0));  // launch 2: 115 .. 117
  double phases = 0;
  for (const auto& [n, s] : p.restart_parts) phases += s;
  CHECK(p.restart_s == doctest::Approx(phases));
  CHECK(p.restart_s == doctest::Approx(5 + 2 + 1 + 2));
  // Steps 1..4 and 5, 6 of launch 2, less the first step's warm-up.
  CHECK(p.productive_s == doctest::Approx(3 + 3 + 2 - 2));
  CHECK(p.memory_save_s == doctest::Approx(0.25));
  CHECK(p.disk_save_s == doctest::Approx(0.5));
  // Step 5 of launch 1 (redone), then from its record (112.75) to the failure seen (113.5), then detection.
  CHECK(p.lost_s == doctest::Approx(1 + 0.75));
  CHECK(p.detection_s == doctest::Approx(0.5));
  // The failed launch's own split (its failure record): the step in flight 0.75 s, then 0.5 s to the exit.
  const AttemptRecords::Tail tail = g.attempts().at(0).failure_tail();
  CHECK(tail.in_flight_s == doctest::Approx(0.75));
  CHECK(tail.detection_s == doctest::Approx(0.5));
  const double sum = p.productive_s + p.memory_save_s + p.disk_save_s + p.eval_s + p.lost_s + p.restart_s +
                     p.detection_s + p.other_s;
  CHECK(sum == doctest::Approx(19.5));
  const json r = goodput_record(p);
  for (const char* k : {"productive_s", "memory_save_s", "disk_save_s", "eval_s", "lost_s", "restart_s",
                        "detection_s", "other_s"})
    CHECK(r.contains(k));
  CHECK(r["restart_parts"].size() == p.restart_parts.size());
  CHECK(restart_line(p).find("MPI start-up 1.5 s") != std::string::npos);
}

TEST_CASE("goodput: the steps a failure loses count from the newest of the disk's and the memory's checkpoints") {
  GoodputAccount g;
  g.begin_attempt(100, 0);
  g.add_record({{"event", "start"}, {"time", 101}, {"start_step", 0}}, 101);
  for (int s = 1; s <= 7; ++s) g.add_record(step(s, 100, 101 + 0.1 * s), 0);
  g.add_record({{"event", "checkpoint_committed"}, {"step", 4}, {"time", 101.5}}, 0);
  CHECK(g.steps_lost() == 3);  // the disk's step 4 alone
  g.add_record({{"event", "checkpoint"}, {"step", 6}, {"mode", "memory"}, {"stall_s", 0.01}}, 0);
  CHECK(g.current().last_memory == 6);
  CHECK(g.steps_lost() == 1);  // the relaunch resumes the memory's step 6
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
