set -u
build-cuda/bin/fulcrum_cuda_tests --gtest_filter='GroupedGemm*' > $OUT/tests.txt 2>&1; echo "tests rc=$?"; grep -E "swap|FAILED|PASSED" $OUT/tests.txt | head -40
mkdir -p $OUT/sw; OUT=$OUT/sw bench/run_gpu_env_sweep.sh e751e7b FULCRUM_BF16_SMALL_GEMM_CONFIGS "10 16 64 256" default 3,3 4,4 5,5
