#!/usr/bin/env bash
# `meshtrain estimate` and `meshtrain plan --search` against measured runs (issue 28, docs/PERFORMANCE.md), on
# CPU ranks of this machine. The model of configs/bench_cpu.yaml (dim 256, 4 layers, 8 heads, 4 kv heads, ffn 768,
# vocab 256, seq 256, batch 8, fp32), every run with training.threads=1 unless a row says otherwise (the estimate
# gives a rank min(threads, cores / ranks) of a core), byte-level shards of docs/*.md, 8 steps a run; a run's step
# time is the median step_ms of steps 3..8 (the first two pay for allocation and page faults), and a
# configuration's the median over REPEATS runs (default 3), the runs of all configurations interleaved round by
# round so that drift of the machine spreads over all of them. The peak is rank 0's (pp stage 0's) allocator
# high-water mark (metrics' alloc_peak_bytes), the largest over steps 2..8, against the estimate's
# stages[0].peak_bytes. The cluster file is configs/clusters/this_machine.yaml (CLUSTER overrides it).
#  1. estimate against measured, time and peak memory, for 16 configurations on 1 to 8 ranks: 1 rank (1 and 2
#     threads), dp_replicate 2, 4 and 8, dp_shard 2 and dp_replicate 2 x dp_shard 2 (fsdp.min_weight_size 1000,
#     so that the weights really shard), tp 2 with and without sequence parallel, cp 2 ring and all_gather,
#     recompute full and selective, pp 2 1f1b (micro-batches of 1), dp_shard 2 x tp 2 x cp 2 on 8 ranks, and
#     dp_replicate 2 at the file's 2 threads (4 threads on 2 cores);
#  2. plan --search for 8 ranks (pp searched too): the ranked plans, and 11-12 of them measured on 8 ranks with
#     their printed --set overrides (ranks 1, 2, 3, 10, 25, 37, 50, 75, 120, 180, the best-ranked plan with pp, and
#     the last); whether the top-ranked plan is the measured fastest or within 10% of it.
# Prints both tables (markdown). Ranks share the cores: 8 ranks on 2 cores are oversubscribed.
#   scripts/bench/bench_estimate.sh [BINARY_OR_BUILD_DIR]   (default build/; about 6 minutes on 2 cores)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
arg=${1:-$root/build}
if [ -d "$arg" ]; then mt="$arg/meshtrain"; else mt=$arg; fi
[ -x "$mt" ] || { echo "no meshtrain binary at $mt" >&2; exit 1; }
repeats=${REPEATS:-3}
cluster=${CLUSTER:-$root/configs/clusters/this_machine.yaml}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

/usr/bin/python3 "$root/scripts/prepare_data" --out "$tmp/data" --name docs "$root"/docs/*.md >/dev/null

/usr/bin/python3 - "$root" "$mt" "$tmp" "$repeats" "$cluster" <<'PY'
import json, os, re, shlex, statistics, subprocess, sys, time

root, mt, tmp, repeats, cluster = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
config = f"{root}/configs/bench_cpu.yaml"
mpirun = f"{root}/scripts/mpirun.sh"
common = ["--set", "training.threads=1"]
train_args = ["--set", f"data.train={tmp}/data/docs_train_*.bin", "--set", "data.val=", "--set", "eval.interval=0",
              "--set", "sample.interval=0", "--set", "training.steps=8", "--set", "log.interval=1"]

def sets(*kv):
    out = []
    for s in kv:
        out += ["--set", s]
    return out

fsdp = "parallel.fsdp.min_weight_size=1000"
rc = 'parallel.recompute.patterns=["model.layers.*"]'
# (label, ranks, overrides); every row sets dp_replicate, since the file's -1 fills whatever the others leave.
part1 = [
    ("1 rank", 1, sets("parallel.dp_replicate=1")),
    ("1 rank, 2 threads", 1, sets("parallel.dp_replicate=1", "training.threads=2")),
    ("dp_replicate 2", 2, sets("parallel.dp_replicate=2")),
    ("dp_replicate 4", 4, sets("parallel.dp_replicate=4")),
    ("dp_replicate 8", 8, sets("parallel.dp_replicate=8")),
    ("dp_shard 2", 2, sets("parallel.dp_replicate=1", "parallel.dp_shard=2", fsdp)),
    ("dp_replicate 2 x dp_shard 2", 4, sets("parallel.dp_replicate=2", "parallel.dp_shard=2", fsdp)),
    ("tp 2, sequence parallel", 2, sets("parallel.dp_replicate=1", "parallel.tp=2")),
    ("tp 2, no sequence parallel", 2, sets("parallel.dp_replicate=1", "parallel.tp=2",
                                           "parallel.sequence_parallel=false")),
    ("cp 2 ring", 2, sets("parallel.dp_replicate=1", "parallel.cp=2", "parallel.cp_method=ring")),
    ("cp 2 all_gather", 2, sets("parallel.dp_replicate=1", "parallel.cp=2", "parallel.cp_method=all_gather")),
    ("recompute full", 1, sets("parallel.dp_replicate=1", rc)),
    ("recompute selective (keep attention)", 1, sets("parallel.dp_replicate=1", rc,
                                                     'parallel.recompute.keep=["attention"]')),
    ("pp 2 1f1b, micro-batches of 1", 2, sets("parallel.dp_replicate=1", "parallel.pp=2",
                                              "parallel.pp_schedule=1f1b", "training.micro_batch_size=1")),
    ("dp_shard 2 x tp 2 x cp 2", 8, sets("parallel.dp_replicate=1", "parallel.dp_shard=2", "parallel.tp=2",
                                          "parallel.cp=2", fsdp)),
    ("dp_replicate 2, 2 threads", 2, sets("parallel.dp_replicate=2", "training.threads=2")),
]

def run(cmd, log):
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        sys.stderr.write(f"failed ({r.returncode}): {shlex.join(cmd)}\n{open(log).read()[-3000:]}\n")
        sys.exit(1)

def estimate(tag, np_, over):
    js = f"{tmp}/{tag}.est.json"
    run([mt, "--config", config] + common + over + ["estimate", "--world", str(np_), "--cluster", cluster,
                                                   "--json", js], f"{tmp}/{tag}.est.txt")
    e = json.load(open(js))
    slow = max(e["stages"], key=lambda s: s["step_s"])
    return {"ms": 1e3 * e["step_s"], "compute_ms": 1e3 * slow["compute_s"],
            "comm_ms": 1e3 * slow["exposed_comm_s"], "bubble_ms": 1e3 * slow.get("bubble_s", 0.0),
            "sync_ms": 1e3 * sum(c.get("sync_seconds", 0.0) for c in slow.get("comm", [])),
            "peak": e["stages"][0]["peak_bytes"]}

def measure(tag, np_, over, k):
    mj = f"{tmp}/{tag}.{k}.jsonl"
    if os.path.exists(mj):
        os.remove(mj)
    run([mpirun, "-np", str(np_), mt, "--config", config] + common + over + train_args +
        ["--set", f"log.metrics_file={mj}", "train"], f"{tmp}/{tag}.{k}.log")
    steps = [json.loads(l) for l in open(mj) if '"step_ms"' in l]
    ms = statistics.median(s["step_ms"] for s in steps if 3 <= s["step"] <= 8)
    peak = max(s["alloc_peak_bytes"] for s in steps if s["step"] >= 2)
    return ms, peak

def measure_all(rows):
    """rows: [(tag, ranks, overrides)]; REPEATS rounds over all rows; per row the median, min and max of the runs."""
    got = {tag: [] for tag, _, _ in rows}
    for k in range(repeats):
        for tag, np_, over in rows:
            got[tag].append(measure(tag, np_, over, k))
    out = {}
    for tag, runs in got.items():
        ms = [r[0] for r in runs]
        out[tag] = {"ms": statistics.median(ms), "lo": min(ms), "hi": max(ms), "peak": max(r[1] for r in runs)}
    return out

mib = lambda b: b / 2**20
t0 = time.time()
cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
model = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "unknown")
print(f"machine: {model}, {os.cpu_count()} cores; cluster file {os.path.relpath(cluster, root)}; "
      f"{repeats} runs per configuration, 8 steps each, median step_ms of steps 3..8")
print(f"binary: {mt}\n")

# 1. estimate against measured.
rows = [(f"c{i}", np_, over) for i, (_, np_, over) in enumerate(part1)]
est = {tag: estimate(tag, np_, over) for tag, np_, over in rows}
meas = measure_all(rows)
print("## 1. estimate against measured runs (training.threads=1 unless the row says otherwise)\n")
print("| configuration | ranks | predicted ms (compute + exposed comm [of it sync waits] + bubble) | measured ms (min-max) | measured / predicted "
      "| within 25% | predicted peak MiB | measured peak MiB | predicted / measured |")
print("| --- | ---: | ---: | ---: | ---: | :---: | ---: | ---: | ---: |")
n_ok = 0
for (label, np_, _), (tag, _, _) in zip(part1, rows):
    e, m = est[tag], meas[tag]
    r = m["ms"] / e["ms"]
    ok = abs(r - 1) <= 0.25
    n_ok += ok
    parts = (f'{e["compute_ms"]:.0f} + {e["comm_ms"]:.1f}' + (f' [{e["sync_ms"]:.1f}]' if e["sync_ms"] > 0 else "") +
             (f' + {e["bubble_ms"]:.1f}' if e["bubble_ms"] > 0 else ""))
    print(f'| {label} | {np_} | {e["ms"]:.0f} ({parts}) | {m["ms"]:.0f} ({m["lo"]:.0f}-{m["hi"]:.0f}) | {r:.2f} | '
          f'{"yes" if ok else "no"} | {mib(e["peak"]):.2f} | {mib(m["peak"]):.2f} | {e["peak"] / m["peak"]:.3f} |')
print(f"\nstep time within 25%: {n_ok} of {len(part1)}\n")

# 2. plan --search for 8 ranks.
search_txt = f"{tmp}/search.txt"
run([mt, "--config", config] + common + ["plan", "--search", "--world", "8", "--cluster", cluster, "--top", "1000"],
    search_txt)
text = open(search_txt).read()
plans = []
for m in re.finditer(r"^(\d+)\. (.*?): step ([0-9.]+) ms.*?\n(?:.*\n)*?\s+(--set .*)$", text, re.M):
    plans.append({"rank": int(m.group(1)), "plan": m.group(2), "pred": float(m.group(3)),
                  "over": m.group(4).split()})  # as printed, quotes kept
print("## 2. plan --search --world 8 on configs/bench_cpu.yaml (training.threads=1)\n")
print(text.splitlines()[0])
n = len(plans)
# Spread down the ranking, and the best-ranked plan with pipeline parallel (the search tries pp too).
first_pp = next((p["rank"] for p in plans if p["plan"].startswith("pp=")), 1)
pick = sorted({r for r in (1, 2, 3, 10, 25, 37, 50, 75, 120, 180, first_pp, n) if 1 <= r <= n})
chosen = [p for p in plans if p["rank"] in pick]
rows2 = [(f"s{p['rank']}", 8, p["over"]) for p in chosen]
for p, (tag, _, over) in zip(chosen, rows2):
    p["est"] = estimate(tag, 8, over)
meas2 = measure_all(rows2)
print(f"\n{n} plans ranked; measured on 8 ranks: ranks {', '.join(map(str, pick))}\n")
print("| rank | plan | predicted ms [of it sync waits] | measured ms (min-max) | measured / predicted | "
      "predicted peak MiB | measured peak MiB |")
print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
for p, (tag, _, _) in zip(chosen, rows2):
    m = meas2[tag]
    print(f'| {p["rank"]} | {p["plan"]} | {p["pred"]:.1f} [{p["est"]["sync_ms"]:.1f}] | {m["ms"]:.0f} ({m["lo"]:.0f}-{m["hi"]:.0f}) | '
          f'{m["ms"] / p["pred"]:.2f} | {mib(p["est"]["peak"]):.2f} | {mib(m["peak"]):.2f} |')
fastest = min(chosen, key=lambda p: meas2[f"s{p['rank']}"]["ms"])
top = meas2["s1"]["ms"]
best = meas2[f"s{fastest['rank']}"]["ms"]
verdict = "PASS" if top <= 1.10 * best else "FAIL"
print(f"\nmeasured fastest: rank {fastest['rank']} ({fastest['plan']}), {best:.0f} ms; top-ranked: {top:.0f} ms, "
      f"{top / best:.3f}x the fastest: {verdict} (rule: within 10%)")
# Rank correlation of predicted against measured over the measured plans.
def ranks_of(v):
    order = sorted(range(len(v)), key=lambda i: v[i])
    r = [0.0] * len(v)
    for pos, i in enumerate(order):
        r[i] = pos
    return r
pv = ranks_of([p["pred"] for p in chosen])
mv = ranks_of([meas2[f"s{p['rank']}"]["ms"] for p in chosen])
k = len(chosen)
rho = 1 - 6 * sum((a - b) ** 2 for a, b in zip(pv, mv)) / (k * (k * k - 1))
print(f"Spearman rank correlation, predicted against measured, over the {k} measured plans: {rho:.2f}")
print(f"\ntotal {time.time() - t0:.0f} s")
PY
