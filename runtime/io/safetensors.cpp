#include "runtime/io/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::f64:
      return "F64";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::u16:
      return "U16";
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
    MT_CHECK(nt.name != "__metadata__" && !nt.name.empty(), "checkpoint", "{}: '{}' is not a valid tensor name", path,
             nt.name);
    MT_CHECK(nt.tensor.defined(), "checkpoint", "{}: tensor '{}' is undefined", path, nt.name);
    MT_CHECK(!header.contains(nt.name), "checkpoint", "{}: tensor '{}' given twice", path, nt.name);
    uint64_t n = nt.tensor.nbytes();
    header[nt.name] = {
        {"dtype", st_dtype(nt.tensor.dtype())}, {"shape", nt.tensor.shape()}, {"data_offsets", {offset, offset + n}}};
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
    if (ok && nt.tensor.nbytes())
      ok = std::fwrite(nt.tensor.data_ptr(), 1, nt.tensor.nbytes(), f) == nt.tensor.nbytes();
  ok = ok && std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  int err = ok ? 0 : errno;
  if (std::fclose(f) != 0 && ok) ok = false, err = errno;
  std::error_code ec;
  if (!ok) {
    std::filesystem::remove(tmp, ec);
    fail("checkpoint", "cannot write {}: {} (disk full?)", tmp, std::strerror(err));
  }
  std::filesystem::rename(tmp, path, ec);
  MT_CHECK(!ec, "checkpoint", "cannot rename {} to {}: {}", tmp, path, ec.message());
  // The rename itself is durable once the directory is synced.
  std::string dir = std::filesystem::path(path).parent_path().string();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
}

namespace {

// One tensor's header entry, checked: its dtype (F16 is read into f32), shape and byte range in the data.
struct Entry {
  std::string name, dt;
  Shape shape;
  DType dtype;
  uint64_t begin, end;
};

// The file opened and its header parsed: the JSON object, and where the data starts and how long it is.
struct Header {
  std::ifstream f;
  json header;
  uint64_t header_len = 0, data_size = 0;
};
Header read_header(const std::string& path) {
  Header r;
  std::ifstream& f = r.f;
  json& header = r.header;
  std::error_code ec;
  MT_CHECK(std::filesystem::is_regular_file(path, ec), "checkpoint", "{}: no such file", path);
  uint64_t size = std::filesystem::file_size(path, ec);
  f.open(path, std::ios::binary);
  MT_CHECK(f.good() && !ec, "checkpoint", "{}: cannot open", path);
  MT_CHECK(size >= 8, "checkpoint", "{}: {} bytes is too short for the 8-byte header length (truncated file?)", path,
           size);
  uint64_t& hl = r.header_len;  // little-endian on every host this builds for
  f.read(reinterpret_cast<char*>(&hl), 8);
  MT_CHECK(hl <= size - 8, "checkpoint", "{}: header length {} exceeds file size {} (corrupted header length?)", path,
           hl, size);
  std::string h(hl, '\0');
  f.read(h.data(), std::streamsize(hl));
  MT_CHECK(f.good(), "checkpoint", "{}: cannot read the {}-byte header", path, hl);
  try {
    header = json::parse(h);
  } catch (const json::exception& e) {
    fail("checkpoint", "{}: header is not valid JSON ({})", path, e.what());
  }
  MT_CHECK(header.is_object(), "checkpoint", "{}: header is not a JSON object", path);
  r.data_size = size - 8 - hl;
  return r;
}

// The entry of tensor `name` (e: its JSON), checked against the data's size.
Entry parse_entry(const std::string& path, const std::string& name, const json& e, uint64_t data_size) {
  MT_CHECK(e.is_object() && e.contains("dtype") && e.contains("shape") && e.contains("data_offsets"), "checkpoint",
           "{}: tensor '{}': expected dtype, shape and data_offsets", path, name);
  Entry en{name, "", {}, DType::f32, 0, 0};
  try {
    en.dt = e["dtype"].get<std::string>();
    en.shape = e["shape"].get<Shape>();
    const json& off = e["data_offsets"];
    MT_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
             "checkpoint", "{}: tensor '{}': data_offsets {} is not a pair of byte offsets", path, name, off.dump());
    en.begin = off[0].get<uint64_t>();
    en.end = off[1].get<uint64_t>();
  } catch (const json::exception& x) {
    fail("checkpoint", "{}: tensor '{}': bad entry ({})", path, name, x.what());
  }
  size_t esize = 0;
  if (en.dt == "F32") en.dtype = DType::f32, esize = 4;
  else if (en.dt == "BF16") en.dtype = DType::bf16, esize = 2;
  else if (en.dt == "F16") en.dtype = DType::f32, esize = 2;  // converted to f32 on read
  else if (en.dt == "F64") en.dtype = DType::f64, esize = 8;
  else if (en.dt == "I32") en.dtype = DType::i32, esize = 4;
  else if (en.dt == "I64") en.dtype = DType::i64, esize = 8;
  else if (en.dt == "U16") en.dtype = DType::u16, esize = 2;
  else
    fail("checkpoint", "{}: tensor '{}' has unknown dtype '{}' (expected F32, BF16, F16, F64, I32 or I64)", path, name,
         en.dt);
  uint64_t want = esize;
  for (int64_t d : en.shape) {
    MT_CHECK(d >= 0, "checkpoint", "{}: tensor '{}' has a negative size in shape {}", path, name, shape_str(en.shape));
    MT_CHECK(!__builtin_mul_overflow(want, uint64_t(d), &want), "checkpoint", "{}: tensor '{}' shape {} is too large",
             path, name, shape_str(en.shape));
  }
  MT_CHECK(en.begin <= en.end && en.end <= data_size, "checkpoint",
           "{}: tensor '{}' data_offsets [{}, {}] out of range of the {} data bytes (truncated file?)", path, name,
           en.begin, en.end, data_size);
  MT_CHECK(en.end - en.begin == want, "checkpoint",
           "{}: tensor '{}' of {} {} needs {} bytes, data_offsets [{}, {}] give {} (shape/offset size mismatch)", path,
           name, en.dt, shape_str(en.shape), want, en.begin, en.end, en.end - en.begin);
  return en;
}

// The tensors' byte ranges must tile the data exactly: no overlap, no gap, nothing after the last.
void check_tiling(const std::string& path, const std::vector<Entry>& entries, uint64_t data_size) {
  std::vector<const Entry*> order;
  for (const Entry& en : entries) order.push_back(&en);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t covered = 0;
  const Entry* prev = nullptr;
  for (const Entry* en : order) {
    if (en->begin < covered)
      fail("checkpoint", "{}: tensors '{}' [{}, {}] and '{}' [{}, {}] have overlapping data_offsets", path, prev->name,
           prev->begin, prev->end, en->name, en->begin, en->end);
    MT_CHECK(en->begin == covered, "checkpoint",
             "{}: data_offsets do not cover the data: bytes [{}, {}) belong to no tensor (before '{}')", path, covered,
             en->begin, en->name);
    covered = en->end;
    prev = en;
  }
  MT_CHECK(covered == data_size, "checkpoint",
           "{}: data_offsets do not cover the data: the tensors end at byte {} of {} data bytes", path, covered,
           data_size);
}

// A tensor's bytes read (F16 widened to f32).
Tensor read_tensor(std::ifstream& f, const std::string& path, uint64_t header_len, const Entry& en) {
  Tensor t = empty(en.shape, en.dtype);
  uint64_t n = en.end - en.begin;
  f.seekg(std::streamoff(8 + header_len + en.begin));
  if (en.dt == "F16") {
    std::vector<uint16_t> raw(size_t(t.numel()));
    if (n) f.read(reinterpret_cast<char*>(raw.data()), std::streamsize(n));
    float* d = t.numel() ? t.data<float>() : nullptr;
    for (size_t i = 0; i < raw.size(); ++i) d[i] = half_to_float(raw[i]);
  } else if (n) {
    f.read(static_cast<char*>(t.data_ptr()), std::streamsize(n));
  }
  MT_CHECK(f.good(), "checkpoint", "{}: cannot read tensor '{}' (truncated file?)", path, en.name);
  return t;
}

}  // namespace

SafetensorsFile read_safetensors(const std::string& path) {
  Header h = read_header(path);
  std::vector<Entry> entries;
  SafetensorsFile out;
  for (auto it = h.header.begin(); it != h.header.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      MT_CHECK(it->is_object(), "checkpoint", "{}: __metadata__ is not a JSON object", path);
      for (auto m = it->begin(); m != it->end(); ++m) {
        MT_CHECK(m->is_string(), "checkpoint", "{}: __metadata__ value '{}' is not a string", path, m.key());
        out.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, name, *it, h.data_size));
  }
  check_tiling(path, entries, h.data_size);
  for (const Entry& en : entries) out.tensors[en.name] = read_tensor(h.f, path, h.header_len, en);
  return out;
}

}  // namespace mt
