#!/usr/bin/python3
"""Draws a run's loss (train and validation) and tokens/s from its JSON-lines
metrics (log.metrics_file) into a PNG.
  scripts/plot_metrics.py METRICS.jsonl [--out loss.png]"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("metrics")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = a.out or os.path.splitext(a.metrics)[0] + ".png"
    train, val, tps = {}, {}, {}
    for line in open(a.metrics):
        if not line.strip():
            continue
        r = json.loads(line)
        if "step" not in r:
            continue
        # A resumed run appends to the same file: later records of a step win.
        if "loss" in r:
            train[r["step"] + 1] = r["loss"]
            if "tokens_per_s" in r:
                tps[r["step"] + 1] = r["tokens_per_s"]
        if "val_loss" in r:
            val[r["step"] + 1] = r["val_loss"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ax1.plot(sorted(train), [train[s] for s in sorted(train)], label="train", lw=1)
    if val:
        ax1.plot(sorted(val), [val[s] for s in sorted(val)], "o-", label="validation")
    ax1.set_ylabel("loss (nats/token)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot(sorted(tps), [tps[s] for s in sorted(tps)], lw=1, color="tab:green")
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.suptitle(os.path.basename(a.metrics))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(out)


if __name__ == "__main__":
    main()
