#!/usr/bin/env bash
# Copies what a GPU machine runs (meshtrain, its CUDA backend libmeshtrain_cuda.so, the GPU suite, the op table,
# the benchmarks) out of a CUDA build, stripped, into DEST with the build's own layout, so that DEST can stand for
# the build directory there:
#   scripts/gpu_bundle.sh BUILD_DIR DEST        then, on the GPU machine:  scripts/gpu_check.sh DEST
# A build directory is larger than what a device call may carry (64 MiB); the stripped programs are a few MiB.
set -euo pipefail
build=${1:?usage: gpu_bundle.sh BUILD_DIR DEST}
dest=${2:?usage: gpu_bundle.sh BUILD_DIR DEST}
[ -x "$build/tests/test_gpu" ] || { echo "gpu_bundle.sh: $build/tests/test_gpu missing: not a CUDA build" >&2; exit 1; }
rm -rf "$dest"
for f in meshtrain tests/test_gpu tests/test_ops scripts/bench/bench_attention scripts/bench/bench_attention_gpu \
  scripts/bench/bench_redistribute scripts/bench/bench_step_parts; do
  [ -x "$build/$f" ] || continue
  mkdir -p "$dest/$(dirname "$f")"
  strip -o "$dest/$f" "$build/$f"
done
# The CUDA backend, loaded at run time from the executable's directory (runtime/core/cuda_table.h); the tests and
# benchmarks link it, found through their rpath ($ORIGIN/..), so it stays at the build's top.
[ -f "$build/libmeshtrain_cuda.so" ] || { echo "gpu_bundle.sh: $build/libmeshtrain_cuda.so missing" >&2; exit 1; }
strip -o "$dest/libmeshtrain_cuda.so" "$build/libmeshtrain_cuda.so"
du -sh "$dest"
