// Pipeline schedules (parallel/pipeline_schedule.h): on a table of (p, v, m), every schedule's action lists pass
// their check (each forward and backward once, sends matched, inputs first, no deadlock), the simulated bubble
// equals the textbook formula (gpipe, 1f1b, interleaved_1f1b) or beats 1F1B's near its own (zb1p), and the
// activations held per rank are gpipe's m against 1F1B's p - r; broken lists are caught by name.
#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <tuple>

#include "check_error.h"
#include "parallel/pipeline_schedule.h"

using namespace mt;

TEST_CASE("pipeline schedules: built and checked on a table of (p, v, m); bubble and memory as the formulas say") {
  for (int p : {1, 2, 3, 4, 8})
    for (int m : {1, 2, 4, 8, 16}) {
      CAPTURE(p);
      CAPTURE(m);
      PpSchedule g = build_pp_schedule("gpipe", p, 1, m), f = build_pp_schedule("1f1b", p, 1, m),
                 z = build_pp_schedule("zb1p", p, 1, m);
      PpSimulation gs = simulate_pp_schedule(g), fs = simulate_pp_schedule(f);
      PpSimulation zs = simulate_pp_schedule(z, PpCosts{1, 2, 1, 1, 0});
      // F = 1, B = 2 (= Bi + W): gpipe and 1F1B idle (p-1)(F+B) of m(F+B) on every rank.
      CHECK(gs.bubble() == doctest::Approx(pp_bubble_formula("gpipe", p, 1, m)));
      CHECK(fs.bubble() == doctest::Approx(pp_bubble_formula("1f1b", p, 1, m)));
      CHECK(zs.bubble() <= fs.bubble() + 1e-12);
      for (int r = 0; r < p; ++r) {
        CHECK(gs.peak_activations[size_t(r)] == m);
        CHECK(fs.peak_activations[size_t(r)] == std::min(p - r, m));
        CHECK(zs.peak_activations[size_t(r)] <= p);  // 1F1B's peak (rank 0's)
      }
      if (m >= 2 * p && p > 1) {
        // Zero bubble H1 with F = Bi = W: about (p-1)/(3m), a third of 1F1B's.
        PpSimulation z1 = simulate_pp_schedule(z, PpCosts{1, 2, 1, 1, 0});
        CHECK(z1.bubble() < 0.5 * fs.bubble());
        CHECK(z1.bubble() <= 1.5 * pp_bubble_formula("zb1p", p, 1, m) + 1e-12);
      }
      for (int v : {2, 3}) {
        if (m % p != 0) continue;
        CAPTURE(v);
        PpSchedule iv = build_pp_schedule("interleaved_1f1b", p, v, m);
        // Each chunk is 1/v of a rank's layers: F = 1/v, B = 2/v.
        PpSimulation is = simulate_pp_schedule(iv, PpCosts{1.0 / v, 2.0 / v, 0, 0, 0});
        if (p > 1) CHECK(is.bubble() == doctest::Approx(pp_bubble_formula("interleaved_1f1b", p, v, m)));
        CHECK(iv.stages() == p * v);
      }
    }
}

TEST_CASE("pipeline schedules: 1F1B's order at p = 4, m = 8 (the warm-up, the steady pairs, the drain)") {
  PpSchedule s = build_pp_schedule("1f1b", 4, 1, 8);
  const std::string t = pp_schedule_str(s);
  CHECK(t.find("rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7\n") != std::string::npos);
  CHECK(t.find("rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7\n") != std::string::npos);
  // A transfer latency shows as idle time, never as a deadlock.
  PpSimulation slow = simulate_pp_schedule(s, PpCosts{1, 2, 1, 1, 0.5});
  CHECK(slow.bubble() > simulate_pp_schedule(s).bubble());
}

TEST_CASE("pipeline schedules: bad input names the keys; broken lists are caught") {
  CHECK_ERROR_CONTAINS(build_pp_schedule("pipedream", 2, 1, 4), "parallel.pp_schedule = 'pipedream'");
  CHECK_ERROR_CONTAINS(build_pp_schedule("1f1b", 2, 2, 4), "parallel.pp_virtual = 2 needs parallel.pp_schedule = interleaved_1f1b");
  CHECK_ERROR_CONTAINS(build_pp_schedule("interleaved_1f1b", 4, 2, 6), "must be a multiple of parallel.pp = 4");
  CHECK_ERROR_CONTAINS(build_pp_schedule("interleaved_1f1b", 2, 1, 4), "needs parallel.pp_virtual >= 2");

  PpSchedule s = build_pp_schedule("1f1b", 2, 1, 2);
  // A receive dropped: the forward runs before its activation arrives.
  PpSchedule no_recv = s;
  auto& r1 = no_recv.ranks[1];
  r1.erase(std::find_if(r1.begin(), r1.end(), [](const PpAction& a) { return a.op == PpOp::recv_act; }));
  CHECK_ERROR_CONTAINS(check_pp_schedule(no_recv), "runs before its activation arrives");
  // A backward dropped: it never runs.
  PpSchedule no_b = s;
  auto& r0 = no_b.ranks[0];
  r0.erase(std::find_if(r0.begin(), r0.end(), [](const PpAction& a) { return a.op == PpOp::backward; }));
  CHECK_ERROR_CONTAINS(check_pp_schedule(no_b), "never runs");
  // Rank 0 waits for a gradient before sending the activation rank 1 needs first: a deadlock, named.
  PpSchedule dead;
  dead.kind = "gpipe", dead.p = 2, dead.v = 1, dead.m = 1;
  dead.ranks = {{{PpOp::forward, 0, 0}, {PpOp::recv_grad, 0, 0, 1}, {PpOp::send_act, 0, 0, 1}, {PpOp::backward, 0, 0}},
                {{PpOp::recv_act, 1, 0, 0}, {PpOp::forward, 1, 0}, {PpOp::backward, 1, 0}, {PpOp::send_grad, 1, 0, 0}}};
  CHECK_ERROR_CONTAINS(check_pp_schedule(dead), "deadlocks; rank 0 waits at recv_grad(stage 0, micro 0, peer rank 1)");
}

TEST_CASE("pipeline stage assignment: even layers, the embedding and lm_head counted, explicit splits checked") {
  CHECK(pp_layer_split(8, 2, 0, 0) == std::vector<int>{4, 4});
  CHECK(pp_layer_split(8, 4, 0, 0) == std::vector<int>{2, 2, 2, 2});
  CHECK(pp_layer_split(7, 2, 0, 0) == std::vector<int>{3, 4});  // the odd layer to the later stage on a tie
  // lm_head worth 2 layers: the last stage takes 2 fewer.
  CHECK(pp_layer_split(8, 2, 0, 2) == std::vector<int>{5, 3});
  CHECK(pp_layer_split(16, 4, 1, 3) == std::vector<int>{4, 5, 5, 2});
  // Every split sums to the layers and minimises the largest stage's cost.
  for (int L : {4, 9, 16, 32})
    for (int S : {1, 2, 3, 4}) {
      std::vector<int> sp = pp_layer_split(L, S, 0.5, 1.5);
      int sum = 0;
      double worst = 0;
      for (int s = 0; s < S; ++s) {
        sum += sp[size_t(s)];
        worst = std::max(worst, sp[size_t(s)] + (s == 0 ? 0.5 : 0) + (s == S - 1 ? 1.5 : 0));
        CHECK(sp[size_t(s)] >= 1);
      }
      CHECK(sum == L);
      CHECK(worst <= (L + 2.0) / S + 1.5 + 1e-9);
    }
  CHECK(pp_layer_split(8, 2, 0, 0, {3, 5}) == std::vector<int>{3, 5});
  CHECK_ERROR_CONTAINS(pp_layer_split(2, 4, 0, 0), "4 stages but model.n_layers = 2");
  CHECK_ERROR_CONTAINS(pp_layer_split(8, 2, 0, 0, {3, 4}), "parallel.pp_layers sums to 7 but model.n_layers = 8");
  CHECK_ERROR_CONTAINS(pp_layer_split(8, 2, 0, 0, {8}), "parallel.pp_layers lists 1 stages but parallel.pp x parallel.pp_virtual = 2");
  CHECK_ERROR_CONTAINS(pp_layer_split(8, 2, 0, 0, {8, 0}), "parallel.pp_layers[1] = 0");
}

TEST_CASE("pipeline schedules: pp_step_bytes counts the sends each rank's action list makes") {
  for (const std::string kind : {"gpipe", "1f1b", "interleaved_1f1b", "zb1p"})
    for (int p : {2, 4})
      for (int m : {4, 8}) {
        const int v = kind == "interleaved_1f1b" ? 2 : 1;
        const PpSchedule s = build_pp_schedule(kind, p, v, m);
        for (int r = 0; r < p; ++r) {
          CAPTURE(kind);
          CAPTURE(p);
          CAPTURE(m);
          CAPTURE(r);
          const int64_t sends =
              std::count_if(s.ranks[size_t(r)].begin(), s.ranks[size_t(r)].end(),
                            [](const PpAction& a) { return a.op == PpOp::send_act || a.op == PpOp::send_grad; });
          CHECK(pp_step_sends(s, r) == sends);
          const std::vector<CommBytes> b = pp_step_bytes(s, r, 100.0, "pp");
          REQUIRE(b.size() == 2);
          CHECK(b[0].kind == "send");
          CHECK(b[0].bytes == 100.0 * double(sends));
          CHECK(b[1].kind == "recv");
          CHECK(b[1].calls == sends);
        }
      }
}

TEST_CASE("pipeline schedules under NCCL's batches: which lists would hang (pp_batches_deadlock)") {
  // 1F1B, GPipe and zb1p pair their batches on every (p, m) here, training and evaluation alike.
  for (const char* kind : {"gpipe", "1f1b", "zb1p"})
    for (int p : {2, 3, 4, 8})
      for (int m : {p, 2 * p, 2 * p + 1}) {
        CAPTURE(kind);
        CAPTURE(p);
        CAPTURE(m);
        const PpSchedule s = build_pp_schedule(kind, p, 1, m);
        CHECK(pp_batches_deadlock(s, false).empty());
        CHECK(pp_batches_deadlock(s, true).empty());
      }
  // Interleaved 1F1B's lists (seen hanging on the NCCL stand-in, 2026-11-29): rank 0 sends a gradient alone while
  // rank 1 waits for a gradient rank 0 receives only in its next batch. MPI's non-blocking transfers run them.
  const PpSchedule s = build_pp_schedule("interleaved_1f1b", 2, 2, 4);
  CHECK(simulate_pp_schedule(s).makespan > 0);
  const std::string why = pp_batches_deadlock(s, false);
  CHECK(why.find("rank 0 waits in the batch [send_grad(stage 2, micro 0, peer rank 1)]") != std::string::npos);
  CHECK(why.find("rank 1 waits in the batch") != std::string::npos);
  // Their lockstep re-placement passes on a table of (p, v, m), training and evaluation, with each rank's computes in
  // the schedule's order and the same messages, and runs under MPI's rule too.
  for (auto [p, v, m] : {std::tuple{2, 2, 4}, {2, 2, 8}, {3, 2, 6}, {4, 2, 8}, {2, 3, 4}, {4, 4, 8}, {8, 2, 16}}) {
    CAPTURE(p);
    CAPTURE(v);
    CAPTURE(m);
    const PpSchedule il = build_pp_schedule("interleaved_1f1b", p, v, m);
    for (bool forward_only : {false, true}) {
      const PpSchedule ls = pp_lockstep_lists(il, forward_only);
      CHECK(pp_batches_deadlock(ls, forward_only).empty());
      if (!forward_only) CHECK_NOTHROW(check_pp_schedule(ls));
      for (int r = 0; r < p; ++r) {
        auto computes = [&](const std::vector<PpAction>& l) {
          std::vector<std::tuple<int, int, int>> c;
          for (const PpAction& a : l)
            if (a.op == PpOp::forward || (!forward_only && a.op == PpOp::backward))
              c.emplace_back(int(a.op), a.stage, a.micro);
          return c;
        };
        auto transfers = [&](const std::vector<PpAction>& l) {
          std::multiset<std::tuple<int, int, int, int>> t;
          for (const PpAction& a : l)
            if ((a.op == PpOp::send_act || a.op == PpOp::recv_act) ||
                (!forward_only && (a.op == PpOp::send_grad || a.op == PpOp::recv_grad)))
              t.emplace(int(a.op), a.stage, a.micro, a.peer);
          return t;
        };
        CHECK(computes(ls.ranks[size_t(r)]) == computes(il.ranks[size_t(r)]));
        CHECK(transfers(ls.ranks[size_t(r)]) == transfers(il.ranks[size_t(r)]));
      }
    }
  }
  // A list whose messages reach a peer in another order than it receives them: NCCL would pair them wrongly.
  PpSchedule swapped = build_pp_schedule("gpipe", 2, 1, 2);
  std::vector<PpAction>& r1 = swapped.ranks[1];
  auto first = std::find_if(r1.begin(), r1.end(), [](const PpAction& a) { return a.op == PpOp::recv_act; });
  auto second = std::find_if(first + 1, r1.end(), [](const PpAction& a) { return a.op == PpOp::recv_act; });
  std::swap(first->micro, second->micro);
  CHECK(pp_batches_deadlock(swapped, true).find("in another order") != std::string::npos);
}
