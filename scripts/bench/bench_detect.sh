#!/usr/bin/env bash
# Failure detection, measured (docs/PERFORMANCE.md, "Goodput under failures"): the CPU benchmark model
# (configs/bench_cpu.yaml) on 4 ranks of 1 thread under `meshtrain supervise --backoff 0`; once the launch has
# recorded a few steps, one rank (1, 2, 3 in turn) gets SIGKILL or SIGSTOP, and the script times, from the signal:
#   down     : every process of the launch gone (mpirun and its 4 ranks; a zombie counts as gone);
#   relaunch : the supervisor's "launch 2 of" line.
# Each round then kills the supervisor (its launch dies with it) and anything of the round left behind.
# Prints one line per round and the median of each kind last.
#   scripts/bench/bench_detect.sh [BUILD_DIR] [ROUNDS]
#   env: TIMEOUT_S (comm.timeout_s, default 5), KEEP=1 (keep the work directory, printed)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
rounds=${2:-3}
timeout_s=${TIMEOUT_S:-5}
mt="$build/meshtrain"
tmp=$(mktemp -d /tmp/mt-detect.XXXXXX)
if [ "${KEEP:-0}" = 1 ]; then echo "work directory: $tmp (kept)"; else trap 'rm -rf "$tmp"' EXIT; fi
export OMP_NUM_THREADS=1
echo "machine: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1), $(getconf _NPROCESSORS_ONLN) cores," \
  "load average $(cut -d' ' -f1-3 /proc/loadavg); $(date -u '+%F %H:%M UTC'); comm.timeout_s $timeout_s"
/usr/bin/python3 "$root/scripts/bench/bench_data.py" "$tmp"
/usr/bin/python3 - "$root" "$mt" "$tmp" "$rounds" "$timeout_s" <<'PY'
import os, signal, statistics, subprocess, sys, time
root, mt, tmp, rounds, timeout_s = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

def procs(tag):
    """(pid, world rank or None) of every process whose command line holds tag."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read()
            if tag.encode() not in cmd:
                continue
            env = open(f"/proc/{d}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        rank = next((int(e.split(b"=")[1]) for e in env if e.startswith(b"OMPI_COMM_WORLD_RANK=")), None)
        out.append((int(d), rank))
    return out

def steps(path):
    try:
        return sum(1 for l in open(path) if '"loss"' in l)
    except OSError:
        return 0

def one(name, sig, rank):
    tag = f"checkpoint.dir={tmp}/{name}.ckpt"
    launch = [f"{root}/scripts/mpirun.sh", "-np", "4", mt, "--config", f"{root}/configs/bench_cpu.yaml",
              "--set", f"data.train={tmp}/bench_*.bin", "--set", "data.val=", "--set", "training.threads=1",
              "--set", "log.interval=1", "--set", f"comm.timeout_s={timeout_s}", "--set", "training.steps=100000",
              "--set", "checkpoint.interval=0", "--set", f"log.metrics_file={tmp}/{name}.jsonl", "--set", tag, "train"]
    log = open(f"{tmp}/{name}.log", "w")
    sup = subprocess.Popen([mt, "supervise", "--max-restarts", "1", "--backoff", "0", "--"] + launch,
                           stdout=log, stderr=subprocess.STDOUT)
    end = time.time() + 300
    while steps(f"{tmp}/{name}.jsonl") < 3 and time.time() < end and sup.poll() is None:
        time.sleep(0.1)
    launch_pids = [p for p, r in procs(tag) if p != sup.pid]
    victim = next((p for p, r in procs(tag) if r == rank), None)
    res = None
    if victim and len(launch_pids) == 5:
        t0 = time.time()
        os.kill(victim, sig)
        down = relaunch = None
        while time.time() < t0 + 120 and (down is None or relaunch is None):
            t = time.time()
            if down is None and not any(alive(p) for p in launch_pids):
                down = t - t0
            if relaunch is None and "] launch 2 of" in open(f"{tmp}/{name}.log").read():
                relaunch = t - t0
            time.sleep(0.01)
        res = (down, relaunch)
    sup.kill()
    sup.wait()
    for _ in range(100):
        left = [p for p, _ in procs(tag)]
        if not left:
            break
        time.sleep(0.1)
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    return res

fmt = lambda x: "none" if x is None else f"{x:.2f} s"
got = {"KILL": [], "STOP": []}
for i in range(rounds):
    for what in ("KILL", "STOP"):
        rank = 1 + i % 3
        r = one(f"r{i}{what}", getattr(signal, "SIG" + what), rank)
        if r is None:
            print(f"round {i + 1} SIG{what} to rank {rank}: the launch was not running, skipped")
            continue
        got[what].append(r)
        print(f"round {i + 1} SIG{what} to rank {rank}: down {fmt(r[0])}, relaunch {fmt(r[1])}", flush=True)
for what, rs in got.items():
    d = [r[0] for r in rs if r[0] is not None]
    l = [r[1] for r in rs if r[1] is not None]
    if d and l:
        print(f"SIG{what}: median down {statistics.median(d):.2f} s (min {min(d):.2f}, max {max(d):.2f}), "
              f"median relaunch {statistics.median(l):.2f} s (min {min(l):.2f}, max {max(l):.2f}) over {len(rs)}")
PY
