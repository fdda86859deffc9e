#!/usr/bin/env bash
# Mixture of experts end to end (models/llama/moe.h, parallel.ep): a Mixtral directory written by the PyTorch
# reference (scripts/reference/llama_ref.py; 8 experts, top-2, the balance loss on) trains 20 f64 AdamW steps
#  - on 1 rank equal to the reference (within 1e-5), and on ep 2, 4, 8 (1 expert per rank), ep 2 x dp_shard 2,
#    ep 2 x tp 2, ep 2 x cp 2, HSDP x ep (dp_replicate 2 x dp_shard 2 x ep 2) equal to the 1-rank run within 1e-4
#    (dropless ep in fixed blocks: model.moe.dropless_bound 1.25), also ep 2 with a bound of 1 whose overflowing
#    steps are recomputed (logged, moe_bound_recomputed, no row dropped) and ep 2 with the exact sizes (bound 0);
#    pp 2 and ep 2 x pp 2 (1f1b and zb1p) with the balance loss pooled over the stages equal to 1 rank (ep 2) in
#    the same micro-batches; ep 2 x pp 2 without the balance loss equal to the reference trained without it;
#  - checkpoints: saved on ep 2 as Hugging Face's per-expert tensors (experts.{j}.w1.weight, no stacked '*' name),
#    read by the reference with meshtrain's logits and loss, resumed on ep 4 and on 1 rank with the same losses;
#  - metrics: aux_loss, expert_load (layers x experts, each row tokens x k), its max over mean, dropped_tokens;
#    a capacity factor of 1 drops rows and trains on; bias_update_rate moves the selection bias, alike on ep 2 and
#    pp 2, and resumed from a checkpoint with it (meta.json's model_state); under pp rank 0's metrics hold every
#    stage's layers;
#  - bad input: a clear config error before any collective; a rank stopped before the all-to-all: the job ends
#    within comm.timeout_s naming the ep group.
# --full adds ep 4 x tp 2, ep 2 x cp 2 x tp 2, ep 2 x pp 2 x dp_shard 2 and a Qwen3-MoE directory (renormalised top-k)
# on ep 8 and ep 2 x tp 2 against its reference.
# Prints "moe: N passed, N failed[, N skipped]" last.
#   tests/cli/test_moe.sh BUILD_DIR [--full]
set -uo pipefail
build=${1:?usage: test_moe.sh BUILD_DIR [--full]}
full=0
[ "${2:-}" = "--full" ] && full=1
source "$(dirname "$0")/common.sh"
ref="$root/scripts/reference/llama_ref.py"

need_torch moe "MoE against the PyTorch reference, expert parallel, checkpoints, metrics"

E=8 K=2 B=8 T=32 L=2
docs_data --val-fraction 0.1
cat >"$tmp/t.yaml" <<YAML
training: {steps: 20, batch_size: $B, seq_len: $T, lr: 3.0e-3, warmup_steps: 3, lr_min: 3.0e-4, grad_clip: 1.0,
           weight_decay: 0.1, threads: 1, schedule: cosine, dtype: fp64}
data: {train: "$tmp/data/docs_train_*.bin", val: "$tmp/data/docs_val_*.bin"}
eval: {interval: 0}
sample: {interval: 0}
log: {interval: 1}
parallel: {fsdp: {min_weight_size: 0}}
YAML

# reference NAME INIT_ARGS...: $tmp/NAME written by the reference and its 20 f64 steps in $tmp/NAME.ref.json.
reference() {
  local name=$1
  shift
  "$py" "$ref" init --out "$tmp/$name" --dim 32 --n-layers $L --n-heads 4 --n-kv-heads 2 --ffn-dim 64 --vocab-size 256 \
    --max-seq-len 64 --seed 5 --n-experts $E --experts-per-token $K --moe-ffn-dim 16 "$@" >"$tmp/$name.init.log" 2>&1 ||
    { bad "$name: reference init" "$(tail -n 5 "$tmp/$name.init.log")"; return 1; }
  ref_train "$name"
}
ref_train() {
  "$py" "$ref" train --model "$tmp/$1" --data "$tmp/data/docs_train_*.bin" --steps 20 --batch-size $B --seq-len $T \
    --lr 3e-3 --schedule cosine --warmup-steps 3 --lr-min 3e-4 --weight-decay 0.1 --grad-clip 1.0 --threads 1 \
    --dtype f64 --out "$tmp/$1.ref.json" >"$tmp/$1.ref.log" 2>&1 ||
    { bad "$1: reference train" "$(tail -n 10 "$tmp/$1.ref.log")"; return 1; }
}

# run NAME NP [--set ...]: 20 steps of $tmp/t.yaml on NP ranks, metrics in $tmp/NAME.jsonl (appended to by meshtrain:
# removed first), output in $tmp/NAME.log.
run() {
  local name=$1 np=$2
  shift 2
  rm -f "$tmp/$name.jsonl"
  timeout 600 "$mpirun" -np "$np" "$mt" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/$name.jsonl" "$@" train \
    >"$tmp/$name.log" 2>&1
}
# same NAME NP AGAINST WHAT [--set ...]: trains NAME and checks its 20 losses against AGAINST's within 1e-4.
same() {
  local name=$1 np=$2 against=$3 what=$4
  shift 4
  if run "$name" "$np" "$@"; then
    if out=$("$py" "$compare" "$tmp/$name.jsonl" "$against" --rel0 1e-4 --abs 1e-4 --steps 20 2>&1); then ok "$what: $out"
    else bad "$what" "$out"; fi
  else
    bad "$what" "$(tail -n 20 "$tmp/$name.log")"
  fi
}

reference mix --model-type mixtral --output-router-logits || { summary moe; exit 1; }
mix=(--set model.init_from="$tmp/mix")

# --- The same losses on every mesh ---
same base 1 "$tmp/mix.ref.json" "1 rank: 20 f64 steps equal the reference's (balance loss on)" "${mix[@]}"
base="$tmp/base.jsonl"
# ep 2 also saves checkpoints every 5 steps (below).
same ep2 2 "$base" "ep 2 equals 1 rank" "${mix[@]}" --set parallel.ep=2 --set checkpoint.dir="$tmp/ep2.ckpt" \
  --set checkpoint.interval=5 --set checkpoint.keep=0
same ep4 4 "$base" "ep 4 equals 1 rank" "${mix[@]}" --set parallel.ep=4
same ep8 8 "$base" "ep 8 (1 expert per rank) equals 1 rank" "${mix[@]}" --set parallel.ep=8
same ep2_ds2 4 "$base" "ep 2 x dp_shard 2 equals 1 rank" "${mix[@]}" --set parallel.ep=2 --set parallel.dp_shard=2
same ep2_tp2 4 "$base" "ep 2 x tp 2 equals 1 rank" "${mix[@]}" --set parallel.ep=2 --set parallel.tp=2
same ep2_cp2 4 "$base" "ep 2 x cp 2 equals 1 rank" "${mix[@]}" --set parallel.ep=2 --set parallel.cp=2
same hsdp_ep 8 "$base" "HSDP x ep (dp_replicate 2 x dp_shard 2 x ep 2) equals 1 rank" "${mix[@]}" \
  --set parallel.dp_replicate=2 --set parallel.dp_shard=2 --set parallel.ep=2
# Dropless ep's exchange: the runs above send fixed blocks of model.moe.dropless_bound (1.25) x the mean rows per
# expert; a bound of 1 (this router is far from balanced) overflows in the first steps: those steps run again with a
# larger bound, and the run still equals 1 rank, with no row dropped. dropless_bound 0: the exact sizes.
same bound1 2 "$base" "ep 2 with model.moe.dropless_bound 1 (steps recomputed past the bound) equals 1 rank" "${mix[@]}" \
  --set parallel.ep=2 --set model.moe.dropless_bound=1 --set checkpoint.dir="$tmp/b1.ckpt" --set checkpoint.interval=10
# The bound is kept in the checkpoint (meta.json's model_state): resumed at step 10, the run goes on with it.
if run bound1_resume 2 "${mix[@]}" --set parallel.ep=2 --set model.moe.dropless_bound=1 \
  --set checkpoint.resume="$tmp/b1.ckpt/step_00000010" --set checkpoint.dir="$tmp/b1_resume.ckpt"; then
  check "dropless_bound 1: resumed at step 10 with the checkpoint's bound, steps 11-20 as uninterrupted" -- \
    "$py" - "$tmp/bound1.jsonl" "$tmp/bound1_resume.jsonl" <<'PY'
import json, sys
a, b = ({r["step"]: r for r in map(json.loads, open(p)) if "loss" in r} for p in sys.argv[1:])
for s in range(11, 21):
    assert b[s]["moe_dropless_bound"] == a[s]["moe_dropless_bound"], (s, a[s]["moe_dropless_bound"], b[s]["moe_dropless_bound"])
    assert abs(b[s]["loss"] - a[s]["loss"]) <= 1e-9 * abs(a[s]["loss"]), (s, a[s]["loss"], b[s]["loss"])
print(f"bound {b[11]['moe_dropless_bound']} at step 11, losses equal")
PY
else bad "dropless_bound 1 resumed at step 10" "$(tail -n 15 "$tmp/bound1_resume.log")"; fi
if [ -f "$tmp/bound1.jsonl" ]; then
  check "dropless_bound 1: the log names the recomputed steps and the metrics' moe_bound_recomputed agree, 0 dropped" -- \
    "$py" - "$tmp/bound1.jsonl" "$tmp/bound1.log" <<'PY'
import collections, json, re, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
log = collections.Counter(int(s) for s in re.findall(r"step (\d+) had rows past the bound \(f = [0-9.]+\); recomputed "
                                                     r"with f = [0-9.]+ \(up to \d+ rows per expert per rank\)",
                                                     open(sys.argv[2], errors="replace").read()))
assert len(rows) == 20 and all(r["dropped_tokens"] == 0 for r in rows), [r["dropped_tokens"] for r in rows]
got = {r["step"]: r["moe_bound_recomputed"] for r in rows if r["moe_bound_recomputed"] > 0}
assert got and got == dict(log), (got, dict(log))
f = [r["moe_dropless_bound"] for r in rows]
assert f == sorted(f) and f[-1] > 1 and f[-1] <= 8 / 2, f  # raised, never past E / k (cap = the rank's tokens)
print(f"recomputed {got}, bound {f[0]} -> {f[-1]}")
PY
fi
same exact 2 "$base" "ep 2 with model.moe.dropless_bound 0 (the exact sizes, read per sparse layer) equals 1 rank" \
  "${mix[@]}" --set parallel.ep=2 --set model.moe.dropless_bound=0
# The balance loss per micro-batch (pooled over the micro-batch's rows, averaged over micro-batches as the reference
# does): 1 rank in 2 micro-batches of 4 against the reference's --micro-batch-size 4.
"$py" "$ref" train --model "$tmp/mix" --data "$tmp/data/docs_train_*.bin" --steps 20 --batch-size $B --seq-len $T \
  --micro-batch-size 4 --lr 3e-3 --schedule cosine --warmup-steps 3 --lr-min 3e-4 --weight-decay 0.1 --grad-clip 1.0 \
  --threads 1 --dtype f64 --out "$tmp/mix_mb4.ref.json" >"$tmp/mix_mb4.ref.log" 2>&1 &&
  same mb4 1 "$tmp/mix_mb4.ref.json" "1 rank in 2 micro-batches equals the reference's --micro-batch-size 4 (balance loss per micro-batch)" \
    "${mix[@]}" --set training.micro_batch_size=4 ||
  bad "the reference in micro-batches of 4" "$(tail -n 5 "$tmp/mix_mb4.ref.log")"
# With the balance loss under pp: the statistics pooled over the stages. A micro-batch under dp is every dp rank's
# k-th micro-batch together, which no 1-rank run groups alike, so ep 2 x pp 2 is checked against ep 2 in the same
# micro-batches (bit for bit in practice), and pp 2 alone against 1 rank in the same micro-batches.
run bal_ep2_mb 2 "${mix[@]}" --set parallel.ep=2 --set training.micro_batch_size=2 ||
  bad "ep 2 in 2 micro-batches of 2 a rank (balance loss on)" "$(tail -n 20 "$tmp/bal_ep2_mb.log")"
same bal_pp2 2 "$tmp/mb4.jsonl" "pp 2 with the balance loss (pooled over both stages) equals 1 rank in the same micro-batches" \
  "${mix[@]}" --set parallel.pp=2 --set training.micro_batch_size=4
same bal_ep2_pp2 4 "$tmp/bal_ep2_mb.jsonl" "ep 2 x pp 2 with the balance loss equals ep 2 in the same micro-batches" \
  "${mix[@]}" --set parallel.ep=2 --set parallel.pp=2 --set training.micro_batch_size=2
same bal_ep2_zb 4 "$tmp/bal_ep2_mb.jsonl" "ep 2 x pp 2 zb1p with the balance loss equals ep 2 in the same micro-batches" \
  "${mix[@]}" --set parallel.ep=2 --set parallel.pp=2 --set parallel.pp_schedule=zb1p --set training.micro_batch_size=2
# The YAML turns the balance loss off over config.json's true, against the reference trained from a copy of the
# directory that says false.
"$py" - "$tmp/mix" "$tmp/nobal" <<'PY' || bad "the directory without the balance loss"
import json, os, shutil, sys
src, dst = sys.argv[1:3]
shutil.copytree(src, dst, dirs_exist_ok=True)
c = json.load(open(os.path.join(dst, "config.json")))
c["output_router_logits"] = False
json.dump(c, open(os.path.join(dst, "config.json"), "w"))
PY
if ref_train nobal; then
  nobal=(--set model.moe.output_router_logits=false)
  same nobal1 1 "$tmp/nobal.ref.json" "1 rank without the balance loss (YAML over config.json) equals the reference without it" \
    "${mix[@]}" "${nobal[@]}"
  same micro 2 "$tmp/nobal.ref.json" "ep 2 in 2 micro-batches of 2 a rank, without the balance loss, equals the reference" \
    "${mix[@]}" "${nobal[@]}" --set parallel.ep=2 --set training.micro_batch_size=2
  same ep2_pp2 4 "$tmp/nobal.ref.json" "ep 2 x pp 2 without the balance loss equals the reference without it" "${mix[@]}" \
    "${nobal[@]}" --set parallel.ep=2 --set parallel.pp=2 --set training.micro_batch_size=2 \
    --set checkpoint.dir="$tmp/pp.ckpt" --set checkpoint.interval=10
  # The stages' checkpoint (each stage writes its layers' experts) resumed on ep 4.
  if run pp_resume 4 "${mix[@]}" "${nobal[@]}" --set parallel.ep=4 --set checkpoint.resume="$tmp/pp.ckpt/step_00000010" \
    --set checkpoint.dir="$tmp/pp_resume.ckpt"; then
    if out=$("$py" "$compare" "$tmp/pp_resume.jsonl" "$tmp/nobal1.jsonl" --rel0 1e-4 --abs 1e-4 --from-step 11 --steps 10 2>&1); then
      ok "saved on ep 2 x pp 2 at step 10, resumed on ep 4: steps 11-20 as 1 rank's: $out"
    else bad "the ep 2 x pp 2 checkpoint resumed on ep 4" "$out"; fi
  else
    bad "the ep 2 x pp 2 checkpoint resumed on ep 4" "$(tail -n 20 "$tmp/pp_resume.log")"
  fi
fi
if [ $full -eq 1 ]; then
  same ep4_tp2 8 "$base" "ep 4 x tp 2 equals 1 rank" "${mix[@]}" --set parallel.ep=4 --set parallel.tp=2
  same ep2_cp2_tp2 8 "$base" "ep 2 x cp 2 x tp 2 equals 1 rank" "${mix[@]}" --set parallel.ep=2 --set parallel.cp=2 \
    --set parallel.tp=2
  same ep2_pp2_ds2 8 "$tmp/nobal.ref.json" "ep 2 x pp 2 x dp_shard 2 without the balance loss equals the reference" \
    "${mix[@]}" "${nobal[@]}" --set parallel.ep=2 --set parallel.pp=2 --set parallel.dp_shard=2 \
    --set training.micro_batch_size=1
  if reference q3 --model-type qwen3_moe --norm-topk-prob --output-router-logits; then
    same q3_1 1 "$tmp/q3.ref.json" "qwen3_moe on 1 rank equals the reference" --set model.init_from="$tmp/q3"
    same q3_ep8 8 "$tmp/q3.ref.json" "qwen3_moe on ep 8 equals the reference" --set model.init_from="$tmp/q3" \
      --set parallel.ep=8
    same q3_ep2_tp2 4 "$tmp/q3.ref.json" "qwen3_moe on ep 2 x tp 2 equals the reference" --set model.init_from="$tmp/q3" \
      --set parallel.ep=2 --set parallel.tp=2
  fi
fi

# --- Metrics: every step of every run has the router's statistics; each layer's load sums to tokens x k ---
runs=(base ep2 ep4 ep8 ep2_ds2 ep2_tp2 ep2_cp2 hsdp_ep bound1 exact mb4 micro)
files=()
for r in "${runs[@]}"; do [ -f "$tmp/$r.jsonl" ] && files+=("$tmp/$r.jsonl"); done
check "aux_loss, expert_load ($L x $E, each row $B x $T x $K = $((B * T * K))), its max over mean and dropped_tokens (0) on every step of ${#files[@]} runs" -- \
  "$py" - $L $E $((B * T * K)) "${files[@]}" <<'PY'
import json, sys
L, E, want = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
n = 0
for path in sys.argv[4:]:
    rows = [json.loads(l) for l in open(path) if '"loss"' in l]
    assert len(rows) == 20, (path, len(rows))
    for r in rows:
        load = r["expert_load"]
        assert len(load) == L and all(len(l) == E for l in load), (path, r["step"], load)
        assert all(sum(l) == want for l in load), (path, r["step"], [sum(l) for l in load])
        mom = [max(l) / (sum(l) / E) for l in load]
        assert all(abs(a - b) < 1e-12 for a, b in zip(mom, r["expert_load_max_over_mean"])), (path, mom, r)
        # The run without the balance loss (micro) reports 0.
        on = not path.endswith("micro.jsonl")
        assert r["dropped_tokens"] == 0 and (r["aux_loss"] > 0) == on, (path, r)
        n += 1
print(f"{n} steps checked")
PY
# Under pp rank 0 logs the metrics: the layers of the other stage must be in them too (the statistics are summed
# over the stages).
if [ -f "$tmp/ep2_pp2.jsonl" ]; then
  out=$("$py" - "$tmp/ep2_pp2.jsonl" $((B * T * K)) <<'PY' 2>&1
import json, sys
sums = [[sum(l) for l in r["expert_load"]] for r in map(json.loads, open(sys.argv[1])) if "loss" in r]
want = float(sys.argv[2])
assert len(sums) == 20 and all(x in (0.0, want) for s in sums for x in s), sums
print("ok" if all(x == want for s in sums for x in s) else "zero", sums[0])
PY
  )
  case "$out" in
    ok*) ok "ep 2 x pp 2: every layer's expert_load row sums to tokens x k: ${out#ok }" ;;
    zero*) bad "ep 2 x pp 2: the metrics' expert_load of stage 1's layer" "rank 0 logs only its stage's layers (row sums ${out#zero })" ;;
    *) bad "ep 2 x pp 2: expert_load" "$out" ;;
  esac
fi
check "aux_loss is router_aux_loss_coef x the reference's balance loss at every step (1 rank, ep 8)" -- \
  "$py" - "$tmp/mix" "$tmp/mix.ref.json" "$tmp/base.jsonl" "$tmp/ep8.jsonl" <<'PY'
import json, sys
coef = json.load(open(sys.argv[1] + "/config.json"))["router_aux_loss_coef"]
ref = json.load(open(sys.argv[2]))["aux_losses"]
for path in sys.argv[3:]:
    got = [json.loads(l)["aux_loss"] for l in open(path) if '"loss"' in l]
    worst = max(abs(g - coef * a) / (coef * a) for g, a in zip(got, ref))
    assert len(got) == len(ref) == 20 and worst < 1e-8, (path, worst)
print(f"largest relative difference {worst:.1e}")
PY
# A capacity of 1 x the even share drops rows (this router is far from balanced) and training goes on; the load
# counts the rows chosen, before the capacity.
for np in 1 2; do
  if run cap$np $np "${mix[@]}" --set parallel.ep=$np --set model.moe.capacity_factor=1.0 --set training.steps=5; then
    check "capacity_factor 1.0 on $np rank(s): dropped_tokens > 0 at every step, finite losses, loads still tokens x k" -- \
      "$py" - "$tmp/cap$np.jsonl" $((B * T * K)) <<'PY'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
assert len(rows) == 5, len(rows)
assert all(r["dropped_tokens"] > 0 and math.isfinite(r["loss"]) for r in rows), [(r["dropped_tokens"], r["loss"]) for r in rows]
assert all(sum(l) == float(sys.argv[2]) for r in rows for l in r["expert_load"]), rows[0]["expert_load"]
print("dropped", [r["dropped_tokens"] for r in rows], "losses", [round(r["loss"], 4) for r in rows])
PY
  else
    bad "capacity_factor 1.0 on $np rank(s)" "$(tail -n 20 "$tmp/cap$np.log")"
  fi
done
# Aux-loss-free balancing: the selection bias moves by the rate after each step, by the global load, so ep 2 and
# pp 2 (where the balance loss is refused) train as 1 rank does.
bias=("${mix[@]}" --set model.moe.output_router_logits=false --set model.moe.bias_update_rate=0.001 --set training.steps=6)
if run bias1 1 "${bias[@]}" --set checkpoint.dir="$tmp/bias1.ckpt" --set checkpoint.interval=3 --set checkpoint.keep=0; then
  check "bias_update_rate 0.001: router_bias_range on every step, non-zero after a few" -- "$py" - "$tmp/bias1.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
assert len(rows) == 6 and all("router_bias_range" in r for r in rows), rows[-1]
lo, hi = rows[-1]["router_bias_range"]
assert hi - lo >= 0.001 - 1e-12 and hi <= 6 * 0.001 + 1e-12 and lo >= -6 * 0.001 - 1e-12, (lo, hi)
print("ranges", [r["router_bias_range"] for r in rows])
PY
  for mesh in ep pp; do
    if run bias_$mesh 2 "${bias[@]}" --set parallel.$mesh=2 --set training.micro_batch_size=4; then
      check "bias_update_rate on $mesh 2: the losses and bias ranges of 1 rank" -- "$py" - "$tmp/bias_$mesh.jsonl" "$tmp/bias1.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(p) if '"loss"' in l] for p in sys.argv[1:3])
assert len(a) == len(b) == 6
assert all(abs(x["loss"] - y["loss"]) < 1e-10 for x, y in zip(a, b)), [(x["loss"], y["loss"]) for x, y in zip(a, b)]
# (Under pp rank 0's range covers only its stage's layers: see expert_load above.)
assert "bias_pp" in sys.argv[1] or all(x["router_bias_range"] == y["router_bias_range"] for x, y in zip(a, b))
print("max |diff|", max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)))
PY
    else
      bad "bias_update_rate on $mesh 2" "$(tail -n 20 "$tmp/bias_$mesh.log")"
    fi
  done
  # Resumed at step 3 on ep 2, steps 4-6 and the bias as the uninterrupted run's (the bias is in meta.json).
  if run bias_resume 2 "${bias[@]}" --set parallel.ep=2 --set checkpoint.resume="$tmp/bias1.ckpt/step_00000003" \
    --set checkpoint.dir="$tmp/bias_resume.ckpt"; then
    out=$("$py" - "$tmp/bias_resume.jsonl" "$tmp/bias1.jsonl" <<'PY' 2>&1
import json, sys
a, b = ({r["step"]: r for r in map(json.loads, open(p)) if "loss" in r} for p in sys.argv[1:3])
assert sorted(a) == [4, 5, 6], sorted(a)
same = all(abs(a[s]["loss"] - b[s]["loss"]) < 1e-10 and a[s]["router_bias_range"] == b[s]["router_bias_range"] for s in a)
print("ok" if same else "differ", f"step 6 loss {a[6]['loss']:.10f} vs {b[6]['loss']:.10f}, bias range",
      a[6]["router_bias_range"], "vs", b[6]["router_bias_range"])
PY
    )
    case "$out" in
      ok*) ok "bias_update_rate: saved at step 3, resumed on ep 2: the bias and steps 4-6 as uninterrupted: ${out#ok }" ;;
      differ*) bad "bias_update_rate: resumed on ep 2 as uninterrupted" "the selection bias was not restored: ${out#differ }" ;;
      *) bad "bias_update_rate: resume" "$out" ;;
    esac
  else
    bad "bias_update_rate: resume on ep 2" "$(tail -n 20 "$tmp/bias_resume.log")"
  fi
else
  bad "bias_update_rate 0.001 on 1 rank" "$(tail -n 20 "$tmp/bias1.log")"
fi

# --- Checkpoints: per-expert tensors, read by the reference, resumed on other meshes ---
ck="$tmp/ep2.ckpt/step_00000005"
check "the ep 2 checkpoint holds model.layers.{0,1}.block_sparse_moe.experts.{0..7}.{w1,w2,w3}.weight and no stacked '*' name" -- \
  "$py" - "$ck" "$root/scripts/reference" $L $E <<'PY'
import json, os, sys
sys.path.insert(0, sys.argv[2])
import llama_ref as L
d, layers, E = sys.argv[1], int(sys.argv[3]), int(sys.argv[4])
w = L.read_model_weights(d)
star = [n for n in w if "*" in n]
assert not star, star
shapes = {"w1": (16, 32), "w3": (16, 32), "w2": (32, 16)}
for l in range(layers):
    for j in range(E):
        for p, s in shapes.items():
            n = f"model.layers.{l}.block_sparse_moe.experts.{j}.{p}.weight"
            assert n in w and tuple(w[n].shape) == s, (n, n in w and w[n].shape)
    assert tuple(w[f"model.layers.{l}.block_sparse_moe.gate.weight"].shape) == (E, 32)
experts = [n for n in w if ".experts." in n]
assert len(experts) == layers * E * 3, len(experts)
opt = L.read_model_weights(d, "optimizer")
star = [n for n in opt if "*" in n]
assert not star, star
print(f"{len(experts)} expert tensors of {len(w)}; optimizer state {len(opt)} tensors, none stacked")
PY
check_logits "the ep 2 checkpoint" 1 "$ck"
check "llama_ref.py loss on the ep 2 checkpoint (ce + coef x aux of step 6's batch) equals meshtrain's step 6 loss" -- \
  "$py" - "$ref" "$ck" "$tmp/data/docs_train_*.bin" "$tmp/ep2.jsonl" $B $T <<'PY'
import json, subprocess, sys
r, ck, data, metrics, B, T = sys.argv[1:7]
out = subprocess.run([sys.executable, r, "loss", "--model", ck, "--data", data, "--batch-size", B, "--seq-len", T,
                      "--step", "5", "--threads", "1"], check=True, capture_output=True, text=True).stdout
ref = json.loads(out.strip().splitlines()[-1])["loss"]
got = [r["loss"] for r in map(json.loads, open(metrics)) if r.get("step") == 6 and "loss" in r]
assert len(got) == 1, got
assert abs(ref - got[0]) < 1e-5, (ref, got[0])
print(f"reference {ref:.8f}, meshtrain {got[0]:.8f}")
PY
for np in 4 1; do
  if run resume$np $np "${mix[@]}" --set parallel.ep=$np --set checkpoint.resume="$ck" \
    --set checkpoint.dir="$tmp/resume$np.ckpt"; then
    if out=$("$py" "$compare" "$tmp/resume$np.jsonl" "$base" --rel0 1e-4 --abs 1e-4 --from-step 6 --steps 15 2>&1) &&
       grep -q "resumed from $ck at step 5" "$tmp/resume$np.log"; then
      ok "saved on ep 2 at step 5, resumed on $([ $np -eq 1 ] && echo '1 rank' || echo "ep $np"): steps 6-20 as the uninterrupted run: $out"
    else
      bad "resume of the ep 2 checkpoint on $np rank(s)" "$out" "$(grep -a resumed "$tmp/resume$np.log")"
    fi
  else
    bad "resume of the ep 2 checkpoint on $np rank(s)" "$(tail -n 20 "$tmp/resume$np.log")"
  fi
done

# --- Bad input: a config error on every rank before any collective (printed once), no step ---
moe_yaml=(--set model.type=mixtral --set model.dim=32 --set model.n_layers=2 --set model.n_heads=4 --set model.n_kv_heads=2
  --set model.ffn_dim=64 --set model.vocab_size=256 --set model.max_seq_len=64 --set model.moe.ffn_dim=16
  --set model.moe.n_experts=4)
refused() {  # refused NAME TEXT NP [--set ...]
  local name=$1 text=$2 np=$3
  shift 3
  local start took
  start=$(date +%s)
  timeout 120 "$mpirun" -np "$np" "$mt" --config "$tmp/t.yaml" "$@" train >"$tmp/refused.log" 2>&1
  local rc=$?
  took=$(($(date +%s) - start))
  if [ $rc -eq 0 ] || [ $rc -eq 124 ]; then bad "$name" "exit $rc" "$(tail -n 5 "$tmp/refused.log")"
  elif ! grep -qF -- "$text" "$tmp/refused.log"; then bad "$name" "output lacks: $text" "$(grep -a error "$tmp/refused.log" | head -n 5)"
  elif [ "$(grep -c '\[error\] \[config\]' "$tmp/refused.log")" -ne 1 ] || grep -qa '^step \|\[comm\]' "$tmp/refused.log"; then
    bad "$name: one config error, no step, no collective" "$(grep -a 'error\|comm\|^step' "$tmp/refused.log" | head -n 5)"
  else ok "$name (${took}s)"; fi
}
refused "n_experts not divisible by ep" "model.moe.n_experts = 6 is not divisible by parallel.ep = 4" 4 \
  "${moe_yaml[@]}" --set model.moe.n_experts=6 --set parallel.ep=4
refused "experts_per_token above n_experts" "model.moe.experts_per_token = 5 exceeds model.moe.n_experts = 4" 4 \
  "${moe_yaml[@]}" --set model.moe.experts_per_token=5 --set parallel.ep=2
refused "a dropless_bound between 0 and 1" "model.moe.dropless_bound = 0.5: expected 0 (the exact sizes" 4 \
  "${moe_yaml[@]}" --set model.moe.dropless_bound=0.5 --set parallel.ep=2
refused "an unknown router_score" "model.moe.router_score = 'softplus': expected one of 'softmax', 'sigmoid'" 4 \
  "${moe_yaml[@]}" --set model.moe.router_score=softplus --set parallel.ep=2
refused "ep > 1 with a dense model" "parallel.ep = 4: model.type = llama has no experts (model.moe.n_experts = 0)" 4 \
  --set model.dim=32 --set model.n_layers=2 --set model.n_heads=4 --set model.n_kv_heads=2 --set model.vocab_size=256 \
  --set model.max_seq_len=64 --set parallel.ep=4

# --- A stuck rank: rank 1 stops itself before evaluation (MT_FAULT_STOP_AT); rank 0's forward waits in the MoE
# layer's all-to-all on the ep group, which times out naming the group and the missing rank ---
limit=3
margin=15
stuck() {  # stuck NAME NP TEXT... -- [--set ...]
  local name=$1 np=$2
  shift 2
  local texts=()
  while [ "$1" != -- ]; do texts+=("$1"); shift; done
  shift
  local start took rc
  start=$(date +%s.%N)
  MT_FAULT_STOP_AT="evaluation:1" timeout -k 5 120 "$mpirun" -np "$np" "$mt" --config "$tmp/t.yaml" "${mix[@]}" \
    --set comm.timeout_s=$limit --set eval.interval=2 --set eval.steps=1 "$@" train >"$tmp/stuck.log" 2>&1
  rc=$?
  took=$(echo "$(date +%s.%N) - $start" | bc)
  echo "drill $name: exit $rc after ${took}s"
  grep -a '\[comm\]' "$tmp/stuck.log" | sed 's/^/  /'
  if [ $rc -eq 0 ]; then bad "$name" "exit 0, expected non-zero"; return; fi
  if [ "$(echo "$took > $limit + $margin" | bc)" = 1 ]; then bad "$name" "took ${took}s (limit $limit s + $margin s)"; return; fi
  for t in "${texts[@]}"; do
    if ! grep -qaF -- "$t" "$tmp/stuck.log"; then bad "$name" "output lacks: $t" "$(grep -a '\[comm\]' "$tmp/stuck.log")"; return; fi
  done
  ok "$name (${took}s)"
}
stuck "ep 2: rank 1 stopped, rank 0 times out in the all-to-all naming the ep group and rank 1" 2 \
  "[comm] timeout: all_to_all on group 'ep' (world ranks 0,1) did not finish within $limit s (comm.timeout_s) on rank 0" \
  "world rank 1 did not arrive" -- --set parallel.ep=2
# dp_replicate 2 x ep 2: rank 0 waits for its ep peer alone; the other ep group waits in the data-parallel loss.
# Whichever rank reports first names rank 1 (rank 0, once another has reported, may stay silent).
stuck "dp_replicate 2 x ep 2: rank 1 is named" 4 \
  "world rank 1 did not arrive and did not answer" "[comm] timeout" -- --set parallel.ep=2

summary moe
[ $failed -eq 0 ]
