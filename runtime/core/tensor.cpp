#include "runtime/core/tensor.h"

#include <cstring>

#include "runtime/core/allocator.h"
#include "runtime/core/cuda_backend.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/stream.h"

namespace mt {

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + (s.size() == 1 ? ",)" : ")");
}

Storage::~Storage() {
  if (owned && ptr) device_free(device, ptr, bytes);
}

int64_t Tensor::size(int64_t d) const {
  int64_t n = dim();
  if (d < 0) d += n;
  MT_CHECK(d >= 0 && d < n, "core", "dim {} out of range for a tensor of shape {}", d, shape_str(shape_));
  return shape_[size_t(d)];
}

void* Tensor::data_ptr() const {
  if (!storage_) return nullptr;
  return static_cast<char*>(storage_->ptr) + offset_ * int64_t(dtype_size(dtype_));
}

Tensor Tensor::view(int64_t start, Shape shape) const {
  for (int64_t d : shape) MT_CHECK(d >= 0, "core", "negative size in view shape {}", shape_str(shape));
  MT_CHECK(start >= 0 && start + shape_numel(shape) <= numel(), "core",
           "view of {} elements at {} is outside a tensor of {} elements", shape_numel(shape), start, numel());
  Tensor t = *this;
  t.offset_ = offset_ + start;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      MT_CHECK(infer < 0, "core", "reshape to {}: more than one -1", shape_str(shape));
      infer = int64_t(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    MT_CHECK(known > 0 && numel() % known == 0, "core", "cannot reshape {} to {}", shape_str(shape_), shape_str(shape));
    shape[size_t(infer)] = numel() / known;
  }
  MT_CHECK(shape_numel(shape) == numel(), "core", "cannot reshape {} ({} elements) to {}", shape_str(shape_), numel(),
           shape_str(shape));
  return view(0, std::move(shape));
}

Tensor Tensor::slice0(int64_t begin, int64_t end) const {
  MT_CHECK(dim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0], "core",
           "slice0({}, {}) out of range for shape {}", begin, end, shape_str(shape_));
  Shape s = shape_;
  s[0] = end - begin;
  int64_t row = shape_[0] ? numel() / shape_[0] : 0;
  return view(begin * row, std::move(s));
}

Tensor Tensor::bitcast(DType d) const {
  MT_CHECK(dtype_size(d) == dtype_size(dtype_), "core", "bitcast {} to {}: sizes differ", dtype_name(dtype_),
           dtype_name(d));
  Tensor t = *this;
  t.dtype_ = d;
  return t;
}

Tensor empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape) MT_CHECK(d >= 0, "core", "negative size in shape {}", shape_str(shape));
  Tensor t;
  size_t bytes = size_t(shape_numel(shape)) * dtype_size(dtype);
  t.storage_ = std::make_shared<Storage>(device_alloc(device, bytes), bytes, device, true);
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  fill_zero_(t);
  return t;
}

Tensor from_blob(void* ptr, const Shape& shape, DType dtype, Device device) {
  Tensor t;
  size_t bytes = size_t(shape_numel(shape)) * dtype_size(dtype);
  t.storage_ = std::make_shared<Storage>(ptr, bytes, device, false);
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor from_values(const std::vector<double>& values, const Shape& shape, DType dtype) {
  MT_CHECK(int64_t(values.size()) == shape_numel(shape), "core", "{} values for shape {}", values.size(),
           shape_str(shape));
  Tensor t = empty(shape, dtype);
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    T* p = t.data<T>();
    for (size_t i = 0; i < values.size(); ++i) {
      if constexpr (std::is_same_v<T, bf16>) p[i] = bf16(float(values[i]));
      else p[i] = T(values[i]);
    }
  });
  return t;
}

std::vector<double> to_f64(const Tensor& t) {
  if (t.device().is_cpu()) note_host_sync();  // a device tensor's copy to the host counts itself
  Tensor h = t.to(Device::cpu());
  std::vector<double> out(size_t(h.numel()));
  dispatch_dtype(h.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* p = h.data<T>();
    for (size_t i = 0; i < out.size(); ++i) {
      if constexpr (std::is_same_v<T, bf16>) out[i] = double(float(p[i]));
      else out[i] = double(p[i]);
    }
  });
  return out;
}

void copy_(const Tensor& dst, const Tensor& src) {
  MT_CHECK(dst.dtype() == src.dtype() && dst.numel() == src.numel(), "core",
           "copy_ from {} {} to {} {}: dtype and element count must match", dtype_name(src.dtype()),
           shape_str(src.shape()), dtype_name(dst.dtype()), shape_str(dst.shape()));
  size_t n = src.nbytes();
  if (n == 0) return;
  Device a = src.device(), b = dst.device();
  if (a.is_cpu() && b.is_cpu()) {
    std::memmove(dst.data_ptr(), src.data_ptr(), n);
  } else if (a.is_cpu()) {
    kprof::Scope prof("copy H2D", b, 0, double(n));
    cuda::memcpy_async(dst.data_ptr(), src.data_ptr(), n, 0, b.index);
  } else if (b.is_cpu()) {
    {
      kprof::Scope prof("copy D2H", a, 0, double(n));
      cuda::memcpy_async(dst.data_ptr(), src.data_ptr(), n, 1, a.index);
    }
    // The host reads the result next: wait for it (the only synchronising copy).
    cuda::stream_sync_current(a.index);
  } else {
    kprof::Scope prof("copy D2D", b, 0, 2.0 * double(n));
    cuda::memcpy_async(dst.data_ptr(), src.data_ptr(), n, 2, b.index);
  }
}

void fill_zero_(const Tensor& t) {
  if (t.nbytes() == 0) return;
  if (t.device().is_cpu()) return (void)std::memset(t.data_ptr(), 0, t.nbytes());
  kprof::Scope prof("fill_zero", t.device(), 0, double(t.nbytes()));
  cuda::memset_zero_async(t.data_ptr(), t.nbytes(), t.device().index);
}

void divide_(const Tensor& t, int64_t n) {
  MT_CHECK(t.device().is_cpu(), "core", "divide_ needs a host tensor, got one on {}", t.device().str());
  dispatch_dtype(t.dtype(), [&](auto zero) {
    using T = decltype(zero);
    T* p = t.data<T>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      if constexpr (std::is_same_v<T, bf16>) p[i] = bf16(float(p[i]) / float(n));
      else p[i] = T(p[i] / T(n));
    }
  });
}

Tensor Tensor::to(Device d) const {
  if (device() == d) return *this;
  Tensor t = empty(shape_, dtype_, d);
  copy_(t, *this);
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  copy_(t, *this);
  return t;
}

bool equal(const Tensor& a, const Tensor& b) {
  MT_CHECK(a.device().is_cpu() && b.device().is_cpu(), "core", "equal() needs host tensors");
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  return dispatch_dtype(a.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* p = a.data<T>();
    const T* q = b.data<T>();
    for (int64_t i = 0; i < a.numel(); ++i) {
      if constexpr (std::is_same_v<T, bf16>) {
        if (!(float(p[i]) == float(q[i]))) return false;
      } else if (!(p[i] == q[i])) {
        return false;
      }
    }
    return true;
  });
}

std::string Tensor::str(int64_t max_elems) const {
  std::string s = fmt::format("Tensor({}, {}, {})", dtype_name(dtype_), device().str(), shape_str(shape_));
  if (!defined()) return "Tensor(undefined)";
  auto v = to_f64(*this);
  s += " [";
  for (int64_t i = 0; i < std::min<int64_t>(max_elems, int64_t(v.size())); ++i)
    s += (i ? ", " : "") + fmt::format("{:g}", v[size_t(i)]);
  if (int64_t(v.size()) > max_elems) s += ", ...";
  return s + "]";
}

}  // namespace mt
