#!/usr/bin/env bash
# Decode of the Qwen3-30B-A3B shape (random weights) with the skinny GEMMs on FP32 FMAs or on the tensor cores, in
# one GPU call (side by side), after scripts/gpu_machine_run.sh built build-cuda/. Runs (JSON per run in $OUT):
#   fma       FULCRUM_EXPERT_MMA=0 FULCRUM_SKINNY_MMA=0 (the kernels before the tensor-core ones)
#   expert    tensor cores for the expert GEMMs only (FULCRUM_SKINNY_MMA=0)
#   mma       both on tensor cores (the default)
#   mma_wide  both, with the MoE skinny path up to 512 entries (batch 64 at top-8) instead of CUTLASS
# Usage: bench/run_gpu_mma_sweep.sh GIT_COMMIT ["BATCHES"] ["WIDE BATCHES"]
set -uo pipefail
commit=$1 batches=${2:-1 4 8 16} wide_batches=${3:-8 16 32 64}
out=${OUT:-/tmp/out}
run() {  # label, batches, then env assignments and extra bench arguments
  local label=$1 b=$2
  shift 2
  echo "## $label"
  # shellcheck disable=SC2086
  env "$@" build-cuda/bin/fulcrum bench generate --batch $b --context 512 --prefill none --steps 20 --warmup 5 \
    --json "$out/mma_sweep_$label.json" --git-commit "$commit" 2>&1 | grep -E "decode|error"
}
run fma "$batches" FULCRUM_EXPERT_MMA=0 FULCRUM_SKINNY_MMA=0
run expert "$batches" FULCRUM_SKINNY_MMA=0
run mma "$batches"
run_wide() {
  echo "## mma_wide"
  # shellcheck disable=SC2086
  build-cuda/bin/fulcrum bench generate --batch $wide_batches --context 512 --prefill none --steps 20 --warmup 5 \
    --skinny-max-entries 512 --json "$out/mma_sweep_mma_wide.json" --git-commit "$commit" 2>&1 | grep -E "decode|error"
}
run_wide
