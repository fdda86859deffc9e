#!/usr/bin/env python3
"""The layer rule of docs/ARCHITECTURE.md, checked on every #include of the sources.

    runtime/{core,kernels,io} -> comm -> parallel -> attention -> models -> runtime/train -> runtime/supervise
    -> runtime/planner -> runtime/cli

A file may include its own layer's headers and those of the layers to its left, never one to its right. Prints
each include that runs against the rule (file:line, the two layers) and ends with "layers: N passed, N failed":
one check per source file, and the checker's own cases (a tree with a violation must fail, a clean one pass).
    tests/check_layers.py [ROOT]
"""
import os
import re
import sys
import tempfile

# Each layer's rank: a layer may include ranks <= its own. The ground (core, kernels, io) shares rank 0.
LAYERS = [("runtime/core", 0), ("runtime/kernels", 0), ("runtime/io", 0), ("comm", 1), ("parallel", 2),
          ("attention", 3), ("models", 4), ("runtime/train", 5), ("runtime/supervise", 6), ("runtime/planner", 7),
          ("runtime/cli", 8)]
SOURCE = (".h", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'\s*#\s*include\s+"([^"]+)"')


def layer_of(path):
    for name, rank in sorted(LAYERS, key=lambda l: -len(l[0])):
        if path == name or path.startswith(name + "/"):
            return name, rank
    return None, None


def violations(root):
    """(checked files, [(file, line, its layer, the included path, that layer)])."""
    files, bad = 0, []
    for name, rank in LAYERS:
        top = os.path.join(root, name)
        for d, _, names in os.walk(top):
            for n in sorted(names):
                if not n.endswith(SOURCE):
                    continue
                p = os.path.relpath(os.path.join(d, n), root)
                mine, my_rank = layer_of(p)
                if mine != name:  # a deeper layer's folder (runtime/train inside runtime) is walked on its own
                    continue
                files += 1
                with open(os.path.join(root, p), errors="replace") as f:
                    for i, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        theirs, their_rank = layer_of(m.group(1))
                        if theirs is not None and their_rank > my_rank:
                            bad.append((p, i, mine, m.group(1), theirs))
    return files, bad


def self_test():
    """The checker finds an upward include and passes a downward one: [(name, ok)]."""
    out = []
    with tempfile.TemporaryDirectory() as t:
        os.makedirs(os.path.join(t, "comm"))
        os.makedirs(os.path.join(t, "runtime/train"))
        with open(os.path.join(t, "runtime/train/a.cpp"), "w") as f:
            f.write('#include "comm/group.h"\n#include "runtime/core/tensor.h"\n')
        n, bad = violations(t)
        out.append(("a downward include passes", n == 1 and not bad))
        with open(os.path.join(t, "comm/b.cpp"), "w") as f:
            f.write('#include <vector>\n  #  include "runtime/train/trainer.h"\n')
        n, bad = violations(t)
        out.append(("comm including runtime/train fails, naming file and line",
                    n == 2 and bad == [("comm/b.cpp", 2, "comm", "runtime/train/trainer.h", "runtime/train")]))
        os.remove(os.path.join(t, "comm/b.cpp"))
        with open(os.path.join(t, "runtime/train/c.cpp"), "w") as f:
            f.write('#include "runtime/supervise/supervisor.h"\n')
        n, bad = violations(t)
        out.append(("runtime/train including runtime/supervise fails",
                    n == 2 and bad == [("runtime/train/c.cpp", 1, "runtime/train", "runtime/supervise/supervisor.h",
                                        "runtime/supervise")]))
    return out


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    passed = failed = 0
    for name, ok in self_test():
        passed, failed = passed + ok, failed + (not ok)
        if not ok:
            print("FAIL checker self-test:", name)
    files, bad = violations(root)
    for p, i, mine, inc, theirs in bad:
        print(f"FAIL {p}:{i}: {mine} includes {inc} ({theirs}, a layer above it)")
    bad_files = len({b[0] for b in bad})
    passed += files - bad_files
    failed += bad_files
    if files < 100:
        print(f"FAIL only {files} source files found under {root}: wrong root?")
        failed += 1
    print(f"layers: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
