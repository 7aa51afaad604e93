set -u
C=7015526
build-cuda/bin/fulcrum_cuda_tests --gtest_filter='GroupedGemm*' > $OUT/tests.txt 2>&1; echo "tests rc=$?"; grep -E "FAILED|PASSED" $OUT/tests.txt | head
mkdir -p $OUT/sw; OUT=$OUT/sw bench/run_gpu_env_sweep.sh $C FULCRUM_BF16_SMALL_GEMM_CONFIGS "128 256 512" default 3,3 4,4 5,5 4,5 5,4 0,0 default
L=../shared/data/loads/qwen3-30b-a3b_prefill_gsm8k_en.csv
timeout 200 build-cuda/bin/fulcrum bench moe --loads $L --tokens 256 1024 --json $OUT/moe_swap_default.json --git-commit $C 2>&1 | tail -30
FULCRUM_BF16_SMALL_GEMM_CONFIGS=0,0 timeout 150 build-cuda/bin/fulcrum bench moe --loads $L --tokens 256 1024 --torch-peer off --json $OUT/moe_swap_old.json --git-commit $C 2>&1 | tail -30
