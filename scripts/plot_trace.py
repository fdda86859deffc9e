#!/usr/bin/python3
"""Draws one training step of a meshtrain trace (profile.steps, profile.dir) as a PNG.

  scripts/plot_trace.py TRACE.json|PROFILE_DIR [--step N] [--out step.png] [--memory-rank R]

Top panel: the step's timeline, one lane per rank (clocks aligned to rank 0's), each moment coloured by what the
rank is doing there: compute (ops, and the step's phases between them), each collective kind (all_gather,
reduce_scatter, all_reduce, send/recv, ...), waiting for an async collective or a pipeline message, data loading,
or idle (no span: white). Above each lane a thin band shows the pipeline actions (F forward, B backward, with the
micro-batch number). Middle: the allocator's bytes in use per rank over the step (the memory counter track);
bottom: one rank's memory by part (parameters, gradients, optimizer state, communication buffers, fully_shard
units, a checkpoint's snapshot, activations and temporaries), stacked.
Prints the PNG's path (default: the trace's directory, step{N}.png).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # render to a file: cluster nodes and CI have no display
import matplotlib.pyplot as plt  # noqa: E402  (must come after the backend is chosen)
from matplotlib.patches import Patch  # noqa: E402

COLLECTIVE_COLORS = {
    "all_gather": "#1f77b4", "reduce_scatter": "#ff7f0e", "all_reduce": "#d62728", "all_to_all": "#9467bd",
    "send": "#8c564b", "recv": "#8c564b", "ring_shift": "#e377c2", "broadcast": "#17becf", "barrier": "#7f7f7f",
}
COMPUTE = "#b8c9a3"
PHASE = "#dfe8d3"  # inside a phase but between ops: the host's own work
WAIT = "#f2c14e"
DATA = "#6a3d9a"
CONTROL = "#333333"
PIPE = {"F": "#4c72b0", "B": "#55a868", "Bi": "#55a868", "W": "#c4ad66"}


def load(path):
    if os.path.isdir(path):
        path = os.path.join(path, "trace.json")
    with open(path) as f:
        doc = json.load(f)
    return path, doc["traceEvents"] if isinstance(doc, dict) else doc


def color_of(e):
    c = e.get("cat")
    if c == "op":
        return COMPUTE
    if c == "phase":
        return PHASE
    if c == "comm":
        return COLLECTIVE_COLORS.get(e["args"].get("kind", ""), "#7f7f7f")
    if c == "wait":
        return WAIT
    if c == "data":
        return DATA
    if c == "control":
        return CONTROL
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--step", type=int, help="the step to draw (default: the last traced)")
    ap.add_argument("--out")
    ap.add_argument("--memory-rank", type=int, default=0)
    args = ap.parse_args()
    path, events = load(args.trace)
    steps = [e for e in events if e.get("ph") == "X" and e.get("cat") == "step"]
    if not steps:
        sys.exit(f"plot_trace: {path}: no step spans (a trace written with profile.steps?)")
    n = args.step or max(e["args"]["step"] for e in steps)
    mine = {e["pid"]: e for e in steps if e["args"]["step"] == n}
    if not mine:
        sys.exit(f"plot_trace: {path}: step {n} is not in the trace")
    ranks = sorted(mine)
    t0 = min(e["ts"] for e in mine.values())
    t1 = max(e["ts"] + e["dur"] for e in mine.values())
    ms = lambda t: (t - t0) / 1e3  # noqa: E731
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}

    fig, (ax, axm, axp) = plt.subplots(3, 1, figsize=(14, 2.2 + 0.62 * len(ranks) + 5.0),
                                       gridspec_kw={"height_ratios": [0.62 * len(ranks) + 1, 2.2, 2.2]})
    # Timeline: paint outer spans first so that the innermost shows (phases, then ops, collectives, waits).
    depth = {"phase": 0, "data": 1, "op": 2, "control": 2, "comm": 3, "wait": 4}
    kinds_seen = set()
    for row, r in enumerate(ranks):
        s = mine[r]
        lo, hi = s["ts"], s["ts"] + s["dur"]
        y = len(ranks) - 1 - row
        xs = [e for e in events if e.get("pid") == r and e.get("ph") == "X" and e.get("tid") == s["tid"]
              and e["ts"] < hi and e["ts"] + e["dur"] > lo]
        for e in sorted((e for e in xs if e.get("cat") in depth), key=lambda e: depth[e["cat"]]):
            c = color_of(e)
            a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
            ax.barh(y, ms(b) - ms(a), left=ms(a), height=0.62, color=c, linewidth=0)
            if e["cat"] == "comm":
                kinds_seen.add(e["args"].get("kind"))
        # The pipeline actions: a thin band above the lane.
        for e in xs:
            if e.get("cat") == "pipeline" and e["name"] in PIPE:
                a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
                ax.barh(y + 0.4, ms(b) - ms(a), left=ms(a), height=0.16, color=PIPE[e["name"]], linewidth=0.3,
                        edgecolor="white")
                if ms(b) - ms(a) > 0.012 * (ms(t1) - ms(t0)):
                    ax.text((ms(a) + ms(b)) / 2, y + 0.4, f"{e['name']}{e['args']['micro']}", ha="center",
                            va="center", fontsize=6, color="white")
        ax.barh(y, ms(hi) - ms(lo), left=ms(lo), height=0.62, fill=False, edgecolor="#555555", linewidth=0.5)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([names.get(r, f"rank {r}") for r in reversed(ranks)], fontsize=8)
    ax.set_xlim(0, ms(t1))
    ax.set_xlabel("ms from the step's start (rank 0's clock)")
    ax.set_title(f"step {n}: what each rank does (white: idle, no span)")
    legend = [Patch(color=COMPUTE, label="compute (ops)"), Patch(color=PHASE, label="host work between ops"),
              Patch(color=WAIT, label="waiting (async collective, pp message)"), Patch(color=DATA, label="data")]
    legend += [Patch(color=COLLECTIVE_COLORS.get(k, "#7f7f7f"), label=k) for k in sorted(k for k in kinds_seen if k)]
    legend += [Patch(color=PIPE["F"], label="pp F (forward)"), Patch(color=PIPE["B"], label="pp B (backward)")]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)

    # Memory: the allocator's bytes in use per rank, and one rank's parts stacked.
    parts = None
    for r in ranks:
        s = mine[r]
        lo, hi = s["ts"], s["ts"] + s["dur"]
        cs = sorted((e for e in events if e.get("pid") == r and e.get("ph") == "C" and e["name"] == "memory"),
                    key=lambda e: e["ts"])
        before = [e for e in cs if e["ts"] <= lo][-1:]
        cs = before + [e for e in cs if lo < e["ts"] <= hi]
        if not cs:
            continue
        xs = [ms(max(e["ts"], lo)) for e in cs] + [ms(hi)]
        tot = [sum(e["args"].values()) / 2**20 for e in cs]
        axm.step(xs, tot + tot[-1:], where="post", linewidth=0.9, label=f"rank {r}")
        if r == args.memory_rank:
            order = ["parameters", "gradients", "optimizer", "communication buffers", "fully_shard units",
                     "checkpoint snapshot", "activations and temporaries"]  # the fixed state at the bottom
            keys = sorted(cs[0]["args"], key=lambda k: order.index(k) if k in order else len(order))
            parts = (xs, keys, [[e["args"].get(k, 0) / 2**20 for e in cs] + [cs[-1]["args"].get(k, 0) / 2**20]
                                for k in keys])
    axm.set_xlim(0, ms(t1))
    axm.set_ylabel("MiB in use")
    axm.set_title("the allocator's bytes in use per rank (peak = the allocator's peak of the step)")
    axm.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    if parts:
        xs, keys, ys = parts
        axp.stackplot(xs, ys, labels=keys, step="post")
        axp.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    axp.set_xlim(0, ms(t1))
    axp.set_ylabel("MiB")
    axp.set_xlabel("ms from the step's start")
    axp.set_title(f"rank {args.memory_rank}'s memory by part")
    fig.tight_layout()
    out = args.out or os.path.join(os.path.dirname(path), f"step{n}.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
