#!/usr/bin/env bash
# The default job: set up, build, and run the cluster self-check on 4 ranks
# (a 2x2 mesh: every collective on every mesh dim, verified and timed).
# Extra arguments go to `meshtrain check`, e.g. --sizes 1K:64M --iters 20.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup.sh build
np=${NP:-4}
exec scripts/mpirun.sh -np "$np" build/meshtrain --config configs/check.yaml check --sizes 1K:4M --iters 5 "$@"
