#!/usr/bin/env bash
# Traces and the slow rank (issue 40): a pp 2 x dp_shard 2 x tp 2 run (8 ranks) with profile.steps writes a Chrome
# trace per rank and the merged trace.json (with an asynchronous checkpoint's phases); check_trace.py checks the format's rules, that the spans inside each
# step cover its wall time within 5% on every rank, that the collective spans' calls and bytes equal the Group
# counters, that the pipeline actions come in the order of `meshtrain plan`'s schedule, and that the memory
# track's peak equals the allocator's; `meshtrain trace merge` rebuilds trace.json; plot_trace.py draws a step;
# a rank slowed on purpose (MT_FAULT_SLOW_RANK) is named within 10 steps with its host, and the spread is in the
# metrics; bad profile keys are clear errors. Prints "trace: N passed, N failed" last.
#   tests/cli/test_trace.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_trace.sh BUILD_DIR}

source "$(dirname "$0")/common.sh"

docs_data
write_yaml "dim: 64, n_layers: 4, n_heads: 4, n_kv_heads: 2, ffn_dim: 96, vocab_size: 256, max_seq_len: 32" \
  "steps: 5, batch_size: 8, seq_len: 32, micro_batch_size: 2" "parallel: {dp_replicate: 1}"
mesh=(--set parallel.pp=2 --set parallel.dp_shard=2 --set parallel.tp=2 --set parallel.fsdp.min_weight_size=1000)

# The traced run: steps 3 and 4 (an evaluation at step 5 is outside the range).
# An asynchronous checkpoint at step 3 puts its phases in the trace, the writer on its own lane.
if train traced 8 "${mesh[@]}" --set 'profile.steps=[3, 4]' --set profile.dir="$tmp/tr" --set checkpoint.dir="$tmp/ck" \
  --set checkpoint.interval=3 --set checkpoint.async=true; then
  if grep -q "trace of steps 3 to 4: .* 8 ranks merged into $tmp/tr/trace.json" "$tmp/traced.log"; then
    ok "the run merges its 8 traces at the end of the range"
  else bad "the merge line" "$(grep -a trace "$tmp/traced.log" | tail -n 3)"; fi
else
  bad "traced run" "$(tail -n 20 "$tmp/traced.log")"
fi
# Rank 0's memory track at its peak, by part, beside `meshtrain estimate`'s (stage 0): within 5% each.
if "$py" - "$tmp/traced.jsonl" <<'PY'; then ok "memory at the traced peak by part within 5% of estimate's"; else bad "memory by part against estimate" "$(grep -a 'memory at the traced peak' "$tmp/traced.log")"; fi
import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if '"memory_peak"' in l][0]
for k in ("parameters", "gradients", "optimizer state", "communication buffers", "activations and temporaries", "peak"):
    t, e = r[k]["trace"], r[k]["estimate"]
    print(f"  {k}: trace {t / 2**20:.3f} MiB, estimate {e / 2**20:.3f} MiB ({100 * (t / e - 1) if e else 0:+.1f}%)")
    assert (t == e == 0) or (e > 0 and abs(t / e - 1) <= 0.05), k
# fully_shard holds its gathered units at the peak of this mesh (dp_shard 2): the track names them.
assert r["fully_shard units"]["trace"] > 0, "no fully_shard units at the peak"
print(f"  fully_shard units: trace {r['fully_shard units']['trace'] / 2**20:.3f} MiB")
PY
"$mpirun" -np 8 "$mt" --config "$tmp/t.yaml" "${mesh[@]}" plan >"$tmp/plan.txt" 2>&1 || bad "plan" "$(tail -n 5 "$tmp/plan.txt")"
out=$("$py" "$root/tests/cli/check_trace.py" "$tmp/tr" --plan "$tmp/plan.txt" 2>&1)
echo "$out"
passed=$((passed + $(grep -c '^ok ' <<<"$out")))
failed=$((failed + $(grep -c '^FAIL' <<<"$out")))
[ -n "$out" ] || bad "check_trace.py printed nothing"

if "$py" - "$tmp/tr/trace_rank0.json" <<'PY'; then ok "checkpoint phases in the trace, the async writer on its own lane"; else bad "checkpoint spans"; fi
import json, sys
ev = json.load(open(sys.argv[1]))["traceEvents"]
names = {(e["name"], e["tid"]) for e in ev if e.get("cat") == "checkpoint"}
writer = [e["tid"] for e in ev if e["ph"] == "M" and e["args"].get("name") == "checkpoint writer"]
assert writer and ("checkpoint: write files", writer[0]) in names, names
# (its commit comes at the first step boundary where the writers are done: in the range or after it)
for n in ("checkpoint save", "checkpoint: check shards", "checkpoint: gather and snapshot"):
    assert (n, 0) in names, (n, names)
# The snapshot's host copies are the memory track's "checkpoint snapshot" while the writer holds them.
mem = [e["args"].get("checkpoint snapshot", 0) for e in ev if e["ph"] == "C" and e["name"] == "memory"]
assert max(mem) > 0, "no checkpoint snapshot in the memory track"
PY
# `meshtrain trace merge DIR` rebuilds the same merged file.
cp "$tmp/tr/trace.json" "$tmp/run_merged.json"
rm "$tmp/tr/trace.json"
if "$mt" trace merge "$tmp/tr" >"$tmp/merge.log" 2>&1 && grep -q "merged 8 rank(s)" "$tmp/merge.log" &&
  cmp -s "$tmp/tr/trace.json" "$tmp/run_merged.json"; then
  ok "meshtrain trace merge: 8 ranks, the same trace.json as the run's"
else bad "meshtrain trace merge" "$(cat "$tmp/merge.log")"; fi
expect "trace merge of a directory without traces" nonzero "no trace_rank*.json files" -- "$mt" trace merge "$tmp/data"

# The picture.
if png=$("$py" "$root/scripts/plot_trace.py" "$tmp/tr" --step 4 --out "$tmp/step4.png" 2>&1) && [ -s "$tmp/step4.png" ]; then
  ok "plot_trace.py draws step 4 ($(stat -c %s "$tmp/step4.png") B)"
else bad "plot_trace.py" "$png"; fi

# The slow rank: rank 3 of 4 (dp_shard 2 x tp 2) sleeps 150 ms in every step; it is named within 10 steps.
write_yaml "dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 96, vocab_size: 256, max_seq_len: 32" \
  "steps: 12, batch_size: 8, seq_len: 32" "parallel: {dp_replicate: 1}"
if MT_FAULT_SLOW_RANK=3:150 train slow 4 --set parallel.dp_shard=2 --set parallel.tp=2; then
  line=$(grep -a "slow rank:" "$tmp/slow.log" | head -n 1)
  at=$(sed -n 's/.*(step \([0-9]*\)).*/\1/p' <<<"$line")
  others=$(grep -a "slow rank:" "$tmp/slow.log" | grep -vc "slow rank: rank 3 ")
  if [[ "$line" == *"slow rank: rank 3 on $(hostname)"*"its own compute"* ]] && [ -n "$at" ] && [ "$at" -le 10 ] &&
    [ "$others" = 0 ]; then
    ok "the slowed rank 3 (and no other) is named at step $at with its host and where the time goes"
  else bad "the slow rank named within 10 steps" "${line:-no 'slow rank' line}"; fi
  if "$py" - "$tmp/slow.jsonl" <<'PY'; then ok "the spread per step in the metrics (slowest rank 3)"; else bad "spread records"; fi
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"event": "ranks"' in l or '"event":"ranks"' in l]
assert len(recs) == 12, len(recs)
late = recs[2:]
assert all(r["slowest_rank"] == 3 and r["compute_max_over_median"] > 1.5 and len(r["compute_s"]) == 4 for r in late), late[:2]
PY
else
  bad "slow-rank run" "$(tail -n 20 "$tmp/slow.log")"
fi
expect "profile.steps without a range" nonzero "profile.steps = [3]: expected [first, last]" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set 'profile.steps=[3]' --set profile.dir="$tmp/x" train
expect "profile.steps without profile.dir" nonzero "profile.dir is empty" -- \
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set 'profile.steps=[1, 2]' train

summary trace
