#!/usr/bin/env bash
# Memory and checkpoint I/O of a 106M-parameter Llama on CPU ranks (issue 25):
#   scripts/bench/bench_scale.sh [BUILD_DIR] [OLD_MESHTRAIN]
# 1. For dp_shard 1, 2, 4, 8: host memory on rank 0 at creation, during a step, during a save and during a load,
#    beside the shard bytes the layouts predict (16 B per parameter element of the rank's part); save and load time
#    and throughput, per rank and in total.
# 2. At 2, 4 and 8 ranks: checkpoint.writers 1 (one writer, as rank 0 alone wrote before) against every rank.
# 3. The disk's own sequential write (dd conv=fsync) and read bandwidth on the same directory: the physical limit.
# 4. Start-up (launch to exit with one step) at dp_shard 8, and with OLD_MESHTRAIN (a build of the code before sharded
#    creation) the same for it.
# Writes $OUT/bench_scale.md (OUT defaults to /tmp/bench_scale).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
old=${2:-}
out=${OUT:-/tmp/bench_scale}
mt="$build/meshtrain"
mpirun="$root/scripts/mpirun.sh"
mkdir -p "$out"
data="$root/data/fortunes"
[ -f "$data/fortunes_train_000000.bin" ] || "$root/scripts/prepare_data" --fortunes --out "$data" >/dev/null
cat >"$out/s.yaml" <<YAML
model: {dim: 768, n_layers: 15, n_heads: 12, n_kv_heads: 12, ffn_dim: 2048, vocab_size: 256, max_seq_len: 64}
training: {steps: 1, batch_size: 8, seq_len: 64, lr: 1.0e-3, warmup_steps: 0, schedule: constant, threads: 1}
data: {train: "$data/fortunes_train_*.bin", val: "$data/fortunes_val_*.bin"}
eval: {interval: 0}
sample: {interval: 0}
log: {interval: 1}
parallel: {dp_replicate: 1, fsdp: {min_weight_size: 1024}}
checkpoint: {interval: 0, keep: 1}
YAML
report="$out/bench_scale.md"
: >"$report"

# The figure after a log line's marker: num LOG REGEX (the first number after it).
num() { grep -aoE -e "$2[^0-9]*[0-9.]+" "$1" | head -1 | grep -oE "[0-9.]+$"; }

echo "| dp_shard | state (predicted) MiB | creation MiB | step peak RSS MiB | save extra MiB | load extra MiB | checkpoint MiB | save s | save MB/s | load s | load MB/s |" >>"$report"
echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" >>"$report"
for n in 1 2 4 8; do
  ck="$out/ck$n"
  rm -rf "$ck"
  "$mpirun" -np $n "$mt" --config "$out/s.yaml" --set parallel.dp_shard=$n --set checkpoint.dir="$ck" \
    --set log.metrics_file="$out/m$n.jsonl" train >"$out/save$n.log" 2>&1 || { echo "dp_shard $n: save run failed"; tail "$out/save$n.log"; }
  "$mpirun" -np $n "$mt" --config "$out/s.yaml" --set parallel.dp_shard=$n --set checkpoint.dir="$ck" train \
    >"$out/load$n.log" 2>&1 || { echo "dp_shard $n: load run failed"; tail "$out/load$n.log"; }
  state=$(num "$out/save$n.log" "expected")
  create=$(num "$out/save$n.log" "peak of creating the model on rank 0:")
  rss=$(python3 -c "
import json
print(max(d.get('peak_mem_bytes', 0) for d in map(json.loads, open('$out/m$n.jsonl')) if 'loss' in d) / 2**20)")
  save_s=$(num "$out/save$n.log" "-> .* in")
  save_x=$(num "$out/save$n.log" "during the save:")
  load_s=$(num "$out/load$n.log" "loaded in")
  load_x=$(num "$out/load$n.log" "while loading on rank 0:")
  bytes=$(du -sb "$ck"/step_* | awk '{print $1}')
  python3 - "$n" "$state" "$create" "$rss" "$save_x" "$load_x" "$bytes" "$save_s" "$load_s" >>"$report" <<'PY'
import sys
n, state, create, rss, sx, lx, b, ss, ls = sys.argv[1:]
b = int(b)
print(f"| {n} | {float(state):.1f} | {float(create):.1f} | {float(rss):.0f} | {float(sx):.1f} | {float(lx):.1f} | "
      f"{b / 2**20:.0f} | {float(ss):.2f} | {b / float(ss) / 1e6:.0f} | {float(ls):.2f} | {b / float(ls) / 1e6:.0f} |")
PY
done

echo >>"$report"
echo "| ranks (dp_shard) | checkpoint.writers | save s | MB/s total | MB/s per writer |" >>"$report"
echo "| ---: | ---: | ---: | ---: | ---: |" >>"$report"
for n in 2 4 8; do
  ws=(1 $n)
  [ $n -eq 8 ] && ws=(1 2 4 8)
  for w in "${ws[@]}"; do
    ck="$out/w$n-$w"
    rm -rf "$ck"
    "$mpirun" -np $n "$mt" --config "$out/s.yaml" --set parallel.dp_shard=$n --set checkpoint.dir="$ck" \
      --set checkpoint.writers=$w --set training.steps=1 train >"$out/w$n-$w.log" 2>&1 || { echo "$n ranks, writers $w failed"; tail "$out/w$n-$w.log"; }
    s=$(num "$out/w$n-$w.log" "-> .* in")
    bytes=$(du -sb "$ck"/step_* | awk '{print $1}')
    python3 -c "print(f'| {$n} | {$w} | {$s:.2f} | {$bytes / $s / 1e6:.0f} | {$bytes / $s / 1e6 / $w:.0f} |')" >>"$report"
  done
done
echo >>"$report"
w=$(dd if=/dev/zero of="$out/dd" bs=16M count=64 conv=fsync 2>&1 | tail -1)
r=$(dd if="$out/dd" of=/dev/null bs=16M 2>&1 | tail -1)
rm -f "$out/dd"
echo "disk, same directory: write (dd conv=fsync, 1 GiB): ${w##*, }; read back: ${r##*, }" >>"$report"

echo >>"$report"
for bin in "$mt" $old; do
  t0=$(date +%s.%N)
  "$mpirun" -np 8 "$bin" --config "$out/s.yaml" --set parallel.dp_shard=8 --set training.steps=1 \
    --set checkpoint.dir= train >"$out/start.log" 2>&1
  t1=$(date +%s.%N)
  echo "dp_shard 8, $bin: launch to exit with 1 step $(python3 -c "print(f'{$t1 - $t0:.2f}')") s; peak resident memory of rank 0 through set-up: $(num "$out/start.log" "memory after setup:") MiB" >>"$report"
done
cat "$report"
