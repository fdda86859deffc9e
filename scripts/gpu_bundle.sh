#!/usr/bin/env bash
# Copies what a GPU machine runs (meshtrain, the GPU suite, the op table, the benchmarks) out of a CUDA build,
# stripped, into DEST with the build's own layout, so that DEST can stand for the build directory there:
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
du -sh "$dest"
