// The MPI environment of one process: MPI_Init/Finalize as RAII, this rank's
// place in the job (world and node-local rank, host) and the CUDA device it
// uses (local rank modulo the devices visible, as Slurm and torchrun do).
#pragma once
#include <string>

namespace mt {

class MpiEnv {
 public:
  MpiEnv(int* argc, char*** argv);
  ~MpiEnv();
  MpiEnv(const MpiEnv&) = delete;
  MpiEnv& operator=(const MpiEnv&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  const std::string& host() const { return host_; }
  // CUDA device for this rank, -1 when none is visible or CUDA is not built. Found (and made current) on the
  // first call, which loads the CUDA backend (runtime/core/cuda_table.h): a CPU run never asks, so never loads it.
  // Throws "[cuda] cannot load the CUDA backend ..." when the backend is built but cannot be loaded.
  int cuda_device() const;

 private:
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  mutable int cuda_device_ = -1;
  mutable bool device_found_ = false;
  std::string host_;
};

// Aborts the whole job (MPI_Abort on the world) after printing msg on stderr.
[[noreturn]] void abort_job(const std::string& msg, int code = 1);

}  // namespace mt
