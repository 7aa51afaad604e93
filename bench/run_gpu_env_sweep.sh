#!/usr/bin/env bash
# Decode of the Qwen3-30B-A3B shape (random weights) under several values of one tuning environment variable,
# in one GPU call (so the runs are side by side): bench/run_gpu_env_sweep.sh GIT_COMMIT VAR "BATCHES" V1 V2 ...
# ("default" leaves VAR unset). After scripts/gpu_machine_run.sh built build-cuda/; JSON per value in $OUT.
# CONTEXTS (default "512") sets the decode contexts; EXTRA_FLAGS more bench generate flags (e.g. "--fp8").
set -uo pipefail
commit=$1 var=$2 batches=$3
shift 3
out=${OUT:-/tmp/out}
for value in "$@"; do
  if [ "$value" = default ]; then unset "$var"; else export "$var=$value"; fi
  echo "## $var=$value"
  # shellcheck disable=SC2086
  build-cuda/bin/fulcrum bench generate ${EXTRA_FLAGS:-} --batch $batches --context ${CONTEXTS:-512} --prefill none --steps 20 --warmup 5 \
    --json "$out/sweep_${var}_${value}.json" --git-commit "$commit" 2>&1 | grep -E "decode|error"
done
unset "$var"
