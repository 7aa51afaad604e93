#!/usr/bin/env bash
# Issue 10's GPU benchmarks in one go, on the GPU machine after scripts/gpu_machine_run.sh built build-cuda/:
# bench generate at the full Qwen3-30B-A3B shape (with the HF transformers peer) and at the Qwen3-235B-A22B layer
# shape (20 layers: what fits with room for KV), bench serve against serve --device cuda, and HF transformers as a
# second oracle on a synthetic bf16 checkpoint. Results land in $OUT (copy them to bench/results/).
# Usage: bench/run_gpu_benchmarks.sh GIT_COMMIT
set -uo pipefail
commit=${1:-unknown}
out=${OUT:-/tmp/out}
bin=build-cuda/bin/fulcrum
$bin bench generate --peer bench/peer/hf_decode_peer.py --json "$out/generate_h200.json" --git-commit "$commit" \
  > "$out/generate.txt" 2>&1; grep -v "peer|" "$out/generate.txt"
$bin bench generate --preset qwen3-235b-a22b --layers 20 --batch 1 16 64 --context 512 2048 --prefill 1x2048 8x2048 \
  --json "$out/generate_235b_h200.json" --git-commit "$commit" 2>&1 | tail -12
GIT_COMMIT=$commit bench/peer/serve_bench.sh $bin "$out/serve_h200.json" 20 2>&1 | grep -E "requests|throughput|TTFT|ITL|latency"
# HF transformers as a second oracle: a 2-layer, 32-expert slice of the Qwen3-30B-A3B shape in bf16.
dir=$(mktemp -d)
$bin make-model --preset qwen3-30b-a3b --layers 2 --experts 32 --dtype bf16 --output "$dir/model" > /dev/null
p1=$(python3 -c "import random; random.seed(1); print(' '.join(str(random.randrange(151936)) for _ in range(40)))")
p2=$(python3 -c "import random; random.seed(2); print(' '.join(str(random.randrange(151936)) for _ in range(7)))")
$bin generate --model "$dir/model" --device cuda --prompt-tokens "$p1" --prompt-tokens "$p2" --max-new-tokens 1 \
  --dump-logits "$dir/logits.safetensors" | tail -2
python3 bench/peer/hf_logits_check.py --model "$dir/model" --logits "$dir/logits.safetensors" --prompt "$p1" --prompt "$p2" \
  2>/dev/null | tail -1 | tee "$out/hf_oracle_h200.json"
