#!/usr/bin/env bash
# LoRA against full fine-tuning on CPU (issue 52, docs/PERFORMANCE.md): the model of configs/bench_cpu.yaml (dim 256,
# 4 layers, 8 heads, 4 kv heads, ffn 768, vocab 256, seq 256, batch 8, fp32; bench_train_cpu.sh's) on 1 rank with 2
# threads, trained in full, with LoRA rank 8 and with LoRA rank 64 (all seven targets). The machine is noisy and
# shared: the three runs alternate, ROUNDS times, and each LoRA run is compared with the full run of its own round
# (paired ratios; the median ratio is the figure). Prints per round and in the median: the median step time (the
# first 3 steps skipped), the high-water mark of the tensors' allocations (alloc_peak_bytes), the process's peak
# resident memory (peak_mem_bytes), the model state train logs and the CPU seconds of the whole run (user + system:
# less sensitive to other processes than wall time, set-up included); and the ratios LoRA / full (goal: step <= 1.1x).
#   scripts/bench/bench_lora.sh [BUILD_DIR] [STEPS] [ROUNDS]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
steps=${2:-10}
rounds=${3:-4}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
threads=2
export OMP_NUM_THREADS=$threads

model=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1)
echo "cpu        : ${model:-unknown}, $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg) at the start"
/usr/bin/python3 "$root/scripts/bench/bench_data.py" "$tmp"
declare -A over=([full]="" [r8]="--set lora.rank=8" [r64]="--set lora.rank=64")
for r in $(seq 1 "$rounds"); do
  for c in full r8 r64; do
    # shellcheck disable=SC2086
    /usr/bin/time -f "%U %S" -o "$tmp/$c.$r.time" "$root/scripts/mpirun.sh" -np 1 "$build/meshtrain" --config "$root/configs/bench_cpu.yaml" \
      --set data.train="$tmp/bench_*.bin" --set data.val="" --set training.steps="$steps" \
      --set training.threads=$threads --set log.interval=1 --set log.peak_cache=off \
      --set log.metrics_file="$tmp/$c.$r.jsonl" ${over[$c]} train >"$tmp/$c.$r.log" 2>&1 ||
      { tail -n 20 "$tmp/$c.$r.log"; exit 1; }
  done
done
echo "load average $(cut -d' ' -f1-3 /proc/loadavg) at the end"

/usr/bin/python3 - "$tmp" "$rounds" <<'PY'
import json, re, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
def run(c, r):
    recs = [json.loads(l) for l in open(f"{tmp}/{c}.{r}.jsonl") if '"loss"' in l]
    log = open(f"{tmp}/{c}.{r}.log", errors="replace").read()
    state = float(re.search(r"model state on rank 0: ([0-9.]+) MiB", log).group(1))
    trainable = re.search(r"LoRA rank \d+ \(scale [0-9.]+\) on \S+: (\d+) trainable parameters of (\d+)", log)
    return {"step": statistics.median(x["step_ms"] for x in recs[3:]),
            "alloc": max(x["alloc_peak_bytes"] for x in recs) / 2**20,
            "rss": max(x["peak_mem_bytes"] for x in recs) / 2**20, "state": state,
            "cpu": sum(float(v) for v in open(f"{tmp}/{c}.{r}.time").read().split()[-2:]),
            "trainable": f"{trainable.group(1)} of {trainable.group(2)}" if trainable else "all"}
names = {"full": "full fine-tuning", "r8": "LoRA rank 8", "r64": "LoRA rank 64"}
res = {c: [run(c, r) for r in range(1, rounds + 1)] for c in names}
print(f"{'run':18s} {'round':>5s} {'step ms':>9s} {'tensors MiB':>12s} {'RSS MiB':>9s} {'state MiB':>10s} {'CPU s':>7s}  trainable")
for r in range(rounds):
    for c in names:
        x = res[c][r]
        print(f"{names[c]:18s} {r + 1:5d} {x['step']:9.1f} {x['alloc']:12.2f} {x['rss']:9.1f} {x['state']:10.2f} {x['cpu']:7.1f}  {x['trainable']}")
print()
full = res["full"]
print(f"{'median over rounds':18s}       {'step ms':>9s} {'x full':>7s} {'tensors MiB':>12s} {'x full':>7s} {'RSS MiB':>9s} {'x full':>7s} {'CPU s':>7s} {'x full':>7s}")
for c in names:
    med = {k: statistics.median(x[k] for x in res[c]) for k in ("step", "alloc", "rss", "cpu")}
    ratio = {k: statistics.median(x[k] / f[k] for x, f in zip(res[c], full)) for k in ("step", "alloc", "rss", "cpu")}
    print(f"{names[c]:18s}       {med['step']:9.1f} {ratio['step']:7.2f} {med['alloc']:12.2f} {ratio['alloc']:7.2f} "
          f"{med['rss']:9.1f} {ratio['rss']:7.2f} {med['cpu']:7.1f} {ratio['cpu']:7.2f}")
worst = max(statistics.median(x["step"] / f["step"] for x, f in zip(res[c], full)) for c in ("r8", "r64"))
print(f"goal: the LoRA step no slower than 1.1x the full step: {'met' if worst <= 1.1 else 'NOT met'} "
      f"(the larger median paired ratio {worst:.2f}x)")
PY
