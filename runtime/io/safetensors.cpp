#include "runtime/io/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "runtime/core/error.h"

using json = nlohmann::json;

namespace mt {

namespace {

std::string st_dtype(DType d) {
  switch (d) {
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::f64: return "F64";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u16: return "U16";
  }
  return "?";
}

float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400));
      bits = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (auto& nt : tensors) {
    MT_CHECK(!nt.tensor.device().is_cuda(), "checkpoint", "{}: tensor '{}' must be on the host", path, nt.name);
    MT_CHECK(!header.contains(nt.name), "checkpoint", "{}: tensor '{}' given twice", path, nt.name);
    uint64_t n = nt.tensor.nbytes();
    header[nt.name] = {{"dtype", st_dtype(nt.tensor.dtype())}, {"shape", nt.tensor.shape()}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  MT_CHECK(f, "checkpoint", "cannot create {}: {}", tmp, std::strerror(errno));
  uint64_t hl = h.size();
  bool ok = std::fwrite(&hl, 8, 1, f) == 1 && std::fwrite(h.data(), 1, h.size(), f) == h.size();
  for (auto& nt : tensors)
    if (ok && nt.tensor.nbytes()) ok = std::fwrite(nt.tensor.data_ptr(), 1, nt.tensor.nbytes(), f) == nt.tensor.nbytes();
  ok = ok && std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  ok = (std::fclose(f) == 0) && ok;
  MT_CHECK(ok, "checkpoint", "cannot write {} (disk full?)", tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  MT_CHECK(!ec, "checkpoint", "cannot rename {} to {}: {}", tmp, path, ec.message());
}

SafetensorsFile read_safetensors(const std::string& path) {
  std::error_code ec;
  MT_CHECK(std::filesystem::is_regular_file(path, ec), "checkpoint", "{}: no such file", path);
  uint64_t size = std::filesystem::file_size(path, ec);
  std::ifstream f(path, std::ios::binary);
  MT_CHECK(f.good() && !ec, "checkpoint", "{}: cannot open", path);
  MT_CHECK(size >= 8, "checkpoint", "{}: {} bytes is too short for a safetensors header", path, size);
  uint64_t hl = 0;
  f.read(reinterpret_cast<char*>(&hl), 8);
  MT_CHECK(hl <= size - 8, "checkpoint", "{}: header length {} exceeds the file size {}", path, hl, size);
  std::string h(hl, '\0');
  f.read(h.data(), std::streamsize(hl));
  json header;
  try {
    header = json::parse(h);
  } catch (const json::exception& e) {
    fail("checkpoint", "{}: the header is not valid JSON ({})", path, e.what());
  }
  MT_CHECK(header.is_object(), "checkpoint", "{}: the header is not a JSON object", path);
  const uint64_t data_size = size - 8 - hl;
  SafetensorsFile out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      if (it->is_object())
        for (auto m = it->begin(); m != it->end(); ++m)
          if (m->is_string()) out.metadata[m.key()] = m->get<std::string>();
      continue;
    }
    const json& e = *it;
    MT_CHECK(e.is_object() && e.contains("dtype") && e.contains("shape") && e.contains("data_offsets"), "checkpoint",
             "{}: tensor '{}': expected dtype, shape and data_offsets", path, name);
    Shape shape;
    uint64_t begin = 0, end = 0;
    std::string dt;
    try {
      dt = e["dtype"].get<std::string>();
      shape = e["shape"].get<Shape>();
      begin = e["data_offsets"].at(0).get<uint64_t>();
      end = e["data_offsets"].at(1).get<uint64_t>();
    } catch (const json::exception& x) {
      fail("checkpoint", "{}: tensor '{}': bad entry ({})", path, name, x.what());
    }
    DType dtype;
    size_t esize;
    if (dt == "F32") dtype = DType::f32, esize = 4;
    else if (dt == "BF16") dtype = DType::bf16, esize = 2;
    else if (dt == "F16") dtype = DType::f32, esize = 2;  // converted on read
    else if (dt == "F64") dtype = DType::f64, esize = 8;
    else if (dt == "I32") dtype = DType::i32, esize = 4;
    else if (dt == "I64") dtype = DType::i64, esize = 8;
    else if (dt == "U16") dtype = DType::u16, esize = 2;
    else fail("checkpoint", "{}: tensor '{}' has unsupported dtype {}", path, name, dt);
    for (int64_t s : shape) MT_CHECK(s >= 0, "checkpoint", "{}: tensor '{}' has a negative size", path, name);
    MT_CHECK(begin <= end && end <= data_size, "checkpoint",
             "{}: tensor '{}' data_offsets [{}, {}] outside the {} data bytes (truncated file?)", path, name, begin, end,
             data_size);
    uint64_t want = uint64_t(shape_numel(shape)) * esize;
    MT_CHECK(end - begin == want, "checkpoint", "{}: tensor '{}' of {} {} needs {} bytes, data_offsets give {}", path,
             name, dt, shape_str(shape), want, end - begin);
    Tensor t = empty(shape, dtype);
    f.seekg(std::streamoff(8 + hl + begin));
    if (dt == "F16") {
      std::vector<uint16_t> raw(size_t(shape_numel(shape)));
      f.read(reinterpret_cast<char*>(raw.data()), std::streamsize(want));
      float* d = t.data<float>();
      for (size_t i = 0; i < raw.size(); ++i) d[i] = half_to_float(raw[i]);
    } else if (want) {
      f.read(static_cast<char*>(t.data_ptr()), std::streamsize(want));
    }
    MT_CHECK(f.good(), "checkpoint", "{}: cannot read tensor '{}'", path, name);
    out.tensors[name] = t;
  }
  return out;
}

}  // namespace mt
