set -u
echo "## skinny tests"
timeout 150 build-cuda/bin/fulcrum_cuda_tests --gtest_filter='SkinnyGemmTest.*' > $OUT/skinny_tests.txt 2>&1; echo rc=$?
grep -E "OK \]|FAILED|Failure|differ" $OUT/skinny_tests.txt | head -20
sed -n '/PrintsTimings/,$p' $OUT/skinny_tests.txt | grep -E "^(shape|qkv|o_proj|router|lm_head|1536)"
mkdir -p $OUT/a $OUT/b $OUT/c
OUT=$OUT/a bench/run_gpu_env_sweep.sh $C FULCRUM_SKINNY_BULK "1 4 16 64" default 0
OUT=$OUT/b bench/run_gpu_env_sweep.sh $C FULCRUM_SKINNY_BULK_STAGES "1 4 16 64" 2
OUT=$OUT/b bench/run_gpu_env_sweep.sh $C FULCRUM_SKINNY_BULK_MAX_TILE "1 4 16 64" 32768
OUT=$OUT/c bench/run_gpu_env_sweep.sh $C FULCRUM_SKINNY_BULK "1 4 16 64" default
echo "## engine tests"
timeout 200 build-cuda/bin/fulcrum_cuda_tests --gtest_filter='*Golden*:GpuEngine*:CudaGenerate*:MoeSkinnyPath*:GpuPromptLogprobs*:DenseGemm*:-*Timings*' > $OUT/engine_tests.txt 2>&1; echo rc=$?
grep -E "FAILED|PASSED|tests ran" $OUT/engine_tests.txt | tail -8
