#!/usr/bin/env bash
# `fulcrum serve --device cuda` on the full Qwen3-30B-A3B shape (random weights: --load-format dummy) under
# `fulcrum bench serve`: 10 concurrent streaming clients, 2048-token prompts, 1024 output tokens (issue 10's
# pattern; vLLM's published H100 figure for it: TPOT 13.18 ms, 740 output tok/s). Usage: serve_bench.sh BIN JSON [REQUESTS]
set -euo pipefail
bin=$1 json=$2 requests=${3:-20}
dir=$(mktemp -d)
python3 - "$dir" <<'PY'
import json, sys
cfg = json.load(open(".devshared/data/configs/qwen3-30b-a3b.config.json"))
json.dump(cfg, open(sys.argv[1] + "/config.json", "w"))
PY
"$bin" serve --model "$dir" --device cuda --load-format dummy --port 0 --kv-pages 4096 --max-running-requests 16 \
  --max-prefill-tokens 2048 > "$dir/serve.log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do grep -q "listening on" "$dir/serve.log" && break; sleep 1; done
url=$(grep -o "http://[0-9.:]*" "$dir/serve.log" | tail -1)
cat "$dir/serve.log"
"$bin" bench serve --url "$url" --clients 10 --requests "$requests" --prompt-len 2048:2048 --max-tokens 1024 --json "$json" \
  --git-commit "${GIT_COMMIT:-unknown}" || true
kill -TERM $pid; wait $pid || true
tail -3 "$dir/serve.log"
