#!/usr/bin/env bash
# End-to-end tests of the command line a person types: options after the
# subcommand, typo suggestions, an error every rank has alike printed once (and
# one that differs printed by each rank that has it), --set named as the origin
# of a bad value, number options that say what they want, one step numbering in
# console, metrics, checkpoints and messages, the exit code of a run stopped by
# a signal, scripts/run.sh --help, and the progress bar only on a person's
# terminal (log.progress).
# Prints "cmdline: N passed, N failed, N skipped" last.
#   tests/cli/test_cmdline.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_cmdline.sh BUILD_DIR}
build=$(cd "$build" && pwd)
source "$(dirname "$0")/common.sh"

# count_lines NAME WANT PATTERN FILE: FILE has exactly WANT lines holding PATTERN (fixed string).
count_lines() {
  local n
  n=$(grep -cF -- "$3" "$4")
  if [ "$n" -eq "$2" ]; then ok "$1"; else bad "$1" "$n lines hold '$3', expected $2" "$(tail -n 12 "$4")"; fi
}

docs_data --val-fraction 0.1
cat >"$tmp/t.yaml" <<YAML
model: {dim: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 64, vocab_size: 256, max_seq_len: 32}
training: {steps: 6, batch_size: 8, seq_len: 32, lr: 3.0e-3, warmup_steps: 2, threads: 1}
data: {train: "$tmp/data/docs_train_*.bin", val: "$tmp/data/docs_val_*.bin"}
eval: {interval: 3, steps: 1}
sample: {interval: 0}
log: {interval: 1}
YAML

# --- Options after the subcommand: the same run as before it ---
"$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/before.jsonl" --set training.lr=2e-3 train \
  >"$tmp/before.log" 2>&1 || bad "options before the subcommand: run" "$(tail -n 10 "$tmp/before.log")"
"$mpirun" -np 2 "$mt" train --config "$tmp/t.yaml" --set log.metrics_file="$tmp/after.jsonl" --set training.lr=2e-3 \
  >"$tmp/after.log" 2>&1 || bad "options after the subcommand: run" "$(tail -n 10 "$tmp/after.log")"
if out=$("$py" "$compare" "$tmp/after.jsonl" "$tmp/before.jsonl" --exact --steps 6 2>&1); then
  ok "train --config --set (after the subcommand) gives the losses of the options before it, bit for bit"
else
  bad "options after the subcommand give the same losses" "$out"
fi
# Both --set took effect after the subcommand (lr 2e-3 differs from the file's 3e-3).
check_peak_lr() { "$py" -c "import json,sys; sys.exit(0 if max(r['lr'] for r in map(json.loads, open(sys.argv[1])) if 'lr' in r) == 2e-3 else 1)" "$1"; }
if check_peak_lr "$tmp/after.jsonl"; then ok "--set after the subcommand is applied (peak lr 2e-3, the file says 3e-3)"; else
  bad "--set after the subcommand is applied" "$(head -n 3 "$tmp/after.jsonl")"; fi
expect "mixed: --set before, --config after" zero "check passed" -- \
  "$mpirun" -np 2 "$mt" --set comm.timeout_s=30 check --config "$root/configs/check.yaml" --sizes 1K --iters 1

# --- Typos: the nearest subcommand or option, printed once (rank 0), exit 2 ---
"$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" trian >"$tmp/typo.log" 2>&1
rc=$?
[ $rc -eq 2 ] && ok "mistyped subcommand: exit 2" || bad "mistyped subcommand: exit 2" "exit $rc"
count_lines "mistyped subcommand: one 'did you mean 'train'?' on 2 ranks" 1 "unknown subcommand 'trian'; did you mean 'train'?" "$tmp/typo.log"
"$mpirun" -np 2 "$mt" check --sizs 1K >"$tmp/opt.log" 2>&1
count_lines "mistyped option: one 'did you mean '--sizes'?' on 2 ranks" 1 "unknown option '--sizs'; did you mean '--sizes'?" "$tmp/opt.log"
# The list comes from the command table (runtime/cli/commands.cpp) through --help: no list typed here.
subcommands=$("$mt" --help 2>&1 | sed -n '/^Subcommands:/,$p' | sed -n 's/^  \([a-z_]*\) .*/\1/p' | paste -sd, - | sed 's/,/, /g')
case "$subcommands" in
  *train*) ok "--help lists the command table's subcommands ($subcommands)" ;;
  *) bad "--help lists the subcommands" "got '$subcommands'" ;;
esac
expect "no subcommand: the subcommands are listed" nonzero "a subcommand is needed: $subcommands" -- \
  "$mt" --config "$tmp/t.yaml"

# --- An error every rank has alike is printed once; one that differs by each rank that has it ---
"$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.steps=-1 train >"$tmp/same.log" 2>&1 &&
  bad "identical config error: exits non-zero" "exit 0"
count_lines "identical config error on 2 ranks: printed once" 1 "training.steps = -1: expected a step count >= 0" "$tmp/same.log"
count_lines "identical config error: printed by rank 0" 1 "[r0] [error] [config]" "$tmp/same.log"
"$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set data.train="$tmp/nothing_*.bin" train >"$tmp/nodata.log" 2>&1 &&
  bad "identical data error: exits non-zero" "exit 0"
count_lines "identical missing-data error on 2 ranks: printed once" 1 "$tmp/nothing_*.bin" "$tmp/nodata.log"
# After start-up too: the check's mesh sizes (the same on every rank) and a resume refused over a changed config.
"$mpirun" -np 2 "$mt" check --mesh tp=3 --sizes 1K >"$tmp/mesh.log" 2>&1 && bad "check --mesh tp=3: exits non-zero" "exit 0"
count_lines "check --mesh tp=3 on 2 ranks: printed once" 1 "mesh tp=3 has 3 ranks but the job has 2" "$tmp/mesh.log"
"$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.steps=2 --set checkpoint.dir="$tmp/rc" \
  --set checkpoint.interval=2 train >"$tmp/rc1.log" 2>&1 || bad "a 2-step run with a checkpoint" "$(tail -n 5 "$tmp/rc1.log")"
"$mpirun" -np 2 "$mt" --config "$tmp/t.yaml" --set training.steps=4 --set checkpoint.dir="$tmp/rc" \
  --set training.seed=7 train >"$tmp/rc2.log" 2>&1 && bad "resume with another seed: refused" "exit 0"
count_lines "resume with another seed on 2 ranks: refused once" 1 "resuming from" "$tmp/rc2.log"
# The data found on rank 0 only (a relative path, and each rank in its own working directory): rank 1 says so.
mkdir -p "$tmp/wd0" "$tmp/wd1" && cp -r "$tmp/data" "$tmp/wd0/data"
"$mpirun" -np 1 -wdir "$tmp/wd0" "$mt" --config "$tmp/t.yaml" --set data.train="data/docs_train_*.bin" train : \
  -np 1 -wdir "$tmp/wd1" "$mt" --config "$tmp/t.yaml" --set data.train="data/docs_train_*.bin" train >"$tmp/differ.log" 2>&1 &&
  bad "an error on one rank: exits non-zero" "exit 0"
count_lines "an error on rank 1 only: rank 1 prints it" 1 "[r1] [error] [data]" "$tmp/differ.log"
count_lines "an error on rank 1 only: rank 0 names the rank" 1 "ranks 1 failed" "$tmp/differ.log"

# --- A bad value names where it came from: --set, or the file ---
expect "type error from --set names the --set" nonzero "[config] --set training.steps=abc: training.steps: expected an integer" -- \
  "$mt" --config "$tmp/t.yaml" --set training.steps=abc train
expect "range error from --set names the --set" nonzero "[config] --set training.lr=-1: training.lr = -1" -- \
  "$mt" --config "$tmp/t.yaml" --set training.lr=-1 train
expect "choice error from --set names the --set" nonzero "[config] --set log.progress=maybe: log.progress = 'maybe'" -- \
  "$mt" --config "$tmp/t.yaml" --set log.progress=maybe train
# A command's number options say what they want (the checks of runtime/cli/command.h; supervise's in test_supervise.sh).
expect "check --iters abc: not an integer" nonzero "--iters: must be an integer, got 'abc'" -- "$mt" check --iters abc
expect "check --warmup -1: at least 0" nonzero "--warmup: must be at least 0, got -1" -- "$mt" check --warmup -1
expect "tokenize --threads abc: not an integer" nonzero "--threads: must be an integer, got 'abc'" -- \
  "$mt" tokenize --threads abc
sed 's/steps: 6,/steps: -6,/' "$tmp/t.yaml" >"$tmp/bad.yaml"
expect "range error from the file names the file" nonzero "[config] $tmp/bad.yaml: training.steps = -6" -- \
  "$mt" --config "$tmp/bad.yaml" --set training.lr=1e-3 train

# --- One step numbering: console, metrics, eval, checkpoints, resume and messages ---
"$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/steps.jsonl" --set checkpoint.dir="$tmp/steps.ckpt" \
  --set checkpoint.interval=3 --set log.interval=3 train >"$tmp/steps.log" 2>&1 || bad "step numbering run" "$(tail -n 10 "$tmp/steps.log")"
if "$py" - "$tmp/steps.log" "$tmp/steps.jsonl" "$tmp/steps.ckpt" >"$tmp/steps.out" 2>&1 <<'PY'
import json, os, re, sys
log, metrics, ckpt = open(sys.argv[1]).read(), [json.loads(l) for l in open(sys.argv[2])], sys.argv[3]
console = [int(m) for m in re.findall(r"^step +(\d+)/6 ", log, re.M)]
train = [r["step"] for r in metrics if "loss" in r]
evals_console = [int(m) for m in re.findall(r"^eval step (\d+) ", log, re.M)]
evals = [r["step"] for r in metrics if "val_loss" in r]
ckpts = sorted(int(d[5:]) for d in os.listdir(ckpt) if re.fullmatch(r"step_\d{8}", d))
notes = [int(m) for m in re.findall(r"^checkpoint step (\d+) ->", log, re.M)]
print("console", console, "metrics", train, "eval", evals_console, evals, "checkpoints", ckpts, notes)
assert console == [1, 3, 6] and train == list(range(1, 7)), "console lines every log.interval, a metrics record every step"
assert evals_console == [3, 6] and evals == evals_console, "eval lines and records"
assert ckpts == [3, 6] and notes == ckpts, "checkpoint names and notes"
PY
then ok "step numbers agree: $(cat "$tmp/steps.out")"; else bad "step numbers agree" "$(cat "$tmp/steps.out")"; fi
"$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/steps2.jsonl" --set checkpoint.dir="$tmp/steps.ckpt" \
  --set training.steps=8 --set checkpoint.allow_config_change=true train >"$tmp/steps2.log" 2>&1
expect "resume: 'at step 6', and the next step logged is 7" zero "resumed from $tmp/steps.ckpt/step_00000006 at step 6" -- cat "$tmp/steps2.log"
check_first() { "$py" -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if '\"loss\"' in l]; sys.exit(0 if r[0]['step']==7 else 1)" "$1"; }
if check_first "$tmp/steps2.jsonl"; then ok "resumed run's first metrics step is 7"; else bad "resumed run's first metrics step is 7" "$(head -n 2 "$tmp/steps2.jsonl")"; fi
# A non-finite step: the warning names the step the metrics record it under.
"$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/nan.jsonl" --set training.lr=1e3 \
  --set training.warmup_steps=0 --set training.nonfinite=skip --set training.max_nonfinite_steps=2 train >"$tmp/nan.log" 2>&1
warn_step=$(grep -oE 'step [0-9]+: the loss is [^ ]+ and the grad norm [^:]+: not finite, the update is skipped' "$tmp/nan.log" | head -n 1 | awk '{print $2}' | tr -d :)
rec_step=$("$py" -c "import json,sys; print(next(r['step'] for r in map(json.loads, open(sys.argv[1])) if r.get('skipped_steps')))" "$tmp/nan.jsonl" 2>/dev/null)
if [ -n "$warn_step" ] && [ "$warn_step" = "$rec_step" ]; then ok "non-finite step: the warning and the metrics say step $warn_step"; else
  bad "non-finite step: the warning and the metrics agree" "warning: '$warn_step', metrics: '$rec_step'" "$(grep -a 'not finite' "$tmp/nan.log" | head -n 3)"; fi

# --- A run stopped by a signal: checkpoint, then exit 128 + the signal's number ---
# stop_run NAME SIGNAL NP: starts a long run, sends SIGNAL to its ranks after 2 logged steps; prints the exit code.
stop_run() {
  local name=$1 sig=$2 np=$3
  rm -rf "$tmp/$name.jsonl" "$tmp/$name.ckpt"
  timeout 300 "$mpirun" -np "$np" "$mt" --config "$tmp/t.yaml" --set training.steps=100000 --set eval.interval=0 \
    --set log.metrics_file="$tmp/$name.jsonl" --set checkpoint.dir="$tmp/$name.ckpt" train >"$tmp/$name.log" 2>&1 &
  local job=$!
  wait_for_steps "$tmp/$name.jsonl" 2 300 0.2
  pkill "-$sig" -f -- "^$mt .*checkpoint.dir=$tmp/$name.ckpt" 2>/dev/null
  wait $job
  echo $?
}
rc=$(stop_run term TERM 2)
if [ "$rc" = 143 ]; then ok "SIGTERM on 2 ranks: exit 143"; else bad "SIGTERM on 2 ranks: exit 143" "exit $rc" "$(tail -n 8 "$tmp/term.log")"; fi
expect "SIGTERM: the run says so, with its step and exit code" zero "received: stopped after step" -- cat "$tmp/term.log"
if ls "$tmp/term.ckpt" | grep -qE '^step_[0-9]{8}$'; then ok "SIGTERM: a checkpoint was saved"; else bad "SIGTERM: a checkpoint was saved"; fi
stop_step=$(grep -oE 'stopped after step [0-9]+' "$tmp/term.log" | awk '{print $4}')
if [ -n "$stop_step" ] && [ -d "$tmp/term.ckpt/$(printf 'step_%08d' "$stop_step")" ]; then
  ok "SIGTERM: the checkpoint is named by the step the message gives ($stop_step)"; else
  bad "SIGTERM: checkpoint named by the message's step" "step '$stop_step'" "$(ls "$tmp/term.ckpt")"; fi
rc=$(stop_run int INT 1)
if [ "$rc" = 130 ]; then ok "SIGINT on 1 rank: exit 130"; else bad "SIGINT on 1 rank: exit 130" "exit $rc" "$(tail -n 8 "$tmp/int.log")"; fi

# --- scripts/run.sh --help: the usage, and no run ---
if out=$(cd "$tmp" && PATH=/nonexistent:/usr/bin:/bin timeout 20 bash "$root/scripts/run.sh" --help 2>&1) &&
  grep -qF "scripts/run.sh [--fresh]" <<<"$out" && grep -qF "128 + N" <<<"$out"; then
  ok "scripts/run.sh --help prints the usage and exits 0"
else
  bad "scripts/run.sh --help" "$out"
fi

# --- The progress bar only on a person's terminal ---
if command -v script >/dev/null; then
  # Each rank's stdout a pseudo-terminal (script), mpirun itself writing into a file, as under a batch system;
  # plain mpirun (not scripts/mpirun.sh, which would tell meshtrain where its output goes).
  plain_mpirun=(mpirun --oversubscribe)
  [ "$(id -u)" -eq 0 ] && plain_mpirun+=(--allow-run-as-root)
  pty_run() {  # pty_run NAME PROGRESS: metrics in NAME.jsonl, mpirun's output in NAME.log
    env -u MT_STDOUT_TTY -u MT_STDERR_TTY OMPI_MCA_btl_vader_single_copy_mechanism=none \
      timeout 300 "${plain_mpirun[@]}" -np 2 script -qefc "stty -onlcr; exec $mt --config $tmp/t.yaml --set log.progress=$2 --set log.metrics_file=$tmp/$1.jsonl train" /dev/null \
      >"$tmp/$1.log" 2>&1
  }
  pty_run auto auto || bad "progress auto under mpirun with a pty: run" "$(tail -n 10 "$tmp/auto.log")"
  if grep -q '"loss"' "$tmp/auto.jsonl" 2>/dev/null && grep -q "^step 6/6" "$tmp/auto.log" &&
    ! grep -q $'\r' "$tmp/auto.log" && ! grep -q $'\033' "$tmp/auto.log"; then
    ok "log.progress: auto, ranks on a pty, mpirun into a file: no carriage return or escape code in the log"
  else
    bad "log.progress: auto into a file" "$(grep -c $'\r' "$tmp/auto.log") lines with CR, $(grep -c $'\033' "$tmp/auto.log") with ESC" "$(tail -n 5 "$tmp/auto.log" | cat -v)"
  fi
  pty_run on on || bad "progress on: run" "$(tail -n 10 "$tmp/on.log")"
  if grep -qF "$(printf '\r[')" "$tmp/on.log" && grep -qE '\] 6/6 loss' "$tmp/on.log"; then
    ok "log.progress: on draws the bar (carriage return, [====>], 6/6)"
  else
    bad "log.progress: on draws the bar" "$(tail -n 5 "$tmp/on.log" | cat -v)"
  fi
  # mpirun's own output on a terminal (script around mpirun): auto draws the bar.
  env -u MT_STDOUT_TTY -u MT_STDERR_TTY OMPI_MCA_btl_vader_single_copy_mechanism=none timeout 300 \
    script -qefc "${plain_mpirun[*]} -np 1 $mt --config $tmp/t.yaml --set log.metrics_file=$tmp/term.jsonl train" "$tmp/typescript" >/dev/null 2>&1
  if grep -qE '\] 6/6 loss' "$tmp/typescript"; then ok "log.progress: auto with mpirun on a terminal draws the bar"; else
    bad "log.progress: auto with mpirun on a terminal draws the bar" "$(tail -n 5 "$tmp/typescript" | cat -v)"; fi
else
  skip "progress bar under a pseudo-terminal" "util-linux 'script' is not installed"
  skipped=$((skipped + 2))
fi

# --- training.threads 0: the cores the rank may run on (a binding launcher's set), else the node's / its ranks ---
threads_of() { grep -oE '[0-9]+ threads per rank' "$1" | head -n 1 | grep -oE '^[0-9]+'; }
ncores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # the cores this shell may run on
first_cpu=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*\([0-9]*\).*/\1/p' /proc/self/status)
if command -v taskset >/dev/null && [ "$ncores" -ge 2 ] && [ -n "$first_cpu" ]; then
  taskset -c "$first_cpu" "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.threads=0 --set training.steps=1 train \
    >"$tmp/bound.log" 2>&1
  "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.threads=0 --set training.steps=1 train >"$tmp/free.log" 2>&1
  if [ "$(threads_of "$tmp/bound.log")" = 1 ] && [ "$(threads_of "$tmp/free.log")" = "$ncores" ]; then
    ok "training.threads 0: 1 thread bound to 1 core, $ncores unbound on 1 rank"
  else
    bad "training.threads 0 follows the binding" "bound: $(threads_of "$tmp/bound.log"), free: $(threads_of "$tmp/free.log")"
  fi
else
  skip "training.threads 0 follows the binding" "needs taskset and 2 cores"
fi

echo "cmdline: $passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
