#!/usr/bin/env bash
# Sets up, builds and runs every test suite; ends with "N passed, N failed, N skipped" (skipped: cases that
# cannot run here, such as GPU tests without a GPU; never counted as passed).
#   scripts/test.sh [--full] [--no-setup]
#     --full      longer variants (MT_TEST_FULL=1: larger sizes in the suites that have them)
#     --no-setup  reuse build/ as it is
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build="$root/build"
setup=1
for a in "$@"; do
  case "$a" in
    --full) export MT_TEST_FULL=1 ;;
    --no-setup) setup=0 ;;
    *) echo "usage: scripts/test.sh [--full] [--no-setup]" >&2; exit 2 ;;
  esac
done
if [ $setup -eq 1 ]; then
  scripts/setup.sh "$build" || { echo "setup failed"; echo "0 passed, 1 failed, 0 skipped"; exit 1; }
  echo "set-up and build: $SECONDS s"
fi
start_s=$SECONDS

passed=0
failed=0
skipped=0
# Each suite's wall time (and each build's), for the list of the slowest at the end: the seconds since the last lap.
laps=""
lap_at=$start_s
lap() {  # lap NAME: the time since the previous lap is NAME's; prints it
  local took=$((SECONDS - lap_at))
  lap_at=$SECONDS
  laps+="$took $1"$'\n'
  last_lap=$took
}
add() {  # add PASSED FAILED SKIPPED SUITE
  passed=$((passed + $1))
  failed=$((failed + $2))
  skipped=$((skipped + $3))
  lap "$4"
  printf '%-28s %4d passed, %d failed, %d skipped  [%d s]\n' "$4" "$1" "$2" "$3" "$last_lap"
}
# report SUITE LOG PREFIX: counts a suite from the last line of LOG that reads "PREFIX N passed, N failed" with an
# optional ", N skipped" (PREFIX an extended regular expression), else from doctest's own "[doctest] test cases:"
# line; a log with neither is one failure (the suite crashed or hung). On failures it shows the lines naming them.
report() {
  local suite=$1 out=$2 prefix=$3 line p f s=0
  line=$(grep -E "^${prefix}[0-9]+ passed, [0-9]+ failed" "$out" | tail -n 1 | sed -E "s/^${prefix}//")
  if [ -z "$line" ]; then
    line=$(grep -E '^\[doctest\] test cases:' "$out" | tail -n 1 |
      sed -E 's/.*\| *([0-9]+) passed *\| *([0-9]+) failed *\| *([0-9]+) skipped.*/\1 passed, \2 failed, \3 skipped/')
  fi
  if ! [[ "$line" =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed(,\ ([0-9]+)\ skipped)? ]]; then
    tail -n 40 "$out"
    add 0 1 0 "$suite (crashed or hung)"
    return
  fi
  p=${BASH_REMATCH[1]}
  f=${BASH_REMATCH[2]}
  [ -n "${BASH_REMATCH[4]}" ] && s=${BASH_REMATCH[4]}
  add "$p" "$f" "$s" "$suite"
  if [ "$f" -gt 0 ]; then grep -E '^(FAIL|  )|ERROR|FAILED' "$out" | head -n 80; fi
}
log_dir="$build/test-logs"
mkdir -p "$log_dir"

# Single-process doctest suites: test_unit prints "[NAME] N passed, N failed, N skipped" (MT_SUITE_NAME), others
# doctest's own summary line.
run_doctest_suite() {  # run_doctest_suite BINARY NAME TIMEOUT_S [ARGS...]
  local bin=$1 name=$2 limit=$3
  shift 3
  local out="$log_dir/$name.log"
  MT_SUITE_NAME=$name timeout "$limit" "$bin" "$@" >"$out" 2>&1
  report "$name" "$out" "\\[$name\\] "
}
run_doctest_suite "$build/tests/test_unit" unit 600
# The op table on every backend (CUDA cases counted as skipped without a device).
run_doctest_suite "$build/tests/test_ops" ops 600
# The flash attention kernels run by the warp emulator on the CPU (built where the CUDA headers are; fast
# selection of shapes, all of them with --full).
if [ -x "$build/tests/test_flash_emulated" ]; then
  run_doctest_suite "$build/tests/test_flash_emulated" flash-emulated 900
else
  add 0 0 1 "flash-emulated (not built: no CUDA headers)"
fi
# The CUDA backend on the emulated CUDA device (tests/emu; test-only): build-emu is configured with
# -Demulate_cuda=true (no nvcc, GPU or toolkit library: the kernels compiled by the host compiler, the toolkit's
# headers only declare) and only the targets below are built. ops-emulated: the op table's CUDA cases (f32 and
# bf16, value and gradient) against the CPU, in both thread orders; cuda-emulated: the emulated runtime's own
# checks (misuse reported, the stream-order hazard tracker, the CUB stand-in). Skipped without the CUDA headers.
emu_build="$root/build-emu"
emu_ready=0
if [ -f /usr/local/cuda/include/cuda_runtime_api.h ]; then
  if { [ -f "$emu_build/build.ninja" ] ||
       meson setup "$emu_build" -Demulate_cuda=true -Dcpu_dispatch=false >"$log_dir/emu-setup.log" 2>&1; } &&
     ninja -C "$emu_build" tests/test_ops tests/test_cuda_emulated tests/test_cublaslt_emu tests/test_nccl_emu meshtrain \
       tests/libcudnn.so.9 tests/test_cudnn_emu \
       >"$log_dir/emu-build.log" 2>&1; then
    lap "(build-emu: the emulated CUDA build)"
    run_doctest_suite "$emu_build/tests/test_ops" ops-emulated 900 -tc="ops value: cuda*,ops gradient: cuda*"
    # Again with each block's threads run last to first between barriers: a read of another thread's write with no
    # barrier in between gives another result in one of the two orders.
    MT_EMU_SCHEDULE=reverse run_doctest_suite "$emu_build/tests/test_ops" ops-emulated-reverse 900 \
      -tc="ops value: cuda*,ops gradient: cuda*"
    run_doctest_suite "$emu_build/tests/test_cuda_emulated" cuda-emulated 300
    # The cuBLASLt stand-in against a triple loop; the NCCL stand-in over MPI on 4 ranks (rank 0 prints the
    # summary, the others only their failures; the exit status is the worst rank's).
    run_doctest_suite "$emu_build/tests/test_cublaslt_emu" cublaslt-emulated 300
    # cuDNN's stand-in (build-emu/tests/libcudnn.so.9, which the emulated build's attention loads): its refusals.
    run_doctest_suite "$emu_build/tests/test_cudnn_emu" cudnn-emulated 300
    out="$log_dir/nccl-emulated.log"
    if timeout 300 scripts/mpirun.sh -np 4 "$emu_build/tests/test_nccl_emu" --no-colors=true >"$out" 2>&1; then
      report "nccl-emulated np=4" "$out" ""
    else
      grep -E 'ERROR|FAILED|error' "$out" | head -n 20
      add 0 1 0 "nccl-emulated np=4 (not every rank passed)"
    fi
    emu_ready=1
  else
    cat "$log_dir/emu-setup.log" 2>/dev/null | tail -n 20
    grep -E 'error|FAILED' "$log_dir/emu-build.log" | head -n 40
    add 0 1 0 "ops-emulated (build-emu did not build)"
  fi
else
  add 0 0 1 "ops-emulated (no CUDA headers in /usr/local/cuda/include)"
fi

# The GPU suite (tests/gpu) on the emulated CUDA device: build-emu's test_gpu (its .cu through the emulator, as the
# kernels). np=1: every case, the largest sizes with --full only (gpu_test.h, emulated_quick); np=2: the multi-rank
# cases (redistribution of device tensors over NCCL and over the staged MPI backend, the auto backend, ring attention)
# with a device per rank (MT_EMU_DEVICES=2: NCCL's stand-in over MPI).
gpu_emulated_suite() {  # gpu_emulated_suite BINARY NAME NP [DOCTEST ARGS...]
  local bin=$1 name=$2 np=$3
  shift 3
  local out="$log_dir/$name-np$np.log"
  MT_SUITE_NAME=$name timeout 900 scripts/mpirun.sh -np "$np" "$bin" "$@" >"$out" 2>&1
  report "$name np=$np" "$out" "\\[$name np=$np\\] "
}
gpu_emulated_multi_rank="-tc=redistribute*,the auto backend*,gpu: ring attention*"
if [ $emu_ready -eq 1 ]; then
  if ninja -C "$emu_build" tests/test_gpu >"$log_dir/emu-gpu-build.log" 2>&1; then
    lap "(build-emu: tests/test_gpu)"
    gpu_emulated_suite "$emu_build/tests/test_gpu" gpu-emulated 1
    MT_EMU_DEVICES=2 gpu_emulated_suite "$emu_build/tests/test_gpu" gpu-emulated 2 "$gpu_emulated_multi_rank"
  else
    grep -E 'error|FAILED' "$log_dir/emu-gpu-build.log" | head -n 40
    add 0 1 0 "gpu-emulated (test_gpu did not build)"
  fi
else
  add 0 0 1 "gpu-emulated (build-emu not built)"
fi

# Multi-rank suite on 1, 2, 4, 6 (2x3 meshes) and 8 ranks; rank 0 prints "[NAME np=K] N passed, N failed, N skipped".
run_mpi_suite() {  # run_mpi_suite BINARY NAME NP
  local out="$log_dir/$2-np$3.log"
  MT_SUITE_NAME=$2 timeout 900 scripts/mpirun.sh -np "$3" "$1" >"$out" 2>&1
  report "$2 np=$3" "$out" "\\[$2 np=$3\\] "
}
for np in 1 2 4 6 8; do run_mpi_suite "$build/tests/test_mpi" test_mpi $np; done

# End-to-end scripts, each ending with "NAME: N passed, N failed" and, when some checks cannot run here,
# ", N skipped".
run_script_suite() {  # run_script_suite NAME SCRIPT [ARGS...]
  local name=$1 script=$2
  shift 2
  local out="$log_dir/$name.log"
  bash "$script" "$build" "$@" >"$out" 2>&1
  report "$name" "$out" "$name: "
}
# The layer rule (docs/ARCHITECTURE.md): no source includes a layer above its own.
out="$log_dir/layers.log"
/usr/bin/python3 tests/check_layers.py "$root" >"$out" 2>&1
report layers "$out" "layers: "
# The map against the tree: every repository path README.md and docs/ name exists.
out="$log_dir/docs.log"
/usr/bin/python3 tests/check_docs.py --root "$root" >"$out" 2>&1
report docs "$out" "docs: "
# The command line end to end: config errors, the self-check, fault tests.
run_script_suite cli tests/cli/test_cli.sh
run_script_suite hang tests/cli/test_hang.sh ${MT_TEST_FULL:+--full}
# Damaged inputs an operator hits: each a clear error naming the key or file, printed once.
run_script_suite failures tests/cli/test_failures.sh
run_script_suite cmdline tests/cli/test_cmdline.sh
# Training: invariance over dp, the PyTorch reference, resume, checkpoint faults, bad input.
run_script_suite train tests/cli/test_train.sh
run_script_suite checkpoint tests/cli/test_checkpoint.sh
# In-memory checkpoints (issue 54): own segment, peer's copy, disk fallback, killed mid-write, removal.
run_script_suite memory_checkpoint tests/cli/test_memory_checkpoint.sh
# Loss masks (issue 41): the reference's masked losses, the global normalisation on every mesh, bad masks.
run_script_suite chat_train tests/cli/test_chat_train.sh
# LoRA (issue 52): the independent PyTorch LoRA's losses and adapters on 1 rank and on dp_shard x tp, pp and cp; resume
# on another mesh, recompute, bf16, loss masks, PEFT files, export --merge, bad adapters.
run_script_suite lora tests/cli/test_lora.sh
run_script_suite families tests/cli/test_families.sh
# Mixture of experts: the reference's losses on 1 rank and on every mesh with expert parallel, checkpoints as
# per-expert tensors resumed on other ep, router metrics, capacity, the selection bias, bad input, a stuck rank.
run_script_suite moe tests/cli/test_moe.sh ${MT_TEST_FULL:+--full}
run_script_suite tokenizer tests/cli/test_tokenizer.sh
# Chat data: prepare_data --chat's ids and masks against Hugging Face's Jinja and tokenizers (npm), packing, bad lines.
run_script_suite chat_data tests/cli/test_chat_data.sh
# Tensor and sequence parallel: invariance over tp and dp x tp, plans, `meshtrain plan`.
run_script_suite tp tests/cli/test_tp.sh ${MT_TEST_FULL:+--full}
# Context parallel: invariance over cp, dp x cp, cp x tp, both methods, packed documents, `meshtrain plan`.
run_script_suite cp tests/cli/test_cp.sh ${MT_TEST_FULL:+--full}
# Activation recompute: full, selective, every N-th and MLP-only give the same losses bit for bit (1 rank, tp, cp).
run_script_suite recompute tests/cli/test_recompute.sh
# Fully sharded data parallel: invariance over dp_shard, HSDP, with tp and cp, layouts, memory, bytes, checkpoints.
run_script_suite fsdp tests/cli/test_fsdp.sh ${MT_TEST_FULL:+--full}
run_script_suite pp tests/cli/test_pp.sh
# Traces (issue 40): a pp 2 x dp_shard 2 x tp 2 trace checked against the format, the step, the Group counters, the
# schedule and the allocator; merge; the picture; a rank slowed on purpose named within 10 steps.
run_script_suite trace tests/cli/test_trace.sh
# meshtrain estimate against measured runs: the peak memory within 5% and every byte of a step, 17 configurations;
# latent attention (deepseek_v3, deepseek_v2: parameters, FLOPs, memory, bytes, plan --search with ep); then on
# seeded random shapes and 4-rank meshes (6, or 20 with MT_TEST_FULL).
run_script_suite estimate tests/cli/test_estimate.sh
run_script_suite estimate-moe tests/cli/test_estimate_moe.sh
run_script_suite estimate-deepseek tests/cli/test_estimate_deepseek.sh
run_script_suite estimate-sweep tests/cli/test_estimate_sweep.sh ${MT_TEST_FULL:+--full}
# A model larger than any one rank: sharded creation, steps, sharded save and resume on another mesh under a cap per
# rank below the model's f32 weights; the saved directory in the PyTorch reference.
run_script_suite scale tests/cli/test_scale.sh ${MT_TEST_FULL:+--full}
# CPU kernels built per instruction-set level, chosen at run time: every level gives the same losses.
run_script_suite cpu_isa tests/cli/test_cpu_isa.sh
# (With the emulated build: its MoE cases on the emulated device too.)
if [ $emu_ready -eq 1 ]; then run_script_suite host_sync tests/cli/test_host_sync.sh "$emu_build"
else run_script_suite host_sync tests/cli/test_host_sync.sh; fi
# training.fp8 on the CPU (its bit-exact FP8 emulation): against bf16, 2 ranks, the start-up refusal, the bf16 fallback.
run_script_suite fp8 tests/cli/test_fp8.sh
run_script_suite supervise tests/cli/test_supervise.sh
run_script_suite slurm tests/cli/test_slurm.sh ${MT_TEST_FULL:+--full}
# The CUDA training step on the emulated device against the CPU backend (build-emu's meshtrain, built above).
if [ $emu_ready -eq 1 ]; then
  run_script_suite emulated tests/cli/test_emulated.sh "$emu_build"
else
  add 0 0 1 "emulated (build-emu not built)"
fi
# --full: the emulated build again under AddressSanitizer (build-emu-asan: -Db_sanitize=address, and
# -Db_lundef=false, which meson asks for with a sanitizer). Emulated device memory is host heap memory
# (cuda_runtime_emu.cpp), so every emulated kernel's loads and stores, every emulated copy, the cuBLASLt and NCCL
# stand-ins and the host code around them are bounds-checked: past an allocation (its canary zone included: within
# it the emulator's own canaries and NaN fill see it), dynamic shared memory, the stack. ops-emulated-asan: the op
# table's CUDA cases; gpu-emulated-asan: the GPU suite as above (its quick sizes: MT_TEST_FULL unset for it);
# emulated-asan: tests/cli/test_emulated.sh's training runs. The fibers announce each stack
# switch to ASan (tests/emu/cuda_emulator.h), so reports and throws inside kernels are right; leak checking is off
# (Open MPI's allocations at exit); detect_stack_use_after_return also passes (ASAN_OPTIONS=...=1) but costs 4x on
# the op table (each block of a launch is a new OS thread with its own fake stack), so it is left to a manual run.
if [ -n "${MT_TEST_FULL:-}" ]; then
  asan_build="$root/build-emu-asan"
  asan_opts=detect_leaks=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}
  if [ $emu_ready -ne 1 ]; then
    add 0 0 1 "ops-emulated-asan (build-emu not built)"
  elif { [ -f "$asan_build/build.ninja" ] ||
         meson setup "$asan_build" -Demulate_cuda=true -Dcpu_dispatch=false -Db_sanitize=address -Db_lundef=false \
           >"$log_dir/emu-asan-setup.log" 2>&1; } &&
       ninja -C "$asan_build" tests/test_ops tests/test_gpu meshtrain >"$log_dir/emu-asan-build.log" 2>&1; then
    ASAN_OPTIONS=$asan_opts run_doctest_suite "$asan_build/tests/test_ops" ops-emulated-asan 1800 \
      -tc="ops value: cuda*,ops gradient: cuda*"
    ASAN_OPTIONS=$asan_opts MT_TEST_FULL= gpu_emulated_suite "$asan_build/tests/test_gpu" gpu-emulated-asan 1
    ASAN_OPTIONS=$asan_opts MT_TEST_FULL= MT_EMU_DEVICES=2 gpu_emulated_suite "$asan_build/tests/test_gpu" \
      gpu-emulated-asan 2 "$gpu_emulated_multi_rank"
    out="$log_dir/emulated-asan.log"
    ASAN_OPTIONS=$asan_opts bash tests/cli/test_emulated.sh "$build" "$asan_build" >"$out" 2>&1
    report "emulated-asan" "$out" "emulated: "
    for l in "$log_dir/ops-emulated-asan.log" "$log_dir"/gpu-emulated-asan-np*.log "$out"; do
      if grep -q 'ERROR: AddressSanitizer' "$l"; then
        grep -A 12 'ERROR: AddressSanitizer' "$l" | head -n 40
        add 0 1 0 "$(basename "$l" .log) (AddressSanitizer reported)"
      fi
    done
  else
    tail -n 20 "$log_dir/emu-asan-setup.log" 2>/dev/null
    grep -E 'error|FAILED' "$log_dir/emu-asan-build.log" | head -n 40
    add 0 1 0 "ops-emulated-asan (build-emu-asan did not build)"
  fi
fi

# The PyTorch reference model's own checks (RoPE, GQA, gradients, safetensors); skipped without python3-torch.
out="$log_dir/reference.log"
/usr/bin/python3 tests/reference/test_reference.py >"$out" 2>&1
report reference "$out" ""
# The independent LoRA reference (tests/reference/lora_ref.py, issue 52) against finite differences, llama_ref.py's
# forward and full gradient, torch's AdamW, PEFT's file layout; skipped without python3-torch.
out="$log_dir/lora_reference.log"
/usr/bin/python3 tests/reference/test_lora_ref.py >"$out" 2>&1
report lora_reference "$out" ""
# The DeepSeek-V2/V3 reference's own checks (scripts/reference/deepseek_check.py): latent attention against per-head
# loops with complex-number RoPE, YaRN by hand, the routers on hand-made groups, multi-token prediction by a
# per-position loop and its shared gradients against separate copies.
out="$log_dir/deepseek_reference.log"
/usr/bin/python3 scripts/reference/deepseek_check.py >"$out" 2>&1
report deepseek_reference "$out" ""
# Hugging Face interoperability: meshtrain's checkpoints in llama_ref.py and transformers (skipped where it does not
# import), their saved models in meshtrain (logits, init_from); skipped as a whole without python3-torch.
out="$log_dir/hf_interop.log"
/usr/bin/python3 tests/reference/test_hf_interop.py --meshtrain "$build/meshtrain" >"$out" 2>&1
report hf_interop "$out" ""

# GPU suite, whenever a GPU is present.
if [ -x "$build/tests/test_gpu" ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  run_mpi_suite "$build/tests/test_gpu" test_gpu 1
  run_mpi_suite "$build/tests/test_gpu" test_gpu 2
else
  add 0 0 1 "gpu (no GPU here)"
fi

echo "logs: $log_dir"
echo "the ten slowest suites and builds of $((SECONDS - start_s)) s (after set-up):"
printf '%s' "$laps" | sort -rn | head -n 10 | awk '{ t = $1; $1 = ""; printf "  %5d s %s\n", t, substr($0, 2) }'
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
