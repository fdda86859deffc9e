# Shared by the end-to-end test scripts, sourced once `build` is set: the paths they use, a temporary
# directory removed at exit (a script that sets $tmp first keeps its own; one that sets its own EXIT trap
# removes $tmp there), one OpenMP thread per rank, and the counters and checks.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mt="$build/meshtrain"
mpirun="$root/scripts/mpirun.sh"
py=/usr/bin/python3
compare="$root/tests/cli/compare_runs.py"
if [ -z "${tmp:-}" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
fi
export OMP_NUM_THREADS=1

passed=0
failed=0
skipped=0

# Each verdict ends with the seconds since the previous one ([N s]): what each case costs the suite's run.
_verdict_at=$SECONDS
_since() { _took=$((SECONDS - _verdict_at)); _verdict_at=$SECONDS; }
ok() { passed=$((passed + 1)); _since; echo "ok   $1 [$_took s]"; }
# Every line of the excerpt is indented: scripts/test.sh's summary (and CI's log) keeps the indented lines.
bad() { failed=$((failed + 1)); _since; echo "FAIL $1 [$_took s]"; shift; for l in "$@"; do printf '%s\n' "$l" | sed 's/^/  /'; done; }
# The bytes `meshtrain plan` counted in one phase (forward, backward, sync) under tags starting with a prefix.
counted() {  # counted PLAN_OUT PHASE TAG_PREFIX
  awk -v ph="bytes[$2]" -v tg="tag=$3" '$1 == ph && index($2, tg) == 1 { sub("bytes=", "", $6); s += $6 } END { print s + 0 }' "$1"
}
# A check that a counted figure equals one computed here from the model's sizes, independently of the runtime.
same_count() {  # same_count NAME GOT WANT
  if [ "$2" = "$3" ]; then ok "$1 ($2 B)"; else bad "$1" "counted $2 B, computed $3 B"; fi
}
# same_sample WHAT LOG BASE_LOG: the step-20 sample lines of two runs exist and are equal (the same model
# generates the same text); two missing lines would compare equal, so a missing one fails.
same_sample() {
  local a b
  a=$(grep -a 'sample step 20' "$2")
  b=$(grep -a 'sample step 20' "$3")
  if [ -z "$a" ] || [ -z "$b" ]; then bad "$1: the same sample" "no 'sample step 20' line in $2 or $3"
  elif [ "$a" = "$b" ]; then ok "$1: the same sample"
  else bad "$1: the same sample" "$a" "$b"; fi
}
# check NAME -- COMMAND...: passes when the command (300 s at most) exits 0, its last line shown; else its last
# 15 lines. (A script whose checks differ defines its own check after sourcing this file.)
check() {
  local name=$1
  shift 2
  local out="$tmp/check.out"
  if timeout 300 "$@" >"$out" 2>&1; then ok "$name: $(tail -n 1 "$out")"; else bad "$name" "$(tail -n 15 "$out")"; fi
}
# same_safetensors A B: every safetensors file of checkpoint directory A is byte-identical in B (and there are some);
# prints how many, or the first that differs.
same_safetensors() {
  local n=0 f
  for f in "$1"/*.safetensors; do
    [ -f "$f" ] || return 1
    cmp -s "$f" "$2/$(basename "$f")" || { echo "differs: $(basename "$f")"; return 1; }
    n=$((n + 1))
  done
  echo "$n safetensors files identical"
}
# skip NAME WHY: a check that cannot run here (a missing tool or device): counted as skipped, never as passed.
skip() { skipped=$((skipped + 1)); _since; echo "skip $1: $2 [$_took s]"; }
# need_torch SUITE WHAT: where python3-torch does not import, WHAT is skipped and the script ends (summary SUITE).
need_torch() {
  if ! "$py" -c "import torch" 2>/dev/null; then
    skip "$2" "python3-torch is not installed"
    summary "$1"
    exit 0
  fi
}
# summary NAME: the last line scripts/test.sh reads, "NAME: N passed, N failed" with ", N skipped" when any were.
summary() {
  if [ "$skipped" -gt 0 ]; then echo "$1: $passed passed, $failed failed, $skipped skipped"; else
    echo "$1: $passed passed, $failed failed"; fi
}

# steps_in FILE: the training-step records in a metrics file so far (0 while it does not exist).
steps_in() { local n; n=$(grep -c '"loss"' "$1" 2>/dev/null); echo "${n:-0}"; }
# wait_for_steps FILE N TRIES PAUSE: returns once FILE holds N step records, or after TRIES pauses of PAUSE s.
wait_for_steps() {
  local i
  for ((i = 0; i < $3; ++i)); do
    [ "$(steps_in "$1")" -ge "$2" ] && return 0
    sleep "$4"
  done
  return 1
}
# train NAME NP [--set ...]: the script's $tmp/t.yaml on NP ranks; metrics in $tmp/NAME.jsonl, output in
# $tmp/NAME.log. (A script with other needs defines its own train after sourcing this file.)
train() {
  local name=$1 np=$2
  shift 2
  mpi_logged "$tmp/$name.log" "$mpirun" -np "$np" "$mt" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/$name.jsonl" \
    "$@" train
}

# mpi_logged LOG COMMAND...: COMMAND (an mpirun launch) with its output in LOG, run once more when it failed inside
# Open MPI's own runtime: an ORTE_ERROR_LOG line (seen once in CI: "Data unpack would read past end of buffer ...
# show_help.c", mpirun's message channel) and no line from meshtrain's logger saying error. With MT_TEST_RETRY_HANG=1
# (test_emulated.sh: a 4-rank emulated run hung once in CI, never here) a run the watchdog ended ("[comm] timeout:")
# is run once more too. Every retry is printed in the test's output with the first run's reason; a second failure
# fails as any other. The launch's limit (900 s) is above the watchdog's default (comm.timeout_s 600), so a hang is
# named by the watchdog, never cut short by this limit first.
mpi_logged() {
  local log=$1 rc why=""
  shift
  timeout 900 "$@" >"$log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then
    if grep -aq "ORTE_ERROR_LOG" "$log" && ! grep -aq "\] \[error\]" "$log"; then
      why="Open MPI's runtime failed ($(grep -a -m1 ORTE_ERROR_LOG "$log" | sed 's/.*ORTE_ERROR_LOG: //'))"
    elif [ "${MT_TEST_RETRY_HANG:-0}" = 1 ] && grep -aq "\[comm\] timeout:" "$log"; then
      why="the watchdog ended it: $(grep -a -m1 "\[comm\] timeout:" "$log" | cut -c1-600)"
    fi
  fi
  if [ -n "$why" ]; then
    echo "note: $(basename "$log" .log): $why; run once more"
    cp "$log" "$log.first"
    timeout 900 "$@" >"$log" 2>&1
    rc=$?
  fi
  return "$rc"
}

# same_as BASE NAME NP DESCRIPTION [--set ...]: trains NAME and checks its 20 steps against BASE's (compare_runs'
# tolerance, or bit for bit when the script sets same_as_exact=1) and that both printed the same sample.
same_as() {
  local base=$1 name=$2 np=$3 what=$4
  shift 4
  local exact=()
  [ "${same_as_exact:-0}" = 1 ] && exact=(--exact)
  if train "$name" "$np" "$@"; then
    if out=$("$py" "$compare" "$tmp/$name.jsonl" "$tmp/$base.jsonl" "${exact[@]}" --steps 20 2>&1); then ok "$what: $out"
    else bad "$what" "$out"; fi
    same_sample "$what" "$tmp/$name.log" "$tmp/$base.log"
  else
    bad "$what" "$(tail -n 20 "$tmp/$name.log")"
  fi
}

# docs_data [ARGS...]: the docs (docs/*.md) as byte-level shards $tmp/data/docs_{train,val}_*.bin; ARGS go to
# prepare_data (--separator 30: each file a document).
docs_data() {
  "$py" "$root/scripts/prepare_data" --out "$tmp/data" --name docs "$@" "$root"/docs/*.md >/dev/null ||
    bad "prepare_data $*"
}
# write_yaml MODEL TRAINING [MORE]: $tmp/t.yaml, the end-to-end scripts' config: the model and training keys given
# (inside their braces), the common optimizer keys, the docs data, evaluation and samples every 10 steps, a log
# line every step, then MORE (whole YAML lines).
write_yaml() {
  cat >"$tmp/t.yaml" <<YAML
model: {$1}
training: {$2, lr: 3.0e-3, warmup_steps: 3, lr_min: 3.0e-4, grad_clip: 1.0, weight_decay: 0.1, threads: 1}
data: {train: "$tmp/data/docs_train_*.bin", val: "$tmp/data/docs_val_*.bin"}
eval: {interval: 10, steps: 2}
sample: {interval: 10, tokens: 8, prompt: "The "}
log: {interval: 1}
${3:-}
YAML
}

# check_logits WHAT NP CKPT: `meshtrain logits` of checkpoint CKPT (WHAT, in the check's name) on NP ranks for 8
# tokens equal what scripts/reference/llama_ref.py computes from the same directory in f64, within 1e-5 of the largest.
check_logits() {
  local what=$1 np=$2 ck=$3 tok=84,104,101,32,113,117,105,99
  if timeout 300 "$mpirun" -np "$np" "$mt" logits --checkpoint "$ck" --tokens $tok --out "$tmp/logits.npy" \
    >"$tmp/logits.log" 2>&1; then
    check "llama_ref.py loads $what and gives meshtrain's logits" -- "$py" - "$ck" "$tmp/logits.npy" "$tok" \
      "$root/scripts/reference" <<'PY'
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[4])
import llama_ref as L
model = L.load_model(sys.argv[1], torch.float64)
toks = torch.tensor([[int(t) for t in sys.argv[3].split(",")]])
ref = model(toks)[0].detach().numpy()
got = np.load(sys.argv[2])
err = np.abs(got - ref).max() / np.abs(ref).max()
print(f"max relative difference {err:.2e}")
assert err < 1e-5, err
PY
  else
    bad "meshtrain logits of $what" "$(tail -n 20 "$tmp/logits.log")"
  fi
}

# estimate_run I NP WHAT [--set ...]: for the estimate scripts, trains m$I on NP ranks (train), counts its bytes with
# `meshtrain plan` ($tmp/p$I.out) and estimates the same run in one process ($tmp/e$I.json); a step that fails is
# a failure naming WHAT, and the return status 1.
estimate_run() {
  local i=$1 np=$2 what=$3
  shift 3
  if ! train "m$i" "$np" "$@"; then bad "$what: train" "$(tail -n 10 "$tmp/m$i.log")"; return 1; fi
  if ! "$mpirun" -np "$np" "$mt" --config "$tmp/t.yaml" "$@" plan >"$tmp/p$i.out" 2>&1; then
    bad "$what: plan" "$(tail -n 10 "$tmp/p$i.out")"; return 1; fi
  # One process, no mpirun: the mesh is simulated.
  if ! "$mt" --config "$tmp/t.yaml" "$@" estimate --world "$np" --json "$tmp/e$i.json" >"$tmp/e$i.out" 2>&1; then
    bad "$what: estimate" "$(tail -n 10 "$tmp/e$i.out")"; return 1; fi
}
# peak_within_5pct METRICS ESTIMATE_JSON DIGITS: prints rank 0's estimated peak against the largest alloc_peak_bytes
# of the steps after the first (which also makes the gradient buckets), in MiB with DIGITS decimals; fails when the
# ratio is more than 5% off.
peak_within_5pct() {
  "$py" - "$@" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"alloc_peak_bytes"' in l]
measured = max(s["alloc_peak_bytes"] for s in steps[1:])
est = json.load(open(sys.argv[2]))["stages"][0]["peak_bytes"]
d = int(sys.argv[3])
print(f"peak {est / 2**20:.{d}f} MiB estimated, {measured / 2**20:.{d}f} MiB measured (ratio {est / measured:.3f})")
sys.exit(0 if abs(est / measured - 1) <= 0.05 else 1)
PY
}

# fault_yaml FILE STEPS TIMEOUT_S: the fault scripts' config (test_failures.sh, test_hang.sh): the small model on the
# docs data (docs_data --val-fraction 0.1), STEPS steps, comm.timeout_s TIMEOUT_S, a checkpoint every step in
# $tmp/ckpt, no evaluation, samples or metrics file.
fault_yaml() {
  cat >"$1" <<YAML
model: {dim: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 64, vocab_size: 256, max_seq_len: 32}
training: {steps: $2, batch_size: 4, seq_len: 32, warmup_steps: 1, threads: 1}
data: {train: "$tmp/data/docs_train_*.bin", val: "$tmp/data/docs_val_*.bin"}
eval: {interval: 0}
sample: {interval: 0}
log: {interval: 1, metrics_file: ""}
comm: {timeout_s: $3}
checkpoint: {interval: 1, keep: 1, dir: "$tmp/ckpt", resume: never}
YAML
}

# expect NAME EXIT(zero|nonzero) TEXT -- COMMAND...: runs the command, checks the exit status and that the output contains TEXT.
expect() {
  local name=$1 want=$2 text=$3
  shift 4
  local out="$tmp/out" rc
  timeout 300 "$@" >"$out" 2>&1
  rc=$?
  if [ "$want" = zero ] && [ $rc -ne 0 ]; then
    bad "$name" "exit $rc, expected 0" "$(tail -n 15 "$out")"
    return
  fi
  if [ "$want" = nonzero ] && [ $rc -eq 0 ]; then
    bad "$name" "exit 0, expected non-zero" "$(tail -n 15 "$out")"
    return
  fi
  if ! grep -qF -- "$text" "$out"; then
    bad "$name" "output lacks: $text" "$(tail -n 15 "$out")"
    return
  fi
  ok "$name"
}

# npm_references REFDIR CACHE: the tests' reference packages from the npm registry (never used by the runtime),
# installed once into CACHE by `npm ci` from REFDIR's lock file (again when the lock changes), preferring npm's own
# cache. Sets have_node (0 without node or npm) and npm_error (the registry's error line when the install failed).
npm_references() {
  local refdir=$1 cache=$2 want
  have_node=1
  npm_error=
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    have_node=0
    return
  fi
  want=$(sha256sum "$refdir/package-lock.json" | cut -d' ' -f1)
  [ "$(cat "$cache/.installed" 2>/dev/null)" = "$want" ] && return
  mkdir -p "$cache" && cp "$refdir/package.json" "$refdir/package-lock.json" "$cache/" &&
    rm -f "$cache/.installed" &&
    (cd "$cache" && timeout 300 npm ci --no-audit --no-fund --prefer-offline) >"$tmp/npm.log" 2>&1 &&
    echo "$want" >"$cache/.installed"
  if [ ! -f "$cache/.installed" ]; then
    npm_error=$(grep -m 1 -iE 'npm (error|err!) (code|errno|network|request)|ENOTFOUND|ECONNREFUSED' "$tmp/npm.log")
    echo "npm ci in $cache failed:"
    tail -n 8 "$tmp/npm.log" | sed 's/^/  /'
  fi
}
