// Where a tensor's storage lives: host memory or one CUDA device.
#pragma once
#include <cstddef>
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

// True when this binary was built with the CUDA backend (libmeshtrain_cuda.so, loaded at run time on the first
// CUDA call: runtime/core/cuda_table.h).
bool cuda_built();
// Loads the CUDA backend if not yet tried: "" once it is loaded, else why it cannot be ("cannot load the CUDA
// backend libmeshtrain_cuda.so (<the loader's message>): ..."); in a build without CUDA, says so.
const std::string& cuda_backend_error();
// Number of visible CUDA devices (0 when not built or none present). Loads the backend in a CUDA build; throws
// "[cuda] cannot load the CUDA backend ..." when it cannot.
int cuda_device_count();
// CUDA device `device`'s total memory in bytes (cudaMemGetInfo). Loads the backend; throws "[cuda] ..." when it
// cannot be loaded or was not built.
size_t cuda_device_memory_bytes(int device);
// Its name ("NVIDIA H100 80GB HBM3"; the emulated device says it is one); the same loading and errors.
std::string cuda_device_name(int device);
// Its PCI bus id ("0000:3b:00.0"); the same loading and errors.
std::string cuda_device_pci_bus_id(int device);

}  // namespace mt
