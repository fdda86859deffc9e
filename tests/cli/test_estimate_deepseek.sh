#!/usr/bin/env bash
# `meshtrain estimate` and `plan --search` for latent attention (deepseek_v3 with q_lora_rank > 0, deepseek_v2 with
# q_proj; v_head_dim 12 below the query-key width 16 + 8, so the zero-padded values count; dense layer 0, then
# sparse layers of 4 experts, top 2, and a shared expert):
#  - the parameters `estimate` prints (the model's count) equal the elements the trained model allocated (train's
#    "model state" line: trainable + frozen, V3's router bias frozen) and the parameters of the stage estimate built;
#  - the model's FLOPs per token (MFU's) are 6 N + 6 H (dqk + dv) T per layer, and the FLOPs a 1-rank step runs
#    count P V at the padded dqk: both against the formula written here from the model's sizes;
#  - the peak memory of rank 0 within 5% of what `train` measured (alloc_peak_bytes), and every (tag, group, kind)
#    of the bytes a step sends equal to the runtime's counters (`meshtrain plan`), on 1 rank, tp 2 with and without
#    sequence parallel, the cp ring and Ulysses (K/V of dn + dr a head), selective recompute, pp 2 (zb1p: the
#    router statistics' all-reduce over the stages too), and pp 2 whose stage 0 has no sparse layer (it trains:
#    the statistics' sum over the stages hung at the second step before; its losses equal one rank's);
#  - `estimate` notes the padded values' share of the attention FLOPs; `plan --search` over 4 ranks proposes plans
#    with ep.
# Prints "estimate-deepseek: N passed, N failed" last.
#   tests/cli/test_estimate_deepseek.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_estimate_deepseek.sh BUILD_DIR}

source "$(dirname "$0")/common.sh"

docs_data
mla="mla: {q_lora_rank: 32, kv_lora_rank: 16, qk_nope_head_dim: 16, qk_rope_head_dim: 8, v_head_dim: 12}"
moe="n_experts: 4, experts_per_token: 2, ffn_dim: 48, shared_expert_ffn_dim: 48, mlp_only_layers: [0]"
v3="type: deepseek_v3, dim: 64, n_layers: 3, n_heads: 4, n_kv_heads: 4, head_dim: 8, ffn_dim: 96, vocab_size: 256, max_seq_len: 64, $mla, moe: {$moe, n_group: 2, topk_group: 1, router_score: sigmoid}"
v2=${v3/deepseek_v3/deepseek_v2}
v2=${v2/q_lora_rank: 32/q_lora_rank: 0}
v2=${v2/, n_group: 2, topk_group: 1, router_score: sigmoid/, router_score: softmax}
yaml() {  # yaml MODEL: $tmp/t.yaml for the model (3 steps of 4 micro-batches of 2 sequences of 64 tokens)
  write_yaml "$1" "steps: 3, batch_size: 8, seq_len: 64, micro_batch_size: 2" "parallel: {dp_replicate: 1}"
  sed -i 's/^eval: .*/eval: {interval: 0}/; s/^sample: .*/sample: {interval: 0}/' "$tmp/t.yaml"
}

# bytes_match I: every (tag, group, kind) of run I's estimated bytes and calls per step equals what `meshtrain plan`
# counted (test_estimate.sh's check).
bytes_match() {
  "$py" - "$tmp/p$1.out" "$tmp/e$1.json" <<'PY'
import collections, json, re, sys
e = json.load(open(sys.argv[2]))
m, st = e["micro_batches"], e["stages"][0]
text = open(sys.argv[1]).read()
whole_step = "pipeline:" in text  # plan counts a whole pipeline step, else one micro-batch and the sync
counted, calls = collections.Counter(), collections.Counter()
for ph, tag, g, k, c, b in re.findall(r"bytes\[(\w+)\] tag=(\S+) group=(\S+) kind=(\S+) calls=(\d+) bytes=(\d+)", text):
    f = 1 if ph == "sync" or whole_step else m
    counted[(tag, g, k)] += int(b) * f
    calls[(tag, g, k)] += int(c) * f
est = {(c["tag"], c["group"], c["kind"]): (c["bytes"], c["calls"]) for c in st.get("comm", [])}
bad = [f"{k}: counted {counted[k]} B in {calls[k]} calls, estimated {est.get(k, (0, 0))}" for k in set(counted) | set(est)
       if est.get(k, (0, 0)) != (counted[k], calls[k])]
print("; ".join(bad) if bad else f"{len(est)} (tag, group, kind) entries, {sum(v[0] for v in est.values()):.0f} B per step")
sys.exit(1 if bad else 0)
PY
}

# counts I MODEL_YAML: run I's parameters (train's allocated elements, estimate's built stage, the model's count)
# and FLOPs (per token: the model's; the 1-rank step's) against the formula here.
counts() {
  "$py" - "$tmp/m$1.log" "$tmp/e$1.json" "$tmp/t.yaml" <<'PY'
import json, re, sys
log = open(sys.argv[1], errors="replace").read()
e = json.load(open(sys.argv[2]))
m = re.search(r"expected [0-9.]+ MiB = [0-9.]+ B x (\d+) elements(?: \+ [0-9.]+ B x (\d+) frozen elements)?", log)
allocated = int(m.group(1)) + int(m.group(2) or 0)
v3 = "deepseek_v3" in open(sys.argv[3]).read()
C, L, H, V, F, T = 64, 3, 4, 256, 96, 64
ql, R, dn, dr, dv, E, k, Fe, Fs = (32 if v3 else 0), 16, 16, 8, 12, 4, 2, 48, 48
dqk = dn + dr
attn = (C * ql + ql + ql * H * dqk if ql else C * H * dqk) + C * (R + dr) + R + R * H * (dn + dv) + H * dv * C
def sparse(experts): return C * E + experts * 3 * C * Fe + 3 * C * Fs + (E if v3 else 0)  # router, experts, shared, bias
layers = L * (attn + 2 * C) + 3 * C * F
total = layers + 2 * sparse(E) + 2 * V * C + C
active_no_emb = layers + 2 * sparse(k) + V * C + C  # lm_head counts, the embedding not
flops_model = 6 * active_no_emb + L * 6 * H * (dqk + dv) * T
tokens = e["micro_batches"] * e["micro_batch_size"] * T
flops_run = tokens * (6 * active_no_emb + L * 12 * H * dqk * T)  # P V at the padded width
got = {"train's allocated elements": allocated, "estimate's built stage": e["params"],
       "estimate's model count": e["params_total"]}
bad = [f"{k} {v} != {total}" for k, v in got.items() if v != total]
if abs(e["flops_per_token"] / flops_model - 1) > 1e-12: bad.append(f"FLOPs per token {e['flops_per_token']} != {flops_model}")
if abs(e["stages"][0]["flops"] / flops_run - 1) > 1e-9: bad.append(f"step FLOPs {e['stages'][0]['flops']} != {flops_run}")
print("; ".join(bad) if bad else f"{total} parameters ({e['params_active']} active) = train's elements = the built "
      f"stage's; {flops_model:.0f} FLOPs a token (the model's), the step {flops_run:.4g} (P V padded: "
      f"{flops_run / tokens / flops_model:.3f}x)")
sys.exit(1 if bad else 0)
PY
}

i=0
run_configs() {  # run_configs MODEL NAME CONFIG...: each "NP|WHAT|ARGS"
  local model=$1 name=$2
  shift 2
  yaml "$model"
  for c in "$@"; do
    IFS='|' read -r np what args <<<"$c"
    what="$name: $what"
    i=$((i + 1))
    # shellcheck disable=SC2086
    estimate_run $i "$np" "$what" $args || continue
    if [ "$np" = 1 ] && [ -z "$args" ]; then
      if out=$(counts $i 2>&1); then ok "$what: counts: $out"; else bad "$what: counts" "$out"; fi
    fi
    if out=$(peak_within_5pct "$tmp/m$i.jsonl" "$tmp/e$i.json" 3 2>&1); then ok "$what: memory: $out"
    else bad "$what: memory within 5%" "$out"; fi
    [ "$np" = 1 ] && continue  # one rank sends nothing
    if out=$(bytes_match $i 2>&1); then ok "$what: bytes per step = the runtime's counters: $out"
    else bad "$what: bytes" "$out"; fi
  done
}
run_configs "$v3" deepseek_v3 "1|1 rank|" "2|tp=2, sequence parallel|--set parallel.tp=2" \
  "2|tp=2, no sequence parallel|--set parallel.tp=2 --set parallel.sequence_parallel=false" \
  "2|cp=2 ring|--set parallel.cp=2" "2|cp=2 alltoall|--set parallel.cp=2 --set parallel.cp_method=alltoall" \
  "1|recompute selective|--set parallel.recompute.patterns=[\"model.layers.*\"] --set parallel.recompute.keep=[\"attention\"]" \
  "2|pp=2 zb1p (the router statistics summed over the stages)|--set parallel.pp=2 --set parallel.pp_schedule=zb1p"
run_configs "$v2" deepseek_v2 "1|1 rank|" "2|tp=2, sequence parallel|--set parallel.tp=2"

# A pipeline stage without sparse layers (as DeepSeek-V3's first stage, its dense layers): the router statistics'
# sum over the stages needs its zeros every micro-batch of every step (it hung at the second step before); the
# balance loss on, which reads that sum, the losses equal one rank's; the estimate as above. comm.timeout_s 60: a
# hang fails in a minute.
yaml "$v3"
dense0=(--set model.n_layers=4 --set "model.moe.mlp_only_layers=[0,1]" --set model.moe.output_router_logits=true
        --set comm.timeout_s=60)
if train d1 1 "${dense0[@]}"; then
  i=$((i + 1))
  what="deepseek_v3: pp=2 1f1b, stage 0 without sparse layers"
  if estimate_run $i 2 "$what" --set parallel.pp=2 "${dense0[@]}"; then
    if out=$("$py" "$compare" "$tmp/m$i.jsonl" "$tmp/d1.jsonl" --steps 3 2>&1); then ok "$what: 3 steps, 1 rank's losses: $out"
    else bad "$what: 1 rank's losses" "$out"; fi
    if out=$(peak_within_5pct "$tmp/m$i.jsonl" "$tmp/e$i.json" 3 2>&1); then ok "$what: memory: $out"
    else bad "$what: memory within 5%" "$out"; fi
    if out=$(bytes_match $i 2>&1); then ok "$what: bytes per step = the runtime's counters: $out"
    else bad "$what: bytes" "$out"; fi
  fi
else
  bad "deepseek_v3, 4 layers, 1 rank: train" "$(tail -n 10 "$tmp/d1.log")"
fi

expect "estimate says the kernels run P V at the padded width (MFU's FLOPs at v_head_dim)" zero \
  "values zero-padded to qk_nope_head_dim + qk_rope_head_dim = 24" -- \
  "$mt" --config "$tmp/t.yaml" estimate --world 1 --cluster "$root/configs/clusters/h100_ib.yaml"
expect "plan --search proposes ep plans for deepseek_v3" zero "ep=2 (2 experts a rank)" -- \
  "$mt" --config "$tmp/t.yaml" plan --search --world 4 --cluster "$root/configs/clusters/h100_ib.yaml" --top 1000
# The shipped configs: DeepSeek-V3's real shape (the report's 671B / 37B; no MTP) and Gemma 3 27B's.
expect "configs/estimate/deepseek_v3.yaml: DeepSeek-V3's parameters" zero \
  "671026419200 parameters total, 37552297472 active" -- \
  "$mt" --config "$root/configs/estimate/deepseek_v3.yaml" estimate --world 2048 --cluster "$root/configs/clusters/h800_ib.yaml"
expect "configs/estimate/gemma3_27b.yaml: Gemma 3 27B's parameters" zero "27009346304 parameters" -- \
  "$mt" --config "$root/configs/estimate/gemma3_27b.yaml" estimate --world 8 --cluster "$root/configs/clusters/h100_ib.yaml"
if grep -q "GiB: fits" "$tmp/out" && ! grep -q "DOES NOT FIT" "$tmp/out"; then ok "configs/estimate/gemma3_27b.yaml fits 80 GiB"
else bad "configs/estimate/gemma3_27b.yaml fits 80 GiB" "$(grep -E '^  (peak|device)' "$tmp/out")"; fi
summary estimate-deepseek
