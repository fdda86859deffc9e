// Eigen for a per-level kernel file, included instead of <Eigen/Core>: the
// library is renamed to Eigen_isa_<level> (Eigen_isa_avx512, ...) so that its
// templates, compiled for this level's vector width, never share a symbol
// with another level's or with the baseline's (isa_level.h). `Eigen::` in
// the file then names this level's copy. Its thread count follows OpenMP's
// (omp_get_max_threads(), which set_cpu_threads sets), as the global Eigen's.
#pragma once
#include "runtime/kernels/cpu/isa_level.h"

#ifdef EIGEN_CORE_H
#error "Eigen was included before isa_eigen.h: it would not be renamed for this level"
#endif
#define Eigen MT_CPU_CAT(Eigen_, MT_CPU_ISA)
#include <Eigen/Core>
