#!/usr/bin/env bash
# CPU training-step benchmark (docs/PERFORMANCE.md): the model of
# configs/bench_cpu.yaml (dim 256, 4 layers, 8 heads, 4 kv heads, ffn 768,
# vocab 256, seq 256, batch 8, fp32) on 1 rank with 2 threads, and the PyTorch
# reference (scripts/reference/llama_ref.py bench) on the same model with 2
# threads, in one run. Prints the machine's CPU model and vector extensions, the
# instruction-set level meshtrain's kernels run at and the kernels PyTorch's
# OpenBLAS picked, tokens/s of both and the ratio, the achieved GFLOP/s against
# the measured GEMM peak, where the step's time goes (its linear GEMMs and its
# attention timed alone by bench_step_parts, the rest by difference), and peak memory against the expected parameter +
# optimizer + activation bytes. MT_CPU_ISA (base, avx2, avx512) and
# OPENBLAS_CORETYPE in the environment pass through to meshtrain and PyTorch.
#   scripts/bench/bench_train_cpu.sh [BUILD_DIR] [STEPS]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
steps=${2:-20}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
threads=2
export OMP_NUM_THREADS=$threads

# The machine: CPU model and the vector extensions that decide the kernels (x86 flags or Arm features).
model=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1)
ext=$(grep -m 1 -E '^(flags|Features)' /proc/cpuinfo | cut -d: -f2 | tr ' ' '\n' |
  grep -E '^(sse4_2|avx|avx2|fma|avx512[a-z0-9_]*|avx_vnni|amx[a-z0-9_]*|asimd|sve|sve2|sme|sme2)$' | tr '\n' ' ' || true)
echo "cpu        : ${model:-unknown}, $(nproc) cores; vector extensions: ${ext:-none listed}"
# Which kernels OpenBLAS (PyTorch's BLAS here) picked: it chooses by CPU model at load time.
blas_core=$(/usr/bin/python3 -c "
import ctypes, os
try:
    f = ctypes.CDLL(os.path.realpath('/usr/lib/x86_64-linux-gnu/libblas.so.3')).openblas_get_corename
    f.restype = ctypes.c_char_p
    print(f().decode())
except (OSError, AttributeError):
    print('not OpenBLAS')" 2>/dev/null)

# Random tokens: speed does not depend on the text.
/usr/bin/python3 "$root/scripts/bench/bench_data.py" "$tmp"
"$root/scripts/mpirun.sh" -np 1 "$build/meshtrain" --config "$root/configs/bench_cpu.yaml" \
  --set data.train="$tmp/bench_*.bin" --set data.val="" --set training.steps=$steps --set training.threads=$threads \
  --set log.interval=1 --set log.peak_cache=off --set log.metrics_file="$tmp/m.jsonl" train >"$tmp/mt.log" 2>&1 || { cat "$tmp/mt.log"; exit 1; }
peak=$(grep -oE 'CPU GEMM peak [0-9.]+' "$tmp/mt.log" | grep -oE '[0-9.]+$')
isa=$(grep -oE 'CPU kernels: [^(]*\([^)]*\)' "$tmp/mt.log" | head -n 1 | sed 's/^CPU kernels: //' || true)
setup_mib=$(grep -oE 'memory after setup: [0-9.]+' "$tmp/mt.log" | grep -oE '[0-9.]+$')
# The step's linear GEMMs and its attention, each timed alone at the same shapes and threads.
"$build/scripts/bench/bench_step_parts" --dim 256 --layers 4 --heads 8 --kv 4 --ffn 768 --vocab 256 --batch 8 \
  --seq 256 >"$tmp/parts.json"
/usr/bin/python3 "$root/scripts/reference/llama_ref.py" bench --dim 256 --n-layers 4 --n-heads 8 --n-kv-heads 4 \
  --ffn-dim 768 --vocab-size 256 --seq-len 256 --batch-size 8 --threads $threads --steps 10 --warmup 3 >"$tmp/ref.json"

/usr/bin/python3 - "$tmp/m.jsonl" "$tmp/ref.json" "$peak" "$setup_mib" "$isa" "$blas_core" "$tmp/parts.json" <<'PY'
import json, sys, statistics
recs = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
ref = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
peak = float(sys.argv[3])
setup = float(sys.argv[4]) * 2**20
isa, blas_core = sys.argv[5] or "?", sys.argv[6] or "?"
# Steady state: skip the first 3 steps (allocation, page faults); median step time.
step_ms = statistics.median(r["step_ms"] for r in recs[3:])
tokens = 8 * 256
tps = tokens / (step_ms / 1e3)
d, L, H, KV, F, V, T = 256, 4, 8, 4, 768, 256, 256
hd = d // H
n_nonemb = L * (2 * d * H * hd + 2 * d * KV * hd + 3 * d * F + 2 * d) + d + V * d
n_all = n_nonemb + V * d
flops_tok = 6 * n_nonemb + 12 * L * d * T
gflops = flops_tok * tps / 1e9
mem = max(r["peak_mem_bytes"] for r in recs)
# Expected bytes: f32 parameters, gradients and two AdamW moments; plus what backward keeps per token:
# per layer x, norm out, q, k, v, attention out, residual, norm out, gate, up, swiglu out (7d + 3F with
# d/2-wide k and v), and the logits (overwritten in place by their gradient).
state = n_all * 4 * 4
act = 8 * 256 * (L * (7 * d + 3 * F) + V + 2 * d) * 4
print(f"meshtrain  : {tps:10.0f} tokens/s  (median step {step_ms:.1f} ms, 1 rank x 2 threads, kernels {isa})")
print(f"PyTorch    : {ref['tokens_per_s']:10.0f} tokens/s  (torch {ref.get('torch')}, {ref.get('threads')} threads, "
      f"{ref.get('blas', '?')}, OpenBLAS kernels {blas_core})")
print(f"ratio      : {tps / ref['tokens_per_s']:.2f}x  (target >= 2x)")
print(f"compute    : {gflops:.1f} GFLOP/s of a {peak:.1f} GFLOP/s GEMM peak = {100 * gflops / peak:.0f}%  ({flops_tok / 1e6:.1f} MFLOP/token)")
parts = json.loads(open(sys.argv[7]).read())
rest = step_ms - parts["gemm_ms"] - parts["attention_ms"]
print(f"GEMMs      : {parts['gemm_ms']:.1f} ms of the {step_ms:.1f} ms step ({100 * parts['gemm_ms'] / step_ms:.0f}%) at "
      f"{parts['gemm_gflops']:.1f} GFLOP/s = {100 * parts['gemm_gflops'] / peak:.0f}% of the peak  (the linears' "
      f"{parts['gemm_mflop'] / 1e3:.1f} GFLOP, timed alone)")
print(f"attention  : {parts['attention_ms']:.1f} ms ({100 * parts['attention_ms'] / step_ms:.0f}%) at "
      f"{parts['attention_gflops']:.1f} GFLOP/s; the rest (norms, RoPE, SwiGLU, embedding, loss, AdamW, "
      f"clipping): {rest:.1f} ms ({100 * rest / step_ms:.0f}%)")
print(f"peak memory: {mem / 2**20:.0f} MiB resident; {setup / 2**20:.0f} MiB after setup (binary, MPI, data, "
      f"model and optimizer state: {state / 2**20:.0f} MiB of it); the step adds {(mem - setup) / 2**20:.0f} MiB "
      f"against {act / 2**20:.0f} MiB of saved activations expected ({(mem - setup) / act:.2f}x: "
      f"temporaries and the host caching allocator's free blocks)")
PY
