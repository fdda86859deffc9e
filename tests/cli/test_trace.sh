#!/usr/bin/env bash
# Traces and the slow rank (issue 40): a pp 2 x dp_shard 2 x tp 2 run (8 ranks) with profile.steps writes a Chrome
# trace per rank and the merged trace.json (with an asynchronous checkpoint's phases); check_trace.py checks the format's rules, that the spans inside each
# step cover its wall time within 5% on every rank, that the collective spans' calls and bytes equal the Group
# counters, that the pipeline actions come in the order of `meshtrain plan`'s schedule, and that the memory
# track's peak equals the allocator's; `meshtrain trace merge` rebuilds trace.json; plot_trace.py draws a step;
# a rank slowed on purpose (MT_FAULT_SLOW_RANK) is named within 10 steps with its host, and the spread is in the
# metrics; bad profile keys are clear errors. On two ranks: a range against training.steps (an error, or cut and
# said), a range ending at the last step and a SIGUSR1 inside one exiting 0 and 138 while a rank writes slowly
# (MT_FAULT_SLOW_TRACE), profile.max_events, two runs in one directory and an unwritable profile.dir.
# Prints "trace: N passed, N failed" last.
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
# What the range's end held the run (every rank waits for the files and the merge): said once, and recorded with
# its parts (issue 54: where a traced run's time goes).
if out=$("$py" - "$tmp/traced.jsonl" 2>&1 <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if '"trace_end"' in l]
assert len(r) == 1, f"{len(r)} trace_end records"
r = r[0]
parts = r["write_s"] + r["merge_s"] + r["compare_s"]
assert min(r["write_s"], r["merge_s"], r["compare_s"]) >= 0 and parts <= r["s"] + 1e-3, r
assert r["events"] > 0, r
print(f"{r['s']:.2f} s: written {r['write_s']:.2f}, merged {r['merge_s']:.2f}, compared {r['compare_s']:.2f}; {r['events']} events")
PY
) && [ "$(grep -ac "the range's end held the run" "$tmp/traced.log")" -eq 1 ]; then
  ok "the range's end said once and recorded: $out"
else bad "the range's end said and recorded (trace_end)" "$out" "$(grep -a "range's end" "$tmp/traced.log")"; fi
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

# --- The range against the run, slow disks, the event bound, two runs in one directory, an unwritable dir ---
# Two ranks (dp_shard 2), no evaluation or samples: a traced step is a few ms and about 400 events per rank.
write_yaml "dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 96, vocab_size: 256, max_seq_len: 32" \
  "steps: 5, batch_size: 8, seq_len: 32" "parallel: {dp_replicate: 1, dp_shard: 2}"
sed -i 's/^eval: .*/eval: {interval: 0}/; s/^sample: .*/sample: {interval: 0}/' "$tmp/t.yaml"
# steps_traced FILE: the "step" spans' numbers of a rank's trace file, and its metadata's range, on one line.
steps_traced() {
  "$py" -c 'import json,sys; d=json.load(open(sys.argv[1])); s=sorted(e["args"]["step"] for e in d["traceEvents"] if e.get("cat")=="step"); print(s[0], s[-1], len(s), d["metadata"]["run"]["steps"])' "$1"
}
# 1. A range the run never reaches is a config error naming it (training.steps is the last step of any run of this
# config, resumed or not); one that ends after it traces and reports the steps it traced.
expect "profile.steps after training.steps: a config error" nonzero \
  "profile.steps = [50, 60] starts after training.steps = 5" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set 'profile.steps=[50, 60]' --set profile.dir="$tmp/r1" train
if train past 2 --set 'profile.steps=[4, 100]' --set profile.dir="$tmp/r2" &&
  grep -q "trace of steps 4 to 5: .* 2 ranks merged" "$tmp/past.log" &&
  [ "$(steps_traced "$tmp/r2/trace_rank1.json")" = "4 5 2 [4, 5]" ]; then
  ok "profile.steps [4, 100] of 5 steps: steps 4 to 5 traced, and said so"
else bad "a range past the last step" "$(grep -a 'trace\|error' "$tmp/past.log" | tail -n 3)" \
  "$(steps_traced "$tmp/r2/trace_rank1.json" 2>&1)"; fi
# A resumed run (from step 5) traces the range's steps it runs, and says when the range is behind it.
train first5 2 --set checkpoint.dir="$tmp/rck" >/dev/null
if train behind 2 --set checkpoint.dir="$tmp/rck" --set training.steps=8 --set 'profile.steps=[2, 3]' \
  --set profile.dir="$tmp/rb" && grep -q "profile.steps = \[2, 3\] ends before step 6, where this run resumes: nothing" \
  "$tmp/behind.log" && [ ! -e "$tmp/rb/trace_rank0.json" ] &&
  train inside 2 --set checkpoint.dir="$tmp/rck" --set training.steps=12 --set 'profile.steps=[4, 10]' \
  --set profile.dir="$tmp/ri" && grep -q "trace of steps 9 to 10: .* 2 ranks merged" "$tmp/inside.log" &&
  [ "$(steps_traced "$tmp/ri/trace_rank0.json")" = "9 10 2 [9, 10]" ]; then
  ok "a resumed run: a range behind it said and not traced; one it enters traced from its first step"
else bad "profile.steps on a resumed run" "$(grep -a 'trace\|resumed' "$tmp/behind.log" "$tmp/inside.log" | cut -c1-300)"; fi
# 2. A range ending at the last step, while rank 0 writes and merges slowly (MT_FAULT_SLOW_TRACE: 45 us per event,
# 2 s for the merge, longer than comm.timeout_s = 1.5): the run ends as an untraced one does, trace merged.
slow=(--set training.steps=100 --set 'profile.steps=[1, 100]' --set comm.timeout_s=1.5)
if MT_FAULT_SLOW_TRACE=0:45 train lastrange 2 "${slow[@]}" --set profile.dir="$tmp/r3" &&
  grep -q "trace of steps 1 to 100: .* 2 ranks merged" "$tmp/lastrange.log"; then
  ok "a range ending at the last step, rank 0 slow to write and merge: exit 0, trace merged"
else bad "a range ending at the last step: exit 0" "$(grep -a 'trace\|timeout\|error' "$tmp/lastrange.log" | cut -c1-300 | tail -n 4)"; fi
# SIGUSR1 inside the range: 138 as untraced, and the steps traced until the stop written and said.
rm -f "$tmp/usr1.jsonl"
MT_FAULT_SLOW_TRACE=0:45 timeout 300 "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.steps=100000 \
  --set 'profile.steps=[1, 100000]' --set comm.timeout_s=1.5 --set profile.dir="$tmp/r4" \
  --set log.metrics_file="$tmp/usr1.jsonl" train >"$tmp/usr1.log" 2>&1 &
usr1_job=$!
wait_for_steps "$tmp/usr1.jsonl" 100 600 0.1
pkill -USR1 -f -- "^$mt .*log.metrics_file=$tmp/usr1.jsonl" 2>/dev/null
wait $usr1_job
usr1_rc=$?
usr1_step=$(sed -n 's/.*stopped after step \([0-9]*\).*/\1/p' "$tmp/usr1.log" | head -n 1)
if [ $usr1_rc -eq 138 ] && [ -n "$usr1_step" ] && grep -q "trace of steps 1 to $usr1_step: .* 2 ranks merged" "$tmp/usr1.log"; then
  ok "SIGUSR1 inside the range: exit 138, steps 1 to $usr1_step traced and merged"
else bad "SIGUSR1 inside the range: exit 138" "exit $usr1_rc" "$(grep -a 'trace\|timeout\|signal' "$tmp/usr1.log" | cut -c1-300 | tail -n 4)"; fi
# 3. A rank slow to write (rank 1: 2 s, past comm.timeout_s) does not time out its peers: the agreement's wait
# grows with the largest trace.
if MT_FAULT_SLOW_TRACE=1:45 train slowwrite 2 "${slow[@]}" --set training.steps=202 --set 'profile.steps=[1, 200]' \
  --set profile.dir="$tmp/r5" && grep -q "trace of steps 1 to 200: .* 2 ranks merged" "$tmp/slowwrite.log"; then
  ok "rank 1 slow to write its trace: no timeout, the run goes on and ends"
else bad "rank 1 slow to write its trace" "$(grep -a 'trace\|timeout\|error' "$tmp/slowwrite.log" | cut -c1-300 | tail -n 4)"; fi
# profile.max_events bounds each rank's buffer: the range ends at the step where a rank reached it, said once.
if train bounded 2 --set training.steps=40 --set 'profile.steps=[1, 40]' --set profile.max_events=3000 \
  --set profile.dir="$tmp/r6" && [ "$(grep -c "reached profile.max_events = 3000" "$tmp/bounded.log")" = 1 ] &&
  last=$(sed -n 's/.*trace of steps 1 to \([0-9]*\): .* 2 ranks merged.*/\1/p' "$tmp/bounded.log") &&
  [ -n "$last" ] && [ "$last" -lt 40 ] && "$py" - "$tmp/r6" "$last" <<'PY'; then
import json, sys
for r in (0, 1):
    d = json.load(open(f"{sys.argv[1]}/trace_rank{r}.json"))
    ev = [e for e in d["traceEvents"] if e["ph"] != "M"]
    assert len(ev) <= 3000, (r, len(ev))
    assert d["metadata"]["run"]["steps"] == [1, int(sys.argv[2])], d["metadata"]["run"]["steps"]
PY
  ok "profile.max_events = 3000: the range ends at step $last, said once, at most 3000 events a rank"
else bad "profile.max_events" "$(grep -a 'trace\|max_events\|error' "$tmp/bounded.log" | cut -c1-300 | tail -n 4)"; fi
# 4. Two runs in one directory: the second run (2 ranks, after one of 4) merges its own files only; `trace merge`
# refuses the mixed directory, and one that lacks ranks, naming what is wrong.
train mix4 4 --set parallel.dp_shard=4 --set 'profile.steps=[2, 3]' --set profile.dir="$tmp/mix" >/dev/null
mkdir -p "$tmp/gap"
cp "$tmp/mix/trace_rank0.json" "$tmp/mix/trace_rank3.json" "$tmp/gap/"
if train mix2 2 --set 'profile.steps=[2, 3]' --set profile.dir="$tmp/mix" &&
  grep -q "trace of steps 2 to 3: .* 2 ranks merged into .*, 2 file(s) of another run beside them left out" \
    "$tmp/mix2.log" &&
  [ "$("$py" -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["metadata"]["ranks"]))' "$tmp/mix/trace.json")" = 2 ]; then
  ok "a run merges its own rank files only, beside another run's in profile.dir"
else bad "a run merges its own rank files only" "$(grep -a 'trace of' "$tmp/mix2.log" "$tmp/mix4.log")"; fi
expect "trace merge of two runs' files: an error naming them" nonzero "trace files of 2 runs" -- "$mt" trace merge "$tmp/mix"
expect "trace merge of ranks 0 and 3 of 4: an error naming the missing ones" nonzero "ranks 1, 2 missing" -- \
  "$mt" trace merge "$tmp/gap"
# The merge reads a rank file as the ranks write it line by line, checking each event line as JSON without building
# the document (rank 0's merge holds every rank); a file laid out otherwise (pretty-printed) is read whole, to the
# same events; a damaged event line or a truncated file is an error naming the file.
for d in pretty bad cut; do mkdir -p "$tmp/$d" && cp "$tmp/tr"/trace_rank*.json "$tmp/$d/"; done
"$py" -c 'import json, sys; p = sys.argv[1]; j = json.load(open(p)); json.dump(j, open(p, "w"), indent=1)' \
  "$tmp/pretty/trace_rank3.json"
sed -i '10s/"ts":/"ts"/' "$tmp/bad/trace_rank5.json"
head -n -1 "$tmp/tr/trace_rank2.json" >"$tmp/cut/trace_rank2.json"
if "$mt" trace merge "$tmp/pretty" >"$tmp/pretty.log" 2>&1 && "$py" - "$tmp/tr/trace.json" "$tmp/pretty/trace.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
key = lambda e: json.dumps(e, sort_keys=True)
assert sorted(map(key, a["traceEvents"])) == sorted(map(key, b["traceEvents"])), "other events"
assert a["metadata"] == b["metadata"]
PY
then ok "trace merge: a pretty-printed rank file read whole, the same events and metadata as the run's merge"
else bad "trace merge of a pretty-printed rank file" "$(tail -n 3 "$tmp/pretty.log")"; fi
expect "trace merge: a damaged event line names the file and line" nonzero "trace_rank5.json: damaged (line 10 is not a JSON event)" -- \
  "$mt" trace merge "$tmp/bad"
expect "trace merge: a truncated rank file names it" nonzero "trace_rank2.json: damaged (truncated" -- \
  "$mt" trace merge "$tmp/cut"
# 5. An unwritable profile.dir: one error line, before the model is set up.
touch "$tmp/afile"
"$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set 'profile.steps=[1, 2]' --set profile.dir="$tmp/afile/tr" train \
  >"$tmp/nodir.log" 2>&1
nodir_rc=$?
if [ $nodir_rc -ne 0 ] && [ "$(grep -ac "profile.dir = $tmp/afile/tr" "$tmp/nodir.log")" = 1 ] &&
  ! grep -aq "model state on rank" "$tmp/nodir.log"; then
  ok "an unwritable profile.dir: one error line, before set-up"
else bad "an unwritable profile.dir" "exit $nodir_rc" "$(grep -a 'profile.dir\|model state' "$tmp/nodir.log" | cut -c1-300)"; fi
summary trace
