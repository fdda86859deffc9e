#!/usr/bin/env python3
"""GPU 0's clock and power during each part of scripts/gpu_run.sh.

  gpu_clocks.py CLOCKS_CSV PART_TIMES

CLOCKS_CSV: `nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,
clocks_throttle_reasons.active --format=csv,noheader,nounits -lms 500` (the timestamp in the machine's local time,
as `date +%s` counts it). PART_TIMES: a line "PART START END" (epoch seconds) per part. Prints a row per part (the
samples, the SM clock's median and range, the median power and temperature, the throttle reasons seen) and the
whole call's SM clock every 10 s, so that a part's sub-steps (bench_gpu.sh's step, then PyTorch, then attention
alone) can be matched to their clock from their logs' times.
"""
import statistics
import sys
import time


def samples(path):
    out = []
    for line in open(path):
        f = [x.strip() for x in line.split(",")]
        if len(f) < 5:
            continue
        try:
            stamp, ms = f[0].rsplit(".", 1) if "." in f[0] else (f[0], "0")
            t = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + ms)
            out.append((t, float(f[1]), float(f[2]), float(f[3]), f[4]))
        except ValueError:
            continue  # "[N/A]" or a cut line
    return out


def row(name, s):
    if not s:
        return f"{name}: no samples"
    clock = [x[1] for x in s]
    reasons = sorted({x[4] for x in s if x[4] not in ("0x0000000000000000", "Not Active")})
    return (f"{name}: {len(s)} samples, SM {statistics.median(clock):.0f} MHz (range {min(clock):.0f}-{max(clock):.0f}), "
            f"{statistics.median(x[2] for x in s):.0f} W, {statistics.median(x[3] for x in s):.0f} C, "
            f"throttle reasons {', '.join(reasons) or 'none'}")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    s = samples(sys.argv[1])
    if not s:
        sys.exit(f"gpu_clocks.py: no samples in {sys.argv[1]}")
    for line in open(sys.argv[2]):
        part, start, end = line.split()
        print(row(f"part {part}", [x for x in s if float(start) <= x[0] <= float(end)]))
    t0 = s[0][0]
    by10 = {}
    for x in s:
        by10.setdefault(int((x[0] - t0) // 10), []).append(x)
    print("every 10 s from the first sample: " + "; ".join(
        f"{k * 10}s {statistics.median(v[1] for v in xs):.0f} MHz {statistics.median(v[2] for v in xs):.0f} W"
        for k, xs in sorted(by10.items())))


if __name__ == "__main__":
    main()
