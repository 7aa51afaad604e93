set -u
B="1 4 16 64"
OUT0=$OUT
mkdir -p $OUT/even $OUT/tw $OUT/tw_even
OUT=$OUT0/even bench/run_gpu_env_sweep.sh $C FULCRUM_SKINNY_EVEN_GRID "$B" default 1 default
OUT=$OUT0/tw bench/run_gpu_env_sweep.sh $C FULCRUM_SKINNY_TARGET_WARPS "$B" 8192 16384
FULCRUM_SKINNY_EVEN_GRID=1 OUT=$OUT0/tw_even bench/run_gpu_env_sweep.sh $C FULCRUM_SKINNY_TARGET_WARPS "$B" 8192
echo "## tests (default settings)"
timeout 150 build-cuda/bin/fulcrum_cuda_tests --gtest_filter='*Skinny*:*Attention*:*Golden*:*GpuEngine*:-*Timings*' > $OUT0/tests_default.txt 2>&1; echo rc=$?
grep -E "PASSED|FAILED|tests ran" $OUT0/tests_default.txt | tail -8
echo "## tests (even grid, 8192 warps)"
FULCRUM_SKINNY_EVEN_GRID=1 FULCRUM_SKINNY_TARGET_WARPS=8192 timeout 100 build-cuda/bin/fulcrum_cuda_tests --gtest_filter='*Skinny*:*Golden*:*GpuEngine*:-*Timings*' > $OUT0/tests_even.txt 2>&1; echo rc=$?
grep -E "PASSED|FAILED|tests ran" $OUT0/tests_even.txt | tail -8
