set -u
echo "## skinny + moe skinny tests"
timeout 150 build-cuda/bin/fulcrum_cuda_tests --gtest_filter='SkinnyGemmTest.*:MoeSkinnyPath*:ExpertSkinny*:-*Timings*' > $OUT/skinny_tests.txt 2>&1; echo rc=$?
grep -E "OK \]|FAILED|Failure|differ|rel err" $OUT/skinny_tests.txt | head -24
mkdir -p $OUT/a $OUT/b $OUT/c
OUT=$OUT/a bench/run_gpu_env_sweep.sh $C FULCRUM_EXPERT_SKINNY_BULK "1 2 4 16 64" default 0
OUT=$OUT/b bench/run_gpu_env_sweep.sh $C FULCRUM_SKINNY_BULK "1 2 4 16 64" 0
OUT=$OUT/c bench/run_gpu_env_sweep.sh $C FULCRUM_EXPERT_SKINNY_BULK "1 2 4 16 64" default
echo "## engine tests"
timeout 200 build-cuda/bin/fulcrum_cuda_tests --gtest_filter='*Golden*:GpuEngine*:CudaGenerate*:GpuPromptLogprobs*:DenseGemm*:Fp8*:GpuEngineFp8*:-*Timings*' > $OUT/engine_tests.txt 2>&1; echo rc=$?
grep -E "FAILED|PASSED|tests ran" $OUT/engine_tests.txt | tail -8
