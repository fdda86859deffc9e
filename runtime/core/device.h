// Where a tensor's storage lives: host memory or one CUDA device.
#pragma once
#include <string>

namespace mt {

struct Device {
  enum class Kind { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  static Device cpu() { return {Kind::cpu, 0}; }
  static Device cuda(int i = 0) { return {Kind::cuda, i}; }
  bool is_cpu() const { return kind == Kind::cpu; }
  bool is_cuda() const { return kind == Kind::cuda; }
  bool operator==(const Device&) const = default;
  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
  static Device parse(const std::string& s);  // "cpu", "cuda", "cuda:N"; throws "[core] ..."
};

// True when this binary was built with the CUDA backend.
bool cuda_built();
// Number of visible CUDA devices (0 when not built or none present).
int cuda_device_count();

}  // namespace mt
