// CUDA kernels not in the op table (tests/op_cases.cpp, whose CUDA mode checks every op of the training step
// against the CPU f64 run): the packing ops of redistribution and the device-resident sums, against the CPU
// backend, with no host synchronisation. Skips itself when no device is visible.
#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "attention/local_attention.h"
#include "gpu_test.h"
#include "runtime/core/stream.h"
#include "runtime/kernels/ops.h"

using namespace mt;

TEST_CASE(
    "gpu kernels: pack_blocks and unpack_blocks vs CPU (uneven, empty, unaligned views, any dtype), no host sync") {
  MT_REQUIRE_GPU();
  const Device d = gpu();
  struct Case {
    Shape shape;
    int dim;
    std::vector<int64_t> lens;
  };
  // Odd row widths and offsets exercise every copy unit (16 down to 1 byte); 70 blocks take two launches.
  std::vector<Case> cases = {{{6, 5}, 0, {2, 2, 2}},       {{3, 7, 4}, 1, {3, 3, 1}},
                             {{3, 7, 4}, 1, {4, 3, 0, 0}}, {{2, 3, 5}, 2, {2, 0, 3}},
                             {{5, 2, 3, 2}, 2, {1, 1, 1}}, {{33, 17, 3}, 1, {9, 8}},
                             {{4, 130, 8}, 1, {}},         {{64, 96, 128}, 1, {24, 24, 24, 24}}};
  for (int j = 0; j < 70; ++j) cases[6].lens.push_back(j < 60 ? 2 : 1);
  if (emulated_quick()) cases.pop_back();  // the 786,432-element case: on the emulated device with MT_TEST_FULL=1
  uint64_t seed = 100;
  for (const Case& c : cases)
    for (DType holder : {DType::u16, DType::i32, DType::i64}) {  // 2-, 4- and 8-byte elements (bf16, f32, i64)
      for (int64_t offset : {0, 1, 3}) {                         // views at element offsets: unaligned base addresses
        CAPTURE(shape_str(c.shape));
        CAPTURE(c.dim);
        CAPTURE(dtype_name(holder));
        CAPTURE(offset);
        const int64_t n = shape_numel(c.shape);
        std::mt19937_64 g(++seed);  // random bits: the copies do not look at values
        Tensor host = empty({n + offset}, holder);
        for (size_t i = 0; i < host.nbytes(); ++i) static_cast<unsigned char*>(host.data_ptr())[i] = uint8_t(g());
        Tensor src = host.view(offset, c.shape);
        Tensor want = empty({n}, holder);
        pack_blocks(want, src, c.dim, c.lens);
        Tensor src_d = host.to(d).view(offset, c.shape);
        Tensor packed_d = empty({n + offset}, holder, d).view(offset, {n});
        fill_zero_(packed_d);
        const int64_t syncs = host_sync_count();
        pack_blocks(packed_d, src_d, c.dim, c.lens);
        Tensor back_d = empty({n + offset}, holder, d).view(offset, c.shape);
        fill_zero_(back_d);
        unpack_blocks(back_d, packed_d, c.dim, c.lens);
        CHECK(host_sync_count() == syncs);  // stream-ordered, nothing waited for
        CHECK(equal(packed_d.to(Device::cpu()), want));
        CHECK(equal(back_d.to(Device::cpu()), src));
      }
    }
}

TEST_CASE("gpu kernels: sum_into and sum_squares_into on the device have the bits of sum and sum_squares") {
  MT_REQUIRE_GPU();
  const Device d = gpu();
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    Tensor a = rnd({4099, 33}, 1), b = rnd({7}, 2);
    Tensor ad = dt == DType::bf16 ? bf(a) : a.to(d), bd = dt == DType::bf16 ? bf(b) : b.to(d);
    Tensor out = zeros({3}, DType::f64, d);
    const int64_t syncs = host_sync_count();
    sum_into(out, 0, ad);
    sum_into(out, 0, bd);
    sum_squares_into(out, {2, 1, 2}, {ad, bd, bd});
    CHECK(host_sync_count() == syncs);  // nothing read back
    double s = 0, s1 = 0, s2 = 0;
    s += sum(ad);
    s += sum(bd);
    s2 += sum_squares(ad);
    s1 += sum_squares(bd);
    s2 += sum_squares(bd);
    std::vector<double> got = to_f64(out);
    CHECK(got[0] == s);
    CHECK(got[1] == s1);
    CHECK(got[2] == s2);
  }
}

TEST_CASE("gpu kernels: copy_slice of slices whose row pitch is 2 GiB or more (over cudaMemcpy2D's limit)") {
  MT_REQUIRE_GPU();
  if (emulated_quick()) MT_SKIP("emulated device: 6 GiB of host memory and about 40 s (runs with MT_TEST_FULL=1)");
  const Device d = gpu();
  // (2, M) u16 rows of 2 GiB + 10 bytes: the slices below have pitches cudaMemcpy2DAsync refuses (max 2^31 - 1).
  const int64_t M = (int64_t(1) << 30) + 5;
  Tensor src, row, tail;
  try {
    src = zeros({2, M}, DType::u16, d);
    row = zeros({1, M}, DType::u16, d);
    tail = zeros({2, 4}, DType::u16, d);
  } catch (const Error& e) {
    if (std::string(e.what()).find("out of memory") != std::string::npos) MT_SKIP("6 GiB of device memory needed");
    throw;
  }
  auto put = [&](int64_t at, std::vector<uint16_t> v) {  // v into src's flat elements at `at`
    Tensor h = empty({int64_t(v.size())}, DType::u16);
    for (size_t i = 0; i < v.size(); ++i) h.at<uint16_t>(int64_t(i)) = v[i];
    copy_(src.reshape({-1}).view(at, {int64_t(v.size())}), h);
  };
  auto get = [](const Tensor& t, int64_t at, int64_t n) {
    Tensor h = t.reshape({-1}).view(at, {n}).to(Device::cpu());
    std::vector<uint16_t> r;
    for (int64_t i = 0; i < n; ++i) r.push_back(h.at<uint16_t>(i));
    return r;
  };
  put(0, {9, 9});                 // row 0 must not be copied
  put(M, {1, 2, 3});              // the first elements of row 1
  put(2 * M - 3, {4, 5, 6});      // its last ones
  put(M - 4, {10, 11, 12, 13});   // the last 4 columns of row 0
  put(2 * M - 4, {14, 4, 5, 6});  // and of row 1 (overwrites the 3 above with the same values)
  // Along dim 0, one row: a source pitch of 4 GiB.
  copy_slice(row, 0, src, 1, 1, 0);
  CHECK(get(row, 0, 3) == std::vector<uint16_t>{1, 2, 3});
  CHECK(get(row, M - 4, 4) == std::vector<uint16_t>{14, 4, 5, 6});
  // Along dim 1, two rows: a source pitch of 2 GiB + 10 bytes.
  copy_slice(tail, 0, src, M - 4, 4, 1);
  CHECK(get(tail, 0, 8) == std::vector<uint16_t>{10, 11, 12, 13, 14, 4, 5, 6});
}
