// safetensors files (Hugging Face's format): an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}},
// then the raw bytes. Read and written whole; f32, bf16, f16 and f64, i32, i64 tensors.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/core/tensor.h"
#include "runtime/io/checksum.h"

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

// One tensor of a file's header: its dtype as written ("F32", "BF16", "F16", ...), the dtype it reads as, shape.
struct SafetensorsEntry {
  std::string dt;
  DType dtype = DType::f32;
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte range in the data
};

// A file's header checked as read_safetensors checks it (offsets inside the file, tiling the data); the data is
// read with pread when asked, nothing mapped: a rank reads only the blocks it holds, and a loaded run keeps none
// of the file's pages in its resident memory.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The block [offset, offset + dst.shape()) of tensor `name` into dst (a host tensor of any float dtype: converted
  // from the file's F32, BF16, F16 or F64). Read through a staging buffer of at most a few MiB.
  void read_block(const std::string& name, const Shape& offset, const Tensor& dst) const;
  // The first non-finite element of that block (its index in the block, row-major), or -1; its value in *value.
  int64_t first_nonfinite(const std::string& name, const Shape& offset, const Shape& shape, double* value) const;

 private:
  template <class F> void for_each_run(const SafetensorsEntry& e, const Shape& offset, const Shape& shape, F&& f) const;
  // n bytes at byte `at` of the data section into p; a short read (the file shrank since its header was read)
  // names the file.
  void read_data(unsigned char* p, uint64_t n, uint64_t at) const;
  std::string path_;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
  int fd_ = -1;
  uint64_t data_start_ = 0;  // the data section's first byte in the file
};

// A file written tensor by tensor, in any order, each at its place (the header first, from the layout): a writer
// holds one tensor at a time. Written to path + ".tmp"; close() syncs and renames. Destroyed unclosed: the .tmp is
// removed.
class SafetensorsWriter {
 public:
  struct Layout {
    std::string name;
    DType dtype;
    Shape shape;
  };
  SafetensorsWriter(const std::string& path, const std::vector<Layout>& tensors,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  // t: a host tensor of the layout's dtype and shape.
  void write(const std::string& name, const Tensor& t);
  void close();
  uint64_t bytes() const { return size_; }
  // The file's checksum (checksum.h), after close(): hashed while writing when the tensors come in the layout's
  // order (a checkpoint's writers write them so), else read back once.
  const std::string& checksum() const { return checksum_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t data_start_ = 0, size_ = 0;
  std::unique_ptr<StreamChecksum> sum_ = std::make_unique<StreamChecksum>();
  uint64_t hashed_to_ = 0;  // the file's bytes [0, hashed_to_) are in sum_; a write elsewhere stops the streaming
  bool streaming_ = true;
  std::string checksum_;
  std::map<std::string, std::pair<uint64_t, Layout>> where_;  // name -> (data offset, layout)
};

}  // namespace mt
