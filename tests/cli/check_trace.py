#!/usr/bin/env python3
"""Checks a run's Chrome traces (issue 40): the format's rules, step coverage, collective bytes against the Group
counters, pipeline actions in the schedule's order, and the memory track's peak against the allocator's.

  check_trace.py DIR [--plan PLAN_OUTPUT] [--coverage 0.95]

DIR holds trace_rank{R}.json and the merged trace.json. Prints one line per check ("ok ..." or "FAIL ...") and
exits 1 when any failed."""
import argparse
import glob
import json
import math
import os
import re
import sys

PHASES = set("BEXIiIsftPCMNODbenR")  # every ph the format defines (complete, begin/end, instant, counter, ...)


def reject_constant(c):
    raise ValueError(f"{c} is not JSON")


def load(path):
    with open(path) as f:
        return json.load(f, parse_constant=reject_constant)


def check_format(doc, where):
    """The rules of the Trace Event Format: a JSON object with a traceEvents array (or a bare array); each event
    an object with name, ph, ts, pid, tid; X events a non-negative dur; B/E balanced and nested per thread; C args
    numeric; M events name the process or thread in args."""
    errors = []
    events = doc if isinstance(doc, list) else doc.get("traceEvents")
    if not isinstance(events, list):
        return [f"{where}: no traceEvents array"], []
    if isinstance(doc, dict) and doc.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        errors.append(f"{where}: displayTimeUnit {doc['displayTimeUnit']!r}")
    stacks = {}
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            errors.append(f"{where}: event {i} is not an object")
            continue
        for k, t in (("name", str), ("ph", str), ("pid", int), ("tid", int)):
            if not isinstance(e.get(k), t):
                errors.append(f"{where}: event {i} {k} = {e.get(k)!r}")
        ts = e.get("ts")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
            errors.append(f"{where}: event {i} ts = {ts!r}")
        ph = e.get("ph")
        if ph not in PHASES:
            errors.append(f"{where}: event {i} unknown ph {ph!r}")
        if ph == "X":
            d = e.get("dur")
            if not isinstance(d, (int, float)) or not d >= 0:
                errors.append(f"{where}: event {i} ({e.get('name')}) dur = {d!r}")
        if ph in ("B", "E"):
            st = stacks.setdefault((e.get("pid"), e.get("tid")), [])
            if ph == "B":
                st.append(e.get("name"))
            elif not st:
                errors.append(f"{where}: event {i} E without B")
            else:
                st.pop()
        if ph == "C":
            a = e.get("args")
            if not isinstance(a, dict) or not a or not all(isinstance(v, (int, float)) for v in a.values()):
                errors.append(f"{where}: counter {i} args {a!r}")
        if ph == "M":
            a = e.get("args")
            if e.get("name") not in ("process_name", "thread_name", "process_sort_index", "thread_sort_index",
                                     "process_labels") or not isinstance(a, dict):
                errors.append(f"{where}: metadata {i} {e.get('name')!r}")
        if "args" in e and not isinstance(e["args"], dict):
            errors.append(f"{where}: event {i} args is not an object")
    for k, st in stacks.items():
        if st:
            errors.append(f"{where}: {len(st)} B events without E on {k}")
    return errors, events


def union_length(intervals):
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def plan_schedule(path):
    """rank r: F0 F1 B0 ... from `meshtrain plan`'s pipeline timeline."""
    sched = {}
    for line in open(path):
        m = re.match(r"\s*rank (\d+):((?: (?:F|B|Bi|W)\d+(?:\.\d+)?)+)\s*$", line)
        if m and int(m.group(1)) not in sched:
            sched[int(m.group(1))] = m.group(2).split()
    return sched


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--plan")
    ap.add_argument("--coverage", type=float, default=0.95)
    args = ap.parse_args()
    failed = 0

    def ok(msg):
        print(f"ok   {msg}")

    def bad(msg, details=()):
        nonlocal failed
        failed += 1
        print(f"FAIL {msg}")
        for d in list(details)[:10]:
            print(f"  {d}")

    files = sorted(glob.glob(os.path.join(args.dir, "trace_rank*.json")),
                   key=lambda p: int(re.search(r"(\d+)\.json$", p).group(1)))
    merged_path = os.path.join(args.dir, "trace.json")
    docs = {}
    errs = []
    for f in files:
        d = load(f)
        e, _ = check_format(d, os.path.basename(f))
        errs += e
        docs[d["metadata"]["rank"]] = d
    merged = load(merged_path)
    e, mev = check_format(merged, "trace.json")
    errs += e
    pids = sorted({ev["pid"] for ev in mev})
    nev = sum(len(d["traceEvents"]) for d in docs.values())
    if errs:
        bad("valid Chrome trace JSON", errs)
    else:
        ok(f"valid Chrome trace JSON: {len(files)} rank files and trace.json ({len(mev)} events, processes {pids})")
    if pids != sorted(docs) or len(mev) != nev:
        bad("the merged trace has a process per rank and every event", [f"pids {pids}", f"{len(mev)} != {nev}"])
    else:
        ok(f"the merged trace has a process per rank ({len(pids)}) and every rank's events")

    cov_lines, cov_bad, leaf_lines = [], [], []
    byte_bad, byte_lines = [], []
    mem_bad, mem_lines = [], []
    pp_bad, pp_lines = [], []
    sched = plan_schedule(args.plan) if args.plan else {}
    for rank, d in sorted(docs.items()):
        ev = d["traceEvents"]
        xs = [e for e in ev if e["ph"] == "X"]
        steps = [e for e in xs if e["cat"] == "step"]
        if not steps:
            cov_bad.append(f"rank {rank}: no step spans")
            continue
        worst, worst_leaf = 1.0, 1.0
        for s in steps:
            t0, t1 = s["ts"], s["ts"] + s["dur"]
            inside = [(max(e["ts"], t0), min(e["ts"] + e["dur"], t1)) for e in xs
                      if e is not s and e["tid"] == s["tid"] and e["ts"] < t1 and e["ts"] + e["dur"] > t0]
            leaf = [(max(e["ts"], t0), min(e["ts"] + e["dur"], t1)) for e in xs
                    if e["cat"] in ("op", "comm", "wait", "data", "control") and e["tid"] == s["tid"]
                    and e["ts"] < t1 and e["ts"] + e["dur"] > t0]
            c = union_length(inside) / s["dur"] if s["dur"] > 0 else 1
            worst = min(worst, c)
            worst_leaf = min(worst_leaf, union_length(leaf) / s["dur"] if s["dur"] > 0 else 1)
        cov_lines.append(f"{worst:.4f}")
        leaf_lines.append(f"{worst_leaf:.3f}")
        if worst < args.coverage:
            cov_bad.append(f"rank {rank}: spans cover {worst:.4f} of a step")
        # Collective bytes against the Group counters of the traced steps.
        got = {}
        for e in xs:
            if e["cat"] == "comm":
                a = e["args"]
                k = (a.get("tag", ""), a["group"], a["kind"])
                c0, b0 = got.get(k, (0, 0))
                got[k] = (c0 + 1, b0 + a["bytes"])
        want = {(c["tag"], c["group"], c["kind"]): (c["calls"], c["bytes"]) for c in d["metadata"]["run"]["comm_counters"]}
        if got != want:
            diff = [f"rank {rank} {k}: spans {got.get(k)} counters {want.get(k)}" for k in sorted(set(got) | set(want))
                    if got.get(k) != want.get(k)]
            byte_bad += diff
        byte_lines.append(sum(b for _, b in got.values()))
        # Memory: the track's peak within each step equals the allocator's peak of the step (the step span's bytes).
        cs = sorted((e for e in ev if e["ph"] == "C" and e["name"] == "memory"), key=lambda e: e["ts"])
        for s in steps:
            t0, t1 = s["ts"], s["ts"] + s["dur"]
            before = [e for e in cs if e["ts"] <= t0]
            vals = [sum(e["args"].values()) for e in (before[-1:] + [e for e in cs if t0 < e["ts"] <= t1])]
            peak = max(vals) if vals else -1
            if peak != s["args"]["bytes"]:
                mem_bad.append(f"rank {rank} step {s['args']['step']}: track peak {peak}, allocator {s['args']['bytes']}")
            else:
                mem_lines.append(peak)
        # Pipeline actions in the schedule's order (compute actions, per step).
        if sched:
            p = len(sched)
            for s in steps:
                t0, t1 = s["ts"], s["ts"] + s["dur"]
                acts = sorted((e for e in xs if e["cat"] == "pipeline" and e["name"] in ("F", "B", "Bi", "W")
                               and t0 <= e["ts"] <= t1), key=lambda e: e["ts"])
                if not acts:
                    pp_bad.append(f"rank {rank} step {s['args']['step']}: no pipeline actions")
                    continue
                prank = acts[0]["args"]["stage"] % p
                v = max(a["args"]["stage"] for a in acts) // p + 1
                seq = [f"{a['name']}{a['args']['micro']}" + (f".{a['args']['stage'] // p}" if v > 1 else "") for a in acts]
                if seq != sched[prank]:
                    pp_bad.append(f"rank {rank} (pp rank {prank}) step {s['args']['step']}: {' '.join(seq)} != "
                                  f"{' '.join(sched[prank])}")
                else:
                    pp_lines.append(len(seq))
    if cov_bad:
        bad(f"spans cover each step within {1 - args.coverage:.0%}", cov_bad)
    else:
        ok(f"spans cover each step within {1 - args.coverage:.0%} on every rank (worst per rank: {' '.join(cov_lines)}; "
           f"ops, collectives, waits and data alone: {' '.join(leaf_lines)})")
    if byte_bad:
        bad("collective spans' bytes equal the Group counters", byte_bad)
    else:
        ok(f"collective spans' calls and bytes equal the Group counters per (tag, group, kind) on every rank "
           f"(bytes per rank: {byte_lines})")
    if mem_bad:
        bad("the memory track's peak equals the allocator's", mem_bad)
    else:
        ok(f"the memory track's peak equals the allocator's peak in every step on every rank ({len(mem_lines)} steps)")
    if args.plan:
        if pp_bad or not pp_lines:
            bad("pipeline actions in the schedule's order", pp_bad or ["no schedule"])
        else:
            ok(f"pipeline actions in the schedule's order on every rank ({len(pp_lines)} rank-steps, "
               f"schedule of `meshtrain plan`)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
