#!/usr/bin/python3
"""Checks scripts/prepare_data --chat's shards and loss masks (tests/cli/test_chat_data.sh), reading them by the
documented format only (docs/CONFIG.md, "Data files"), never with prepare_data's code:

  check_chat_data.py compare REF.json DIR NAME SEP [--train-on-prompt]
      The train split (DIR/NAME_train_*.bin + .mask, no validation) is the reference's conversations
      (tests/reference/chat/chat_ref.mjs render) in order, each starting with the separator SEP (its own first token
      when it is SEP, else SEP written before it), the separator's mask 0, then one more SEP at mask 0.
  check_chat_data.py packed DIR NAME T PAD --docs-from UNPACKED_DIR [--long cut|drop] [--rows-per-shard R]
      DIR holds the same conversations as UNPACKED_DIR (an unpacked run of the same data), packed in rows of T:
      every shard but the last of a split holds whole rows (R of them when given), the last one more token (SEP,
      mask 0); mask headers give T; each row is whole conversations (each as in UNPACKED_DIR, starting with the
      separator), then PAD at mask 0 to the end; a conversation longer than T is its first T tokens in a row of its
      own (cut) or absent (drop); every conversation appears exactly once, in a train or a val row.
  check_chat_data.py split DIR NAME WHOLE_DIR
      DIR's train split followed by its val split (each without its final separator) is WHOLE_DIR's train split
      (a run without validation), cut at a conversation boundary.
Prints what it checked and exits 0, or prints the first difference and exits 1."""
import glob
import os
import sys

import numpy as np

MAGICS = {20240520: (1, "<u2"), 20240801: (7, "<u4")}
MASK_MAGIC, MASK_VERSION = 20241127, 1


def fail(msg):
    print(msg)
    sys.exit(1)


def read_shard(path):
    h = np.fromfile(path, dtype="<i4", count=256)
    if int(h[0]) not in MAGICS or int(h[1]) != MAGICS[int(h[0])][0]:
        fail(f"{path}: magic {h[0]} version {h[1]}")
    t = np.fromfile(path, dtype=MAGICS[int(h[0])][1], offset=1024).astype(np.int64)
    if len(t) != h[2]:
        fail(f"{path}: header count {h[2]}, {len(t)} tokens")
    mpath = path[:-4] + ".mask"
    if not os.path.isfile(mpath):
        fail(f"{mpath}: missing")
    mh = np.fromfile(mpath, dtype="<i4", count=256)
    m = np.fromfile(mpath, dtype=np.uint8, offset=1024)
    if int(mh[0]) != MASK_MAGIC or int(mh[1]) != MASK_VERSION or mh[2] != len(t) or len(m) != len(t) or mh[4:].any():
        fail(f"{mpath}: header {mh[:5].tolist()} (rest {'zero' if not mh[4:].any() else 'not zero'}), "
             f"{len(m)} values; the shard has {len(t)} tokens")
    if not np.isin(m, (0, 1)).all():
        fail(f"{mpath}: values other than 0 and 1")
    return t, m, int(mh[3])


def read_split(d, name, split):
    files = sorted(glob.glob(os.path.join(glob.escape(d), f"{glob.escape(name)}_{split}_*.bin")))
    if not files:
        fail(f"no {name}_{split}_*.bin in {d}")
    return [read_shard(f) for f in files], files


def stream(d, name, split):
    shards, _ = read_split(d, name, split)
    return (np.concatenate([s[0] for s in shards]), np.concatenate([s[1] for s in shards]))


def docs_of(tokens, mask, sep):
    """The conversations of an unpacked stream (each from a separator to the next; the final separator apart)."""
    if len(tokens) == 0:
        return []
    if tokens[-1] != sep or mask[-1] != 0:
        fail(f"the stream does not end with the separator {sep} at mask 0: {tokens[-3:].tolist()}")
    starts = np.flatnonzero(tokens[:-1] == sep).tolist() + [len(tokens) - 1]
    if starts[0] != 0:
        fail(f"the stream does not start with the separator {sep}: {tokens[:3].tolist()}")
    return [(tokens[a:b], mask[a:b]) for a, b in zip(starts, starts[1:])]


def compare(ref_file, d, name, sep, train_on_prompt):
    import json
    with open(ref_file, encoding="utf-8") as f:
        ref = json.load(f)
    want_t, want_m = [], []
    for line in ref["lines"]:
        if "error" in line:
            continue
        ids, mask = np.array(line["ids"], dtype=np.int64), np.array(line["mask"], dtype=np.uint8)
        if train_on_prompt:
            mask[:] = 1
        if len(ids) and ids[0] == sep:
            mask[0] = 0
        else:
            ids, mask = np.concatenate([[sep], ids]), np.concatenate([[0], mask]).astype(np.uint8)
        want_t.append(ids)
        want_m.append(mask)
    want_t.append(np.array([sep]))
    want_m.append(np.array([0], dtype=np.uint8))
    want_t, want_m = np.concatenate(want_t), np.concatenate(want_m)
    shards, files = read_split(d, name, "train")
    for (_, _, T), f in zip(shards, files):
        if T != 0:
            fail(f"{f[:-4]}.mask: the header gives T = {T}, not 0 (not packed)")
    got_t, got_m = np.concatenate([s[0] for s in shards]), np.concatenate([s[1] for s in shards])
    for what, got, want in (("ids", got_t, want_t), ("mask", got_m, want_m)):
        n = min(len(got), len(want))
        diff = np.flatnonzero(got[:n] != want[:n])
        if len(diff) or len(got) != len(want):
            at = int(diff[0]) if len(diff) else n
            fail(f"{what} differ at token {at} of {len(want)} (got {len(got)}): got {got[max(0, at - 4):at + 6].tolist()}, "
                 f"reference {want[max(0, at - 4):at + 6].tolist()}")
    n_conv = sum(1 for line in ref["lines"] if "error" not in line)
    print(f"same ids and masks as the reference: {len(want_t)} tokens, {int(want_m.sum())} trained, {n_conv} "
          f"conversations ({ref['jinja']}, {ref['tokenizer']})")


def packed(d, name, T, pad, unpacked, long_rule, rows_per_shard):
    sep = None
    whole = []
    for split in ("train", "val"):
        t, m = stream(unpacked, name, split)
        if len(t):
            sep = int(t[-1])
            whole += docs_of(t, m, sep)
    if sep is None:
        fail(f"no conversations in {unpacked}")
    remaining = {}
    for i, (t, m) in enumerate(whole):
        remaining.setdefault(tuple(t.tolist()), []).append(i)
    n_rows = n_cut = n_pad = 0
    for split in ("train", "val"):
        shards, files = read_split(d, name, split)
        for k, ((t, m, hT), f) in enumerate(zip(shards, files)):
            last = k == len(shards) - 1
            if hT != T:
                fail(f"{f}: the mask header gives T = {hT}, not {T}")
            body = len(t) - (1 if last and len(t) else 0)
            if body % T:
                fail(f"{f}: {len(t)} tokens: not whole rows of {T}{' plus one' if last else ''}")
            if rows_per_shard and not last and body != rows_per_shard * T:
                fail(f"{f}: {body // T} rows, not {rows_per_shard}")
            if last and len(t) and (t[-1] != sep or m[-1] != 0):
                fail(f"{f}: does not end with the separator {sep} at mask 0")
            for r in range(body // T):
                row_t, row_m = t[r * T:(r + 1) * T], m[r * T:(r + 1) * T]
                n_rows += 1
                at = 0
                while at < T and row_t[at] == sep:
                    # The longest remaining conversation that fits here exactly (ids and mask).
                    found = None
                    for key in sorted(remaining, key=len, reverse=True):
                        n = len(key)
                        if at + n <= T and tuple(row_t[at:at + n].tolist()) == key:
                            i = remaining[key][0]
                            if (whole[i][1] == row_m[at:at + n]).all():
                                found = key
                                break
                    if found is None:
                        break
                    remaining[found].pop(0)
                    if not remaining[found]:
                        del remaining[found]
                    at += len(found)
                if at == 0:  # a conversation longer than T, cut
                    cands = [key for key in remaining if len(key) > T and key[:T] == tuple(row_t.tolist())]
                    if long_rule != "cut" or not cands:
                        fail(f"{f}: row {r} does not start with a whole conversation: {row_t[:8].tolist()}")
                    i = remaining[cands[0]].pop(0)
                    if not remaining[cands[0]]:
                        del remaining[cands[0]]
                    if not (whole[i][1][:T] == row_m).all():
                        fail(f"{f}: row {r}: the cut conversation's mask differs")
                    n_cut += 1
                    continue
                if not (row_t[at:] == pad).all() or row_m[at:].any():
                    fail(f"{f}: row {r}: after the whole conversations (up to {at}), not pad {pad} at mask 0: "
                         f"{row_t[at:at + 8].tolist()} mask {row_m[at:at + 8].tolist()}")
                n_pad += T - at
    longer = [k for k in remaining if len(k) > T]
    if long_rule == "drop":
        for k in longer:
            del remaining[k]
    if remaining:
        fail(f"{sum(len(v) for v in remaining.values())} conversations are in no row (lengths "
             f"{sorted(len(k) for k in remaining)[:8]})")
    print(f"{n_rows} rows of {T}: every conversation once, whole "
          f"({f'{len(longer)} longer than {T} absent' if long_rule == 'drop' else f'{n_cut} longer than {T} cut to it'})"
          f", then {n_pad} pad tokens at mask 0")


def split_check(d, name, whole_dir):
    t0, m0 = stream(d, name, "train")
    t1, m1 = stream(d, name, "val")
    w, wm = stream(whole_dir, name, "train")
    if not len(t1):
        fail("the val split is empty")
    got = np.concatenate([t0[:-1], t1[:-1], t1[-1:]])
    gotm = np.concatenate([m0[:-1], m1[:-1], m1[-1:]])
    if not (len(got) == len(w) and (got == w).all() and (gotm == wm).all()):
        fail(f"train + val ({len(t0)} + {len(t1)} tokens) is not the whole stream ({len(w)} tokens)")
    if t1[0] != w[-1]:
        fail(f"the val split does not start with the separator {w[-1]}")
    print(f"train ({len(t0) - 1} tokens) + val ({len(t1) - 1} tokens) is the whole stream, cut before a conversation")


def main():
    a = sys.argv[1:]
    if len(a) >= 5 and a[0] == "compare":
        compare(a[1], a[2], a[3], int(a[4]), "--train-on-prompt" in a)
    elif len(a) >= 7 and a[0] == "packed" and a[5] == "--docs-from":
        opt = lambda k, d: a[a.index(k) + 1] if k in a else d
        packed(a[1], a[2], int(a[3]), int(a[4]), a[6], opt("--long", "cut"), int(opt("--rows-per-shard", 0)))
    elif len(a) == 4 and a[0] == "split":
        split_check(a[1], a[2], a[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
