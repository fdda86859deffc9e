#!/usr/bin/env bash
# Pipeline-parallel benchmark (issue 27, docs/PERFORMANCE.md), on CPU ranks x 1 thread. One model (dim 256,
# 8 layers, 8 heads, 4 kv heads, ffn 768, vocab 256; seq 256, micro-batches of 1 sequence, fp32), trained STEPS
# steps per run; the first 2 steps are warm-up, figures are medians over the rest. Measures:
#  1. the bubble of each schedule (gpipe, 1f1b, interleaved_1f1b with pp_virtual 2, zb1p) at pp = 2 and 4 and
#     m = 4, 8, 16 micro-batches: the mean over pp ranks of (step - compute) / compute (the metrics file's
#     pp_bubble) beside the schedule's formula ((p-1)/m, (p-1)/(v m), about (p-1)/(3m)), and their ratio; under
#     two shared-memory transports of Open MPI: "copy", what scripts/mpirun.sh sets (single_copy_mechanism none:
#     a 256 KiB boundary message is above the eager limit and moves in fragments, each pushed by the sender, so
#     it advances only while the sender is inside MPI, not while it computes), and "cma" (the receiver reads the
#     sender's buffer itself; needs the kernel's cross-memory attach, which some containers forbid). A small
#     table adds "eager" (the eager limit raised above the message: copied out at the send) at pp 2, m 16.
#     pp = 4 puts 4 ranks on this machine's cores: oversubscribed when it has fewer than 4; those runs set
#     mpi_yield_when_idle = 1 (a waiting rank gives its core up), and one extra run shows 1f1b without it;
#  2. peak activation memory per stage, 1F1B against GPipe, at pp = 2 and m = 4, 8, 16 (the sweep's copy runs):
#     the most micro-batches in flight on each stage (pp_in_flight) and the largest allocator high-water mark of
#     a step over the stages (pp_peak_bytes: activations held + temporaries), with the GPipe / 1F1B ratio;
#  3. step time on 2 ranks at the same global batch (16 sequences of 256 tokens): pp = 2 (m = 16, each
#     schedule; the sweep's runs) against dp_replicate = 2 and tp = 2, each with micro-batches of 1 sequence
#     (every forward on every rank sees one sequence, as in pp) and without micro-batching (one forward per rank
#     per step), under both transports, with the ratios to dp_replicate = 2.
#   scripts/bench/bench_pp.sh [BINARY_OR_BUILD_DIR] [STEPS]   (defaults: build/, 10 steps; about 9 minutes on
#   2 cores)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
arg=${1:-$root/build}
if [ -d "$arg" ]; then mt="$arg/meshtrain"; else mt=$arg; fi
steps=${2:-10}
[ -x "$mt" ] || { echo "no meshtrain binary at $mt" >&2; exit 1; }
[ "$steps" -ge 4 ] || { echo "STEPS must be at least 4 (2 warm-up steps are skipped)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mpirun="$root/scripts/mpirun.sh"
cores=$(nproc --all)  # (plain nproc answers OMP_NUM_THREADS)
export OMP_NUM_THREADS=1
d=256 L=8 H=8 KV=4 F=768 V=256 T=256
# The boundary message: (1, T, d) f32; the eager limit raised above it, with room for the headers.
eager=$((T * d * 4 + 4096))

/usr/bin/python3 "$root/scripts/prepare_data" --out "$tmp/data" --name docs "$root"/docs/*.md >/dev/null
cat >"$tmp/pp.yaml" <<YAML
model: {dim: $d, n_layers: $L, n_heads: $H, n_kv_heads: $KV, ffn_dim: $F, vocab_size: $V, max_seq_len: $T}
training: {steps: $steps, batch_size: 16, seq_len: $T, micro_batch_size: 1, lr: 3.0e-3, warmup_steps: 2, threads: 1}
data: {train: "$tmp/data/docs_train_*.bin", val: ""}
eval: {interval: 0}
sample: {interval: 0}
checkpoint: {interval: 0}
log: {interval: 1, progress: "off"}
YAML

# train NAME NP [--set ...]: one run with the extra environment in the array $with; metrics in $tmp/NAME.jsonl.
# A failed run is reported (its log's tail) and marked, and the sweep goes on.
with=()
train() {
  local name=$1 np=$2
  shift 2
  if ! env ${with[@]+"${with[@]}"} timeout 600 "$mpirun" -np "$np" "$mt" --config "$tmp/pp.yaml" \
    --set log.metrics_file="$tmp/$name.jsonl" "$@" train >"$tmp/$name.log" 2>&1; then
    echo "FAILED: $name (-np $np $*)"
    tail -n 15 "$tmp/$name.log" | sed 's/^/  /'
    touch "$tmp/$name.failed"
  fi
}
yield=(OMPI_MCA_mpi_yield_when_idle=1)
cma=(OMPI_MCA_btl_vader_single_copy_mechanism=cma)
eagerenv=(OMPI_MCA_btl_vader_eager_limit=$eager OMPI_MCA_btl_vader_max_send_size=$eager)

t0=$SECONDS
echo "machine: $cores cores ($(lscpu | sed -n 's/^Model name: *//p')), $(date -u +%Y-%m-%d)"
echo "model: dim $d, $L layers, $H heads ($KV kv), ffn $F, vocab $V; seq $T, micro-batch 1 sequence, fp32;" \
  "1 thread per rank; $steps steps per run, medians over steps 3..$steps"
echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg) (other work on the cores slows the runs it overlaps)"
[ "$cores" -lt 4 ] && echo "pp = 4: 4 ranks on $cores cores, OVERSUBSCRIBED (run with mpi_yield_when_idle = 1)"
echo

# 1 and 2: the sweep. The two transports run one after the other for each point, so that other load on the
# machine falls on both alike.
for p in 2 4; do
  for s in gpipe 1f1b interleaved_1f1b zb1p; do
    sets=(--set parallel.pp=$p --set parallel.pp_schedule=$s)
    [ $s = interleaved_1f1b ] && sets+=(--set parallel.pp_virtual=2)
    for m in 4 8 16; do
      base=(); [ $p -gt "$cores" ] && base=("${yield[@]}")
      with=(${base[@]+"${base[@]}"})
      train "pp${p}_${s}_m${m}_copy" $p "${sets[@]}" --set training.batch_size=$m
      with=(${base[@]+"${base[@]}"} "${cma[@]}")
      train "pp${p}_${s}_m${m}_cma" $p "${sets[@]}" --set training.batch_size=$m
    done
  done
done
# The eager transport at pp 2, m 16.
with=("${eagerenv[@]}")
for s in gpipe 1f1b; do train "pp2_${s}_m16_eager" 2 --set parallel.pp=2 --set parallel.pp_schedule=$s; done
# pp = 4 without yielding: a waiting rank spins on its core.
with=(OMPI_MCA_mpi_yield_when_idle=0)
train pp4_1f1b_m8_noyield 4 --set parallel.pp=4 --set parallel.pp_schedule=1f1b --set training.batch_size=8

# 3: dp_replicate 2 and tp 2 on the same model and global batch (16 sequences), both transports.
for tr in copy cma; do
  if [ $tr = cma ]; then with=("${cma[@]}"); else with=(); fi
  train dp2_mb1_$tr 2 --set parallel.dp_replicate=2
  train dp2_mb0_$tr 2 --set parallel.dp_replicate=2 --set training.micro_batch_size=0
  train tp2_mb1_$tr 2 --set parallel.tp=2
  train tp2_mb0_$tr 2 --set parallel.tp=2 --set training.micro_batch_size=0
done

split=$(grep -ho 'decoder layers per stage \[[0-9, ]*\]' "$tmp"/pp2_1f1b_m4_copy.log "$tmp"/pp4_1f1b_m4_copy.log \
  "$tmp"/pp2_interleaved_1f1b_m4_copy.log "$tmp"/pp4_interleaved_1f1b_m4_copy.log 2>/dev/null | tr '\n' ';' || true)
/usr/bin/python3 - "$tmp" "$cores" "$eager" "$split" <<'PY'
import json, os, statistics, sys
tmp, ncores, eager, split = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
med = statistics.median

def load(name):
    path = f"{tmp}/{name}.jsonl"
    if os.path.exists(f"{tmp}/{name}.failed") or not os.path.exists(path):
        return None
    recs = [json.loads(l) for l in open(path) if l.strip()]
    steps = [r for r in recs if "loss" in r and r["step"] > 2]
    pp = [r for r in recs if "pp_bubble" in r and r["step"] > 2]
    out = {"step_ms": med(r["step_ms"] for r in steps), "loss": [r for r in recs if "loss" in r][-1]["loss"]}
    if pp:
        out["bubble"] = med(statistics.fmean(r["pp_bubble"]) for r in pp)
        out["formula"] = pp[0]["pp_bubble_formula"]
        out["peak"] = med(max(r["pp_peak_bytes"]) for r in pp)
        out["peak_ranks"] = [med(r["pp_peak_bytes"][i] for r in pp) for i in range(len(pp[0]["pp_peak_bytes"]))]
        out["in_flight"] = [max(r["pp_in_flight"][i] for r in pp) for i in range(len(pp[0]["pp_in_flight"]))]
        out["compute"] = [med(r["pp_compute_s"][i] for r in pp) for i in range(len(pp[0]["pp_compute_s"]))]
    return out

def f(x, fmt):
    w = int(fmt.split(".")[0] or 0)
    return "failed".rjust(w) if x is None else format(x, fmt)

def fx(x, fmt):  # a ratio: "1.23x"
    w = int(fmt.split(".")[0] or 0) + 1
    return "failed".rjust(w) if x is None else format(x, fmt) + "x"

mib = 1 << 20
print("== 1. bubble: mean over pp ranks of (step - compute) / compute, against the schedule's formula")
print("   copy: scripts/mpirun.sh's transport (single_copy_mechanism none; a 256 KiB boundary message advances only")
print("   while its sender is inside MPI); cma: single copy by the receiver. step ms: median step_ms")
if split:
    print(f"   layer split (pp 2, pp 4, interleaved pp 2, pp 4): {split.rstrip(';')}")
print(f"{'p':>2} {'schedule':<17} {'m':>3} {'formula':>8} {'copy':>7} {'ratio':>6} {'cma':>7} {'ratio':>6}"
      f" {'ms copy':>8} {'ms cma':>7}  note")
for p in (2, 4):
    for s in ("gpipe", "1f1b", "interleaved_1f1b", "zb1p"):
        for m in (4, 8, 16):
            a, b = load(f"pp{p}_{s}_m{m}_copy"), load(f"pp{p}_{s}_m{m}_cma")
            fo = (a or b or {}).get("formula")
            ra = a["bubble"] / fo if a and fo else None
            rb = b["bubble"] / fo if b and fo else None
            note = "oversubscribed" if p > ncores else ""
            print(f"{p:>2} {s:<17} {m:>3} {f(fo, '8.3f')} {f(a and a['bubble'], '7.3f')} {fx(ra, '5.1f')}"
                  f" {f(b and b['bubble'], '7.3f')} {fx(rb, '5.1f')} {f(a and a['step_ms'], '8.0f')}"
                  f" {f(b and b['step_ms'], '7.0f')}  {note}")
    if p == 2:
        print()
print()
print(f"pp 2, m 16, the three transports (eager: btl_vader_eager_limit = {eager} B, the message copied out at the send):")
print(f"{'schedule':<9} {'formula':>8} {'copy':>7} {'eager':>7} {'cma':>7} {'ms copy':>8} {'ms eager':>8} {'ms cma':>7}")
for s in ("gpipe", "1f1b"):
    a, e, c = (load(f"pp2_{s}_m16_{t}") for t in ("copy", "eager", "cma"))
    fo = (a or e or c or {}).get("formula")
    print(f"{s:<9} {f(fo, '8.3f')} {f(a and a['bubble'], '7.3f')} {f(e and e['bubble'], '7.3f')} {f(c and c['bubble'], '7.3f')}"
          f" {f(a and a['step_ms'], '8.0f')} {f(e and e['step_ms'], '8.0f')} {f(c and c['step_ms'], '7.0f')}")
y, n = load("pp4_1f1b_m8_copy"), load("pp4_1f1b_m8_noyield")
if y and n:
    print(f"pp 4, 1f1b, m 8, copy: mpi_yield_when_idle 1: bubble {y['bubble']:.3f}, step {y['step_ms']:.0f} ms;"
          f" 0 (a waiting rank spins): bubble {n['bubble']:.3f}, step {n['step_ms']:.0f} ms ({n['step_ms'] / y['step_ms']:.2f}x)")

print()
print("== 2. peak activation memory per stage, pp 2 (copy runs): micro-batches in flight per stage (stage 0, 1)")
print("   and the largest high-water mark over the stages (activations held + temporaries)")
print(f"{'m':>3} {'1f1b in flight':>14} {'1f1b MiB':>9} {'gpipe in flight':>15} {'gpipe MiB':>10} {'gpipe/1f1b':>10}"
      f" {'m/p':>5} {'zb1p MiB':>9} {'interleaved MiB':>15}")
for m in (4, 8, 16):
    o, g = load(f"pp2_1f1b_m{m}_copy"), load(f"pp2_gpipe_m{m}_copy")
    z, i = load(f"pp2_zb1p_m{m}_copy"), load(f"pp2_interleaved_1f1b_m{m}_copy")
    r = g["peak"] / o["peak"] if o and g else None
    inf = lambda x: "failed" if x is None else ",".join(map(str, x["in_flight"]))
    print(f"{m:>3} {inf(o):>14} {f(o and o['peak'] / mib, '9.2f')} {inf(g):>15} {f(g and g['peak'] / mib, '10.2f')}"
          f" {fx(r, '9.2f')} {m / 2:>4.0f}x {f(z and z['peak'] / mib, '9.2f')} {f(i and i['peak'] / mib, '15.2f')}")

print()
print("== 3. step time on 2 ranks, global batch 16 x 256 tokens: median step_ms, and its ratio to dp_replicate 2")
print("   with micro-batches of 1 under the same transport")
print(f"{'run':<46} {'ms copy':>8} {'ratio':>6} {'ms cma':>7} {'ratio':>6} {'final loss':>10}")
rows = [(f"pp 2, {s}, m 16 of 1 sequence", f"pp2_{s}_m16") for s in ("gpipe", "1f1b", "interleaved_1f1b", "zb1p")]
rows += [("dp_replicate 2, micro-batches of 1 (8 per rank)", "dp2_mb1"),
         ("dp_replicate 2, no micro-batching (8 seqs/rank)", "dp2_mb0"),
         ("tp 2, micro-batches of 1 (16 per rank)", "tp2_mb1"),
         ("tp 2, no micro-batching (16 seqs/rank)", "tp2_mb0")]
dp = {t: load(f"dp2_mb1_{t}") for t in ("copy", "cma")}
for label, name in rows:
    x = {t: load(f"{name}_{t}") for t in ("copy", "cma")}
    r = {t: x[t]["step_ms"] / dp[t]["step_ms"] if x[t] and dp[t] else None for t in x}
    loss = (x["copy"] or x["cma"] or {}).get("loss")
    print(f"{label:<46} {f(x['copy'] and x['copy']['step_ms'], '8.0f')} {fx(r['copy'], '5.2f')}"
          f" {f(x['cma'] and x['cma']['step_ms'], '7.0f')} {fx(r['cma'], '5.2f')} {f(loss, '10.4f')}")
PY
echo
echo "total $((SECONDS - t0)) s; load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
