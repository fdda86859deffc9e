#!/usr/bin/env bash
# Context parallel end to end (parallelism invariance): cp = 2, 4 and 8,
# dp_replicate 2 x cp 2, cp 2 x tp 2 and dp_replicate 2 x cp 2 x tp 2, with the
# ring and the all-gather methods, give the losses of 1 rank over 20 steps; so do
# Ulysses (alltoall) at cp 2, 4 and 8 (8 > n_kv_heads: shared kv heads), with
# tp 2 and with dp_shard 2, and 2-D cp (cp_ulysses 2 x cp_ring 2, alone and
# under dp_replicate 2);
# head_tail and contiguous splits agree; packed documents (data.document_separator)
# on cp = 4 give the losses of documents on 1 rank, and differ from no documents;
# bad cp settings are clear errors; `meshtrain plan` prints each rank's chunks and
# the cp bytes equal to the analytic count. Prints "cp: N passed, N failed" last.
#   tests/cli/test_cp.sh BUILD_DIR [--full]
set -uo pipefail
build=${1:?usage: test_cp.sh BUILD_DIR}
full=0
[ "${2:-}" = "--full" ] && full=1

source "$(dirname "$0")/common.sh"

# The docs as documents, each file starting with byte 30 (the separator): documents of a few KiB cross the
# chunk boundaries of a 64-token sequence split 16 ways.
docs_data --separator 30
# Short documents: every 40 bytes of the docs' text a separator, so that a 64-token sequence holds several and
# they cross every cp chunk boundary.
"$py" - "$tmp/data" <<'PY'
import glob, sys, numpy as np
for path in glob.glob(sys.argv[1] + "/docs_*.bin"):
    raw = open(path, "rb").read()
    head, toks = raw[:1024], np.frombuffer(raw[1024:], dtype=np.uint16).copy()
    toks[::40] = 30
    open(path.replace("docs_", "short_"), "wb").write(head + toks.tobytes())
PY
write_yaml "dim: 64, n_layers: 2, n_heads: 8, n_kv_heads: 4, ffn_dim: 96, vocab_size: 256, max_seq_len: 64" \
  "steps: 20, batch_size: 4, seq_len: 64"
one=(--set parallel.dp_replicate=1)

train base 1 "${one[@]}" || bad "1-rank baseline" "$(tail -n 20 "$tmp/base.log")"
for method in ring all_gather; do
  m=(--set parallel.cp_method=$method)
  same_as base cp2_$method 2 "cp=2 ($method)" "${one[@]}" --set parallel.cp=2 "${m[@]}"
  same_as base cp4_$method 4 "cp=4 ($method)" "${one[@]}" --set parallel.cp=4 "${m[@]}"
  same_as base cp8_$method 8 "cp=8 ($method)" "${one[@]}" --set parallel.cp=8 "${m[@]}"
  same_as base dp2cp2_$method 4 "dp_replicate=2 x cp=2 ($method)" --set parallel.dp_replicate=2 --set parallel.cp=2 "${m[@]}"
  same_as base cp2tp2_$method 4 "cp=2 x tp=2 ($method)" "${one[@]}" --set parallel.cp=2 --set parallel.tp=2 "${m[@]}"
  same_as base dp2cp2tp2_$method 8 "dp_replicate=2 x cp=2 x tp=2 ($method)" --set parallel.dp_replicate=2 \
    --set parallel.cp=2 --set parallel.tp=2 "${m[@]}"
done
same_as base cp4_none 4 "cp=4, contiguous split (cp_load_balance none)" "${one[@]}" --set parallel.cp=4 \
  --set parallel.cp_load_balance=none
# Ulysses: heads all-to-all'd over cp_ulysses (n_heads 8, n_kv_heads 4), alone, with tp and fully_shard, and 2-D.
a2a=(--set parallel.cp_method=alltoall)
same_as base cp2_a2a 2 "cp=2 (alltoall)" "${one[@]}" --set parallel.cp=2 "${a2a[@]}"
same_as base cp4_a2a 4 "cp=4 (alltoall)" "${one[@]}" --set parallel.cp=4 "${a2a[@]}"
same_as base cp8_a2a 8 "cp=8 (alltoall; 4 kv heads shared by 2 ranks each)" "${one[@]}" --set parallel.cp=8 "${a2a[@]}"
same_as base a2a2tp2 4 "cp=2 (alltoall) x tp=2" "${one[@]}" --set parallel.cp=2 --set parallel.tp=2 "${a2a[@]}"
same_as base ds2a2a2 4 "dp_shard=2 x cp=2 (alltoall)" "${one[@]}" --set parallel.dp_shard=2 --set parallel.cp=2 "${a2a[@]}"
same_as base u2r2 4 "cp_ulysses=2 x cp_ring=2" "${one[@]}" --set parallel.cp_ulysses=2 --set parallel.cp_ring=2
same_as base dp2u2r2 8 "dp_replicate=2 x (cp_ulysses=2 x cp_ring=2)" --set parallel.dp_replicate=2 \
  --set parallel.cp_ulysses=2 --set parallel.cp_ring=2
if [ $full -eq 1 ]; then
  same_as base u2r4 8 "cp_ulysses=2 x cp_ring=4 (all_gather)" "${one[@]}" --set parallel.cp_ulysses=2 \
    --set parallel.cp_ring=4 --set parallel.cp_method=all_gather
  same_as base u4r2 8 "cp_ulysses=4 x cp_ring=2" "${one[@]}" --set parallel.cp_ulysses=4 --set parallel.cp_ring=2
  same_as base cp2tp2_nosp 4 "cp=2 x tp=2 without sequence parallel" "${one[@]}" --set parallel.cp=2 --set parallel.tp=2 \
    --set parallel.sequence_parallel=false
  same_as base cp8_none_ag 8 "cp=8 contiguous, all_gather" "${one[@]}" --set parallel.cp=8 \
    --set parallel.cp_load_balance=none --set parallel.cp_method=all_gather
fi

# Packed documents: attention stays inside documents, with and without cp.
docs=(--set data.train="$tmp/data/short_train_*.bin" --set data.val="$tmp/data/short_val_*.bin" --set data.document_separator=30)
train nodoc 1 "${one[@]}" --set data.train="$tmp/data/short_train_*.bin" --set data.val="$tmp/data/short_val_*.bin" ||
  bad "documents off" "$(tail -n 20 "$tmp/nodoc.log")"
train doc1 1 "${one[@]}" "${docs[@]}" || bad "documents on 1 rank" "$(tail -n 20 "$tmp/doc1.log")"
if out=$("$py" "$compare" "$tmp/doc1.jsonl" "$tmp/nodoc.jsonl" --steps 20 2>&1); then
  bad "documents change the losses" "$out"; else ok "documents change the losses (the mask is applied)"; fi
same_as doc1 doc_cp4_ring 4 "documents, cp=4 (ring)" "${one[@]}" --set parallel.cp=4 "${docs[@]}"
same_as doc1 doc_cp4_all_gather 4 "documents, cp=4 (all_gather)" "${one[@]}" --set parallel.cp=4 \
  --set parallel.cp_method=all_gather "${docs[@]}"
same_as doc1 doc_cp2tp2 4 "documents, cp=2 x tp=2" "${one[@]}" --set parallel.cp=2 --set parallel.tp=2 "${docs[@]}"
same_as doc1 doc_cp4_a2a 4 "documents, cp=4 (alltoall)" "${one[@]}" --set parallel.cp=4 "${a2a[@]}" "${docs[@]}"
same_as doc1 doc_u2r2 4 "documents, cp_ulysses=2 x cp_ring=2" "${one[@]}" --set parallel.cp_ulysses=2 \
  --set parallel.cp_ring=2 "${docs[@]}"

# Bad input: each a clear message naming the key.
expect "seq_len not divisible by 2 cp" nonzero "training.seq_len = 60 must be a multiple of 8: parallel.cp = 4 with cp_load_balance head_tail" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp=4 --set training.seq_len=60 train
expect "seq_len not divisible by 2 cp x tp" nonzero "training.seq_len = 36 must be a multiple of 8" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp=2 --set parallel.tp=2 --set training.seq_len=36 train
expect "unknown cp method" nonzero "parallel.cp_method = 'ring_shift': expected one of 'ring', 'all_gather', 'alltoall'" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp=2 --set parallel.cp_method=ring_shift train
expect "unknown load balance" nonzero "parallel.cp_load_balance = 'zigzag': expected one of" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp=2 --set parallel.cp_load_balance=zigzag train
expect "q heads do not split over alltoall" nonzero \
  "model.n_heads = 4 over parallel.tp = 1 leaves 4 q heads per rank, which do not divide by parallel.cp = 8" -- \
  "$mpirun" -np 8 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp=8 "${a2a[@]}" --set model.n_heads=4 train
expect "q heads do not split over tp x cp_ulysses" nonzero \
  "leaves 2 q heads per rank, which do not divide by parallel.cp = 4" -- \
  "$mpirun" -np 8 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.tp=2 --set parallel.cp_ulysses=4 \
  --set parallel.cp_ring=1 --set model.n_heads=4 --set model.n_kv_heads=2 train
expect "cp is not cp_ulysses x cp_ring" nonzero \
  "parallel.cp_ulysses x parallel.cp_ring = 2 x 2 = 4, but parallel.cp = 8" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp=8 --set parallel.cp_ulysses=2 \
  --set parallel.cp_ring=2 train
expect "seq_len not divisible by 2-D cp" nonzero \
  "training.seq_len = 56 must be a multiple of 16: parallel.cp_ring = 2 with cp_load_balance head_tail splits it into 2 x 2 chunks, and parallel.cp_ulysses = 4 splits each of those into 4" -- \
  "$mpirun" -np 8 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp_ulysses=4 --set parallel.cp_ring=2 \
  --set training.seq_len=56 train
expect "separator outside the vocabulary" nonzero "data.document_separator = 300: expected a token id in [0, model.vocab_size = 256)" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set data.document_separator=300 train

# meshtrain plan: chunks per rank and the cp bytes of a step. The "(equal)" lines compare the runtime's count with
# the analytic formula of the same binary (cp_layer_bytes): a consistency check. The bytes are also checked against
# a count made here from the YAML's sizes: per layer a rank's K and V are 2 x 4 rows x 16 tokens x 4 kv heads x 8 x
# 4 B = 16384 B; forward 2 layers x 3 x K/V; backward adds dK/dV (f32, the same size) 4 times (ring) or 3 times.
for method in ring all_gather; do
  expect "meshtrain plan ($method): chunks" zero "cp_ring 1 cp_ulysses 0: [8, 16) [48, 56) (16 tokens)" -- \
    "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp=4 --set parallel.cp_method=$method plan
  cp "$tmp/out" "$tmp/plan.out"
  expect "meshtrain plan ($method): forward cp bytes = analytic (consistency: runtime count vs its own formula)" zero \
    "(equal)" -- grep "cp_ring ($method) bytes per rank: forward" "$tmp/plan.out"
  expect "meshtrain plan ($method): backward cp bytes = analytic (consistency: runtime count vs its own formula)" zero \
    "(equal)" -- grep "cp_ring bytes per rank: backward" "$tmp/plan.out"
  kv=16384
  moves=3
  [ $method = ring ] && moves=4
  same_count "meshtrain plan ($method): forward cp bytes = the test's own count" \
    "$(counted "$tmp/plan.out" forward cp.)" $((2 * 3 * kv))
  same_count "meshtrain plan ($method): backward cp bytes = the test's own count" \
    "$(counted "$tmp/plan.out" backward cp.)" $((2 * (3 * kv + moves * kv)))
done
# Ulysses: per layer a rank sends (U-1)/U of q, k, v (4 rows x 16 tokens x (8 + 2 x 4) heads x 8 x 4 B) in forward
# and the output back: (U-1) x 4 x 16 x 8 x (2 x 8/U + 2 x max(1, 4/U)) x 4 B; backward the same. 2-D (U 2 x R 2):
# the ring then moves K/V of (4 rows, 32 tokens, 2 kv heads, 8) = 16384 B: once forward, once + dK/dV twice backward.
expect "meshtrain plan (alltoall): chunks and heads" zero "rank 3 q [6, 8) kv [3, 4)" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp=4 "${a2a[@]}" plan
cp "$tmp/out" "$tmp/plan.out"
for phase in forward backward; do
  expect "meshtrain plan (alltoall): $phase bytes = analytic" zero "(equal)" -- \
    grep "cp_ulysses (alltoall) bytes per rank: $phase" "$tmp/plan.out"
  same_count "meshtrain plan (alltoall): $phase bytes = the test's own count" \
    "$(counted "$tmp/plan.out" $phase cp.)" $((2 * 3 * 4 * 16 * 8 * (2 * 2 + 2 * 1) * 4))
done
expect "meshtrain plan (2-D): chunks" zero "cp_ring 1 cp_ulysses 1: [32, 48) (16 tokens)" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp_ulysses=2 --set parallel.cp_ring=2 plan
cp "$tmp/out" "$tmp/plan.out"
grep -q "cp_ring (ring) bytes per rank: forward.*(equal)" "$tmp/plan.out" && grep -q "cp_ring bytes per rank: backward.*(equal)" "$tmp/plan.out" &&
  grep -q "cp_ulysses (alltoall) bytes per rank: forward.*(equal)" "$tmp/plan.out" &&
  grep -q "cp_ulysses (alltoall) bytes per rank: backward.*(equal)" "$tmp/plan.out" &&
  ok "meshtrain plan (2-D): each dim's bytes = analytic" || bad "meshtrain plan (2-D): each dim's bytes = analytic" \
  "$(grep "bytes per rank" "$tmp/plan.out")"
a2a_layer=$((1 * 4 * 16 * 8 * (2 * 4 + 2 * 2) * 4))
same_count "meshtrain plan (2-D): forward bytes = the test's own count" \
  "$(counted "$tmp/plan.out" forward cp.)" $((2 * (a2a_layer + 16384)))
same_count "meshtrain plan (2-D): backward bytes = the test's own count" \
  "$(counted "$tmp/plan.out" backward cp.)" $((2 * (a2a_layer + 16384 + 2 * 16384)))

echo "cp: $passed passed, $failed failed"
[ $failed -eq 0 ]
