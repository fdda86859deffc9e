// NumPy .npy (format 1.0) writer, so any tool can read a tensor meshtrain dumped.
#pragma once
#include <string>

#include "runtime/core/tensor.h"

namespace mt {

// Writes t (any device; copied to host) as a C-order array. Throws "[npy] ..." naming the path.
void write_npy(const std::string& path, const Tensor& t);
// Reads what write_npy wrote (C order, the dtypes meshtrain has).
Tensor read_npy(const std::string& path);

}  // namespace mt
