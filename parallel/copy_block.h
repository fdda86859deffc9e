// A block copy between two host tensors: what redistribution uses to cut a rank's shard out of a whole
// tensor, and tests to build expected shards.
#pragma once
#include "runtime/core/tensor.h"

namespace mt {

// Copies a block of block_shape elements between two row-major tensors of the
// same dtype (host memory), from src at src_start to dst at dst_start.
void copy_block(const Tensor& dst, const Shape& dst_start, const Tensor& src, const Shape& src_start,
                const Shape& block_shape);

}  // namespace mt
