set -u
echo "## tests"
timeout 150 build-cuda/bin/fulcrum_cuda_tests --gtest_filter='SkinnyGemmTest.*:MoeSkinnyPath*:ExpertSkinny*:*Golden*:GpuEngine*:CudaGenerate*:-*Timings*' > $OUT/cuda_tests.txt 2>&1; echo rc=$?
grep -E "FAILED|PASSED" $OUT/cuda_tests.txt | tail -6
build-cuda/bin/fulcrum bench generate --peer bench/peer/hf_decode_peer.py --json $OUT/generate_h200.json --git-commit $C 2>&1 | grep -E "decode|prefill|peer|error" | head -40
GIT_COMMIT=$C bench/peer/serve_bench.sh build-cuda/bin/fulcrum $OUT/serve_h200.json 20 2>&1 | tail -5
