#!/usr/bin/env python3
"""The benchmarks' token shard: DIR/bench_000.bin, N (default 200,000) uniform random byte tokens, seed 0, in
meshtrain's shard format (a 256-int32 header: magic 20240520, version 1, token count; then uint16 tokens).
  scripts/bench/bench_data.py DIR [N]"""
import random
import struct
import sys

random.seed(0)
n = int(sys.argv[2]) if len(sys.argv) > 2 else 200000
toks = [random.randrange(256) for _ in range(n)]
with open(sys.argv[1] + "/bench_000.bin", "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253)) + struct.pack(f"<{len(toks)}H", *toks))
