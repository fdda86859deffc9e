#include "runtime/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
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
    case DType::u8:
      return "U8";
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
  std::vector<SafetensorsWriter::Layout> layout;
  for (auto& nt : tensors) {
    MT_CHECK(nt.tensor.defined(), "checkpoint", "{}: tensor '{}' is undefined", path, nt.name);
    MT_CHECK(!nt.tensor.device().is_cuda(), "checkpoint", "{}: tensor '{}' must be on the host", path, nt.name);
    layout.push_back({nt.name, nt.tensor.dtype(), nt.tensor.shape()});
  }
  SafetensorsWriter w(path, layout, metadata);
  for (auto& nt : tensors) w.write(nt.name, nt.tensor);
  w.close();
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

}  // namespace

SafetensorsFile read_safetensors(const std::string& path) {
  SafetensorsReader r(path);
  SafetensorsFile out;
  out.metadata = r.metadata();
  for (auto& [name, e] : r.entries()) {
    Tensor t = empty(e.shape, e.dtype);
    r.read_block(name, Shape(e.shape.size(), 0), t);
    out.tensors[name] = t;
  }
  return out;
}

namespace {

// Sizes of the dtypes a file may hold (as written).
size_t written_size(const std::string& dt) {
  if (dt == "F64" || dt == "I64") return 8;
  if (dt == "F32" || dt == "I32") return 4;
  return 2;  // BF16, F16, U16
}

double read_as_double(const std::string& dt, const unsigned char* p) {
  if (dt == "F32") {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  if (dt == "F64") {
    double d;
    std::memcpy(&d, p, 8);
    return d;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  if (dt == "F16") return half_to_float(h);
  uint32_t bits = uint32_t(h) << 16;  // BF16
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  Header h = read_header(path);
  std::vector<Entry> entries;
  for (auto it = h.header.begin(); it != h.header.end(); ++it) {
    if (it.key() == "__metadata__") {
      MT_CHECK(it->is_object(), "checkpoint", "{}: __metadata__ is not a JSON object", path);
      for (auto m = it->begin(); m != it->end(); ++m) {
        MT_CHECK(m->is_string(), "checkpoint", "{}: __metadata__ value '{}' is not a string", path, m.key());
        metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, it.key(), *it, h.data_size));
  }
  check_tiling(path, entries, h.data_size);
  for (const Entry& e : entries) entries_[e.name] = SafetensorsEntry{e.dt, e.dtype, e.shape, e.begin, e.end};
  data_start_ = 8 + h.header_len;
  if (h.data_size > 0) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    MT_CHECK(fd_ >= 0, "checkpoint", "{}: cannot open: {}", path, std::strerror(errno));
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsReader::read_data(unsigned char* p, uint64_t n, uint64_t at) const {
  uint64_t done = 0;
  while (done < n) {
    const ssize_t r =
        ::pread(fd_, p + done, size_t(std::min<uint64_t>(n - done, 1ull << 30)), off_t(data_start_ + at + done));
    if (r < 0 && errno == EINTR) continue;
    MT_CHECK(r > 0, "checkpoint", "{}: cannot read {} bytes at byte {}: {}", path_, n - done, data_start_ + at + done,
             r < 0 ? std::strerror(errno) : "end of file (truncated file?)");
    done += uint64_t(r);
  }
}

template <class F>
void SafetensorsReader::for_each_run(const SafetensorsEntry& e, const Shape& offset, const Shape& shape, F&& f) const {
  // Runs near one another in the file are read by one pread into a staging buffer (skipping a gap of up to kGap
  // bytes costs less than another call); f sees each run, or a piece of one longer than the buffer, in that buffer.
  constexpr uint64_t kStage = 4u << 20, kGap = 16u << 10;
  const size_t nd = e.shape.size(), es = written_size(e.dt);
  struct Run {
    int64_t at;    // its first element's index in the block
    uint64_t pos;  // its first byte in the data section
    int64_t n;     // elements
  };
  std::vector<Run> window;
  std::vector<unsigned char> stage;
  auto flush = [&] {
    if (window.empty()) return;
    const uint64_t lo = window.front().pos, hi = window.back().pos + uint64_t(window.back().n) * es;
    if (stage.size() < hi - lo) stage.resize(hi - lo);
    read_data(stage.data(), hi - lo, lo);
    for (const Run& r : window) f(r.at, stage.data() + (r.pos - lo), r.n);
    window.clear();
  };
  auto add = [&](int64_t at, uint64_t pos, int64_t n) {
    const int64_t piece = int64_t(kStage / es);
    for (int64_t k = 0; k < n; k += piece) {
      const int64_t m = std::min(piece, n - k);
      const uint64_t p = pos + uint64_t(k) * es;
      if (!window.empty()) {
        Run& last = window.back();
        const uint64_t end = last.pos + uint64_t(last.n) * es;
        if (p < end || p - end > kGap || p + uint64_t(m) * es - window.front().pos > kStage) {
          flush();
        } else if (p == end && at + k == last.at + last.n) {  // contiguous in the file and the block: one run
          last.n += m;
          continue;
        }
      }
      window.push_back({at + k, p, m});
    }
  };
  if (nd == 0) {
    add(0, e.begin, 1);
    return flush();
  }
  // The block's rows: every index of dims 0 .. nd-2, each a contiguous run of shape[nd-1] elements in the file.
  Shape stride(nd, 1);
  for (size_t d = nd; d-- > 1;) stride[d - 1] = stride[d] * e.shape[d];
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < nd; ++d) rows *= shape[d];
  const int64_t run = shape[nd - 1];
  Shape idx(nd, 0);
  for (int64_t r = 0; r < rows && run > 0; ++r) {
    int64_t rest = r, el = offset[nd - 1];
    for (size_t d = nd - 1; d-- > 0;) {
      idx[d] = rest % shape[d];
      rest /= shape[d];
      el += (idx[d] + offset[d]) * stride[d];
    }
    add(r * run, e.begin + uint64_t(el) * es, run);
  }
  flush();
}

void SafetensorsReader::read_block(const std::string& name, const Shape& offset, const Tensor& dst) const {
  auto it = entries_.find(name);
  MT_CHECK(it != entries_.end(), "checkpoint", "{}: no tensor '{}'", path_, name);
  const SafetensorsEntry& e = it->second;
  const Shape& shape = dst.shape();
  MT_CHECK(offset.size() == e.shape.size() && shape.size() == e.shape.size(), "checkpoint",
           "{}: tensor '{}' {}: block of {} dims asked", path_, name, shape_str(e.shape), shape.size());
  for (size_t d = 0; d < shape.size(); ++d)
    MT_CHECK(offset[d] >= 0 && offset[d] + shape[d] <= e.shape[d], "checkpoint",
             "{}: tensor '{}' {}: block at {} of {} out of range", path_, name, shape_str(e.shape), shape_str(offset),
             shape_str(shape));
  MT_CHECK(!dst.device().is_cuda() && (dtype_is_float(dst.dtype()) || dst.dtype() == e.dtype), "checkpoint",
           "{}: tensor '{}' ({}): read into a host tensor of a float dtype or its own", path_, name, e.dt);
  if (dst.numel() == 0) return;
  const size_t es = written_size(e.dt), ds = dtype_size(dst.dtype());
  const bool same = e.dt != "F16" && dst.dtype() == e.dtype;  // the bytes as they are (F16 is widened)
  unsigned char* out = static_cast<unsigned char*>(dst.data_ptr());
  for_each_run(e, offset, shape, [&](int64_t at, const unsigned char* src, int64_t n) {
    if (same) {
      std::memcpy(out + size_t(at) * ds, src, size_t(n) * es);
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      const double v = read_as_double(e.dt, src + size_t(i) * es);
      unsigned char* o = out + size_t(at + i) * ds;
      if (dst.dtype() == DType::f32) {
        float f = float(v);
        std::memcpy(o, &f, 4);
      } else if (dst.dtype() == DType::f64) {
        std::memcpy(o, &v, 8);
      } else {
        const bf16 b = bf16(float(v));
        std::memcpy(o, &b, 2);
      }
    }
  });
}

int64_t SafetensorsReader::first_nonfinite(const std::string& name, const Shape& offset, const Shape& shape,
                                           double* value) const {
  const SafetensorsEntry& e = entries_.at(name);
  if (e.dt != "F32" && e.dt != "F64" && e.dt != "BF16" && e.dt != "F16") return -1;
  const size_t es = written_size(e.dt);
  int64_t bad = -1;
  for_each_run(e, offset, shape, [&](int64_t at, const unsigned char* src, int64_t n) {
    for (int64_t i = 0; i < n && bad < 0; ++i) {
      const double v = read_as_double(e.dt, src + size_t(i) * es);
      if (!std::isfinite(v)) bad = at + i, *value = v;
    }
  });
  return bad;
}

SafetensorsWriter::SafetensorsWriter(const std::string& path, const std::vector<Layout>& tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const Layout& l : tensors) {
    MT_CHECK(l.name != "__metadata__" && !l.name.empty(), "checkpoint", "{}: '{}' is not a valid tensor name", path,
             l.name);
    MT_CHECK(!header.contains(l.name), "checkpoint", "{}: tensor '{}' given twice", path, l.name);
    const uint64_t n = uint64_t(shape_numel(l.shape)) * dtype_size(l.dtype);
    header[l.name] = {{"dtype", st_dtype(l.dtype)}, {"shape", l.shape}, {"data_offsets", {offset, offset + n}}};
    where_[l.name] = {offset, l};
    offset += n;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  const std::string tmp = path + ".tmp";
  fd_ = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  MT_CHECK(fd_ >= 0, "checkpoint", "cannot create {}: {}", tmp, std::strerror(errno));
  uint64_t hl = h.size();
  data_start_ = 8 + hl;
  size_ = data_start_ + offset;
  bool ok = ::pwrite(fd_, &hl, 8, 0) == 8 && ::pwrite(fd_, h.data(), h.size(), 8) == ssize_t(h.size()) &&
            ::ftruncate(fd_, off_t(size_)) == 0;
  sum_->update(&hl, 8);
  sum_->update(h.data(), h.size());
  hashed_to_ = data_start_;
  if (!ok) {
    const int err = errno;
    ::close(fd_), fd_ = -1;
    ::unlink(tmp.c_str());
    fail("checkpoint", "cannot write {}: {} (disk full?)", tmp, std::strerror(err));
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink((path_ + ".tmp").c_str());
  }
}

void SafetensorsWriter::write(const std::string& name, const Tensor& t) {
  auto it = where_.find(name);
  MT_CHECK(it != where_.end(), "checkpoint", "{}: tensor '{}' is not in the file's layout", path_, name);
  const Layout& l = it->second.second;
  MT_CHECK(fd_ >= 0 && !t.device().is_cuda() && t.dtype() == l.dtype && t.shape() == l.shape, "checkpoint",
           "{}: tensor '{}' is {} {} on {}, the layout says {} {}", path_, name, dtype_name(t.dtype()),
           shape_str(t.shape()), t.device().str(), dtype_name(l.dtype), shape_str(l.shape));
  const char* p = static_cast<const char*>(t.data_ptr());
  uint64_t done = 0, n = t.nbytes(), at = data_start_ + it->second.first;
  while (done < n) {
    const ssize_t w = ::pwrite(fd_, p + done, size_t(std::min<uint64_t>(n - done, 1ull << 30)), off_t(at + done));
    MT_CHECK(w > 0, "checkpoint", "cannot write tensor '{}' to {}.tmp: {} (disk full?)", name, path_,
             std::strerror(errno));
    done += uint64_t(w);
  }
  if (streaming_ && at == hashed_to_) {
    sum_->update(p, size_t(n));
    hashed_to_ += n;
  } else {
    streaming_ = false;
  }
}

void SafetensorsWriter::close() {
  const std::string tmp = path_ + ".tmp";
  bool ok = ::fsync(fd_) == 0;
  int err = errno;
  if (::close(fd_) != 0 && ok) ok = false, err = errno;
  fd_ = -1;
  if (!ok) {
    ::unlink(tmp.c_str());
    fail("checkpoint", "cannot write {}: {} (disk full?)", tmp, std::strerror(err));
  }
  checksum_ = streaming_ && hashed_to_ == size_ ? sum_->hex() : file_checksum(tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path_, ec);
  MT_CHECK(!ec, "checkpoint", "cannot rename {} to {}: {}", tmp, path_, ec.message());
  // The rename itself is durable once the directory is synced.
  std::string dir = std::filesystem::path(path_).parent_path().string();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace mt
