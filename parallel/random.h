// Factories for distributed tensors. Random ones are parallelism-invariant:
// element values depend only on (seed, stream name, global element index),
// so a tensor made sharded equals, bit for bit, the same tensor made whole and
// then sharded, on any mesh: initialisation does not depend on the layout.
#pragma once
#include <string>

#include "parallel/dtensor.h"

namespace mt {

struct RandomKey {
  uint64_t seed = 0;
  std::string stream;  // e.g. the parameter's name
};

// The local part at `coord` of a tensor laid out by spec (no communication).
// kind: "zeros", "ones", "full", "empty", "rand", "randn". Partial placements
// are allowed for zeros and empty only.
Tensor make_local(const DTensorSpec& spec, const std::vector<int>& coord, const std::string& kind, DType dtype,
                  const RandomKey& key = {}, double value = 0, double mean = 0, double std = 1);

DTensor zeros(const DeviceMesh& mesh, const Shape& shape, const Placements& p, DType dtype = DType::f32);
DTensor ones(const DeviceMesh& mesh, const Shape& shape, const Placements& p, DType dtype = DType::f32);
DTensor full(const DeviceMesh& mesh, const Shape& shape, const Placements& p, double value, DType dtype = DType::f32);
DTensor empty(const DeviceMesh& mesh, const Shape& shape, const Placements& p, DType dtype = DType::f32);
// Uniform in [0, 1).
DTensor rand(const DeviceMesh& mesh, const Shape& shape, const Placements& p, const RandomKey& key,
             DType dtype = DType::f32);
// Normal(mean, std): the float draw scaled as mean + std * z, then converted to dtype.
DTensor randn(const DeviceMesh& mesh, const Shape& shape, const Placements& p, const RandomKey& key,
              DType dtype = DType::f32, double mean = 0, double std = 1);

}  // namespace mt
