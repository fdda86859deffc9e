#!/usr/bin/python3
"""Compares the per-step losses of two runs (meshtrain metrics JSON lines, or the
reference's JSON {"losses": [...]}).
  compare_runs.py A B [--rel0 1e-5] [--abs 1e-4] [--exact [--expect-differ]] [--from-step K] [--steps N]
Steps are numbered as meshtrain's metrics number them: step N is the loss of the
N-th optimizer step (1-based); the reference's list starts at step 1 likewise.
Exit 0 when the first common step agrees within --rel0 (relative), every step
within --abs (absolute) or, with --exact, bit for bit; prints the largest
differences."""
import argparse
import json
import sys


def losses(path):
    with open(path) as f:
        text = f.read()
    try:
        j = json.loads(text)
        if isinstance(j, dict) and "losses" in j:
            return {i + 1: float(x) for i, x in enumerate(j["losses"])}
    except json.JSONDecodeError:
        pass
    out = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if "loss" in r and "step" in r:
            out[int(r["step"])] = float(r["loss"])
    return out


p = argparse.ArgumentParser()
p.add_argument("a")
p.add_argument("b")
p.add_argument("--rel0", type=float, default=1e-5)
p.add_argument("--abs", type=float, default=1e-4)
p.add_argument("--exact", action="store_true")
p.add_argument("--expect-differ", action="store_true", help="with --exact: exit 0 only when some step differs")
p.add_argument("--from-step", type=int, default=0)
p.add_argument("--steps", type=int, default=0, help="steps both must have (0: any common)")
args = p.parse_args()
a, b = losses(args.a), losses(args.b)
common = sorted(s for s in set(a) & set(b) if s >= args.from_step)
if not common or (args.steps and len(common) < args.steps):
    print(f"too few common steps: {len(common)} ({sorted(a)[:3]}... vs {sorted(b)[:3]}...)")
    sys.exit(1)
worst = max(abs(a[s] - b[s]) for s in common)
first = common[0]
rel0 = abs(a[first] - b[first]) / max(abs(b[first]), 1e-30)
print(f"{len(common)} steps from {first}: step {first} {a[first]:.8f} vs {b[first]:.8f} (rel {rel0:.2e}), "
      f"max |diff| {worst:.2e}")
if args.exact:
    bad = [s for s in common if a[s] != b[s]]
    if args.expect_differ:
        print(f"{len(bad)} of {len(common)} steps differ")
        sys.exit(0 if bad else 1)
    if bad:
        print(f"not bit-identical at steps {bad[:5]}: {a[bad[0]]!r} vs {b[bad[0]]!r}")
        sys.exit(1)
    sys.exit(0)
if rel0 > args.rel0 or worst > args.abs:
    sys.exit(1)
