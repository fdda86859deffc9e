#!/usr/bin/env bash
# Tensor-parallel benchmark (docs/PERFORMANCE.md):
#  1. per-step communication bytes per rank for tp = 2, 4, 8, counted by the
#     runtime (`meshtrain plan`: a real forward/backward) against the analytic
#     count for Megatron-style TP with sequence parallel;
#  2. CPU tokens/s for tp = 2 on 2 ranks against dp_replicate = 2 on the same
#     model (configs/bench_cpu.yaml; not a target on 2 cores).
#   scripts/bench/bench_tp_cpu.sh [BUILD_DIR] [STEPS]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
steps=${2:-12}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mt="$build/meshtrain"
mpirun="$root/scripts/mpirun.sh"
cfg="$root/configs/bench_cpu.yaml"

echo "== communication per rank, one step of configs/bench_cpu.yaml (batch 8 x 256 tokens, dim 256, 4 layers;"
echo "   n_kv_heads 8 so that tp = 8 splits whole heads)"
printf '%-4s %-14s %-14s %-14s %-10s %s\n' tp forward backward analytic equal "gradient sync (tp)"
for tp in 2 4 8; do
  "$mpirun" -np $tp "$mt" --config "$cfg" --set parallel.dp_replicate=1 --set parallel.tp=$tp \
    --set model.n_kv_heads=8 --set training.threads=1 plan >"$tmp/plan$tp.txt" 2>&1 || { tail "$tmp/plan$tp.txt"; exit 1; }
  f=$(grep -E '^  forward' "$tmp/plan$tp.txt" | awk '{print $2, $3}')
  b=$(grep -E '^  backward' "$tmp/plan$tp.txt" | awk '{print $2, $3}')
  g=$(grep -E '^  gradient sync' "$tmp/plan$tp.txt" | sed -E 's/.*(tp all_reduce: [0-9.]+ MiB).*/\1/')
  a=$(grep -E '^analytic' "$tmp/plan$tp.txt" | sed -E 's/.*= //')
  e=$(grep -qE 'measured = analytic' "$tmp/plan$tp.txt" && echo yes || echo NO)
  printf '%-4s %-14s %-14s %-14s %-10s %s\n' $tp "$f" "$b" "$a" "$e" "$g"
done

echo
echo "== tokens/s on 2 ranks x 1 thread, $steps steps (median of steps 4..)"
/usr/bin/python3 "$root/scripts/bench/bench_data.py" "$tmp"
for mode in dp tp; do
  if [ $mode = dp ]; then sets=(--set parallel.dp_replicate=2); else sets=(--set parallel.dp_replicate=1 --set parallel.tp=2); fi
  "$mpirun" -np 2 "$mt" --config "$cfg" "${sets[@]}" --set data.train="$tmp/bench_*.bin" --set data.val="" \
    --set training.steps=$steps --set training.threads=1 --set log.interval=1 --set log.metrics_file="$tmp/$mode.jsonl" \
    train >"$tmp/$mode.log" 2>&1 || { tail "$tmp/$mode.log"; exit 1; }
done
/usr/bin/python3 - "$tmp/dp.jsonl" "$tmp/tp.jsonl" <<'PY'
import json, sys, statistics
def tps(path):
    r = [json.loads(l) for l in open(path) if '"loss"' in l]
    return 8 * 256 / (statistics.median(x["step_ms"] for x in r[3:]) / 1e3), r[-1]["loss"]
d, dl = tps(sys.argv[1]); t, tl = tps(sys.argv[2])
print(f"dp_replicate=2: {d:8.0f} tokens/s (final loss {dl:.5f})")
print(f"tp=2          : {t:8.0f} tokens/s (final loss {tl:.5f})")
print(f"tp / dp       : {t / d:.2f}x")
PY
