#!/usr/bin/env bash
# The default job: set up (packages, build, the fortunes dataset), then train
# the tiny byte-level Llama of configs/tiny.yaml on 2 ranks with data parallel,
# printing progress, loss, throughput, validation loss and generated samples;
# finally draw the loss plot. Resumes from runs/tiny/checkpoints if present.
#   scripts/run.sh [--fresh] [--set key=value ...]
#     --fresh   start over (removes runs/tiny)
#     NP=4 scripts/run.sh   another rank count
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ "${1:-}" = "--fresh" ]; then
  rm -rf runs/tiny
  shift
fi
scripts/setup.sh build
np=${NP:-2}
mkdir -p runs/tiny
scripts/mpirun.sh -np "$np" build/meshtrain --config configs/tiny.yaml "$@" train
/usr/bin/python3 scripts/plot_metrics.py runs/tiny/metrics.jsonl --out runs/tiny/loss.png
echo "samples: build/meshtrain generate --checkpoint runs/tiny/checkpoints --prompt 'The '"
