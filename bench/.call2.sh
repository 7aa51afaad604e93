set -u
build-cuda/bin/fulcrum_cuda_tests --gtest_filter='GroupedGemm*' > $OUT/tests.txt 2>&1; echo "tests rc=$?"; grep -E "FAILED|PASSED" $OUT/tests.txt | head -20
mkdir -p $OUT/sw; OUT=$OUT/sw bench/run_gpu_env_sweep.sh 29b7709 FULCRUM_BF16_SMALL_GEMM_CONFIGS "10 16 32 64 128 256" default 3,3 4,4 5,5 6,6 3,4 4,3 6,3 3,6 default
