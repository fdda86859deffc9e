// Tensor: a cheap-to-copy value handle over shared storage. Row-major and
// contiguous; a view is the same storage at an element offset with another
// shape. Device work is stream-ordered: copies to and from a device are issued
// on the current stream and do not synchronise unless the caller asks.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "runtime/core/device.h"
#include "runtime/core/dtype.h"
#include "runtime/core/error.h"

namespace mt {

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);  // "(7, 5)"

struct Storage {
  void* ptr = nullptr;
  size_t bytes = 0;
  Device device;
  bool owned = true;  // false for storage wrapping memory someone else frees
  Storage(void* p, size_t n, Device d, bool own) : ptr(p), bytes(n), device(d), owned(own) {}
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

class Tensor {
 public:
  Tensor() = default;  // undefined tensor: defined() is false

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return int64_t(shape_.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device : Device::cpu(); }
  int64_t offset() const { return offset_; }  // in elements

  void* data_ptr() const;
  template <typename T> T* data() const {
    MT_CHECK(dtype_of<T>() == dtype_, "core", "data<{}>() on a {} tensor", dtype_name(dtype_of<T>()),
             dtype_name(dtype_));
    return static_cast<T*>(data_ptr());
  }
  // Host element access for tests and small code paths (cpu tensors only).
  template <typename T> T& at(int64_t flat_index) const { return data<T>()[flat_index]; }

  // Same storage, elements [start, start + numel(shape)) of this tensor's range.
  Tensor view(int64_t start, Shape shape) const;
  Tensor reshape(Shape shape) const;  // one entry may be -1
  // Rows [begin, end) along dim 0 (a view: rows are contiguous).
  Tensor slice0(int64_t begin, int64_t end) const;
  // Reinterpret the bytes as another dtype of the same size (bf16 <-> u16).
  Tensor bitcast(DType d) const;

  Tensor to(Device d) const;  // copy unless already there
  Tensor clone() const;
  std::string str(int64_t max_elems = 8) const;  // "Tensor(f32, cpu, (2, 3)) [0, 1, ...]"
  const std::shared_ptr<Storage>& storage() const { return storage_; }

 private:
  friend Tensor empty(const Shape&, DType, Device);
  friend Tensor from_blob(void*, const Shape&, DType, Device);
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;
  Shape shape_;
  DType dtype_ = DType::f32;
};

Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
// Wraps memory owned elsewhere (not freed by the tensor).
Tensor from_blob(void* ptr, const Shape& shape, DType dtype, Device device = Device::cpu());
// A host tensor holding the given values, converted to dtype.
Tensor from_values(const std::vector<double>& values, const Shape& shape, DType dtype);
// Host f64 copy of any tensor's values (synchronises a device tensor's stream).
std::vector<double> to_f64(const Tensor& t);

// dst <- src, same shape and dtype, any devices. Device copies are async on
// the current stream; a device-to-host copy into pageable memory synchronises.
void copy_(const Tensor& dst, const Tensor& src);
void fill_zero_(const Tensor& t);
// Host tensors: t <- t / n element-wise (integer division for integer dtypes;
// used for avg reductions and Replicate -> Partial(sum)).
void divide_(const Tensor& t, int64_t n);
// Host tensors only: exact element-wise equality (NaN != NaN).
bool equal(const Tensor& a, const Tensor& b);

}  // namespace mt
