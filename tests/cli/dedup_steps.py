#!/usr/bin/python3
"""The steps of a run that was relaunched after failures (meshtrain supervise), deduplicated: a step redone
after a failure has several records in the metrics file, and the last one counts.
  dedup_steps.py RUN.jsonl STEPS [--base BASE.jsonl]
Checks that steps 1..STEPS each have a record (none missing, none beyond), and with --base that the losses of
the last records equal an uninterrupted run's bit for bit. Lines that are not JSON (a record cut by a kill) are
counted and skipped. Prints one line; exit 0 when every check holds."""
import argparse
import json
import sys

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("steps", type=int)
p.add_argument("--base")
a = p.parse_args()


def step_records(path):
    last, records, broken = {}, 0, 0
    for line in open(path, errors="replace"):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            broken += 1
            continue
        if isinstance(r, dict) and "step" in r and "loss" in r:
            records += 1
            last[int(r["step"])] = float(r["loss"])
    return last, records, broken


last, records, broken = step_records(a.run)
want = set(range(1, a.steps + 1))
missing = sorted(want - set(last))
extra = sorted(set(last) - want)
problems = []
if missing:
    problems.append(f"{len(missing)} steps missing (first {missing[:5]})")
if extra:
    problems.append(f"{len(extra)} steps beyond {a.steps} ({extra[:5]})")
msg = (f"{len(last)} distinct steps of {a.steps} from {records} step records ({records - len(last)} redone"
       f"{f', {broken} cut lines skipped' if broken else ''})")
if a.base:
    base, _, _ = step_records(a.base)
    diff = [s for s in sorted(want & set(last)) if base.get(s) != last[s]]
    if diff:
        problems.append(f"{len(diff)} losses differ from the base run (first at step {diff[0]}: {last[diff[0]]!r} vs "
                        f"{base.get(diff[0])!r})")
    else:
        msg += "; every loss equals the uninterrupted run's bit for bit"
print(msg + ("; " + "; ".join(problems) if problems else ""))
sys.exit(1 if problems else 0)
