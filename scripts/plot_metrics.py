#!/usr/bin/python3
"""Plots a meshtrain run's JSON-lines metrics (log.metrics_file) into a PNG.

  scripts/plot_metrics.py METRICS.jsonl [--out loss.png]

Records with "step" and "loss" are training steps (they also carry
"tokens_per_s"); records with "step" and "val_loss" are evaluations; anything
else (samples, notes) is skipped. Top panel: train and validation loss against
step; bottom panel: tokens/s against step. Prints the PNG's path; the default
is METRICS with its extension replaced by .png.

A mixture-of-experts run's records also carry "expert_load" (sparse layers x
experts: rows routed in the step), "expert_load_max_over_mean" and "aux_loss":
then a second PNG (OUT with "_experts" before the extension) holds one heat map
per sparse layer, expert against step, each cell the expert's load over the
layer's mean load (1: balanced), and the balance loss and the most loaded
expert's ratio against step. Its path is printed too.

A job run under `meshtrain supervise` holds several launches in one file: a
step redone after a failure has several records, and the last one is drawn
(every step once). Its {"event": "failure"} records are marked on the loss
panel (a dotted line at the last step each failed launch recorded), and its
{"event": "goodput"} record (the job's, else the last run's) becomes a third
PNG (OUT with "_goodput" before the extension): the wall time as one stacked
bar by cause (productive steps, in-memory and disk saves, evaluation, lost
work, restarts, detection and the rest; a run's own record: checkpoint stalls
and set-up), each with its seconds and share, and for a job a second bar: the
restart time by phase (back-off, launcher, MPI start-up, mesh, model, load,
GEMM peak, first step's warm-up). Its path is printed too.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # render to a file: cluster nodes and CI have no display
import matplotlib.pyplot as plt  # noqa: E402  (must come after the backend is chosen)


def records(path, warn=False):
    """The JSON objects of a metrics file, in order. A run killed mid-write can leave a truncated last line; the rest
    is still worth plotting, so a line that is not JSON is skipped (said once per line when warn)."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                if warn:
                    print(f"plot_metrics: {path}:{lineno}: skipping a line that is not JSON", file=sys.stderr)
                continue
            if isinstance(r, dict):
                yield r


def read_metrics(path):
    """Returns {step: loss}, {step: val_loss}, {step: tokens_per_s}. A resumed run appends to the same file
    and may repeat steps, so a later record for a step replaces an earlier one."""
    train, val, tps = {}, {}, {}
    for r in records(path, warn=True):
        if "step" not in r:
            continue
        if "loss" in r:
            train[r["step"]] = r["loss"]
            if "tokens_per_s" in r:
                tps[r["step"]] = r["tokens_per_s"]
        if "val_loss" in r:
            val[r["step"]] = r["val_loss"]
    return train, val, tps


def read_expert_load(path):
    """Returns {step: record} of the records with "expert_load" (a later record for a step replaces an earlier one)."""
    return {r["step"]: r for r in records(path) if "step" in r and "expert_load" in r}


def plot_experts(records, out, title):
    """The heat maps (one per sparse layer: expert x step, load / mean load) and the balance panel."""
    steps = sorted(records)
    layers = len(records[steps[0]]["expert_load"])
    fig, axes = plt.subplots(layers + 1, 1, figsize=(8, 2.2 * (layers + 1)), sharex=True, squeeze=False)
    for l in range(layers):
        grid = []  # (experts, steps)
        for s in steps:
            row = records[s]["expert_load"][l]
            mean = sum(row) / len(row) if row and sum(row) > 0 else 1.0
            grid.append([v / mean for v in row])
        grid = list(map(list, zip(*grid)))
        ax = axes[l][0]
        im = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(grid) - 0.5))
        ax.set_ylabel(f"layer {l}\nexpert")
        fig.colorbar(im, ax=ax, label="load / mean")
    ax = axes[layers][0]
    ax.plot(steps, [records[s].get("aux_loss", 0.0) for s in steps], lw=1, label="balance loss (in the loss)")
    ax.set_ylabel("balance loss")
    ax2 = ax.twinx()
    ax2.plot(steps, [max(records[s].get("expert_load_max_over_mean", [0.0])) for s in steps], lw=1,
             color="tab:red", label="max load / mean (worst layer)")
    ax2.set_ylabel("max / mean", color="tab:red")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    fig.suptitle(title + ": expert load")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def read_job_events(path):
    """Returns (the goodput record: the job's if any, else the last run's, or None; the failure records)."""
    job = run = None
    failures = []
    for r in records(path):
        if r.get("event") == "goodput":
            if r.get("scope") == "job":
                job = r
            else:
                run = r
        elif r.get("event") == "failure":
            failures.append(r)
    return job or run, failures


# The causes of a goodput record, in the order drawn: the job's (meshtrain supervise: memory and disk saves apart,
# detection), or a run's own (checkpoint stalls, set-up). Only those the record carries are drawn.
GOODPUT_PARTS = [("productive_s", "productive", "tab:green"), ("memory_save_s", "in-memory saves", "tab:cyan"),
                 ("disk_save_s", "disk saves", "tab:blue"), ("checkpoint_s", "checkpoint", "tab:blue"),
                 ("eval_s", "eval", "tab:purple"), ("lost_s", "lost", "tab:red"),
                 ("restart_s", "restart", "tab:orange"), ("setup_s", "set-up", "tab:orange"),
                 ("detection_s", "detection", "tab:brown"), ("other_s", "other", "tab:gray")]
RESTART_PHASES = {"backoff": "back-off", "launcher": "launcher", "mpi": "MPI start-up", "mesh": "config and mesh",
                  "model": "model", "load": "load or init", "peak": "GEMM peak", "report": "set-up report",
                  "first_step": "first step's warm-up", "not_started": "never stepped", "not_timed": "not timed"}


def stacked_bar(ax, y, parts, wall):
    """Draws parts [(seconds, label, color)] as one horizontal bar at y; returns the bar's length."""
    left = 0.0
    for v, name, color in parts:
        if not v or v <= 0:
            continue
        ax.barh([y], [v], left=left, color=color, edgecolor="white", label=f"{name} {v:.1f} s ({100 * v / wall:.1f}%)")
        if v / wall > 0.06:
            ax.text(left + v / 2, y, f"{100 * v / wall:.0f}%", ha="center", va="center", color="white", fontsize=8)
        left += v
    return left


def plot_goodput(g, out, title):
    """The wall time by cause as one stacked bar, each part labelled with seconds and share; with a job's record
    (restart_parts), a second bar below: the restart time by phase of the launches' set-up."""
    wall = g.get("wall_s") or sum(g.get(k, 0) for k, _, _ in GOODPUT_PARTS) or 1.0
    phases = [p for p in g.get("restart_parts", []) if p.get("s", 0) > 0]
    fig, axes = plt.subplots(2 if phases else 1, 1, figsize=(10, 5.2 if phases else 2.8), squeeze=False)
    ax = axes[0][0]
    length = stacked_bar(ax, 0, [(g.get(k), name, color) for k, name, color in GOODPUT_PARTS], wall)
    ax.set_xlim(0, max(wall, length))
    ax.set_yticks([0], ["by cause"])
    ax.set_xlabel("wall time (s)")
    extra = f", {g['failures']} failures, {g['attempts']} launches" if "failures" in g else ""
    ax.set_title(f"{title}: goodput {100 * g.get('goodput', 0):.1f}% ({g.get('scope', 'run')}{extra})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=8, frameon=False)
    if phases:
        ax = axes[1][0]
        cmap = plt.get_cmap("tab20")
        restart = sum(p["s"] for p in phases) or 1.0
        stacked_bar(ax, 0, [(p["s"], RESTART_PHASES.get(p["part"], p["part"]), cmap(i % 20))
                            for i, p in enumerate(phases)], restart)
        ax.set_xlim(0, restart)
        ax.set_yticks([0], ["restart"])
        ax.set_xlabel("restart time (s), by phase (share of the restart time)")
        ax.set_title(f"restart {g.get('restart_s', restart):.1f} s over {g.get('attempts', 1)} launches, by phase")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def series(d):
    steps = sorted(d)
    return steps, [d[s] for s in steps]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", help="a JSON-lines metrics file")
    ap.add_argument("--out", help="the PNG to write (default: METRICS with .png)")
    a = ap.parse_args()
    out = a.out or os.path.splitext(a.metrics)[0] + ".png"
    train, val, tps = read_metrics(a.metrics)
    if not train and not val:
        sys.exit(f"plot_metrics: {a.metrics} has no training or evaluation records")

    fig, (ax_loss, ax_tps) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    if train:
        ax_loss.plot(*series(train), lw=1, label="train")
    if val:
        ax_loss.plot(*series(val), "o-", ms=4, label="validation")
    goodput, failures = read_job_events(a.metrics)
    for i, f in enumerate(failures):
        if f.get("last_step", -1) >= 0:
            ax_loss.axvline(f["last_step"], color="tab:red", ls=":", lw=1, label="failure" if i == 0 else None)
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    if tps:
        ax_tps.plot(*series(tps), lw=1, color="tab:green")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_xlabel("step")
    ax_tps.grid(alpha=0.3)
    fig.suptitle(os.path.basename(a.metrics))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(out)
    experts = read_expert_load(a.metrics)
    if experts:
        base, ext = os.path.splitext(out)
        plot_experts(experts, base + "_experts" + (ext or ".png"), os.path.basename(a.metrics))
        print(base + "_experts" + (ext or ".png"))
    if goodput:
        base, ext = os.path.splitext(out)
        plot_goodput(goodput, base + "_goodput" + (ext or ".png"), os.path.basename(a.metrics))
        print(base + "_goodput" + (ext or ".png"))


if __name__ == "__main__":
    main()
