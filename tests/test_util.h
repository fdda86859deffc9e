// What the test files share: random inputs (normal or uniform, never all zero), outputs poisoned with NaN,
// the two error measures (whole-output relative error and worst element), and central finite differences.
// Everything is inline; the vector helpers need no library, the Tensor ones need meshtrain's core.
#pragma once
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "runtime/core/tensor.h"

namespace mt::test {

// n normal values N(0, scale^2) from seed; bf16_exact rounds each to bf16 so that a bf16 kernel and its f32 or
// f64 reference read the same numbers.
inline std::vector<double> randn_values(size_t n, uint64_t seed, double scale = 1.0, bool bf16_exact = false) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> d(0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = bf16_exact ? double(float(bf16(float(d(g))))) : d(g);
  return v;
}

// ||got - want|| / ||want|| over the whole output (||got - want|| when want is zero). A NaN in got fails
// (infinite error); infinities (the -inf log-sum-exp of a row that sees no key) must match exactly.
inline double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    if (std::isinf(got[i]) || std::isinf(want[i])) {
      if (got[i] != want[i]) return INFINITY;
      continue;
    }
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// The worst element: max |got - want| / max(1, |want|); a NaN fails.
inline double max_rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double e = std::abs(got[i] - want[i]) / std::max(1.0, std::abs(want[i]));
    if (!(e <= worst)) worst = std::isnan(e) ? INFINITY : e;
  }
  return worst;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) s += a[i] * b[i];
  return s;
}

// Normal values in dtype dt on the host (see randn_values).
inline Tensor randn(const Shape& s, uint64_t seed, DType dt = DType::f64, double scale = 1.0, bool bf16_exact = false) {
  return from_values(randn_values(size_t(shape_numel(s)), seed, scale, bf16_exact), s, dt);
}

// Uniform values in [lo, hi) in dtype dt on the host.
inline Tensor randu(const Shape& s, uint64_t seed, DType dt = DType::f64, double lo = -1, double hi = 1) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(size_t(shape_numel(s)));
  for (double& x : v) x = u(g);
  return from_values(v, s, dt);
}

// An output the kernel must overwrite: every element NaN.
inline Tensor poisoned(const Shape& s, DType dt, Device d = Device::cpu()) {
  Tensor t = from_values(std::vector<double>(size_t(shape_numel(s)), std::nan("")), s, dt);
  return d.is_cuda() ? t.to(d) : t;
}

// Integer tensors (tokens and targets i32, positions i64) from a list.
inline Tensor ints(const std::vector<int64_t>& v, DType dt = DType::i32) {
  return from_values(std::vector<double>(v.begin(), v.end()), {int64_t(v.size())}, dt);
}

inline double rel_err(const Tensor& got, const Tensor& want) { return rel_err(to_f64(got), to_f64(want)); }
// {||got - want||^2, ||want||^2} over the whole output (as many elements each), for a tolerance that has both a
// relative and an absolute part.
inline std::pair<double, double> squared_diff_and_norm(const Tensor& got, const Tensor& want) {
  double num = 0, den = 0;
  auto a = to_f64(got), b = to_f64(want);
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return {num, den};
}
inline double rel_err(const Tensor& got, const std::vector<double>& want) { return rel_err(to_f64(got), want); }
inline double dot(const Tensor& a, const Tensor& b) { return dot(to_f64(a), to_f64(b)); }

// d loss / d x[i] for one element of the f64 host tensor x by central differences (x is restored).
inline double finite_difference_at(const Tensor& x, int64_t i, const std::function<double()>& loss, double eps = 1e-6) {
  double* p = x.data<double>();
  const double keep = p[i];
  p[i] = keep + eps;
  const double lp = loss();
  p[i] = keep - eps;
  const double lm = loss();
  p[i] = keep;
  return (lp - lm) / (2 * eps);
}

// The same for every element of x.
inline std::vector<double> finite_differences(const Tensor& x, const std::function<double()>& loss, double eps = 1e-6) {
  std::vector<double> g(size_t(x.numel()));
  for (int64_t i = 0; i < x.numel(); ++i) g[size_t(i)] = finite_difference_at(x, i, loss, eps);
  return g;
}

// A fresh directory under the system's temporary one for the test's files, removed at the end:
// mt_test_<what>_<pid>_<n>, n counting the process's TempDirs so that two alive at once never share one.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& what) {
    static int count = 0;
    path = std::filesystem::temp_directory_path() /
           ("mt_test_" + what + "_" + std::to_string(::getpid()) + "_" + std::to_string(count++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& n) const { return (path / n).string(); }
};

}  // namespace mt::test
