set -u
echo "## skinny tests"
timeout 120 build-cuda/bin/fulcrum_cuda_tests --gtest_filter='SkinnyGemmTest.*' > $OUT/skinny_tests.txt 2>&1; echo rc=$?
grep -E "OK \]|FAILED|PASSED|Failure|differ" $OUT/skinny_tests.txt | head -20
sed -n '/PrintsTimings/,$p' $OUT/skinny_tests.txt | grep -E "^(shape|qkv|o_proj|router|lm_head|1536)" 
bench/run_gpu_env_sweep.sh $C FULCRUM_SKINNY_BULK "1 4 16 64" default 0
mv $OUT/sweep_FULCRUM_SKINNY_BULK_default.json $OUT/sweep_bulk_default_1st.json
bench/run_gpu_env_sweep.sh $C FULCRUM_SKINNY_BULK "1 4 16 64" default
echo "## engine tests"
timeout 150 build-cuda/bin/fulcrum_cuda_tests --gtest_filter='*Golden*:GpuEngine*:CudaGenerate*:MoeSkinnyPath*:GpuPromptLogprobs*:-*Timings*' > $OUT/engine_tests.txt 2>&1; echo rc=$?
grep -E "FAILED|PASSED|tests ran" $OUT/engine_tests.txt | tail -8
