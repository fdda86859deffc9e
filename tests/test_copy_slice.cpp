// copy_slice (runtime/kernels/ops.h), the strided copy along one dim that context parallel uses to cut and join
// sequence chunks: every dim of 2-D to 4-D tensors in several dtypes against an index-by-index reference, and
// its errors.
#include <doctest/doctest.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "attention/sequence_shard.h"
#include "check_error.h"
#include "runtime/kernels/ops.h"
#include "test_util.h"

using namespace mt;

namespace {

// Fills t with `sign * (1 + flat index)` (small integers: exact in every dtype up to 256 for bf16).
void fill_index(const Tensor& t, double sign, int64_t mod = 1 << 20) {
  std::vector<double> v(size_t(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = sign * double(1 + int64_t(i) % mod);
  copy_(t, from_values(v, t.shape(), t.dtype()));
}

// Row-major multi-index of flat index i.
std::vector<int64_t> unravel(int64_t i, const Shape& s) {
  std::vector<int64_t> idx(s.size());
  for (size_t d = s.size(); d-- > 0;) {
    idx[d] = i % s[d];
    i /= s[d];
  }
  return idx;
}
int64_t ravel(const std::vector<int64_t>& idx, const Shape& s) {
  int64_t i = 0;
  for (size_t d = 0; d < s.size(); ++d) i = i * s[d] + idx[d];
  return i;
}

}  // namespace

TEST_CASE("copy_slice: 2-D, 3-D and 4-D tensors along each dim, several dtypes") {
  const std::vector<Shape> bases{{4, 5}, {3, 4, 5}, {2, 3, 4, 5}};
  for (const Shape& base : bases)
    for (int dim = 0; dim < int(base.size()); ++dim)
      for (DType dt : {DType::f64, DType::f32, DType::i64, DType::i32, DType::bf16}) {
        // (n, src_begin, dst_begin): a middle part, the whole src, nothing.
        const int64_t len = base[size_t(dim)];
        for (auto [n, sb, db] : {std::tuple<int64_t, int64_t, int64_t>{len - 1, 1, 2}, {len, 0, 2}, {0, 0, 0}}) {
          CAPTURE(shape_str(base));
          CAPTURE(dim);
          CAPTURE(dtype_name(dt));
          CAPTURE(n);
          CAPTURE(sb);
          CAPTURE(db);
          Shape ds = base;
          ds[size_t(dim)] += 2;
          Tensor src = empty(base, dt), dst = empty(ds, dt);
          fill_index(src, 1, 250);
          fill_index(dst, -1, 250);
          const auto before = to_f64(dst), sv = to_f64(src);
          copy_slice(dst, db, src, sb, n, dim);
          const auto got = to_f64(dst);
          int64_t wrong = 0, copied = 0;
          for (int64_t i = 0; i < dst.numel(); ++i) {
            auto idx = unravel(i, ds);
            double want = before[size_t(i)];
            if (idx[size_t(dim)] >= db && idx[size_t(dim)] < db + n) {
              idx[size_t(dim)] += sb - db;
              want = sv[size_t(ravel(idx, base))];
              ++copied;
            }
            wrong += got[size_t(i)] != want;
          }
          CHECK(wrong == 0);
          CHECK(copied == n * (src.numel() / len));
        }
      }
}

TEST_CASE("copy_slice: errors") {
  Tensor a = empty({3, 4, 5}, DType::f32), b = zeros({3, 6, 5}, DType::f32);
  fill_index(a, 1);
  copy_slice(b, 1, a, 0, 4, 1);  // fine
  const Tensor before = b.clone();
  CHECK_ERROR_CONTAINS(copy_slice(b, 0, zeros({3, 4, 5}, DType::f64), 0, 4, 1), "copy_slice");  // dtypes differ
  CHECK_ERROR_CONTAINS(copy_slice(b, 0, zeros({3, 4}, DType::f32), 0, 4, 1), "copy_slice");     // ranks differ
  CHECK_ERROR_CONTAINS(copy_slice(b, 0, zeros({3, 4, 6}, DType::f32), 0, 4, 1), "copy_slice");  // dim 2 differs
  CHECK_ERROR_CONTAINS(copy_slice(b, 0, zeros({2, 4, 5}, DType::f32), 0, 4, 1), "copy_slice");  // dim 0 differs
  CHECK_ERROR_CONTAINS(copy_slice(b, 0, a, 0, 3, 3), "copy_slice");                             // no dim 3
  CHECK_ERROR_CONTAINS(copy_slice(b, 0, a, 0, 3, -1), "copy_slice");                            // negative dim
  CHECK_ERROR_CONTAINS(copy_slice(b, 3, a, 0, 4, 1), "copy_slice");   // past the end of dst (3 + 4 > 6)
  CHECK_ERROR_CONTAINS(copy_slice(b, 0, a, 1, 4, 1), "copy_slice");   // past the end of src (1 + 4 > 4)
  CHECK_ERROR_CONTAINS(copy_slice(b, -1, a, 0, 2, 1), "copy_slice");  // negative begin
  CHECK_ERROR_CONTAINS(copy_slice(b, 0, a, -1, 2, 1), "copy_slice");
  CHECK_ERROR_CONTAINS(copy_slice(b, 0, a, 0, -1, 1), "copy_slice");  // negative count
  CHECK_ERROR_CONTAINS(copy_slice(b, 0, Tensor(), 0, 1, 1), "copy_slice");
  CHECK(equal(b, before));  // nothing written by a failed call
}
