#include "parallel/random.h"

#include "runtime/core/philox.h"

namespace mt {

Tensor make_local(const DTensorSpec& spec, const std::vector<int>& coord, const std::string& kind, DType dtype,
                  const RandomKey& key, double value, double mean, double std) {
  bool partial = false;
  for (auto& p : spec.placements) partial |= p.is_partial();
  MT_CHECK(!partial || kind == "zeros" || kind == "empty", "random",
           "{} with placements {}: only zeros and empty can be made partial (a partial sum of random values is not "
           "the random tensor)",
           kind, spec.str());
  Shape ls = spec.local_shape(coord), off = spec.local_offset(coord);
  Tensor t = mt::empty(ls, dtype);
  if (kind == "empty") return t;
  MT_CHECK(kind == "zeros" || kind == "ones" || kind == "full" || kind == "rand" || kind == "randn", "random",
           "unknown factory '{}'", kind);
  uint64_t stream = philox::stream_id(key.stream.c_str());
  size_t nd = ls.size();
  // Global row-major strides: the key of each element is its global index.
  Shape gstride(nd, 1);
  for (size_t i = nd; i-- > 1;) gstride[i - 1] = gstride[i] * spec.global_shape[i];
  // Each element's value depends on its global index only, so the elements are filled in parallel (a 1B-parameter
  // model's weights, gradients and optimizer state are billions of elements) with the same bits as in order.
  enum Kind { k_zeros, k_ones, k_full, k_rand, k_randn };
  const Kind k = kind == "zeros"  ? k_zeros
                 : kind == "ones" ? k_ones
                 : kind == "full" ? k_full
                 : kind == "rand" ? k_rand
                                  : k_randn;
  const int64_t n = t.numel();
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    T* p = t.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      double v = k == k_zeros ? 0.0 : k == k_ones ? 1.0 : value;
      if (k == k_rand || k == k_randn) {
        int64_t g = 0, rest = i;  // the global index of local element i (row-major, last dim fastest)
        for (size_t d = nd; d-- > 0;) {
          g += (rest % ls[d] + off[d]) * gstride[d];
          rest /= ls[d];
        }
        v = k == k_rand ? double(philox::uniform(key.seed, stream, uint64_t(g)))
                        : double(float(mean + std * double(philox::normal(key.seed, stream, uint64_t(g)))));
      }
      if constexpr (std::is_same_v<T, bf16>) p[i] = bf16(float(v));
      else p[i] = T(v);
    }
  });
  return t;
}

namespace {
DTensor make(const DeviceMesh& mesh, const Shape& shape, const Placements& p, const std::string& kind, DType dtype,
             const RandomKey& key = {}, double value = 0, double mean = 0, double std = 1) {
  DTensorSpec spec = DTensorSpec::make(mesh.dims(), p, shape);
  Tensor local = make_local(spec, mesh.coordinate(), kind, dtype, key, value, mean, std);
  return DTensor{local.to(mesh.device()), spec, mesh};
}
}  // namespace

DTensor zeros(const DeviceMesh& mesh, const Shape& shape, const Placements& p, DType dtype) {
  return make(mesh, shape, p, "zeros", dtype);
}
DTensor ones(const DeviceMesh& mesh, const Shape& shape, const Placements& p, DType dtype) {
  return make(mesh, shape, p, "ones", dtype);
}
DTensor full(const DeviceMesh& mesh, const Shape& shape, const Placements& p, double value, DType dtype) {
  return make(mesh, shape, p, "full", dtype, {}, value);
}
DTensor empty(const DeviceMesh& mesh, const Shape& shape, const Placements& p, DType dtype) {
  return make(mesh, shape, p, "empty", dtype);
}
DTensor rand(const DeviceMesh& mesh, const Shape& shape, const Placements& p, const RandomKey& key, DType dtype) {
  return make(mesh, shape, p, "rand", dtype, key);
}
DTensor randn(const DeviceMesh& mesh, const Shape& shape, const Placements& p, const RandomKey& key, DType dtype,
              double mean, double std) {
  return make(mesh, shape, p, "randn", dtype, key, 0, mean, std);
}

}  // namespace mt
