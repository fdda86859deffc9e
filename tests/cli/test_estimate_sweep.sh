#!/usr/bin/env bash
# `meshtrain estimate` on configurations no other test uses: shapes drawn at random (a fixed seed, so every run
# draws the same ones; --seed N for others) over vocabularies, widths, depths, heads, sequence lengths,
# micro-batches, dtypes, recompute and 4-rank meshes (dp_shard, HSDP, tp x dp_shard, cp x dp_shard, pp x
# dp_shard, pp x tp, dp_replicate, cp), each trained for 3 steps. The estimate's peak for rank 0 must be within 5%
# of the high-water mark of what rank 0's tensors asked for (metrics' alloc_peak_bytes after the first step).
# Also prints, uncounted, rank 0's resident memory above an idle rank against the estimate's process figure.
# Prints "estimate-sweep: N passed, N failed" last.
#   tests/cli/test_estimate_sweep.sh BUILD_DIR [--full] [--seed N]
set -uo pipefail
build=${1:?usage: test_estimate_sweep.sh BUILD_DIR [--full] [--seed N]}
shift
count=6
seed=20261127
while [ $# -gt 0 ]; do
  case "$1" in
    --full) count=20 ;;
    --seed) seed=$2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

source "$(dirname "$0")/common.sh"
docs_data

# One configuration a line: "DESCRIPTION|--set ...", drawn with Python's seeded generator.
"$py" - "$seed" "$count" >"$tmp/configs.txt" <<'PY'
import random, sys
rng = random.Random(int(sys.argv[1]))
meshes = [("dp_shard=4", {"dp_shard": 4}), ("dp_replicate=2 x dp_shard=2", {"dp_replicate": 2, "dp_shard": 2}),
          ("tp=2 x dp_shard=2", {"tp": 2, "dp_shard": 2}), ("cp=2 x dp_shard=2", {"cp": 2, "dp_shard": 2}),
          ("pp=2 x dp_shard=2", {"pp": 2, "dp_shard": 2}), ("pp=2 x tp=2", {"pp": 2, "tp": 2}),
          ("dp_replicate=4", {"dp_replicate": 4}), ("cp=4", {"cp": 4})]
for i in range(int(sys.argv[2])):
    name, mesh = meshes[i % len(meshes)] if i < len(meshes) else rng.choice(meshes)
    hd = rng.choice([16, 32])
    heads = rng.choice([2, 4, 6]) if "tp" not in mesh else rng.choice([2, 4])
    kv = rng.choice([k for k in (1, 2, heads) if heads % k == 0 and ("tp" not in mesh or k % mesh["tp"] == 0)])
    dim = hd * heads
    layers = rng.choice([2, 3, 4])
    ffn = rng.choice([2, 3, 4]) * dim + rng.choice([0, 32])
    vocab = rng.choice([256, 1000, 5000, 32000])
    seq = rng.choice([64, 128])
    dp = mesh.get("dp_shard", 1) * mesh.get("dp_replicate", 1)
    rows = 8 // dp
    pp = mesh.get("pp", 1)
    micro = rng.choice([m for m in (1, 2, 4, 8) if rows % m == 0 and rows // m >= pp])
    sets = [f"parallel.{k}={v}" for k, v in mesh.items()] + [
        f"model.dim={dim}", f"model.n_heads={heads}", f"model.n_kv_heads={kv}", f"model.n_layers={layers}",
        f"model.ffn_dim={ffn}", f"model.vocab_size={vocab}", f"model.max_seq_len={seq}", f"training.seq_len={seq}",
        f"training.micro_batch_size={micro}"]
    what = f"{name}, dim {dim}, {layers} layers, {heads}/{kv} heads, ffn {ffn}, vocab {vocab}, seq {seq}, micro {micro}"
    if rng.random() < 0.3:
        sets.append("training.dtype=bf16"); what += ", bf16"
    if rng.random() < 0.3:
        sets.append('parallel.recompute.patterns=["model.layers.*"]'); what += ", recompute"
    if "dp_shard" in mesh and rng.random() < 0.5:
        sets.append("parallel.fsdp.min_weight_size=1000"); what += ", small weights sharded"
    print(what + "|" + " ".join("--set " + s for s in sets))
PY
write_yaml "dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 128, vocab_size: 256, max_seq_len: 64" \
  "steps: 3, batch_size: 8, seq_len: 64"
sed -i 's/^eval: .*/eval: {interval: 0}/; s/^sample: .*/sample: {interval: 0}/' "$tmp/t.yaml"

# An idle rank of the same binary and launcher: its resident memory after MPI init (estimate --rank-floor).
process_outside=0
floor=$(timeout 120 "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" estimate --rank-floor | "$py" -c "import json,sys; print(json.load(sys.stdin)['rank_floor_mib'])")
i=0
while IFS="|" read -r what args <&3; do
  i=$((i + 1))
  # shellcheck disable=SC2086
  if ! train s$i 4 $args; then bad "$what: train" "$(tail -n 5 "$tmp/s$i.log")"; continue; fi
  # shellcheck disable=SC2086
  if ! "$mt" --config "$tmp/t.yaml" $args estimate --world 4 --json "$tmp/e$i.json" >"$tmp/e$i.out" 2>&1; then
    bad "$what: estimate" "$(tail -n 5 "$tmp/e$i.out")"; continue; fi
  if out=$(peak_within_5pct "$tmp/s$i.jsonl" "$tmp/e$i.json" 2 2>&1); then ok "$what: $out"
  else bad "$what: memory within 5%" "$out"; fi
  # The process: rank 0's resident high-water mark above an idle rank's against the estimate's process less its
  # floor. Counted apart (not in the summary): the allocator's cache of transients of other sizes and blocks the
  # GEMM probe leaves are not modelled, and some configurations land outside 15% (see process_outside below).
  if pout=$("$py" - "$tmp/s$i.jsonl" "$tmp/e$i.json" "$floor" <<'PY' 2>&1
import json, sys
rss = max(json.loads(l)["peak_mem_bytes"] for l in open(sys.argv[1]) if '"peak_mem_bytes"' in l)
st = json.load(open(sys.argv[2]))["stages"][0]
est, measured = st["process_bytes"] - st["rank_floor_bytes"], rss - float(sys.argv[3]) * 2**20
print(f"process above an idle rank {est / 2**20:.2f} MiB estimated, {measured / 2**20:.2f} MiB measured "
      f"(ratio {est / measured:.3f})")
sys.exit(0 if abs(est / measured - 1) <= 0.15 else 1)
PY
  ); then echo "     process within 15%: $pout"; else
    process_outside=$((process_outside + 1)); echo "     process OUTSIDE 15%: $pout"; fi
done 3<"$tmp/configs.txt"
[ "$i" -gt 0 ] || bad "configurations drawn" "none"
echo "process: $process_outside of $i configuration(s) outside 15% (not counted)"
summary estimate-sweep
[ "$failed" -eq 0 ]
