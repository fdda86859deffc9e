#include "parallel/copy_block.h"

#include <cstring>
#include <functional>

namespace mt {

void copy_block(const Tensor& dst, const Shape& dst_start, const Tensor& src, const Shape& src_start,
                const Shape& block) {
  MT_CHECK(dst.dtype() == src.dtype() && dst.device().is_cpu() && src.device().is_cpu(), "redistribute",
           "copy_block needs host tensors of one dtype");
  size_t nd = block.size(), es = dtype_size(src.dtype());
  if (shape_numel(block) == 0) return;
  if (nd == 0) {
    std::memcpy(dst.data_ptr(), src.data_ptr(), es);
    return;
  }
  // Row-major strides in elements.
  auto strides = [](const Shape& s) {
    Shape st(s.size(), 1);
    for (size_t i = s.size() - 1; i-- > 0;) st[i] = st[i + 1] * s[i + 1];
    return st;
  };
  Shape ds = strides(dst.shape()), ss = strides(src.shape());
  auto* d0 = static_cast<char*>(dst.data_ptr());
  auto* s0 = static_cast<const char*>(src.data_ptr());
  size_t row = size_t(block[nd - 1]) * es;
  std::function<void(size_t, int64_t, int64_t)> rec = [&](size_t i, int64_t doff, int64_t soff) {
    if (i == nd - 1) {
      std::memcpy(d0 + (doff + dst_start[i]) * int64_t(es), s0 + (soff + src_start[i]) * int64_t(es), row);
      return;
    }
    for (int64_t j = 0; j < block[i]; ++j)
      rec(i + 1, doff + (dst_start[i] + j) * ds[i], soff + (src_start[i] + j) * ss[i]);
  };
  rec(0, 0, 0);
}

}  // namespace mt
