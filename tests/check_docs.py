#!/usr/bin/env python3
"""Every repository path the docs mention exists in the tree.

Reads README.md and docs/**/*.md (or the files and folders given), finds each path that starts with a top-level
folder of the repository (runtime, comm, parallel, attention, models, tests, scripts, configs, docs), expands a
brace form (`parallel/fully_shard.{h,cpp}`, `runtime/{core,kernels,io}`), and checks it: a trailing `/` must be a
folder, anything else a file or a folder. Inside backticks and fenced code blocks every such path counts; in plain
text only one that ends in a file name with an extension, in `/` or holds a brace form (so that prose such as
"attention/MLP" is not read as a path). Placeholders (`<name>`, `*`, `...`, a one-letter name as
`configs/x.yaml`), paths under runs/, data/ and build*/, and ninja's targets after `ninja -C DIR` are left out. Prints each missing path as
"FAIL file:line: path" and ends with "docs: N passed, N failed": one check per path mentioned on a line, and the
checker's own cases (a doc naming a missing file must fail, an existing one pass).
    tests/check_docs.py [--root ROOT] [FILE_OR_FOLDER ...]   (relative to ROOT; default README.md docs)
"""
import os
import re
import sys
import tempfile

TOP = ("runtime", "comm", "parallel", "attention", "models", "tests", "scripts", "configs", "docs")
IGNORED = re.compile(r"^(runs|data|build[^/]*)/")
# A user's Hugging Face downloads that the fine-tuning examples name (configs/finetune_*.yaml's init_from).
USER_FOLDERS = re.compile(r"^models/Llama-3\.2-1B(-Instruct)?/?$")
# A path: a known top-level folder, then segments of path characters and brace groups. Not preceded by a path
# character, so that /usr/local/cuda or a URL's tail is not read as one.
PATH = re.compile(r"(?<![\w./{}-])((?:%s)/(?:[\w.+\-/<>*]|\{[^{}\s`]*\})*)" % "|".join(TOP))
BRACE = re.compile(r"\{([^{}]*)\}")
CODE = re.compile(r"`([^`]*)`")
NINJA = re.compile(r"\bninja -C \S+\s")  # what follows names build targets, not files of the tree


def expand(path):
    """`a.{h,cpp}` -> [`a.h`, `a.cpp`]; several brace groups multiply."""
    m = BRACE.search(path)
    if not m:
        return [path]
    out = []
    for alt in m.group(1).split(","):
        out += expand(path[:m.start()] + alt + path[m.end():])
    return out


def clean(path):
    """The path without the sentence's punctuation after it."""
    while path and path[-1] in ".,:;)":
        if path.endswith("/..."):
            return path[:-3]
        path = path[:-1]
    return path


def placeholder(path):
    """`<name>`, `*`, `...`, a one-letter file name (`configs/x.yaml`), runs/, data/, build*/."""
    stem = path.rstrip("/").rsplit("/", 1)[-1].split(".")[0]
    return (any(c in path for c in "<>*") or "..." in path or len(stem) == 1 or IGNORED.match(path) is not None
            or USER_FOLDERS.match(path) is not None)


def plain_enough(path):
    """In plain text: a file name with an extension, a folder written with its `/`, or a brace form."""
    last = path.rstrip("/").rsplit("/", 1)[-1]
    return path.endswith("/") or "{" in path or ("." in last and not last.endswith("."))


def mentions(text):
    """[(line, path)] of the paths a markdown text mentions, brace forms expanded, each once per line."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        spans = []  # (text, in code)
        if fenced:
            spans.append((line, True))
        else:
            pos = 0
            for m in CODE.finditer(line):
                spans.append((line[pos:m.start()], False))
                spans.append((m.group(1), True))
                pos = m.end()
            spans.append((line[pos:], False))
        seen = set()
        for s, code in spans:
            for m in PATH.finditer(s):
                p = clean(m.group(1))
                if not p or placeholder(p) or (not code and not plain_enough(p)):
                    continue
                if NINJA.search(s[:m.start()]):
                    continue  # a build target, relative to the build folder
                for q in expand(p):
                    if q not in seen:
                        seen.add(q)
                        out.append((i, q))
    return out


def exists(root, path):
    full = os.path.join(root, path)
    return os.path.isdir(full) if path.endswith("/") else os.path.exists(full)


def doc_files(root, args):
    """The markdown files to read, relative to root."""
    files = []
    for a in args or ["README.md", "docs"]:
        full = os.path.join(root, a)
        if os.path.isdir(full):
            for d, dirs, names in os.walk(full):
                dirs.sort()
                files += [os.path.relpath(os.path.join(d, n), root) for n in sorted(names) if n.endswith(".md")]
        elif os.path.isfile(full):
            files.append(os.path.relpath(full, root))
    return files


def check(root, args):
    """(passed, [(doc, line, path)] missing, docs read)."""
    passed, missing = 0, []
    files = doc_files(root, args)
    for doc in files:
        with open(os.path.join(root, doc), errors="replace") as f:
            for line, path in mentions(f.read()):
                if exists(root, path):
                    passed += 1
                else:
                    missing.append((doc, line, path))
    return passed, missing, files


def self_test():
    """The checker fails a doc naming a missing file and passes one naming files that exist: [(name, ok)]."""
    out = []
    with tempfile.TemporaryDirectory() as t:
        os.makedirs(os.path.join(t, "runtime/train"))
        os.makedirs(os.path.join(t, "docs"))
        for f in ("runtime/train/run.h", "runtime/train/run.cpp", "configs/tiny.yaml"):
            os.makedirs(os.path.dirname(os.path.join(t, f)), exist_ok=True)
            open(os.path.join(t, f), "w").close()
        with open(os.path.join(t, "docs/a.md"), "w") as f:
            f.write("`runtime/train/run.{h,cpp}` and `runtime/train/`, with configs/tiny.yaml.\n"
                    "`models/<family>/`, `tests/cli/test_*.sh`, configs/x.yaml, runs/x.json, attention/MLP prose.\n"
                    "`ninja -C build tests/test_ops meshtrain`\n")
        passed, missing, _ = check(t, [])
        out.append(("existing paths pass, placeholders and prose are left out", passed == 4 and not missing))
        with open(os.path.join(t, "docs/b.md"), "w") as f:
            f.write("Intro.\nSee `runtime/train/trainer.h` and runtime/train/step.cpp; `configs/tiny.yaml/`.\n")
        passed, missing, _ = check(t, [])
        out.append(("missing paths fail, naming file and line",
                    passed == 4 and missing == [("docs/b.md", 2, "runtime/train/trainer.h"),
                                                ("docs/b.md", 2, "runtime/train/step.cpp"),
                                                ("docs/b.md", 2, "configs/tiny.yaml/")]))
        passed, missing, _ = check(t, ["docs/a.md"])
        out.append(("a file argument reads that file alone", passed == 4 and not missing))
    return out


def main():
    args = sys.argv[1:]
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    if len(args) >= 2 and args[0] == "--root":
        root, args = args[1], args[2:]
    passed = failed = 0
    for name, ok in self_test():
        passed, failed = passed + ok, failed + (not ok)
        if not ok:
            print("FAIL checker self-test:", name)
    p, missing, files = check(root, args)
    for doc, line, path in missing:
        print(f"FAIL {doc}:{line}: {path}")
    passed, failed = passed + p, failed + len(missing)
    if not files:
        print(f"FAIL no markdown file found under {root} for {args or ['README.md', 'docs']}: wrong root?")
        failed += 1
    print(f"docs: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
