#!/usr/bin/env bash
# Decode of the Qwen3-30B-A3B shape (random weights) under several values of one tuning environment variable,
# in one GPU call (so the runs are side by side): bench/run_gpu_env_sweep.sh GIT_COMMIT VAR "BATCHES" V1 V2 ...
# ("default" leaves VAR unset). After scripts/gpu_machine_run.sh built build-cuda/. In $OUT: one JSON per run,
# sweep_VAR_VALUE.json (a value given again: sweep_VAR_VALUE_runN.json, so no run overwrites another), and all of
# them in call order in sweep_VAR.json (bench/peer/gather_sweep.py), which `scripts/engine_bench_tables.py --sweep`
# prints as a table.
# CONTEXTS (default "512") sets the decode contexts; EXTRA_FLAGS more bench generate flags (e.g. "--fp8").
set -uo pipefail
commit=$1 var=$2 batches=$3
shift 3
out=${OUT:-/tmp/out}
declare -A times
labelled=()
for value in "$@"; do
  times[$value]=$(( ${times[$value]:-0} + 1 ))
  n=${times[$value]}
  json="$out/sweep_${var}_${value}.json" label="$var=$value"
  if [ "$n" -gt 1 ]; then json="$out/sweep_${var}_${value}_run$n.json" label="$label (run $n)"; fi
  if [ "$value" = default ]; then unset "$var"; else export "$var=$value"; fi
  echo "## $var=$value"
  # shellcheck disable=SC2086
  build-cuda/bin/fulcrum bench generate ${EXTRA_FLAGS:-} --batch $batches --context ${CONTEXTS:-512} --prefill none --steps 20 --warmup 5 \
    --json "$json" --git-commit "$commit" 2>&1 | grep -E "decode|error"
  [ -f "$json" ] && labelled+=("$label=$json")
done
unset "$var"
if [ ${#labelled[@]} -gt 0 ]; then
  what="bench generate decode (30B-A3B shape, 48 layers, random weights, contexts ${CONTEXTS:-512}"
  what+="${EXTRA_FLAGS:+, $EXTRA_FLAGS}) under $var = $*, in this order, one call at commit $commit"
  python3 "$(dirname "$0")/peer/gather_sweep.py" "$out/sweep_${var}.json" \
    --command "bench/run_gpu_env_sweep.sh $commit $var \"$batches\" $*" --what "$what" "${labelled[@]}"
fi
