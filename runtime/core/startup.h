// The launch's set-up, timed on one clock from the process's start as the kernel saw it (/proc/self/stat), so
// that exec, loading the libraries and MPI_Init are counted: each layer marks the part it ends (MPI start-up in
// comm/env.cpp, the config, the mesh, the model, the load, the first step in runtime/train), and the trainer
// prints and records them once (runtime/train/run_report.h, the set-up timeline).
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace mt::startup {

// Seconds since the process started (the kernel's start time, 10 ms ticks; the static initialisation's time
// where /proc cannot be read).
double seconds_since_process_start();

// The part of the set-up that ends now ("mpi", "config", ...), recorded with seconds_since_process_start().
// Thread-safe; a part marked again keeps its first end.
void mark(const std::string& part);

// The parts in the order they ended: (name, seconds since the process started at its end). The first, "exec",
// ends at the static initialisation (process start to the program's own code).
std::vector<std::pair<std::string, double>> marks();

}  // namespace mt::startup
