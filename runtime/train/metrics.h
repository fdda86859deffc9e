// Progress and metrics of a run, printed by rank 0: a progress bar with ETA
// when stdout reaches a person's terminal (log.progress, progress_bar_wanted),
// plain lines always; the same records as JSON lines in log.metrics_file.
// Step numbers count optimizer steps done: "step 1" is the first step's
// result, in the console, the metrics ("step"), checkpoints (step_00000001)
// and messages alike. MFU counts 6N + 12 L d T FLOPs per token (N the
// parameters without embeddings) against the device's peak (for a CPU, a peak measured once by a GEMM).
#pragma once
#include <chrono>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "models/model.h"
#include "runtime/core/device.h"
#include "runtime/core/dtype.h"

namespace mt {

struct StepMetrics {
  int64_t step = 0;  // 0-based index of the step just done (printed and recorded as step + 1, the steps done)
  double loss = 0, lr = 0, grad_norm = 0;
  double step_s = 0;    // wall time of the step
  int64_t tokens = 0;   // global tokens in the step (tokens/s and MFU count them all)
  int64_t trained_tokens = -1;  // the step's trained targets (the loss mask's; -1: not given)
  int64_t skipped = 0;  // steps not applied so far (non-finite loss or grad norm, training.nonfinite: skip)
  // The high-water mark over the step on this rank of what its tensors asked for (tensors only: not MPI, not the
  // binary; AllocatorStats::peak_requested_bytes), what `meshtrain estimate` predicts as the peak; and the
  // allocator's own (peak_allocated_bytes: with the slack of reused cached blocks). -1: not measured.
  double alloc_peak_bytes = -1;
  double alloc_peak_block_bytes = -1;
  const RouterStepStats* router = nullptr;  // an MoE model's routing (null or !any: none)
};

class MetricsLogger {
 public:
  // rank: only rank 0 prints and writes. flops_per_token and peak_flops (per rank, FLOP/s) give MFU.
  // progress: log.progress (auto | on | off).
  MetricsLogger(int rank, int world_size, const std::string& metrics_file, int64_t total_steps, int64_t interval,
                double flops_per_token, double peak_flops, Device device, const std::string& progress = "auto");
  ~MetricsLogger();
  void step(const StepMetrics& m);
  void eval(int64_t step, double val_loss, double seconds = -1);  // step: 0-based index, as in StepMetrics
  void sample(int64_t step, const std::string& text);
  void note(const std::string& line);  // a plain line that does not break the progress bar
  void record(nlohmann::json j);       // a JSON line as is

 private:
  void clear_bar();
  int rank_, world_;
  FILE* file_ = nullptr;
  int64_t total_, interval_;
  double flops_per_token_, peak_flops_;
  Device device_;
  bool tty_;
  bool bar_shown_ = false;
  double tokens_window_ = 0, time_window_ = 0;
  double ema_step_s_ = 0;
};

// Whether rank 0 draws the progress bar: on / off as said; auto when stdout reaches a person's terminal
// (reaches_terminal in runtime/core/log.h: not when mpirun copies a rank's pty into a file or a batch log).
bool progress_bar_wanted(const std::string& mode);
// Dense GEMM peak of this process's CPU threads in FLOP/s (f32, measured once, cached for the process, logged).
// `meshtrain train` keeps it per machine instead (peak_cache.h).
double cpu_peak_flops();
// The same measurement, each call afresh, unlogged.
double probe_cpu_peak_flops();
// The same measurement in any dtype: the best of `reps` n^3 GEMMs after a warm-up (matmul_forward, the kernels
// the training step runs), in FLOP/s. Not cached (calibration measures bf16 with it).
double gemm_peak_flops(DType dt, int64_t n, int reps);
// Peak resident memory of this process in bytes (getrusage), or of the device's caching allocator.
double peak_memory_bytes(Device d);
// Now, in seconds since the Unix epoch (the metrics' "time").
double unix_time_s();
// "1h02m", "3m05s", "12s"
std::string format_duration(double seconds);

}  // namespace mt
