#!/usr/bin/env bash
# Context parallel end to end (parallelism invariance): cp = 2, 4 and 8,
# dp_replicate 2 x cp 2, cp 2 x tp 2 and dp_replicate 2 x cp 2 x tp 2, with the
# ring and the all-gather methods, give the losses of 1 rank over 20 steps;
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
if [ $full -eq 1 ]; then
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

# Bad input: each a clear message naming the key.
expect "seq_len not divisible by 2 cp" nonzero "training.seq_len = 60 must be a multiple of 8: parallel.cp = 4 with cp_load_balance head_tail" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp=4 --set training.seq_len=60 train
expect "seq_len not divisible by 2 cp x tp" nonzero "training.seq_len = 36 must be a multiple of 8" -- \
  "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp=2 --set parallel.tp=2 --set training.seq_len=36 train
expect "unknown cp method" nonzero "parallel.cp_method = 'ring_shift': expected one of 'ring', 'all_gather'" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp=2 --set parallel.cp_method=ring_shift train
expect "unknown load balance" nonzero "parallel.cp_load_balance = 'zigzag': expected one of" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp=2 --set parallel.cp_load_balance=zigzag train
expect "separator outside the vocabulary" nonzero "data.document_separator = 300: expected a token id in [0, model.vocab_size = 256)" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set data.document_separator=300 train

# meshtrain plan: chunks per rank and the cp bytes of a step. The "(equal)" lines compare the runtime's count with
# the analytic formula of the same binary (cp_layer_bytes): a consistency check. The bytes are also checked against
# a count made here from the YAML's sizes: per layer a rank's K and V are 2 x 4 rows x 16 tokens x 4 kv heads x 8 x
# 4 B = 16384 B; forward 2 layers x 3 x K/V; backward adds dK/dV (f32, the same size) 4 times (ring) or 3 times.
for method in ring all_gather; do
  expect "meshtrain plan ($method): chunks" zero "cp rank 1: [8, 16) [48, 56) (16 tokens)" -- \
    "$mpirun" -np 4 "$mt" --config "$tmp/t.yaml" "${one[@]}" --set parallel.cp=4 --set parallel.cp_method=$method plan
  cp "$tmp/out" "$tmp/plan.out"
  expect "meshtrain plan ($method): forward cp bytes = analytic (consistency: runtime count vs its own formula)" zero \
    "(equal)" -- grep "cp ($method) bytes per rank: forward" "$tmp/plan.out"
  expect "meshtrain plan ($method): backward cp bytes = analytic (consistency: runtime count vs its own formula)" zero \
    "(equal)" -- grep "cp bytes per rank: backward" "$tmp/plan.out"
  kv=16384
  moves=3
  [ $method = ring ] && moves=4
  same_count "meshtrain plan ($method): forward cp bytes = the test's own count" \
    "$(counted "$tmp/plan.out" forward cp.)" $((2 * 3 * kv))
  same_count "meshtrain plan ($method): backward cp bytes = the test's own count" \
    "$(counted "$tmp/plan.out" backward cp.)" $((2 * (3 * kv + moves * kv)))
done

echo "cp: $passed passed, $failed failed"
[ $failed -eq 0 ]
