set -u
C=c46cf34
timeout 240 build-cuda/bin/fulcrum_cuda_tests > $OUT/cuda_tests.txt 2>&1; echo "tests rc=$?"; grep -E "^\[  FAILED|PASSED|tests ran" $OUT/cuda_tests.txt | head -20
build-cuda/bin/fulcrum bench generate --peer bench/peer/hf_decode_peer.py --json $OUT/generate_h200.json --git-commit $C 2>&1 | grep -E "decode|prefill|peer|error" | head -40
GIT_COMMIT=$C bench/peer/serve_bench.sh build-cuda/bin/fulcrum $OUT/serve_h200.json 20 2>&1 | tail -5
