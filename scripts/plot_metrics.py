#!/usr/bin/python3
"""Plots a meshtrain run's JSON-lines metrics (log.metrics_file) into a PNG.

  scripts/plot_metrics.py METRICS.jsonl [--out loss.png]

Records with "step" and "loss" are training steps (they also carry
"tokens_per_s"); records with "step" and "val_loss" are evaluations; anything
else (samples, notes) is skipped. Top panel: train and validation loss against
step; bottom panel: tokens/s against step. Prints the PNG's path; the default
is METRICS with its extension replaced by .png.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # render to a file: cluster nodes and CI have no display
import matplotlib.pyplot as plt  # noqa: E402  (must come after the backend is chosen)


def read_metrics(path):
    """Returns {step: loss}, {step: val_loss}, {step: tokens_per_s}. A resumed run appends to the same file
    and may repeat steps, so a later record for a step replaces an earlier one."""
    train, val, tps = {}, {}, {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                # A run killed mid-write can leave a truncated last line; the rest is still worth plotting.
                print(f"plot_metrics: {path}:{lineno}: skipping a line that is not JSON", file=sys.stderr)
                continue
            if "step" not in r:
                continue
            if "loss" in r:
                train[r["step"]] = r["loss"]
                if "tokens_per_s" in r:
                    tps[r["step"]] = r["tokens_per_s"]
            if "val_loss" in r:
                val[r["step"]] = r["val_loss"]
    return train, val, tps


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


if __name__ == "__main__":
    main()
