#!/usr/bin/env bash
# The Slurm batch files on a real Slurm: starts a private one-node cluster on this machine (munged, slurmctld and
# slurmd as the current user, every file in a temporary directory, ports chosen free), then
#   - scripts/slurm/train.sbatch on 2 tasks (srun --mpi=pmix) finishes with its metrics and checkpoint;
#   - a second job gets the time-limit warning (SIGUSR1 to the batch script, as --signal=B:USR1@... sends it),
#     checkpoints, exits with 128 + 10, requeues itself and finishes from that checkpoint with the losses of the
#     uninterrupted run, bit for bit;
#   - train.sbatch under mpirun (MT_LAUNCHER=mpirun) and scripts/slurm/check.sbatch pass; a missing config is a
#     clear error;
#   - a rank killed (SIGKILL) during a train.sbatch job: the job's `meshtrain supervise` names the rank and node,
#     relaunches srun inside the allocation from the newest checkpoint, and the job completes with the
#     uninterrupted run's weights byte for byte and every step in its metrics;
#   - with --full, a real one-minute time limit: warned, requeued, resumed, until the last step (about a minute).
# Where Slurm or munge is not installed or the daemons do not start, every check is counted as skipped.
# Prints "slurm: N passed, N failed[, N skipped]" last.
#   tests/cli/test_slurm.sh BUILD_DIR [--full]
set -uo pipefail
build=${1:?usage: test_slurm.sh BUILD_DIR [--full]}
full=0
[ "${2:-}" = "--full" ] && full=1
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "$build" && pwd)
mt="$build/meshtrain"
py=/usr/bin/python3
compare="$root/tests/cli/compare_runs.py"
tmp=$(mktemp -d /tmp/mt-slurm.XXXXXX)
chmod 755 "$tmp"
source "$root/tests/cli/common.sh"
checks=$((10 + full))  # the checks below, all counted as skipped when the cluster cannot start

# Nothing of an outer Slurm job (this test may itself run in one) may leak into the private cluster's commands.
for v in $(compgen -e | grep -E '^(SLURM|SBATCH|SALLOC|SRUN)_'); do unset "$v"; done
export SLURM_CONF="$tmp/slurm.conf"
export OMP_NUM_THREADS=1

pids=()
cleanup() {
  if [ -f "$tmp/slurmctld.pid" ]; then
    # Jobs end first (their slurmstepd would outlive slurmd otherwise), then the daemons.
    timeout 10 scancel --quiet --user "$(id -un)" 2>/dev/null
    for _ in $(seq 30); do [ -z "$(timeout 5 squeue -h -t R,CG,PD 2>/dev/null)" ] && break; sleep 0.5; done
    timeout 10 scontrol shutdown >/dev/null 2>&1
  fi
  for p in "${pids[@]}"; do
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
    kill "$p" 2>/dev/null
  done
  wait 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
# skip_all WHY: the cluster cannot run here.
skip_all() {
  for _ in $(seq "$checks"); do skipped=$((skipped + 1)); done
  echo "skip all $checks checks: $1"
  summary slurm
  exit 0
}

for tool in munged slurmctld slurmd sbatch srun scontrol scancel squeue sinfo; do
  command -v "$tool" >/dev/null || skip_all "$tool is not installed (Debian: munge slurmctld slurmd slurm-client; scripts/setup.sh installs them)"
done
[ -x "$mt" ] || { bad "meshtrain binary" "$mt not found"; summary slurm; exit 1; }

# Two free TCP ports on this machine for slurmctld and slurmd.
read -r ctld_port slurmd_port < <("$py" -c '
import socket
ss = [socket.socket() for _ in range(2)]
for s in ss: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in ss])')
user=$(id -un)
host=$(hostname -s)

# munge: a private key and socket.
mkdir -p "$tmp/munge/key" "$tmp/log" "$tmp/state" "$tmp/spool" "$tmp/run"
chmod 700 "$tmp/munge/key"
head -c 1024 /dev/urandom >"$tmp/munge/key/munge.key"
chmod 600 "$tmp/munge/key/munge.key"
munged --foreground --force --key-file="$tmp/munge/key/munge.key" --socket="$tmp/munge/munge.sock" \
  --pid-file="$tmp/munge/munged.pid" --log-file="$tmp/log/munged.log" --seed-file="$tmp/munge/seed" \
  >>"$tmp/log/munged.log" 2>&1 &
pids+=($!)

# A minimal cluster: one node of 2 CPUs (more than the machine has is fine: config_overrides), one partition,
# no accounting or cgroups; requeued jobs start again within seconds (cred_expire, sched_interval).
cat >"$SLURM_CONF" <<EOF
ClusterName=meshtrain-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$tmp/munge/munge.sock,cred_expire=5
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MinJobAge=600
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF

for _ in $(seq 50); do [ -S "$tmp/munge/munge.sock" ] && break; sleep 0.1; done
[ -S "$tmp/munge/munge.sock" ] || skip_all "munged did not start: $(tail -n 3 "$tmp/log/munged.log" | tr '\n' ' ')"
slurmctld -D -f "$SLURM_CONF" >>"$tmp/log/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" -N localhost >>"$tmp/log/slurmd.out" 2>&1 &
pids+=($!)
state=""
for _ in $(seq 60); do
  state=$(timeout 5 sinfo -h -n localhost -o %t 2>/dev/null)
  [ "$state" = idle ] && break
  sleep 0.5
done
[ "$state" = idle ] || skip_all "the private slurmctld and slurmd did not come up (node state '$state'): $(
  tail -q -n 2 "$tmp/log/slurmctld.log" "$tmp/log/slurmd.log" 2>/dev/null | tr '\n' ' ')"
echo "slurm: private cluster up ($(sinfo --version), ports $ctld_port/$slurmd_port, srun --mpi: $(
  srun --mpi=list 2>&1 | grep -v 'MPI plugin' | tr -s ' \t\n' ' '))"

# The job's data and config: the repository's docs as byte-level shards, a model small enough for 2 cores. 150
# steps (a few seconds) leave the signal of test 2 and 3, sent after step 3, well inside the run: at 30 steps the
# run could end before the signal arrived.
docs_data
steps=150
last_ckpt=$(printf 'step_%08d' $steps)
cat >"$tmp/t.yaml" <<YAML
model: {dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 96, vocab_size: 256, max_seq_len: 64}
training: {steps: $steps, batch_size: 8, seq_len: 64, lr: 3.0e-3, warmup_steps: 3, lr_min: 3.0e-4, grad_clip: 1.0,
           weight_decay: 0.1, threads: 1}
data: {train: "$tmp/data/docs_train_*.bin", val: "$tmp/data/docs_val_*.bin"}
eval: {interval: 0}
sample: {interval: 0}
log: {interval: 1}
checkpoint: {interval: 0, keep: 3}
YAML
# The options every job gets here: no GPUs, 2 ranks of 1 CPU, the log in the temporary directory.
sb=(--gpus-per-node=0 --ntasks-per-node=2 --cpus-per-task=1)
export MESHTRAIN="$mt"
# job_field ID FIELD: a field of `scontrol show job` (JobState, ExitCode, Restarts).
job_field() { scontrol show job "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n 1; }
# distinct_steps FILE: the number of different steps in a metrics file (a step run twice counts once).
distinct_steps() { grep -o '"step": *[0-9]*' "$1" 2>/dev/null | sort -u | wc -l; }

# 1. The plain run: 2 ranks through srun --mpi=pmix, to the last step, its metrics and its checkpoint.
cd "$tmp/run"
out="$tmp/run/plain.out"
jid=$(timeout 120 sbatch --parsable --wait "${sb[@]}" --output="$out" "$root/scripts/slurm/train.sbatch" "$tmp/t.yaml" \
  --set log.metrics_file="$tmp/run/plain.jsonl" --set checkpoint.dir="$tmp/run/plain_ckpt")
rc=$?
if [ $rc -eq 0 ] && [ "$(job_field "$jid" JobState)" = COMPLETED ] && grep -q "srun --mpi=pmix" "$out" &&
  grep -q "dp_replicate=2" "$out" && [ "$(steps_in "$tmp/run/plain.jsonl")" -eq $steps ] &&
  [ -f "$tmp/run/plain_ckpt/$last_ckpt/meta.json" ]; then
  ok "train.sbatch: 2 ranks under srun --mpi=pmix finish $steps steps with metrics and the last checkpoint"
else
  bad "train.sbatch: 2 ranks under srun --mpi=pmix" "sbatch exit $rc, job $jid $(job_field "$jid" JobState)," \
    "$(steps_in "$tmp/run/plain.jsonl") step records" "$(tail -n 15 "$out" 2>/dev/null)"
fi
# The job log is for reading: no progress-bar redraws (carriage returns) or terminal escape codes.
if [ -s "$out" ] && ! grep -q $'[\r\e]' "$out"; then
  ok "train.sbatch: the job log has no progress-bar redraws or escape codes"
else
  bad "train.sbatch: the job log has progress-bar redraws or escape codes" "$(grep -c $'[\r\e]' "$out") lines"
fi

# 2. The time-limit warning: SIGUSR1 to the batch script (what --signal=B:USR1@180 sends), sent once the run is
# a few steps in. The ranks checkpoint and exit with 128 + 10, the script requeues the job, the requeued run
# resumes from that checkpoint and ends with the losses of the uninterrupted run.
out="$tmp/run/sig.out"
jid=$(sbatch --parsable "${sb[@]}" --output="$out" "$root/scripts/slurm/train.sbatch" "$tmp/t.yaml" \
  --set log.metrics_file="$tmp/run/sig.jsonl" --set checkpoint.dir="$tmp/run/sig_ckpt")
wait_for_steps "$tmp/run/sig.jsonl" 3 600 0.1
scancel --batch --signal=USR1 "$jid"
state=""
for _ in $(seq 120); do
  state=$(job_field "$jid" JobState)
  [ "$state" = COMPLETED ] || [ "$state" = FAILED ] || [ "$state" = CANCELLED ] && break
  sleep 0.5
done
stop_ckpt=$(ls -d "$tmp"/run/sig_ckpt/step_* 2>/dev/null | head -n 1)
stop_step=$(basename "${stop_ckpt:-step_x}" | sed -E 's/^step_0*//')
if grep -q "SIGUSR1 (time limit near)" "$out" && grep -q "stopped by SIGUSR1 with a checkpoint: requeueing" "$out" &&
  [ -n "$stop_ckpt" ] && [ "${stop_step:-0}" -ge 3 ] 2>/dev/null && [ "$stop_step" -lt $steps ]; then
  ok "train.sbatch: SIGUSR1 checkpoints at step $stop_step, exits 128 + 10 and requeues the job"
else
  bad "train.sbatch: SIGUSR1 checkpoints and requeues" "first checkpoint '${stop_ckpt:-none}', job $state" \
    "$(grep -v '^\[' "$out" 2>/dev/null | tail -n 12)"
fi
if [ "$state" = COMPLETED ] && [ "$(job_field "$jid" Restarts)" = 1 ] && [ "$(job_field "$jid" ExitCode)" = 0:0 ] &&
  grep -q "resumed from $stop_ckpt at step $stop_step" "$out" && [ -f "$tmp/run/sig_ckpt/$last_ckpt/meta.json" ] &&
  "$py" "$compare" "$tmp/run/sig.jsonl" "$tmp/run/plain.jsonl" --exact --steps $steps >"$tmp/cmp" 2>&1; then
  ok "train.sbatch: the requeued job resumes at step $stop_step and ends with the uninterrupted run's losses"
else
  bad "train.sbatch: the requeued job resumes and finishes" "job $state, restarts $(job_field "$jid" Restarts)," \
    "exit $(job_field "$jid" ExitCode)" "$(cat "$tmp/cmp" 2>/dev/null)" "$(grep -v '^\[' "$out" | tail -n 12)"
fi

# 3. Open MPI's mpirun inside the allocation instead of srun, signal included: it forwards SIGUSR1 to the ranks.
out="$tmp/run/mpirun.out"
jid=$(MT_LAUNCHER=mpirun sbatch --parsable "${sb[@]}" --no-requeue --output="$out" "$root/scripts/slurm/train.sbatch" \
  "$tmp/t.yaml" --set log.metrics_file="$tmp/run/mpirun.jsonl" --set checkpoint.dir="$tmp/run/mpirun_ckpt")
wait_for_steps "$tmp/run/mpirun.jsonl" 3 600 0.1
scancel --batch --signal=USR1 "$jid"
for _ in $(seq 120); do
  state=$(job_field "$jid" JobState)
  [ "$state" = COMPLETED ] || [ "$state" = FAILED ] || [ "$state" = CANCELLED ] && break
  sleep 0.5
done
if grep -q "mpirun.*meshtrain" "$out" && grep -q "dp_replicate=2" "$out" && ! grep -q $'[\r\e]' "$out" &&
  ls -d "$tmp"/run/mpirun_ckpt/step_* >/dev/null 2>&1 && grep -q "stopped by SIGUSR1 with a checkpoint" "$out"; then
  ok "train.sbatch: MT_LAUNCHER=mpirun runs 2 ranks, logs plain lines and passes SIGUSR1 on (checkpoint, requeue)"
else
  bad "train.sbatch: MT_LAUNCHER=mpirun" "job $state" "$(grep -v '^\[' "$out" 2>/dev/null | tail -n 12)"
fi

# 3b. (--full) A real time limit: 1 minute, the warning at most 60 s before it (Slurm sends it at its next
# time-limit scan, up to 30 s after the start). The run takes longer than that, so it is warned, checkpoints and
# is requeued, maybe more than once, each run resuming where the last stopped, until the last step.
if [ $full -eq 1 ]; then
  # Steps for about 45 s of training at the plain run's median step time.
  n=$("$py" -c '
import json, statistics, sys
ms = [json.loads(l)["step_ms"] for l in open(sys.argv[1]) if "step_ms" in l]
print(max(200, min(5000, int(45000 / max(statistics.median(ms), 1e-3)))))' "$tmp/run/plain.jsonl" 2>/dev/null || echo 500)
  out="$tmp/run/limit.out"
  jid=$(sbatch --parsable "${sb[@]}" --time=1 --signal=B:USR1@60 --output="$out" "$root/scripts/slurm/train.sbatch" \
    "$tmp/t.yaml" --set training.steps="$n" --set log.metrics_file="$tmp/run/limit.jsonl" \
    --set checkpoint.dir="$tmp/run/limit_ckpt")
  for _ in $(seq 400); do
    state=$(job_field "$jid" JobState)
    [ "$state" = COMPLETED ] || [ "$state" = FAILED ] || [ "$state" = CANCELLED ] || [ "$state" = TIMEOUT ] && break
    sleep 0.5
  done
  restarts=$(job_field "$jid" Restarts)
  if [ "$state" = COMPLETED ] && [ "${restarts:-0}" -ge 1 ] &&
    [ "$(grep -c "resumed from $tmp/run/limit_ckpt/step_" "$out")" -eq "$restarts" ] &&
    [ "$(distinct_steps "$tmp/run/limit.jsonl")" -eq "$n" ] &&
    [ -f "$tmp/run/limit_ckpt/$(printf 'step_%08d' "$n")/meta.json" ]; then
    ok "train.sbatch: --time=1 warns, checkpoints and requeues; $restarts requeued run(s) resume and reach step $n"
  else
    bad "train.sbatch: a real time limit" "job $state, restarts ${restarts:-?}," \
      "$(distinct_steps "$tmp/run/limit.jsonl") of $n steps" \
      "$(grep -v '^\[' "$out" 2>/dev/null | grep -v '^step ' | tail -n 12)"
  fi
fi

# 3c. A rank killed during the job: the supervisor in train.sbatch relaunches srun inside the allocation, from the
# newest checkpoint, and the job completes as if nothing happened.
out="$tmp/run/kill.out"
jid=$(MT_BACKOFF=1 sbatch --parsable "${sb[@]}" --output="$out" "$root/scripts/slurm/train.sbatch" "$tmp/t.yaml" \
  --set log.metrics_file="$tmp/run/kill.jsonl" --set checkpoint.dir="$tmp/run/kill_ckpt" --set checkpoint.interval=10 \
  --set comm.timeout_s=10)
wait_for_steps "$tmp/run/kill.jsonl" 25 1200 0.05
victim=""
for p in $(pgrep -f -- "^$mt .*checkpoint.dir=$tmp/run/kill_ckpt"); do
  tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "SLURM_PROCID=1" && victim=$p
done
echo "slurm: SIGKILL to rank 1 (pid ${victim:-none}) after $(steps_in "$tmp/run/kill.jsonl") step records"
[ -n "$victim" ] && kill -KILL "$victim"
for _ in $(seq 240); do
  state=$(job_field "$jid" JobState)
  [ "$state" = COMPLETED ] || [ "$state" = FAILED ] || [ "$state" = CANCELLED ] && break
  sleep 0.5
done
if [ "$state" = COMPLETED ] && grep -q "\] failure 1 (launch 1): rank 1 on localhost exited on signal 9" "$out" &&
  grep -q "\] launch 2 of .*srun" "$out" && grep -q "resumed from $tmp/run/kill_ckpt/step_" "$out" &&
  grep -q "\] goodput [0-9.]*% of" "$out"; then
  ok "train.sbatch: a rank killed mid-job: the supervisor names rank 1 on localhost, relaunches srun, the job completes"
else
  bad "train.sbatch: a rank killed mid-job is relaunched by the supervisor" "job $state" \
    "$(grep -v '^\[\|^step ' "$out" 2>/dev/null | tail -n 8)" "$(grep '^\[supervise' "$out" 2>/dev/null | tail -n 6)"
fi
ckpt_same=1
for f in "$tmp/run/plain_ckpt/$last_ckpt"/*.safetensors; do
  cmp -s "$f" "$tmp/run/kill_ckpt/$last_ckpt/$(basename "$f")" || ckpt_same=0
done
if [ $ckpt_same = 1 ] && cmpout=$("$py" "$root/tests/cli/dedup_steps.py" "$tmp/run/kill.jsonl" $steps \
  --base "$tmp/run/plain.jsonl" 2>&1); then
  ok "train.sbatch: after the relaunch, the weights equal the uninterrupted job's byte for byte; $cmpout"
else
  bad "train.sbatch: after the relaunch, the uninterrupted job's weights and steps" "weights equal: $ckpt_same" \
    "${cmpout:-}"
fi

# 4. check.sbatch: the communication self-check over the allocation, through srun.
out="$tmp/run/check.out"
jid=$(timeout 120 sbatch --parsable --wait "${sb[@]}" --output="$out" "$root/scripts/slurm/check.sbatch" "$tmp/t.yaml" \
  --sizes 1K:16K)
rc=$?
if [ $rc -eq 0 ] && grep -q "srun --mpi=pmix" "$out" && grep -q "check passed: 0 wrong result" "$out"; then
  ok "check.sbatch: every collective right on 2 ranks under srun"
else
  bad "check.sbatch" "sbatch exit $rc" "$(tail -n 12 "$out" 2>/dev/null)"
fi

# 5. Bad input is a clear error in the job log, not a hang: a missing config, a missing binary.
out="$tmp/run/bad.out"
timeout 60 sbatch --wait "${sb[@]}" --output="$out" "$root/scripts/slurm/train.sbatch" "$tmp/missing.yaml" >/dev/null 2>&1
rc=$?
if [ $rc -ne 0 ] && grep -q "config file '$tmp/missing.yaml' not found" "$out"; then
  ok "train.sbatch: a missing config file is named in the job log"
else
  bad "train.sbatch: a missing config file" "sbatch exit $rc" "$(cat "$out" 2>/dev/null)"
fi
out="$tmp/run/bad2.out"
MESHTRAIN="$tmp/nothing" timeout 60 sbatch --wait "${sb[@]}" --output="$out" "$root/scripts/slurm/check.sbatch" \
  >/dev/null 2>&1
rc=$?
if [ $rc -ne 0 ] && grep -q "meshtrain binary '$tmp/nothing' not found" "$out"; then
  ok "check.sbatch: a missing binary is named in the job log (set MESHTRAIN)"
else
  bad "check.sbatch: a missing binary" "sbatch exit $rc" "$(cat "$out" 2>/dev/null)"
fi

cd "$root"
summary slurm
[ $failed -eq 0 ]
