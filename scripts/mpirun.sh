#!/usr/bin/env bash
# mpirun with what this kind of machine needs: --allow-run-as-root when root,
# --oversubscribe (8 ranks on 2 cores), shared memory without ptrace (CMA is
# not allowed in containers). Uses $MPIRUN when set (the GPU machine's packed
# Open MPI). Usage: scripts/mpirun.sh -np 4 build/meshtrain check ...
set -euo pipefail
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_hwloc_base_binding_policy=${OMPI_MCA_hwloc_base_binding_policy:-none}
# The point-to-point layer named: ob1, the one Open MPI selects here anyway (shared memory, one node); naming it
# skips the probes of UCX and the MTLs, 0.2 s of every launch (the tests launch hundreds: test_cmdline 35 -> 27 s).
export OMPI_MCA_pml=${OMPI_MCA_pml:-ob1}
# A rank's stdout may be a pty under mpirun whatever ours is: tell meshtrain where its output really goes
# (progress bar or plain lines, coloured log or plain).
if [ -t 1 ]; then export MT_STDOUT_TTY=1; else export MT_STDOUT_TTY=0; fi
if [ -t 2 ]; then export MT_STDERR_TTY=1; else export MT_STDERR_TTY=0; fi
if [ -n "${MPIRUN:-}" ]; then
  exec $MPIRUN "$@"
fi
args=(--oversubscribe)
[ "$(id -u)" -eq 0 ] && args+=(--allow-run-as-root)
exec mpirun "${args[@]}" "$@"
