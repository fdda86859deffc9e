#!/usr/bin/env bash
# The CPU kernels' instruction-set levels (runtime/kernels/cpu/isa.h):
#  - the linked meshtrain has no AVX, AVX-512, FMA or BMI instruction outside the per-level kernels
#    (mt::cpu::isa_avx2 / isa_avx512 and their Eigen copies), and no AVX-512 in the AVX2 level: so it
#    runs on any x86-64-v2 machine, and the linker kept no wide copy of a shared template
#    (runtime/kernels/cpu/isa_level.h);
#  - the level is the widest the machine has, MT_CPU_ISA picks a narrower one, a bad value is refused;
#  - training at every level this machine supports gives the same losses within 1e-4 (the levels differ
#    in FMA and GEMM blocking: summation order only).
# Prints "cpu_isa: N passed, N failed[, N skipped]" last.
#   tests/cli/test_cpu_isa.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_cpu_isa.sh BUILD_DIR}

source "$(dirname "$0")/common.sh"

# --- The binary: wide instructions only inside the per-level kernels (x86-64) ---
if [ "$(uname -m)" = x86_64 ] && command -v objdump >/dev/null; then
  objdump -d --no-show-raw-insn -C "$mt" >"$tmp/dis.txt"
  "$py" - "$tmp/dis.txt" >"$tmp/isa.out" 2>&1 <<'PY'
import re, sys
# AVX/AVX2/FMA/F16C/AVX-512 mnemonics all start with v (verr/verw are old); BMI1/2, LZCNT and MOVBE are
# x86-64-v3 (tzcnt is left out: GCC emits rep bsf for x86-64, which objdump shows as tzcnt).
v3_only = re.compile(r"^(v(?!err|erw)\w+|andn|bextr|blsi|blsmsk|blsr|bzhi|mulx|pdep|pext|rorx|sarx|shlx|shrx|lzcnt|movbe)$")
v4_regs = re.compile(r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2[0-9]|3[01])\b")
func, bad, counts = None, {}, {"base": 0, "avx2": 0, "avx512": 0}
level = "base"
for line in open(sys.argv[1]):
    m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
    if m:
        func = m.group(1)
        level = "avx512" if "isa_avx512" in func else "avx2" if "isa_avx2" in func else "base"
        counts[level] += 1
        continue
    parts = line.split("\t")
    if func is None or len(parts) < 2:
        continue
    ins = parts[1].strip()
    if not ins:
        continue
    mnem = ins.split()[0]
    if mnem in ("rep", "repz", "repnz", "lock", "notrack", "bnd", "data16") and len(ins.split()) > 1:
        mnem = ins.split()[1]
    wide = level == "base" and (v3_only.match(mnem) or "%ymm" in ins or v4_regs.search(ins))
    wide = wide or (level == "avx2" and v4_regs.search(ins))
    if wide:
        bad.setdefault(func, ins)
print("functions:", counts)
for f, ins in list(bad.items())[:20]:
    print(f"wide instruction outside its level: {f}: {ins}")
sys.exit(1 if bad or counts["avx2"] == 0 or counts["avx512"] == 0 else 0)
PY
  if [ $? -eq 0 ]; then ok "only the per-level kernels use AVX/AVX-512 ($(head -n 1 "$tmp/isa.out"))"; else
    bad "wide instructions outside the per-level kernels (or no levels built)" "$(tail -n 22 "$tmp/isa.out")"; fi
else
  skip "binary check" "not x86-64 or no objdump"
fi

# --- The level: widest by default, MT_CPU_ISA narrower, bad values refused ---
docs_data --val-fraction 0.1
cat >"$tmp/t.yaml" <<YAML
model: {dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 160, vocab_size: 256, max_seq_len: 64}
training: {steps: 12, batch_size: 8, seq_len: 64, lr: 3.0e-3, warmup_steps: 3, threads: 1}
data: {train: "$tmp/data/docs_train_*.bin", val: ""}
eval: {interval: 0}
sample: {interval: 0}
log: {interval: 1}
checkpoint: {dir: ""}
YAML
train() {  # train NAME [ENV=VALUE...]: metrics in $tmp/NAME.jsonl
  local name=$1
  shift
  env "$@" timeout 300 "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set log.metrics_file="$tmp/$name.jsonl" \
    train >"$tmp/$name.log" 2>&1
}
if train default; then
  widest=$(grep -oE 'widest supported: [^)]*\)' "$tmp/default.log" | head -n 1)
  level=$(grep -oE 'CPU kernels: [^(]*\([^)]*\)' "$tmp/default.log" | head -n 1)
  if [ -n "$level" ] && [ "${level#CPU kernels: }" = "${widest#widest supported: }" ]; then ok "default level is the widest: $level"; else
    bad "default level is the widest" "$(grep 'CPU kernels' "$tmp/default.log")"; fi
else
  bad "train at the default level" "$(tail -n 20 "$tmp/default.log")"
fi
levels=(base)
case "$(grep -oE 'widest supported: [^)]*\)' "$tmp/default.log" | head -n 1)" in
  *AVX-512*) levels=(base avx2 avx512) ;;
  *AVX2*) levels=(base avx2) ;;
esac
for l in "${levels[@]}"; do
  if train "$l" MT_CPU_ISA="$l"; then
    if "$py" "$compare" "$tmp/$l.jsonl" "$tmp/default.jsonl" --abs 1e-4 --steps 12 >"$tmp/cmp.out" 2>&1; then
      ok "MT_CPU_ISA=$l: $(grep -oE 'CPU kernels: [^;]*' "$tmp/$l.log" | head -n 1 | sed 's/ (widest.*//'); losses of the default level within 1e-4"
    else
      bad "MT_CPU_ISA=$l: losses of the default level within 1e-4" "$(tail -n 5 "$tmp/cmp.out")"
    fi
  else
    bad "train with MT_CPU_ISA=$l" "$(tail -n 20 "$tmp/$l.log")"
  fi
done
expect "MT_CPU_ISA=sse2 is refused" nonzero "MT_CPU_ISA=sse2: expected base, avx2 or avx512" -- \
  env MT_CPU_ISA=sse2 "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.steps=1 train
if [ "${#levels[@]}" -lt 3 ]; then
  expect "MT_CPU_ISA wider than the machine is refused" nonzero "which this" -- \
    env MT_CPU_ISA=avx512 "$mpirun" -np 1 "$mt" --config "$tmp/t.yaml" --set training.steps=1 train
fi

summary cpu_isa
[ "$failed" -eq 0 ]
