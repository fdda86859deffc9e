#!/usr/bin/env bash
# The default job: set up (packages, build, the fortunes dataset), then train
# the tiny byte-level Llama of configs/tiny.yaml on 2 ranks with data parallel,
# printing progress, loss, throughput, validation loss and generated samples;
# finally draw the loss plot. Resumes from runs/tiny/checkpoints if present.
#   scripts/run.sh [--fresh] [--set key=value ...]
#     --fresh   start over (removes runs/tiny)
#     NP=4 scripts/run.sh   another rank count
#     exit code: meshtrain's (0 done, 1 an error, 2 a command-line error,
#     128 + N stopped by signal N after a checkpoint: run it again to resume)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
  -h | --help)
    # The header above, without the interpreter line and the comment marks.
    sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
    exit 0
    ;;
esac
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
