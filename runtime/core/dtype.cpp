#include "runtime/core/dtype.h"

#include "runtime/core/error.h"

namespace mt {

size_t dtype_size(DType d) {
  switch (d) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::bf16:
    case DType::u16:
      return 2;
    case DType::u8:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType d) {
  switch (d) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f64:
      return "f64";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u16:
      return "u16";
    case DType::u8:
      return "u8";
  }
  return "?";
}

DType dtype_from_name(std::string_view name) {
  for (DType d : {DType::f32, DType::bf16, DType::f64, DType::i32, DType::i64, DType::u16, DType::u8})
    if (dtype_name(d) == name) return d;
  if (name == "fp32" || name == "float32") return DType::f32;
  if (name == "bfloat16") return DType::bf16;
  if (name == "fp64" || name == "float64") return DType::f64;
  fail("core", "unknown dtype '{}' (expected f32, bf16, f64, i32, i64, u16 or u8)", name);
}

bool dtype_is_float(DType d) { return d == DType::f32 || d == DType::bf16 || d == DType::f64; }

}  // namespace mt
