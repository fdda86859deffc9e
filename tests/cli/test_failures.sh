#!/usr/bin/env bash
# Damaged inputs an operator hits (issue 39 part 6): each must end non-zero with a message naming the key or
# file, printed once when every rank hits it alike (not once per rank, each calling MPI_Abort), and nothing may
# run the machine out of memory first. Prints "failures: N passed, N failed" last.
#   tests/cli/test_failures.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: test_failures.sh BUILD_DIR}

source "$(dirname "$0")/common.sh"

docs_data --val-fraction 0.1
fault_yaml "$tmp/f.yaml" 1 30
run2=("$mpirun" -np 2 "$mt" --config "$tmp/f.yaml")

# once NAME TEXT -- COMMAND...: non-zero exit, TEXT in the output exactly once (one rank printed it).
once() {
  local name=$1 text=$2
  shift 3
  timeout 120 "$@" >"$tmp/out" 2>&1
  local rc=$? n
  n=$(grep -cF -- "$text" "$tmp/out")
  if [ $rc -eq 0 ]; then bad "$name" "exit 0, expected non-zero" "$(tail -n 5 "$tmp/out")"
  elif [ "$n" -ne 1 ]; then bad "$name" "'$text' printed $n times, expected once" "$(grep -v '^step\|info' "$tmp/out" | tail -n 6)"
  else ok "$name"; fi
}

# A sharded checkpoint (two files and an index, with config.json) to damage.
"${run2[@]}" --set checkpoint.writers=2 train >"$tmp/save.log" 2>&1 || bad "a sharded checkpoint" "$(tail -n 5 "$tmp/save.log")"
good="$tmp/ckpt/step_00000001"

# The model's size against the rank's memory, before anything is allocated: model.n_layers, or config.json's
# num_hidden_layers (model.init_from), a trillion layers.
once "huge model.n_layers: refused before allocating" "does not fit in this rank's memory: model.n_layers = 1000000000000" -- \
  "${run2[@]}" --set model.n_layers=1000000000000 train
# estimate describes every layer: a million layers (which would take hours and gigabytes) is refused at once.
once "estimate: a million layers refused, naming the key" "model.n_layers = 1000000 (num_hidden_layers in a config.json)" -- \
  "$mt" --config "$tmp/f.yaml" --set model.n_layers=1000000 estimate --world 2
cp -r "$good" "$tmp/huge"
"$py" - "$tmp/huge/config.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); j["num_hidden_layers"] = 1000000000000; json.dump(j, open(sys.argv[1], "w"))
PY
sed -e '/^model:/d' "$tmp/f.yaml" >"$tmp/g.yaml"
echo "model: {init_from: \"$tmp/huge\"}" >>"$tmp/g.yaml"
once "huge num_hidden_layers in config.json: refused before allocating" "model.init_from's config.json: num_hidden_layers" -- \
  "$mpirun" -np 2 "$mt" --config "$tmp/g.yaml" train

# An index listing a tensor twice.
cp -r "$good" "$tmp/dup"
"$py" - "$tmp/dup/model.safetensors.index.json" <<'PY'
import sys
p = sys.argv[1]; lines = open(p).read().split("\n")
i = next(k for k, l in enumerate(lines) if '"weight_map"' in l)
lines.insert(i + 1, lines[i + 2] if lines[i + 2].rstrip().endswith(",") else lines[i + 2] + ",")  # a later key repeated first
open(p, "w").write("\n".join(lines))
PY
once "index lists a tensor twice" "model.safetensors.index.json: weight_map lists tensor" -- \
  "${run2[@]}" --set model.init_from="$tmp/dup" train

# A wrong architectures string with a known model_type.
cp -r "$good" "$tmp/arch"
"$py" - "$tmp/arch/config.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); j["architectures"] = ["BertForMaskedLM"]; json.dump(j, open(sys.argv[1], "w"))
PY
once "wrong architectures in config.json" "config.json: architectures = [\"BertForMaskedLM\"] but model_type \"llama\" is LlamaForCausalLM" -- \
  "${run2[@]}" --set model.init_from="$tmp/arch" train

# plan --search --top 0 and -3.
for top in 0 -3; do
  once "plan --search --top $top" "--search --top $top: expected the number of plans to show, at least 1" -- \
    "$mpirun" -np 2 "$mt" --config "$tmp/f.yaml" plan --search --world 4 --cluster "$root/configs/clusters/this_machine.yaml" --top "$top"
done

# checkpoint.writers above the rank count.
once "checkpoint.writers above the ranks" "checkpoint.writers = 3 but the job has 2 ranks" -- "${run2[@]}" --set checkpoint.writers=3 train

# An empty tokenizer.json.
mkdir -p "$tmp/tok" && : >"$tmp/tok/tokenizer.json"
once "empty tokenizer.json" "tokenizer.json: the file is empty (a tokenizer.json must hold a JSON object)" -- \
  "${run2[@]}" --set data.tokenizer="$tmp/tok/tokenizer.json" --set sample.interval=1 --set sample.tokens=2 train
printf 'not json' >"$tmp/tok/bad.json"
once "a tokenizer .json that is not JSON" "bad.json: not valid JSON" -- \
  "${run2[@]}" --set data.tokenizer="$tmp/tok/bad.json" --set sample.interval=1 --set sample.tokens=2 train

# Ulysses head counts, and a resume of a directory without meta.json: every rank hits them, rank 0 prints.
once "Ulysses: heads that do not split" "leaves 3 q heads per rank, which do not divide by parallel.cp = 2" -- \
  "${run2[@]}" --set parallel.cp=2 --set parallel.cp_method=alltoall --set parallel.dp_replicate=1 \
  --set model.dim=48 --set model.n_heads=3 --set model.n_kv_heads=1 train
mkdir -p "$tmp/nometa"
once "resume of a directory without meta.json" "not a complete checkpoint (no meta.json)" -- \
  "${run2[@]}" --set checkpoint.resume="$tmp/nometa" train

summary failures
[ $failed -eq 0 ]
