#!/usr/bin/env bash
# The control plane at scale on one machine, oversubscribed (issue 25): a tiny Llama on 1, 8, 32, 64 and 128 ranks
# (dp_shard n/2 x tp 2; 1 rank alone), each run timed from launch:
#   start-up   launch to "memory after setup" (MPI_Init, config agreement, mesh and groups, sharded creation);
#   step+save  one step and a sharded checkpoint (every rank a writer), to the end of the job;
#   resume     a second job resuming that checkpoint, launch to "resumed from";
#   stopped    (64 and 128 ranks) the last rank stops itself at the step's stop-signal all-reduce: the job must end
#              non-zero within comm.timeout_s (20 s; 120 s at 128 ranks, whose start-up alone takes ~60 s here) + a
#              margin, naming that rank.
#   scripts/bench/bench_control_plane.sh [BUILD_DIR] [RANKS...]   (default 1 8 32 64 128; OUT=/tmp/bench_cp_plane)
# Use a CPU-only build (scripts/setup.sh --cpu-only BUILD_DIR): a build with CUDA links cuBLAS/cuBLASLt/NCCL/cudart
# and each rank then carries about 110 MiB of private memory for them even on CPU.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
shift || true
ranks=("$@")
[ ${#ranks[@]} -eq 0 ] && ranks=(1 8 32 64 128)
out=${OUT:-/tmp/bench_cp_plane}
mt="$build/meshtrain"
mkdir -p "$out"
data="$root/data/fortunes"
[ -f "$data/fortunes_train_000000.bin" ] || "$root/scripts/prepare_data" --fortunes --out "$data" >/dev/null
cat >"$out/c.yaml" <<YAML
model: {dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 4, ffn_dim: 128, vocab_size: 256, max_seq_len: 32}
training: {steps: 1, batch_size: 128, seq_len: 32, threads: 1}
data: {train: "$data/fortunes_train_*.bin"}
eval: {interval: 0}
sample: {interval: 0}
log: {interval: 1}
parallel: {dp_replicate: 1, fsdp: {min_weight_size: 64}}
checkpoint: {interval: 0, keep: 1}
comm: {timeout_s: 60}
YAML
now() { date +%s.%N; }
# at LOG TEXT T0: seconds from T0 (epoch) to the timestamp of the first line holding TEXT.
at() {
  python3 - "$1" "$2" "$3" <<'PY'
import re, sys, datetime
for l in open(sys.argv[1], errors="replace"):
    m = re.match(r"\[(\d+):(\d+):(\d+\.\d+)\]", l)
    if m and sys.argv[2] in l:
        t0 = float(sys.argv[3])
        day = datetime.datetime.fromtimestamp(t0).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
        print(f"{day + int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3]) - t0:.2f}")
        break
else:
    print("-")
PY
}
report="$out/control_plane.md"
echo "| ranks | mesh | start-up s | step + save to exit s | save s (in the job) | resume: launch to resumed s | load s | stopped rank: ends in s, named |" >"$report"
echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |" >>"$report"
for n in "${ranks[@]}"; do
  mesh=(--set parallel.dp_shard=$n)
  desc="dp_shard=$n"
  if [ "$n" -ge 2 ]; then mesh=(--set parallel.dp_shard=$((n / 2)) --set parallel.tp=2); desc="dp_shard=$((n / 2)) x tp=2"; fi
  ck="$out/ck$n"
  rm -rf "$ck"
  t0=$(now)
  timeout 900 "$root/scripts/mpirun.sh" -np "$n" "$mt" --config "$out/c.yaml" "${mesh[@]}" --set checkpoint.dir="$ck" train \
    >"$out/run$n.log" 2>&1
  rc=$?
  t1=$(now)
  start=$(at "$out/run$n.log" "memory after setup" "$t0")
  total=$(python3 -c "print(f'{$t1 - $t0:.2f}')")
  save=$(grep -aoE "checkpoint step 1 -> .* in [0-9.]+ s" "$out/run$n.log" | grep -oE "[0-9.]+ s$" | head -1)
  [ $rc -ne 0 ] && total="FAILED ($rc)"
  t0=$(now)
  timeout 900 "$root/scripts/mpirun.sh" -np "$n" "$mt" --config "$out/c.yaml" "${mesh[@]}" --set checkpoint.dir="$ck" \
    --set training.steps=2 train >"$out/resume$n.log" 2>&1
  resume=$(at "$out/resume$n.log" "resumed from" "$t0")
  load=$(grep -aoE "loaded in [0-9.]+ s" "$out/resume$n.log" | grep -oE "[0-9.]+ s" | head -1)
  stopped="-"
  if [ "$n" -ge 64 ]; then
    last=$((n - 1))
    # The watchdog's limit covers start-up's collectives too: 128 ranks on 2 cores take about 60 s to start.
    drill_s=$((n >= 128 ? 120 : 20))
    t0=$(now)
    MT_FAULT_STOP_AT="stop-signal all_reduce:$last" timeout -k 10 $((drill_s + 300)) "$root/scripts/mpirun.sh" -np "$n" "$mt" \
      --config "$out/c.yaml" "${mesh[@]}" --set comm.timeout_s=$drill_s --set training.steps=3 --set checkpoint.dir= train \
      >"$out/stop$n.log" 2>&1
    src=$?
    t1=$(now)
    named=no
    grep -aq "world rank $last did not arrive" "$out/stop$n.log" && named=yes
    stopped="exit $src after $(python3 -c "print(f'{$t1 - $t0:.1f}')") s (timeout $drill_s s), rank $last named: $named"
  fi
  echo "| $n | $desc | $start | $total | ${save:--} | $resume | ${load:--} | $stopped |" >>"$report"
  tail -n 1 "$report"
done
