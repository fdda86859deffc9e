// Runs the op table (tests/op_cases.cpp) on every backend:
//   value mode     forward outputs of CPU f32/bf16 and CUDA f32/bf16 against the CPU f64 run, which is itself
//                  checked against each case's naive f64 reference;
//   gradient mode  backward outputs against the CPU f64 backward, which is itself checked against central
//                  differences of the f64 forward at a small size.
// Error: ||got - f64|| / ||f64|| per output (a NaN left in an output fails). CUDA cases are skipped (counted as
// skipped by doctest) when no device is visible.
//   test_ops [doctest options]   the checks
//   test_ops --perf              the time of each case's forward and backward on each backend, at a large size
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "op_cases.h"
#include "runtime/core/stream.h"
#include "runtime/kernels/ops.h"
#include "skip.h"
#include "test_util.h"

using namespace mt;
using namespace mt::test;

namespace {

struct Backend {
  const char* name;
  DType act;
  bool cuda;
};
const Backend kBackends[] = {{"cpu f32", DType::f32, false},
                             {"cpu bf16", DType::bf16, false},
                             {"cuda f32", DType::f32, true},
                             {"cuda bf16", DType::bf16, true}};

bool have_gpu() { return cuda_device_count() > 0; }

enum class Mode { forward, backward };

// MT_OP_CASES=a,b: the value and gradient modes run only the op cases whose name contains one of the words (a
// developer's quick run of the cases they touch; the suite's counts are of what ran).
bool selected(const OpCase& c) {
  const char* env = std::getenv("MT_OP_CASES");
  if (!env || !*env) return true;
  std::string list = env;
  for (size_t b = 0; b <= list.size();) {
    const size_t e = std::min(list.find(',', b), list.size());
    if (e > b && c.name.find(list.substr(b, e - b)) != std::string::npos) return true;
    b = e + 1;
  }
  return false;
}

OpRun make_run(const OpCase& c, Values& vals, DType act, Device dev) {
  OpRun r;
  r.case_name = c.name;
  r.act = act;
  r.dev = dev;
  r.values = &vals;
  return r;
}

Results run(const OpCase& c, Values& vals, const Dims& d, DType act, Device dev, Mode m, bool zero_acc = false,
            bool check = false) {
  OpRun r = make_run(c, vals, act, dev);
  r.zero_acc = zero_acc;
  r.check = check;
  (m == Mode::forward ? c.forward : c.backward)(r, d);
  return r.results();
}

const std::vector<double>* find(const Results& rs, const std::string& name) {
  for (const auto& [n, v] : rs)
    if (n == name) return &v;
  return nullptr;
}

// Every output of want is in got (by name) within tol. (got may hold more: the bf16 copy AdamW writes only with
// bf16 activations, checked by the case itself.)
// Returns whether every output was within tol.
bool compare(const Results& got, const Results& want, double tol, const std::string& what) {
  bool ok = got.size() >= want.size();
  CHECK(got.size() >= want.size());
  for (const auto& [name, w] : want) {
    INFO(what, ": output '", name, "'");
    const std::vector<double>* g = find(got, name);
    REQUIRE(g != nullptr);
    const double e = rel_err(*g, w);
    INFO("relative error ", e, " (tolerance ", tol, ")");
    CHECK(e <= tol);
    ok = ok && e <= tol;
  }
  return ok;
}

// The suite's summary counts one test per (op case, backend, mode), not one per mode: outcomes by the
// doctest case that ran them ("ops value: cpu f32"), and how many op cases a mode has on a backend.
std::map<std::string, std::vector<bool>>& op_outcomes() {
  static std::map<std::string, std::vector<bool>> m;
  return m;
}
int cases_in_mode(const Backend& b, bool gradient) {
  int n = 0;
  for (const OpCase& c : op_cases()) n += !(c.cpu_only && b.cuda) && (!gradient || c.backward);
  return n;
}

void value_mode(const Backend& b) {
  const Dims d = dims_for(Size::normal);
  const Device dev = b.cuda ? Device::cuda(0) : Device::cpu();
  for (const OpCase& c : op_cases()) {
    if ((c.cpu_only && b.cuda) || !selected(c)) continue;
    Values vals;
    Results want = run(c, vals, d, DType::f64, Device::cpu(), Mode::forward);
    Results got = run(c, vals, d, b.act, dev, Mode::forward, false, /*check=*/true);
    op_outcomes()[std::string("ops value: ") + b.name].push_back(
        compare(got, want, b.act == DType::bf16 ? c.tol_bf16 : c.tol_f32, c.name + " forward on " + b.name));
  }
}

void gradient_mode(const Backend& b) {
  const Dims d = dims_for(Size::normal);
  const Device dev = b.cuda ? Device::cuda(0) : Device::cpu();
  for (const OpCase& c : op_cases()) {
    if (!c.backward || (c.cpu_only && b.cuda) || !selected(c)) continue;
    Values vals;
    Results want = run(c, vals, d, DType::f64, Device::cpu(), Mode::backward);
    Results got = run(c, vals, d, b.act, dev, Mode::backward, false, /*check=*/true);
    op_outcomes()[std::string("ops gradient: ") + b.name].push_back(
        compare(got, want, b.act == DType::bf16 ? c.tol_bf16 : c.tol_f32, c.name + " backward on " + b.name));
  }
}

}  // namespace

TEST_CASE("ops: every case's CPU f64 forward against its naive f64 reference") {
  const Dims d = dims_for(Size::normal);
  int checked = 0;
  for (const OpCase& c : op_cases()) {
    if (!c.reference) continue;  // local attention: its naive reference is in tests/test_attention.cpp
    ++checked;
    Values vals;
    OpRun r = make_run(c, vals, DType::f64, Device::cpu());
    r.check = true;
    c.forward(r, d);
    Results got = r.results();
    OpRun rr = make_run(c, vals, DType::f64, Device::cpu());
    compare(got, c.reference(rr, d), 1e-12, c.name + " f64 forward vs naive reference");
  }
  CHECK(checked >= 15);
}

TEST_CASE("ops: every case's CPU f64 backward against central differences of its f64 forward") {
  const Dims d = dims_for(Size::small);
  int checked = 0;
  for (const OpCase& c : op_cases()) {
    if (!c.backward) continue;
    REQUIRE(!c.grads.empty());
    Values vals;
    run(c, vals, d, DType::f64, Device::cpu(), Mode::forward, true);  // draws every forward input
    Results grad = run(c, vals, d, DType::f64, Device::cpu(), Mode::backward, /*zero_acc=*/true);
    // L = sum over seeds of <forward output, R>.
    auto loss = [&] {
      Results f = run(c, vals, d, DType::f64, Device::cpu(), Mode::forward, true);
      double l = 0;
      for (const Seed& s : c.seeds) {
        const std::vector<double>* y = find(f, s.out);
        REQUIRE(y != nullptr);
        if (s.dout.empty()) {
          for (double v : *y) l += s.constant * v;
        } else {
          REQUIRE(vals.count(s.dout));
          l += dot(*y, vals.at(s.dout));
        }
      }
      return l;
    };
    for (const auto& [input, gname] : c.grads) {
      INFO(c.name, ": d loss / d ", input, " against ", gname);
      REQUIRE(vals.count(input));
      const std::vector<double>* g = find(grad, gname);
      REQUIRE(g != nullptr);
      // Perturb the stored values of the input: each forward run reads them afresh.
      std::vector<double>& x = vals.at(input);
      Tensor view = from_blob(x.data(), {int64_t(x.size())}, DType::f64);
      std::vector<double> numeric = finite_differences(view, loss);
      const double e = max_rel_err(*g, numeric);
      INFO("worst element error ", e);
      CHECK(e <= 1e-6);
      ++checked;
    }
  }
  CHECK(checked >= 10);
}

TEST_CASE("ops value: cpu f32") { value_mode(kBackends[0]); }
TEST_CASE("ops value: cpu bf16") { value_mode(kBackends[1]); }
TEST_CASE("ops value: cuda f32" * doctest::skip(!have_gpu())) { value_mode(kBackends[2]); }
TEST_CASE("ops value: cuda bf16" * doctest::skip(!have_gpu())) { value_mode(kBackends[3]); }
TEST_CASE("ops gradient: cpu f32") { gradient_mode(kBackends[0]); }
TEST_CASE("ops gradient: cpu bf16") { gradient_mode(kBackends[1]); }
TEST_CASE("ops gradient: cuda f32" * doctest::skip(!have_gpu())) { gradient_mode(kBackends[2]); }
TEST_CASE("ops gradient: cuda bf16" * doctest::skip(!have_gpu())) { gradient_mode(kBackends[3]); }

namespace {

// The median time of a call after one warm-up call (3 to 20 calls, about half a second), in milliseconds.
double time_ms(const std::function<void()>& f, bool cuda) {
  f();
  if (cuda) device_synchronize();
  std::vector<double> t;
  double total = 0;
  for (int i = 0; i < 20 && (i < 3 || total < 0.5); ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    if (cuda) device_synchronize();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    total += t.back();
  }
  std::sort(t.begin(), t.end());
  return 1e3 * t[t.size() / 2];
}

int perf() {
  const Dims d = dims_for(Size::perf);
  std::printf("%-28s %-10s %12s %12s\n", "case", "backend", "forward ms", "backward ms");
  for (const OpCase& c : op_cases())
    for (const Backend& b : kBackends) {
      if (b.cuda && (!have_gpu() || c.cpu_only)) continue;
      Values vals;
      const Device dev = b.cuda ? Device::cuda(0) : Device::cpu();
      // The first call makes the inputs and outputs, the timed ones reuse them (the vocab-parallel case's host
      // combining of statistics, standing for its all-reduces, is timed with it).
      OpRun f = make_run(c, vals, b.act, dev), g = make_run(c, vals, b.act, dev);
      f.reuse = g.reuse = true;
      double fwd = time_ms([&] { c.forward(f, d); }, b.cuda);
      double bwd = c.backward ? time_ms([&] { c.backward(g, d); }, b.cuda) : 0;
      std::printf("%-28s %-10s %12.3f %12s\n", c.name.c_str(), b.name, fwd,
                  c.backward ? std::to_string(bwd).c_str() : "-");
      std::fflush(stdout);
    }
  if (!have_gpu()) std::printf("(no CUDA device visible: CUDA backends not timed)\n");
  return 0;
}

}  // namespace

REGISTER_LISTENER("suite_counts", 1, mt_test::SuiteCounts);

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--perf") == 0) return perf();
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  int rc = ctx.run();
  if (ctx.shouldExit()) return rc;
  int passed = 0, failed = 0, skipped = 0;  // the summary line of the suites (tests/unit_main.cpp)
  const auto& names = mt_test::case_names();
  const auto& results = mt_test::case_results();
  for (size_t i = 0; i < results.size(); ++i) {
    const int r = results[i];
    // A mode's doctest case counts as its op cases: each passed or failed, or all skipped.
    const Backend* mode_backend = nullptr;
    bool gradient = false;
    for (const Backend& b : kBackends)
      for (bool g : {false, true})
        if (i < names.size() && names[i] == std::string(g ? "ops gradient: " : "ops value: ") + b.name) {
          mode_backend = &b;
          gradient = g;
        }
    if (mode_backend && r == mt_test::case_skip) {
      skipped += cases_in_mode(*mode_backend, gradient);
    } else if (mode_backend && r != mt_test::case_skip && op_outcomes().count(names[i])) {
      const auto& outcomes = op_outcomes().at(names[i]);
      const int ok = int(std::count(outcomes.begin(), outcomes.end(), true));
      passed += ok;
      failed += int(outcomes.size()) - ok;
      // A failure outside compare (an exception, a REQUIRE) fails the mode even if its cases compared well.
      if (r == mt_test::case_failed && ok == int(outcomes.size())) ++failed;
    } else if (r == mt_test::case_failed) {
      ++failed;
    } else if (r == mt_test::case_skip) {
      ++skipped;
    } else {
      ++passed;
    }
  }
  const char* name = std::getenv("MT_SUITE_NAME");
  std::printf("[%s] %d passed, %d failed, %d skipped\n", name ? name : "ops", passed, failed, skipped);
  return rc;
}
