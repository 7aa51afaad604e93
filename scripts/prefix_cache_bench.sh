#!/usr/bin/env bash
# The issue-16 measurement on the CPU engine: a gsm8k-like pattern (one shared prefix + short questions,
# many concurrent clients) through `fulcrum bench serve --shared-prefix`, against a server with the prefix
# cache and one with --disable-radix-cache, one after the other on the same model. Writes one JSON with both
# runs, the commands, the machine and the commit.
#   scripts/prefix_cache_bench.sh OUT.json [MODEL_DIR]   (env: BIN, CLIENTS, REQUESTS, PREFIX, QUESTION,
#                                                         MAX_TOKENS, PAGE_SIZE, KV_PAGES, GIT_COMMIT,
#                                                         SERVE_EXTRA: more serve flags, e.g. "--device cuda
#                                                         --load-format dummy", ENGINE: its label in the JSON)
# Without MODEL_DIR it makes the tiny synthetic model (max_position_embeddings raised to 2048: RoPE only).
set -euo pipefail
out=${1:?usage: scripts/prefix_cache_bench.sh OUT.json [MODEL_DIR]}
bin=${BIN:-build/bin/fulcrum}
clients=${CLIENTS:-64} requests=${REQUESTS:-256} prefix=${PREFIX:-1000} question=${QUESTION:-50}
max_tokens=${MAX_TOKENS:-16} page_size=${PAGE_SIZE:-16} kv_pages=${KV_PAGES:-4400}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
model=${2:-}
if [[ -z "$model" ]]; then
  model=$work/tiny
  "$bin" make-model --preset tiny --output "$model" --seed 7 >/dev/null
  sed -i 's/"max_position_embeddings": 512/"max_position_embeddings": 2048/' "$model/config.json"
fi
commit=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
engine=${ENGINE:-cpu}
read -r -a extra <<<"${SERVE_EXTRA:-}"
serve_flags=(--model "$model" --port 0 --kv-pages "$kv_pages" --page-size "$page_size" --max-running-requests "$clients"
             "${extra[@]}")

run_one() {  # NAME EXTRA_SERVE_FLAGS...
  local name=$1
  shift
  "$bin" serve "${serve_flags[@]}" "$@" >"$work/$name.log" 2>&1 &
  local pid=$!
  local port=""
  for _ in $(seq 300); do
    port=$(grep -oP 'listening on http://127\.0\.0\.1:\K[0-9]+' "$work/$name.log" || true)
    [[ -n "$port" ]] && break
    sleep 0.1
  done
  [[ -n "$port" ]] || { cat "$work/$name.log" >&2; kill "$pid"; exit 1; }
  "$bin" bench serve --url "http://127.0.0.1:$port" --clients "$clients" --requests "$requests" \
    --shared-prefix "$prefix" --prompt-len "$question:$question" --max-tokens "$max_tokens" \
    --json "$work/$name.json" --git-commit "$commit" | tee "$work/$name.txt" >&2
  kill -TERM "$pid"
  wait "$pid"
  python3 - "$work/$name.json" "$work/$name.full.json" "$bin serve ${serve_flags[*]} $*" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
doc["serve_command"] = sys.argv[3]
json.dump(doc, open(sys.argv[2], "w"), indent=2)
PY
}

run_one with_cache
run_one without_cache --disable-radix-cache
python3 - "$work/with_cache.full.json" "$work/without_cache.full.json" "$out" "$commit" "$engine" "$prefix" \
  "scripts/prefix_cache_bench.sh $*" <<'PY'
import datetime, json, os, platform, sys
on, off = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
prefix = int(sys.argv[6])
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
doc = {"script": sys.argv[7], "git_commit": sys.argv[4], "engine": sys.argv[5],
       "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
       "machine": f"{platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} cores, {cpu}",
       "with_cache": on, "without_cache": off, "ttft_p50_ratio": off["ttft_s"]["p50"] / on["ttft_s"]["p50"],
       "prompt_tokens_computed_with_cache": on["server_prompt_tokens"] - on["server_prefix_cache_hit_tokens"],
       "unshared_prompt_tokens": on["server_prompt_tokens"] - (on["succeeded"] - 1) * prefix}
json.dump(doc, open(sys.argv[3], "w"), indent=2)
PY
echo "wrote $out" >&2
