#include "runtime/io/npy.h"

#include <cerrno>
#include <cstring>
#include <fstream>

namespace mt {

namespace {
// bf16 has no NumPy type: it is stored as its 16 raw bits ('<u2').
const char* descr(DType d) {
  switch (d) {
    case DType::f32:
      return "<f4";
    case DType::f64:
      return "<f8";
    case DType::i32:
      return "<i4";
    case DType::i64:
      return "<i8";
    case DType::u16:
    case DType::bf16:
      return "<u2";
    case DType::u8:
      return "|u1";
  }
  return "?";
}
}  // namespace

void write_npy(const std::string& path, const Tensor& t) {
  Tensor h = t.to(Device::cpu());
  std::string shape = "(";
  for (size_t i = 0; i < h.shape().size(); ++i)
    shape += std::to_string(h.shape()[i]) + (h.shape().size() == 1 ? "," : i + 1 < h.shape().size() ? ", " : "");
  shape += ")";
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr(h.dtype()), shape);
  // Magic (6) + version (2) + length (2) + header, padded with spaces and a newline to a multiple of 64.
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  if (!f) fail("npy", "cannot write '{}': {}", path, std::strerror(errno));
  f.write("\x93NUMPY\x01\x00", 8);
  uint16_t len = uint16_t(header.size());
  char lb[2] = {char(len & 0xff), char(len >> 8)};
  f.write(lb, 2);
  f.write(header.data(), std::streamsize(header.size()));
  f.write(static_cast<const char*>(h.data_ptr()), std::streamsize(h.nbytes()));
  if (!f) fail("npy", "writing '{}' failed", path);
}

Tensor read_npy(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("npy", "cannot read '{}': {}", path, std::strerror(errno));
  char magic[10];
  f.read(magic, 10);
  if (!f || std::memcmp(magic, "\x93NUMPY\x01\x00", 8) != 0) fail("npy", "'{}' is not a .npy 1.0 file", path);
  size_t len = uint8_t(magic[8]) | (size_t(uint8_t(magic[9])) << 8);
  std::string header(len, '\0');
  f.read(header.data(), std::streamsize(len));
  DType dt = DType::f32;
  bool found = false;
  for (DType d : {DType::f32, DType::f64, DType::i32, DType::i64, DType::u16, DType::u8})
    if (header.find(std::string("'descr': '") + descr(d) + "'") != std::string::npos) dt = d, found = true;
  if (!found || header.find("'fortran_order': False") == std::string::npos)
    fail("npy", "'{}': unsupported header {}", path, header);
  Shape s;
  size_t p = header.find("'shape': (") + 10;
  while (p < header.size() && header[p] != ')') {
    if (std::isdigit(static_cast<unsigned char>(header[p]))) {
      size_t q = p;
      while (std::isdigit(static_cast<unsigned char>(header[q]))) ++q;
      s.push_back(std::stoll(header.substr(p, q - p)));
      p = q;
    } else {
      ++p;
    }
  }
  Tensor t = empty(s, dt);
  f.read(static_cast<char*>(t.data_ptr()), std::streamsize(t.nbytes()));
  if (!f) fail("npy", "'{}' is truncated", path);
  return t;
}

}  // namespace mt
