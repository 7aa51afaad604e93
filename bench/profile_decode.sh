#!/usr/bin/env bash
# Where one eager decode step's device time goes, per kernel: ncu over one step of the 48-layer Qwen3-30B-A3B shape
# at each batch size given (context 512), summed by bench/peer/ncu_kernel_times.py. On the GPU machine after
# scripts/gpu_machine_run.sh built build-cuda/. Usage: [CACHE=none] bench/profile_decode.sh GIT_COMMIT [BATCH ...] > profile.txt
# CACHE=none keeps L2 between kernels (as a real step does); the default (all) flushes it before each kernel.
set -uo pipefail
commit=${1:-unknown}; shift || true
batches=${*:-1 4 16 64}
bin=build-cuda/bin/fulcrum
cache=${CACHE:-all}
tmp=$(mktemp -d)
echo "# ncu --clock-control none --cache-control $cache --profile-from-start off --csv --page raw --metrics gpu__time_duration.sum $bin bench generate --no-cuda-graphs --profile --batch B --context 512 --prefill none --steps 1 --warmup 2"
echo "# one eager decode step of the 48-layer Qwen3-30B-A3B shape, commit $commit, one H200; summed by bench/peer/ncu_kernel_times.py"
for b in $batches; do
  echo "## batch $b"
  ncu --clock-control none --cache-control "$cache" --profile-from-start off --csv --page raw --metrics gpu__time_duration.sum \
    $bin bench generate --no-cuda-graphs --profile --batch "$b" --context 512 --prefill none --steps 1 --warmup 2 \
    > "$tmp/ncu_$b.csv" 2> "$tmp/ncu_$b.err" || { tail -5 "$tmp/ncu_$b.err"; continue; }
  python3 bench/peer/ncu_kernel_times.py "$tmp/ncu_$b.csv"
done
