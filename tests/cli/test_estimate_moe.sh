#!/usr/bin/env bash
# `meshtrain estimate` for a mixture-of-experts model (mixtral: 4 sparse layers of 4 experts, top 2, expert ffn 48)
# against measured runs on 1, 2 and 4 CPU ranks with ep = 1, 2, 4:
#  - the peak memory of rank 0 within 5% of the high-water mark `train` reports (alloc_peak_bytes, every step after
#    the first). Bounded dropless ep (model.moe.dropless_bound, the default) holds E blocks of cap rows whatever the
#    routing, cap from the bound the step ran with (its metrics' moe_dropless_bound, raised by a step that
#    overflowed): the estimate at that bound, for the steps that ran with it. Exact dropless (dropless_bound 0): the
#    estimate assumes balanced routing (R = M = B T k rows at each rank's experts); the experts' rows on rank 0
#    follow the routing, so under ep the estimate is corrected by the measured routing (metrics' expert_load: with
#    one micro-batch a step it is exactly the rows rank 0's experts took) and the per-row bytes the estimate counts
#    (saved x, gate, up: C + 2 F elements a row and layer; the last layer's backward: 4 F + 4 C);
#  - every (tag, group, kind) of the bytes a step sends equal to the runtime's counters (`meshtrain plan`), calls
#    included; bounded, the rows' all-to-all (moe.dispatch) too: E x cap rows, padded, at the starting bound.
#    Exact, its bytes follow the routing: its calls equal, its bytes equal to the formula evaluated on the routing
#    plan measured (moe_load: each rank holds the same random micro-batch there, so rank 0 sends (M - its experts'
#    rows) and returns (ep - 1) x its experts' rows, C x 4 B each, twice: forward and backward), and reported
#    against uniform routing's (ep-1)/ep M;
#  - estimate and plan print total and active parameters; plan --search tries ep.
# Prints "estimate-moe: N passed, N failed" last.
#   tests/cli/test_estimate_moe.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_estimate_moe.sh BUILD_DIR}

source "$(dirname "$0")/common.sh"

docs_data
write_yaml "type: mixtral, dim: 64, n_layers: 4, n_heads: 8, n_kv_heads: 4, ffn_dim: 96, vocab_size: 256, max_seq_len: 64, moe: {n_experts: 4, experts_per_token: 2, ffn_dim: 48}" \
  "steps: 3, batch_size: 8, seq_len: 64, micro_batch_size: 2" "parallel: {dp_replicate: 1}"
sed -i 's/^eval: .*/eval: {interval: 0}/; s/^sample: .*/sample: {interval: 0}/' "$tmp/t.yaml"

# One micro-batch of 2 sequences a rank (batch 2 x ep): the measured routing is then the rows of that micro-batch.
configs=("1|ep=1 (4 micro-batches)|--set parallel.ep=1"
         "2|ep=2|--set parallel.ep=2 --set training.batch_size=4"
         "4|ep=4|--set parallel.ep=4 --set training.batch_size=8"
         "4|ep=2 x dp_replicate=2|--set parallel.ep=2 --set parallel.dp_replicate=2 --set training.batch_size=8"
         "2|ep=2 exact (dropless_bound 0)|--set parallel.ep=2 --set training.batch_size=4 --set model.moe.dropless_bound=0")
i=0
for c in "${configs[@]}"; do
  IFS='|' read -r np what args <<<"$c"
  i=$((i + 1))
  # shellcheck disable=SC2086
  estimate_run $i "$np" "$what" $args || continue
  # Bounded: the estimate again at the bound the last step ran with (the steps before may have run with less).
  bound=$("$py" -c 'import json, sys; r = [json.loads(l) for l in open(sys.argv[1]) if "moe_dropless_bound" in l]
print(r[-1]["moe_dropless_bound"] if r else "")' "$tmp/m$i.jsonl")
  cp "$tmp/e$i.json" "$tmp/eb$i.json"
  # shellcheck disable=SC2086
  if [ -n "$bound" ] && ! "$mt" --config "$tmp/t.yaml" $args --set model.moe.dropless_bound="$bound" estimate \
       --world "$np" --json "$tmp/eb$i.json" >"$tmp/eb$i.out" 2>&1; then
    bad "$what: estimate at dropless_bound $bound" "$(tail -n 5 "$tmp/eb$i.out")"
    continue
  fi
  if out=$("$py" - "$tmp/m$i.jsonl" "$tmp/e$i.json" "$tmp/eb$i.json" "$bound" <<'PY' 2>&1
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"alloc_peak_bytes"' in l]
e = json.load(open(sys.argv[2]))
est, ep = e["stages"][0]["peak_bytes"], e["experts_per_rank"]
E, ep = 4, 4 // e["experts_per_rank"]
M, C, F = 2 * 64 * 2, 64, 48
bound = float(sys.argv[4]) if sys.argv[4] else 0
if bound:  # bounded dropless: E x cap rows whatever the routing, at the bound the step ran with
    est = json.load(open(sys.argv[3]))["stages"][0]["peak_bytes"]
    steps = [s for s in steps[:1] + [s for s in steps[1:] if s["moe_dropless_bound"] == bound]]
    assert len(steps) > 1, "no step after the first ran with the last step's bound"
out, worst = [], 0
for s in steps[1:]:  # the first step also makes the gradient buckets
    fix = 0
    if ep > 1 and not bound:
        assert e["micro_batches"] == 1, e["micro_batches"]
        # Rank 0's experts (the first E/ep) took these rows of the step's one micro-batch (summed over the ranks;
        # with dp_replicate the other replica's tokens go to its own ep group: divide by the replicas).
        reps = e["world"] // ep
        R = [sum(l[:E // ep]) / reps for l in s["expert_load"]]
        fix = 4 * (sum(r - M for r in R) * (C + 2 * F) + (R[-1] - M) * (4 * F + 4 * C))
    r = (est + fix) / s["alloc_peak_bytes"]
    worst = max(worst, abs(r - 1))
    how = f" (bound {bound:g})" if bound else " (routing-corrected)" if ep > 1 else ""
    out.append(f"step {s['step']}: {(est + fix) / 2**20:.3f} MiB estimated{how}, "
               f"{s['alloc_peak_bytes'] / 2**20:.3f} MiB measured ({r:.3f})")
print(f"{'bounded' if bound else 'balanced-routing'} estimate {est / 2**20:.3f} MiB; " + "; ".join(out))
sys.exit(0 if worst <= 0.05 else 1)
PY
  ); then ok "$what: memory: $out"; else bad "$what: memory within 5%" "$out"; fi
  if out=$("$py" - "$tmp/p$i.out" "$tmp/e$i.json" "$bound" <<'PY' 2>&1
import collections, json, re, sys
e = json.load(open(sys.argv[2]))
bounded = bool(sys.argv[3])
m, st = e["micro_batches"], e["stages"][0]
text = open(sys.argv[1]).read()
counted, calls = collections.Counter(), collections.Counter()
for ph, tag, g, k, c, b in re.findall(r"bytes\[(\w+)\] tag=(\S+) group=(\S+) kind=(\S+) calls=(\d+) bytes=(\d+)", text):
    f = 1 if ph == "sync" else m
    counted[(tag, g, k)] += int(b) * f
    calls[(tag, g, k)] += int(c) * f
est = {(c["tag"], c["group"], c["kind"]): (c["bytes"], c["calls"]) for c in st.get("comm", [])}
bad = []
for k in set(counted) | set(est):
    eb, ec = est.get(k, (0, 0))
    if k[0] == "moe.dispatch" and not bounded:
        if ec != calls[k]: bad.append(f"{k}: {calls[k]} calls counted, {ec} estimated")
        continue
    if (eb, ec) != (counted[k], calls[k]): bad.append(f"{k}: counted {counted[k]} B in {calls[k]} calls, estimated {(eb, ec)}")
note = ""
key = [k for k in est if k[0] == "moe.dispatch"]
if key and bounded:
    note = f"; moe.dispatch {counted[key[0]]} B in fixed blocks (E x cap rows)"
elif key:
    E, ep = 4, 4 // e["experts_per_rank"]
    loss_ranks = e["world"]
    loads = [[float(x) / loss_ranks for x in l.split()] for l in re.findall(r"moe_load\[\d+\]((?: \d+)+)", text)]
    assert len(loads) == 4, loads
    rows = sum((sum(l) - sum(l[:E // ep])) + (ep - 1) * sum(l[:E // ep]) for l in loads)  # out + returned, a layer
    formula = rows * 64 * 4 * m  # forward (rows out and back); the backward the same
    got = counted[key[0]]
    if got != 2 * formula: bad.append(f"moe.dispatch: counted {got} B, the formula on the measured routing {2 * formula:.0f} B")
    note = (f"; moe.dispatch {got} B = the formula on the measured routing, {got / est[key[0]][0]:.3f} x uniform "
            f"routing's {est[key[0]][0]:.0f} B")
print("; ".join(bad) if bad else f"{len(est)} (tag, group, kind) entries{note}")
sys.exit(1 if bad else 0)
PY
  ); then ok "$what: bytes per step = the runtime's counters: $out"; else bad "$what: bytes" "$out"; fi
done
expect "estimate prints total and active parameters" zero "230976 parameters total, 157248 active" -- \
  "$mt" --config "$tmp/t.yaml" --set parallel.ep=2 estimate --world 2 --cluster "$root/configs/clusters/h100_ib.yaml"
expect "plan prints the experts per rank" zero "2 experts per rank (E/ep = 4/2)" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set parallel.ep=2 --set training.batch_size=4 plan
expect "plan --search tries ep for an MoE model" zero "ep=2 (2 experts a rank)" -- \
  "$mt" --config "$tmp/t.yaml" plan --search --world 4 --cluster "$root/configs/clusters/h100_ib.yaml" --top 1000
# The shipped configs: GPU runs with ep, pp and NCCL.
for c in mixtral_8x7b qwen3_30b_a3b; do
  expect "estimate answers for configs/estimate/$c.yaml" zero "MFU" -- \
    "$mt" --config "$root/configs/estimate/$c.yaml" estimate --world 64 --cluster "$root/configs/clusters/h100_ib.yaml"
done
summary estimate-moe
