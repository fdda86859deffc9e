# Shared by the end-to-end test scripts (sourced after $tmp exists): counters and checks.
passed=0
failed=0

ok() { passed=$((passed + 1)); echo "ok   $1"; }
bad() { failed=$((failed + 1)); echo "FAIL $1"; shift; for l in "$@"; do echo "  $l"; done; }

# expect NAME EXIT(zero|nonzero) TEXT -- COMMAND...: runs the command, checks the exit status and that the output contains TEXT.
expect() {
  local name=$1 want=$2 text=$3
  shift 4
  local out="$tmp/out" rc
  timeout 300 "$@" >"$out" 2>&1
  rc=$?
  if [ "$want" = zero ] && [ $rc -ne 0 ]; then
    bad "$name" "exit $rc, expected 0" "$(tail -n 15 "$out")"
    return
  fi
  if [ "$want" = nonzero ] && [ $rc -eq 0 ]; then
    bad "$name" "exit 0, expected non-zero" "$(tail -n 15 "$out")"
    return
  fi
  if ! grep -qF -- "$text" "$out"; then
    bad "$name" "output lacks: $text" "$(tail -n 15 "$out")"
    return
  fi
  ok "$name"
}
