set -u
echo "## skinny + moe skinny tests"
timeout 120 build-cuda/bin/fulcrum_cuda_tests --gtest_filter='SkinnyGemmTest.*:MoeSkinnyPath*:ExpertSkinny*:-*Timings*' > $OUT/skinny_tests.txt 2>&1; echo rc=$?
grep -E "FAILED|Failure|differ|PASSED" $OUT/skinny_tests.txt | head -12
for v in default down gate_up; do mkdir -p $OUT/$v; OUT=$OUT/$v bench/run_gpu_env_sweep.sh $C FULCRUM_EXPERT_SKINNY_BULK "1 2 4" $v; done
mkdir -p $OUT/default2; OUT=$OUT/default2 bench/run_gpu_env_sweep.sh $C FULCRUM_EXPERT_SKINNY_BULK "1 2 4" default
