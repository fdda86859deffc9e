#!/usr/bin/env bash
# Loss masks (issue 41: supervised fine-tuning on chat, the loss only on the assistant's tokens) end to end. Beside
# a token shard X.bin, X.mask (256 int32: magic 20241127, version 1, token count, packing length; then one uint8
# 0/1 per token) says which targets count; a shard without one trains every token. A step's loss is the counted
# targets' cross-entropy summed over the number counted in the whole global batch (every data-parallel rank and
# micro-batch), so neither the loss nor the gradients depend on the mesh. Synthetic byte-level chat shards (three,
# the middle one without a mask; 7 batches an epoch, so steps 8-10 wrap) whose masks give the two halves of every
# batch (the dp ranks' rows), its micro-batches and its sequence halves very different counts: dp rank 0's rows
# have nothing counted in step 2, a micro-batch of 2 rows nothing in several steps. A model written by the PyTorch
# reference (scripts/reference/llama_ref.py) trains 10 f64 AdamW steps:
#  - 1 rank: the losses, the val loss (eval every 5 steps over 2 batches) and the metrics' trained_tokens (counted
#    here from the masks) equal the reference's masked computation (train --masks) within 1e-4 relative;
#  - dp_replicate 2, dp_shard 2 x tp 2, cp 2 and pp 2 in micro-batches of 2, and 1 rank in micro-batches of 1: the
#    1-rank run's losses and val losses within 1e-4, and the reference's (a run that ignores the masks matches the
#    1-rank run that ignores them too), and the same trained_tokens;
#  - all-ones masks (and all-ones with a packing length dividing seq_len) give the run without .mask files bit for
#    bit;
#  - a mask with the wrong token count (train and val), the wrong magic, or a packing length not dividing
#    training.seq_len: a non-zero exit within 120 s, one error line naming the .mask file (and data.train for the
#    packing length), no step; so are train masks that keep no target in any batch (every step would be skipped),
#    a validation mask that keeps none in the evaluated batches (val_loss NaN), and an empty validation shard.
# Prints "chat_train: N passed, N failed[, N skipped]" last.
#   tests/cli/test_chat_train.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_chat_train.sh BUILD_DIR}
source "$(dirname "$0")/common.sh"
ref="$root/scripts/reference/llama_ref.py"

need_torch chat_train "loss masks against the PyTorch reference, on every mesh, errors"

B=8 T=32 STEPS=10
# --- Data: chat-like byte text; the masks are laid out by where each target falls in its step's batch ---
if ! out=$("$py" - "$tmp" $B $T $STEPS "$ref" <<'PY' 2>&1
import json, os, sys
import numpy as np
tmp, B, T, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, os.path.dirname(sys.argv[5]))
import llama_ref as L  # write_shard and write_mask only: the file formats
rng = np.random.default_rng(41)
BT = B * T


def chat(n):
    """n bytes of conversations: a question, then the assistant's answer."""
    out = b""
    while len(out) < n:
        a, b = rng.integers(10, 99, 2)
        out += f"U: what is {a}+{b}?\nA: {a + b}, since {a}+{b} is {a + b}.\n".encode()
    return np.frombuffer(out[:n], dtype=np.uint8).astype(np.int64)


def layout(n, plan):
    """A 0/1 mask over n stream positions: position p is the target of row r, column t of batch b (targets start
    at offset b*B*T + 1); plan(b, r) gives 'few' (6% counted), 'none', 'all' or 'answer' (a prompt of 2-16 columns,
    then counted: the assistant's turn)."""
    m = np.zeros(n, dtype=np.uint8)
    starts = {}
    for p in range(1, n):
        b, q = divmod(p - 1, BT)
        r, t = divmod(q, T)
        kind = plan(b, r)
        if kind == "few":
            m[p] = rng.random() < 0.06
        elif kind == "all":
            m[p] = 1
        elif kind == "answer":
            s = starts.setdefault((b, r), int(rng.integers(2, 17)))
            m[p] = t >= s
    m[0] = 1  # never a target of any batch: its value must not matter
    return m


def train_plan(b, r):
    if b == 1:  # step 2 (and 9): dp rank 0's rows (0-3) have nothing counted
        return "none" if r < 4 else "answer"
    if b == 5:  # the other way round: rank 1's rows almost empty, row 7 empty
        return "none" if r == 7 else ("all" if r < 4 else "few")
    if b == 6:  # rows 2-3 (a micro-batch of 2) empty
        return "none" if r in (2, 3) else ("answer" if r >= 4 else "few")
    return "few" if r < 4 else "answer"


def val_plan(b, r):
    if b == 0:
        return "none" if r < 4 else "answer"
    return "few" if r % 2 else "all"


sizes = [1000, 150, 800]  # 1950 tokens: (1950 - 1) // 256 = 7 steps an epoch; the middle shard has no mask
n = sum(sizes)
tokens, mask = chat(n), layout(n, train_plan)
off = np.cumsum([0] + sizes)
mask[off[1]:off[2]] = 1  # the shard without a .mask file trains every token
vtokens, vmask = chat(700), layout(700, val_plan)
for d in ("data", "ones", "pack16", "plain", "bad_count", "bad_magic", "bad_pack", "bad_val"):
    os.makedirs(os.path.join(tmp, d), exist_ok=True)
for i, size in enumerate(sizes):
    name = f"chat_train_{i:03d}"
    for d in ("data", "ones", "pack16", "plain", "bad_count", "bad_magic", "bad_pack", "bad_val"):
        L.write_shard(os.path.join(tmp, d, name + ".bin"), tokens[off[i]:off[i + 1]])
    L.write_mask(os.path.join(tmp, "ones", name + ".mask"), np.ones(size))
    L.write_mask(os.path.join(tmp, "pack16", name + ".mask"), np.ones(size), t_pack=16)
    if i == 1:
        continue
    part = mask[off[i]:off[i + 1]]
    for d in ("data", "bad_count", "bad_magic", "bad_pack", "bad_val"):
        L.write_mask(os.path.join(tmp, d, name + ".mask"), part)
# The damaged masks: the last shard's.
L.write_mask(os.path.join(tmp, "bad_count", "chat_train_002.mask"), mask[off[2]:off[3] - 1])
L.write_mask(os.path.join(tmp, "bad_pack", "chat_train_002.mask"), mask[off[2]:off[3]], t_pack=24)
with open(os.path.join(tmp, "bad_magic", "chat_train_002.mask"), "r+b") as f:
    f.write(np.int32(20240520).tobytes())  # a token shard's magic
for d in ("data", "ones", "pack16", "plain", "bad_count", "bad_magic", "bad_pack", "bad_val"):
    L.write_shard(os.path.join(tmp, d, "chat_val_000.bin"), vtokens)
    if d in ("ones", "pack16"):
        L.write_mask(os.path.join(tmp, d, "chat_val_000.mask"), np.ones(700), t_pack=16 if d == "pack16" else 0)
    elif d != "plain":
        L.write_mask(os.path.join(tmp, d, "chat_val_000.mask"), vmask if d != "bad_val" else vmask[:-3])

# What each step counts, straight from the masks: step s reads batch s % 7, targets at offset + 1 onwards.
per_epoch = (n - 1) // BT
counts, rows = [], []
for s in range(steps):
    w = mask[(s % per_epoch) * BT + 1:(s % per_epoch) * BT + BT + 1].reshape(B, T).astype(int)
    counts.append(int(w.sum()))
    rows.append(w.sum(1).tolist())
halves = [(sum(r[:4]), sum(r[4:])) for r in rows]
assert all(c > 0 for c in counts), counts
assert any(h[0] == 0 for h in halves) and any(h[1] < h[0] / 5 for h in halves), halves
assert sum(min(sum(r[i:i + 2]) for i in range(0, B, 2)) == 0 for r in rows) >= 3, rows
assert sum(max(h) > 5 * max(1, min(h)) for h in halves) >= 8, halves
json.dump({"trained_tokens": counts}, open(os.path.join(tmp, "counts.json"), "w"))
print("trained targets a step", counts, "; dp halves", halves)
PY
); then
  bad "the masked shards" "$out"
  summary chat_train
  exit 1
fi
echo "data: $out"

# --- The model and the reference's masked training ---
if ! "$py" "$ref" init --out "$tmp/model" --dim 32 --n-layers 2 --n-heads 4 --n-kv-heads 2 --ffn-dim 64 \
  --vocab-size 256 --max-seq-len 64 --seed 5 >"$tmp/init.log" 2>&1; then
  bad "reference init" "$(tail -n 5 "$tmp/init.log")"
  summary chat_train
  exit 1
fi
ref_train() {  # ref_train NAME DATA_DIR [ARGS...]: the reference's 10 f64 steps on DIR's shards into $tmp/NAME.json
  local name=$1 dir=$2
  shift 2
  "$py" "$ref" train --model "$tmp/model" --data "$tmp/$dir/chat_train_*.bin" --val-data "$tmp/$dir/chat_val_*.bin" \
    --eval-interval 5 --eval-steps 2 --steps $STEPS --batch-size $B --seq-len $T --lr 3e-3 --schedule cosine \
    --warmup-steps 3 --lr-min 3e-4 --weight-decay 0.1 --grad-clip 1.0 --threads 1 --dtype f64 "$@" \
    --out "$tmp/$name.json" >"$tmp/$name.log" 2>&1
}
ref_train ref data --masks || bad "reference train --masks" "$(tail -n 10 "$tmp/ref.log")"

cat >"$tmp/t.yaml" <<YAML
model: {init_from: "$tmp/model"}
training: {steps: $STEPS, batch_size: $B, seq_len: $T, lr: 3.0e-3, warmup_steps: 3, lr_min: 3.0e-4, grad_clip: 1.0,
           weight_decay: 0.1, threads: 1, schedule: cosine, dtype: fp64}
data: {train: "$tmp/data/chat_train_*.bin", val: "$tmp/data/chat_val_*.bin"}
eval: {interval: 5, steps: 2}
sample: {interval: 0}
log: {interval: 1}
parallel: {fsdp: {min_weight_size: 0}}
YAML
on() {  # on DIR: sets `data` to the --set arguments that train on $tmp/DIR's shards
  data=(--set "data.train=$tmp/$1/chat_train_*.bin" --set "data.val=$tmp/$1/chat_val_*.bin")
}

# agree NAME COUNTS AGAINST...: NAME's 10 losses and its val losses (steps 5 and 10) against each of AGAINST (a
# meshtrain metrics file or the reference's JSON) within 1e-4 relative, and (COUNTS not -) the trained_tokens of NAME
# and of the reference against those counted from the masks (COUNTS, a JSON file). Prints one line; exit 0 when all
# agree.
agree() {
  "$py" - "$2" "$tmp/$1.jsonl" "${@:3}" <<'PY'
import json, sys


def read(path):
    text = open(path).read()
    if '"losses"' in text.split("\n", 1)[0]:
        j = json.loads(text)  # the reference
        return {"loss": dict(enumerate(j["losses"], 1)), "val": {v["step"]: v["val_loss"] for v in j["val_losses"]},
                "trained": dict(enumerate(j.get("trained_tokens", []), 1))}
    out = {"loss": {}, "val": {}, "trained": {}}
    for line in text.splitlines():
        r = json.loads(line)
        if "loss" in r:
            out["loss"][r["step"]] = r["loss"]
            if "trained_tokens" in r:
                out["trained"][r["step"]] = r["trained_tokens"]
        if "val_loss" in r:
            out["val"][r["step"]] = r["val_loss"]
    return out


want = None if sys.argv[1] == "-" else dict(enumerate(json.load(open(sys.argv[1]))["trained_tokens"], 1))
run = read(sys.argv[2])
problems, notes = [], []
if sorted(run["loss"]) != list(range(1, 11)) or sorted(run["val"]) != [5, 10]:
    problems.append(f"steps {sorted(run['loss'])}, val steps {sorted(run['val'])} (want 1-10 and 5, 10)")
if want and run["trained"] != want:
    problems.append(f"trained_tokens {[run['trained'].get(s) for s in range(1, 11)]}, "
                    f"the masks count {[want[s] for s in range(1, 11)]}")
for path in sys.argv[3:]:
    other = read(path)
    name = path.rsplit("/", 1)[-1]
    if want and other["trained"] and other["trained"] != want:
        problems.append(f"{name}'s trained_tokens {list(other['trained'].values())} are not the masks' count")
    worst = 0.0
    for kind in ("loss", "val"):
        for s, v in run[kind].items():
            if s not in other[kind]:
                problems.append(f"{name} has no {kind} at step {s}")
                continue
            d = abs(v - other[kind][s]) / abs(other[kind][s])
            worst = max(worst, d)
            if d > 1e-4:
                problems.append(f"{kind} at step {s}: {v:.8f} vs {name}'s {other[kind][s]:.8f} (rel {d:.1e})")
    notes.append(f"vs {name} largest relative difference {worst:.1e}")
if problems:
    print("; ".join(problems[:4] + ([f"... {len(problems) - 4} more"] if len(problems) > 4 else [])))
    sys.exit(1)
print(f"step 1 loss {run['loss'][1]:.6f}, step 10 val {run['val'][10]:.6f}"
      + (", trained_tokens as counted" if want else "") + "; " + ", ".join(notes))
PY
}
# masked NAME NP WHAT [--set ...]: trains NAME on the masked shards; its losses against the 1-rank run's (the
# suites' compare_runs.py, 1e-4), and its losses, val losses and trained_tokens against the reference's.
masked() {
  local name=$1 np=$2 what=$3 out1 out2
  shift 3
  if train "$name" "$np" "$@"; then
    if out1=$("$py" "$compare" "$tmp/$name.jsonl" "$tmp/base.jsonl" --rel0 1e-4 --abs 1e-4 --steps 10 2>&1) &&
       out2=$(agree "$name" "$tmp/counts.json" "$tmp/ref.json" "$tmp/base.jsonl" 2>&1); then
      ok "$what: vs 1 rank $out1; $out2"
    else
      bad "$what" "vs 1 rank: $out1" "${out2:-}"
    fi
  else
    bad "$what" "$(tail -n 20 "$tmp/$name.log")"
  fi
}

# --- 1 rank against the reference ---
if train base 1; then
  if out=$(agree base "$tmp/counts.json" "$tmp/ref.json" 2>&1); then
    ok "1 rank: 10 f64 steps, the val loss and trained_tokens equal the reference's masked computation: $out"
  else
    bad "1 rank against the reference's masked computation" "$out"
  fi
else
  bad "1 rank on the masked shards" "$(tail -n 20 "$tmp/base.log")"
fi

# --- Every mesh: the global normalisation ---
masked dp2 2 "dp_replicate 2 (rank 0's rows count nothing in step 2)" --set parallel.dp_replicate=2
masked ds2tp2 4 "dp_shard 2 x tp 2" --set parallel.dp_shard=2 --set parallel.tp=2 --set parallel.dp_replicate=1
masked cp2 2 "cp 2" --set parallel.cp=2 --set parallel.dp_replicate=1
masked pp2 2 "pp 2 in micro-batches of 2 (some with nothing counted)" --set parallel.pp=2 --set parallel.dp_replicate=1 \
  --set training.micro_batch_size=2
masked mb1 1 "1 rank in micro-batches of 1 equals 1 rank without" --set training.micro_batch_size=1

# --- All-ones masks: the run without .mask files, bit for bit ---
exact() {  # exact NAME BASE WHAT: the losses and val losses of two runs equal bit for bit
  if out=$("$py" - "$tmp/$1.jsonl" "$tmp/$2.jsonl" <<'PY' 2>&1
import json, sys
a, b = ([(r["step"], r.get("loss"), r.get("val_loss")) for r in map(json.loads, open(p))
         if "loss" in r or "val_loss" in r] for p in sys.argv[1:3])
assert len(a) == 12 and a == b, (a, b)
print(f"{len(a)} records equal, step 10 loss {a[-2][1]!r}")
PY
  ); then ok "$3: $out"; else bad "$3" "$out"; fi
}
# Without masks the reference computes what meshtrain always did (its evaluation included): the runs agree today.
on plain
ref_train ref_plain plain || bad "reference train without masks" "$(tail -n 10 "$tmp/ref_plain.log")"
if train plain 1 "${data[@]}"; then
  if out=$(agree plain - "$tmp/ref_plain.json" 2>&1); then ok "without .mask files: the reference's unmasked losses and val losses: $out"
  else bad "without .mask files against the reference" "$out"; fi
else
  bad "1 rank without .mask files" "$(tail -n 20 "$tmp/plain.log")"
fi
on ones
if train ones 1 "${data[@]}"; then exact ones plain "all-ones masks give the losses without .mask files bit for bit"
else bad "all-ones masks" "$(tail -n 20 "$tmp/ones.log")"; fi
on pack16
if train pack16 1 "${data[@]}"; then
  exact pack16 plain "all-ones masks with packing length 16 (divides seq_len 32) give the losses without .mask files"
else bad "all-ones masks with packing length 16" "$(tail -n 20 "$tmp/pack16.log")"; fi

# --- Masks that keep nothing, copies of data/ with: every train mask all zeros (no step could train), the validation
# mask all zeros (no evaluation could average), an empty validation shard (an empty split) ---
if ! out=$("$py" - "$tmp" "$ref" <<'PY' 2>&1
import os, shutil, sys
import numpy as np
tmp = sys.argv[1]
sys.path.insert(0, os.path.dirname(sys.argv[2]))
import llama_ref as L
for d in ("none", "none_val", "empty_val"):
    os.makedirs(os.path.join(tmp, d), exist_ok=True)
    for f in os.listdir(os.path.join(tmp, "data")):
        shutil.copy(os.path.join(tmp, "data", f), os.path.join(tmp, d, f))
for i, size in enumerate((1000, 150, 800)):  # the middle shard's mask too: without one it trains every token
    L.write_mask(os.path.join(tmp, "none", f"chat_train_{i:03d}.mask"), np.zeros(size))
L.write_mask(os.path.join(tmp, "none_val", "chat_val_000.mask"), np.zeros(700))
L.write_shard(os.path.join(tmp, "empty_val", "chat_val_000.bin"), [])
L.write_mask(os.path.join(tmp, "empty_val", "chat_val_000.mask"), [])
PY
); then bad "the masks that keep nothing" "$out"; fi

# --- Damaged masks: refused on 2 ranks, one error line naming the file, no step, no hang ---
refused() {  # refused WHAT DIR FILE [TEXT...]
  local what=$1 dir=$2 file=$3 rc n t
  shift 3
  on "$dir"
  mpi_logged "$tmp/$dir.log" timeout 120 "$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" "${data[@]}" \
    --set parallel.dp_replicate=2 train
  rc=$?
  n=$(grep -a "$tmp/$dir/$file" "$tmp/$dir.log" | grep -aci "error")
  if [ $rc -eq 0 ]; then bad "$what" "exit 0, expected non-zero" "$(tail -n 5 "$tmp/$dir.log")"; return; fi
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then bad "$what" "no exit within 120 s (a hang)"; return; fi
  if [ "$n" -ne 1 ]; then
    bad "$what" "$n error lines name $tmp/$dir/$file, expected 1" "$(grep -a -i 'error' "$tmp/$dir.log" | head -n 5)"
    return
  fi
  for t in "$@"; do
    if ! grep -a "$tmp/$dir/$file" "$tmp/$dir.log" | grep -qaF -- "$t"; then
      bad "$what" "the error line lacks: $t" "$(grep -a "$file" "$tmp/$dir.log" | head -n 3)"
      return
    fi
  done
  if grep -aq '^step ' "$tmp/$dir.log"; then bad "$what" "a step ran" "$(grep -a '^step ' "$tmp/$dir.log" | head -n 2)"; return; fi
  ok "$what (exit $rc): $(grep -a "$tmp/$dir/$file" "$tmp/$dir.log" | grep -ai error | sed 's/.*\] //' | cut -c1-160)"
}
refused "a mask with one value too few" bad_count chat_train_002.mask
refused "a mask with a token shard's magic" bad_magic chat_train_002.mask
refused "a packing length (24) that does not divide training.seq_len (32)" bad_pack chat_train_002.mask data.train
refused "a validation mask with three values too few" bad_val chat_val_000.mask
refused "train masks that keep no target: no step could train" none chat_train_000.mask \
  "keep no target in any of the 7 batch(es) of an epoch" "no step has anything to train on"
refused "a validation mask that keeps no target: no evaluation could average" none_val chat_val_000.mask \
  "keep no target in the 2 batch(es) evaluated (eval.steps)"
refused "an empty validation shard while evaluation is on" empty_val chat_val_000.bin \
  "holds no token (an empty split): evaluation is on (eval.interval = 5): set data.val: '' or eval.interval: 0"

summary chat_train
[ $failed -eq 0 ]
