// safetensors files (Hugging Face's format): an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}},
// then the raw bytes. Read and written whole; f32, bf16, f16 and f64, i32, i64 tensors.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "runtime/core/tensor.h"

namespace mt {

struct NamedTensor {
  std::string name;
  Tensor tensor;  // host tensor
};

// Writes tensors in the given order (offsets ascending), metadata as "__metadata__".
// Written to path + ".tmp" then renamed, so a crash leaves no half file under path.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;  // f16 is converted to f32 on read
  std::map<std::string, std::string> metadata;
};
// Errors name the file and what is wrong: "[checkpoint] m.safetensors: header length 999999 exceeds file size 100".
SafetensorsFile read_safetensors(const std::string& path);

}  // namespace mt
