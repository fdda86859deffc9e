#!/usr/bin/env bash
# Tokenizer throughput: `meshtrain tokenize` with 1 and 2 threads on about MT_BENCH_MB (default 100) MB of mixed text
# (Debian's fortunes, this repository's C++ sources as code, CJK and accented lines), generated once into
# /tmp/mt_bench_tokenizer_<MB>MB.txt and reused. Prints MB/s of each (wall clock of the whole command, tokenizer
# loading included, and meshtrain's own encode time from --stats), the 2-thread speed-up and whether both gave the
# same ids. An optional reference command (e.g. a node script under tests/reference/tokenizers/) encodes the same
# file: "{in}" in it is replaced by the text file and "{out}" by an output path (u32 ids expected there, compared
# with meshtrain's when present); it runs under bash -c and is timed the same way.
#   scripts/bench/bench_tokenizer.sh TOKENIZER_JSON_OR_MODEL [REFERENCE_COMMAND]
#   MT_BENCH_MB=20 MESHTRAIN=build-x/meshtrain scripts/bench/bench_tokenizer.sh tok/tokenizer.json \
#     'node tests/reference/tokenizers/encode.mjs --tokenizer llama3 --in {in} --out {out}'
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
tok=${1:?usage: bench_tokenizer.sh TOKENIZER [REFERENCE_COMMAND]}
ref=${2:-}
mb=${MT_BENCH_MB:-100}
mt=${MESHTRAIN:-$root/build/meshtrain}
[ -x "$mt" ] || { echo "bench_tokenizer: $mt not found (build it, or set MESHTRAIN)" >&2; exit 1; }
text=/tmp/mt_bench_tokenizer_${mb}MB.txt
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The text: rounds of fortunes + code + CJK/accented lines until it holds mb MB.
if [ ! -s "$text" ]; then
  seed="$tmp/seed.txt"
  for f in /usr/share/games/fortunes/*; do
    case $f in *.dat | *.u8) continue ;; esac
    [ -f "$f" ] && [ ! -L "$f" ] && cat "$f"
  done >"$seed" 2>/dev/null || true
  find "$root/runtime" "$root/models" "$root/parallel" -name '*.cpp' -o -name '*.h' 2>/dev/null | sort | head -n 60 |
    xargs cat >>"$seed"
  for i in $(seq 1 400); do
    printf '東京都の天気は晴れです。今日は%d度、明日は雨の予報。中文分词测试：我们在北京学习机器学习。\n' "$i"
    printf '한국어 문장도 조금 넣습니다 %d. Ça coûte %d €, naïve café — déjà vu; Straße, Ελληνικά, русский текст.\n' "$i" "$((i * 7))"
  done >>"$seed"
  [ -s "$seed" ] || { echo "bench_tokenizer: no seed text (install Debian's fortunes)" >&2; exit 1; }
  want=$((mb * 1000 * 1000))
  : >"$tmp/text"
  while [ "$(stat -c %s "$tmp/text")" -lt "$want" ]; do cat "$seed" >>"$tmp/text"; done
  head -c "$want" "$tmp/text" >"$text.tmp" && mv "$text.tmp" "$text"
fi
bytes=$(stat -c %s "$text")
echo "text       : $text, $bytes bytes"
echo "tokenizer  : $("$mt" tokenize --tokenizer "$tok" --info)"
echo "cpu        : $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) cores"

now() { date +%s.%N; }
mbps() { awk -v b="$bytes" -v s="$1" 'BEGIN { printf "%.2f", b / 1e6 / s }'; }
declare -A wall
for t in 1 2; do
  t0=$(now)
  "$mt" tokenize --tokenizer "$tok" --threads $t --in "$text" --out "$tmp/mt$t.u32" --stats 2>"$tmp/mt$t.log"
  t1=$(now)
  wall[$t]=$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')
  echo "meshtrain  : --threads $t: $(mbps "${wall[$t]}") MB/s wall ($(printf '%.2f' "${wall[$t]}") s); $(tail -n 1 "$tmp/mt$t.log")"
done
same=$(cmp -s "$tmp/mt1.u32" "$tmp/mt2.u32" && echo "the same ids" || echo "DIFFERENT ids")
echo "threads    : 2 threads / 1 thread = $(awk -v a="${wall[1]}" -v b="${wall[2]}" 'BEGIN { printf "%.2f", a / b }')x, $same"
if [ -n "$ref" ]; then
  cmd=${ref//\{in\}/$text}
  cmd=${cmd//\{out\}/$tmp/ref.u32}
  t0=$(now)
  bash -c "$cmd" >"$tmp/ref.log" 2>&1 || { echo "reference command failed: $cmd"; tail -n 5 "$tmp/ref.log"; exit 1; }
  t1=$(now)
  rw=$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')
  echo "reference  : $(mbps "$rw") MB/s wall ($(printf '%.2f' "$rw") s): $cmd"
  [ -s "$tmp/ref.log" ] && echo "             $(tail -n 1 "$tmp/ref.log")"
  cmp_ids=""
  if [ -f "$tmp/ref.u32" ]; then
    cmp_ids=$(cmp -s "$tmp/mt1.u32" "$tmp/ref.u32" && echo ", the same ids" || echo ", DIFFERENT ids")
  fi
  echo "ratio      : meshtrain 1 thread / reference = $(awk -v a="$rw" -v b="${wall[1]}" 'BEGIN { printf "%.2f", a / b }')x, 2 threads / reference = $(awk -v a="$rw" -v b="${wall[2]}" 'BEGIN { printf "%.2f", a / b }')x$cmp_ids"
fi
