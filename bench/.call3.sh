set -uo pipefail
out=$OUT; c=${C:-unknown}
timeout 150 build-cuda/bin/fulcrum_cuda_tests --gtest_filter='*Skinny*:*MoeLayer*:GpuEngineTest*:*GpuGolden*:-*PrintsTimings*' > $out/tests.txt 2>&1; echo "tests rc $?"
grep -E "^\[  FAILED|^\[  PASSED|^\[  SKIPPED \] [0-9]" $out/tests.txt | head -20
bench/run_gpu_env_sweep.sh $c FULCRUM_SKINNY_EARLY_W "1 2 4 8" default 0
bench/run_gpu_env_sweep.sh $c FULCRUM_SKINNY_BALANCED "1 2 4 8" 0
bench/run_gpu_env_sweep.sh $c FULCRUM_SKINNY_L2_NEXT "1 2 4 8" 0 default
