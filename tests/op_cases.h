// The op table: every op of runtime/kernels/ops.h and local attention as one list of cases, each run on
// every backend (CPU f64, the reference; CPU f32 and bf16; CUDA f32 and bf16 where a device is visible) by
// tests/test_ops.cpp. A case names its inputs and outputs; inputs are drawn from the case's seed by name (the
// same values on every backend, normal and bf16-exact, so a bf16 kernel reads exactly what the f64 reference
// reads) and outputs start as NaN, so a kernel that skips an element fails.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "runtime/core/tensor.h"

namespace mt::test {

// Which dtype a tensor takes given the backend's activation dtype (the mixed-precision rule of ops.h).
enum class Kind {
  act,  // the activation dtype
  acc,  // statistics and weight gradients: accum_dtype(act), f32 for bf16
  f64,  // always f64 (the vocab-parallel statistics)
};

// The sizes a case is built at: small for finite differences (every input element perturbed), normal for the
// value and gradient modes, perf for --perf.
struct Dims {
  int64_t N, C, OC, F, V, B, T, S, H, KV, hd;
};
enum class Size { small, normal, perf };
Dims dims_for(Size s);

// Host f64 values by name: what the inputs are drawn from.
using Values = std::map<std::string, std::vector<double>>;
// Outputs by name, read back to the host in f64, in the order they were registered.
using Results = std::vector<std::pair<std::string, std::vector<double>>>;

// One run of one case on one backend.
struct OpRun {
  std::string case_name;
  DType act = DType::f64;
  Device dev = Device::cpu();
  Values* values = nullptr;  // shared by every run of the case
  bool zero_acc = false;     // accumulating outputs start at zero (finite differences) instead of random
  bool check = false;        // assert the case's own invariants (value mode only, once per backend)
  bool reuse = false;        // --perf: a repeated call gets the tensors of the first (made once, not timed)
  std::map<std::string, Tensor> cache;
  std::vector<std::pair<std::string, Tensor>> outputs;
  Results scalars;

  DType dtype(Kind k) const;
  // A float input: normal values N(0, scale^2), rounded to bf16, drawn once per case and name.
  Tensor in(const std::string& name, const Shape& s, Kind k = Kind::act, double scale = 1.0);
  // The host f64 values of input `name` (drawn if new), for references.
  const std::vector<double>& values_of(const std::string& name, int64_t n, double scale = 1.0);
  // An integer input (tokens, targets: i32; positions, doc_start: i64) on this run's device, or on the host.
  Tensor ints(const std::vector<int64_t>& v, const Shape& s, DType dt, bool host = false) const;
  // An output the op must overwrite: NaN.
  Tensor out(const std::string& name, const Shape& s, Kind k = Kind::act);
  // An output the op adds to: random (value mode) or zero (finite differences) to start.
  Tensor acc(const std::string& name, const Shape& s, Kind k = Kind::acc);
  // An input the op overwrites (in place): registered as an output too.
  Tensor inout(const std::string& name, const Shape& s, Kind k = Kind::act, double scale = 1.0);
  void scalar(const std::string& name, double v) { scalars.push_back({name, {v}}); }
  Results results() const;  // outputs then scalars
};

// The finite-difference loss sum over seeds of <forward output `out`, R>, R = backward input `dout` (or the
// constant `constant` when dout is empty); grads pair a forward input with the backward output holding its
// gradient.
struct Seed {
  std::string out, dout;
  double constant = 0;
};

struct OpCase {
  std::string name;
  double tol_f32 = 1e-5, tol_bf16 = 1e-2;  // ||got - f64|| / ||f64|| per output
  bool cpu_only = false;                   // host-only ops (rope_tables)
  std::function<void(OpRun&, const Dims&)> forward;
  std::function<void(OpRun&, const Dims&)> backward;  // empty: no gradient mode
  // Naive f64 results of the forward from the input values (checked against the CPU f64 run within 1e-12).
  std::function<Results(OpRun&, const Dims&)> reference;
  std::vector<Seed> seeds;
  std::vector<std::pair<std::string, std::string>> grads;
};

std::vector<OpCase> op_cases();

}  // namespace mt::test
