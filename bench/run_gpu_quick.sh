#!/usr/bin/env bash
# A short GPU call after scripts/gpu_machine_run.sh built build-cuda/: the engine's CUDA tests (kernels, MoE
# layer, engine, golden), decode at batch 1 / 4 / 16 / 64 with programmatic dependent launch on and off
# (FULCRUM_PDL, same call), and the prefix-cache pattern on `serve --device cuda` (the Qwen3-30B-A3B shape with
# random weights). Results in $OUT. Usage: bench/run_gpu_quick.sh GIT_COMMIT
set -uo pipefail
commit=${1:-unknown}
out=${OUT:-/tmp/out}
bin=build-cuda/bin/fulcrum
timeout 120 build-cuda/bin/fulcrum_cuda_tests \
  --gtest_filter='*StepOps*:*PagedAttention*:*Skinny*:*MoeLayer*:*GpuEngine*:*GpuGolden*:*MoeSkinny*:-*PrintsTimings*' \
  > "$out/tests.txt" 2>&1
echo "tests rc $?"
grep -E "^\[  FAILED|^\[  PASSED|prefix cache \]" "$out/tests.txt"
for pdl in 1 0; do
  FULCRUM_PDL=$pdl $bin bench generate --batch 1 4 16 64 --context 512 --prefill none --steps 20 --warmup 5 \
    --json "$out/generate_pdl$pdl.json" --git-commit "$commit" 2>&1 | grep -E "decode|error"
done
dir=$(mktemp -d)
python3 -c "import json,sys; json.dump(json.load(open('.devshared/data/configs/qwen3-30b-a3b.config.json')), open(sys.argv[1] + '/config.json', 'w'))" "$dir"
BIN=$bin SERVE_EXTRA="--device cuda --load-format dummy" ENGINE=gpu GIT_COMMIT=$commit CLIENTS=64 REQUESTS=128 \
  KV_PAGES=8192 scripts/prefix_cache_bench.sh "$out/prefix_cache_gpu.json" "$dir" 2>&1 | grep -E "TTFT|throughput|prefix cache|requests"
