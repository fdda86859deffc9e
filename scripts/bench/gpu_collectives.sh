#!/usr/bin/env bash
# Issue-2 GPU figures, on a GPU machine, in one run: the GPU test suite
# (1 rank; 2 ranks sharing the GPU through staged MPI), NCCL with 1 rank and
# the staged MPI path with 2 ranks on one GPU, through `meshtrain check`.
#   scripts/bench/gpu_collectives.sh BIN_DIR OUT_DIR
# BIN_DIR holds meshtrain and test_gpu; $MPIRUN (from .gpu-deps/env.sh) or
# scripts/mpirun.sh launches the ranks.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${1:?usage: gpu_collectives.sh BIN_DIR OUT_DIR}
out=${2:?usage: gpu_collectives.sh BIN_DIR OUT_DIR}
mkdir -p "$out"
run() { "$root/scripts/mpirun.sh" "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== GPU test suite"
MT_SUITE_NAME=test_gpu run -np 1 "$bin/test_gpu" 2>&1 | tail -n 3
MT_SUITE_NAME=test_gpu run -np 2 "$bin/test_gpu" 2>&1 | tail -n 3
echo "== NCCL, 1 rank"
run -np 1 "$bin/meshtrain" --log-level warn check --device cuda --backend nccl --sizes 1M:1G --iters 20 \
  --json "$out/nccl_np1.json" 2>&1 | tail -n 60
echo "== staged MPI, 2 ranks sharing one GPU"
run -np 2 "$bin/meshtrain" --log-level warn check --device cuda --backend mpi --sizes 1M:64M --iters 10 \
  --ops all_reduce,all_gather,reduce_scatter --json "$out/staged_np2.json" 2>&1 | tail -n 40
echo "== host memcpy and PCIe reference (PyTorch, if present)"
python3 - <<'PY' 2>&1 | tail -n 5
try:
    import torch, time
    for mib in (64, 256):
        n = mib << 20
        h = torch.empty(n, dtype=torch.uint8).pin_memory(); d = torch.empty(n, dtype=torch.uint8, device="cuda")
        for _ in range(3): d.copy_(h); h.copy_(d)
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(10): d.copy_(h)
        torch.cuda.synchronize(); h2d = 10 * n / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for _ in range(10): h.copy_(d)
        torch.cuda.synchronize(); d2h = 10 * n / (time.perf_counter() - t) / 1e9
        d2 = torch.empty_like(d); torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(10): d2.copy_(d)
        torch.cuda.synchronize(); d2d = 10 * n / (time.perf_counter() - t) / 1e9
        print(f"{mib} MiB: pinned h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s, device copy {d2d:.1f} GB/s (read+write {2*d2d:.1f})")
except Exception as e:
    print("torch reference unavailable:", e)
PY
