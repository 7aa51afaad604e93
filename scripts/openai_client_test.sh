#!/usr/bin/env bash
# The official `openai` Python client against `fulcrum serve` on a tiny model with the golden tokenizer:
# tests/python/openai_client_test.py (logprobs, echo scoring as lm-eval sends it, chat top_logprobs, streaming,
# errors). Installs `openai` into a virtual environment (OPENAI_VENV, default build-cpu/openai-venv; needs PyPI
# the first time). Without python3 it says so and exits 0 (skipped, never silently).
# Usage: scripts/openai_client_test.sh [path/to/fulcrum]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
fulcrum="${1:-$root/build-cpu/bin/fulcrum}"
if ! command -v python3 >/dev/null; then
  echo "openai_client_test: SKIPPED: python3 is not installed" >&2
  exit 0
fi
[[ -x "$fulcrum" ]] || { echo "openai_client_test: no fulcrum binary at $fulcrum" >&2; exit 1; }
venv="${OPENAI_VENV:-$root/build-cpu/openai-venv}"
if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet openai
fi
work="$(mktemp -d)"
server=""
cleanup() {
  if [[ -n "$server" ]]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
tokenizer="$root/../shared/golden/tokenizer/bpe-qwen-style-2k/tokenizer.json"
"$fulcrum" make-model --preset tiny --layers 2 --seed 7 --tokenizer "$tokenizer" --output "$work/tiny" >/dev/null
"$fulcrum" serve --model "$work/tiny" --port 0 --kv-pages 64 --page-size 8 >"$work/serve.log" 2>&1 &
server=$!
port=""
for _ in $(seq 1 600); do
  port="$(grep -oE 'http://[0-9.]+:[0-9]+' "$work/serve.log" | head -1 | sed -E 's/.*://')" || true
  if [[ -n "$port" ]] && curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then break; fi
  kill -0 "$server" 2>/dev/null || { cat "$work/serve.log" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$port" ]] || { echo "openai_client_test: the server did not start" >&2; cat "$work/serve.log" >&2; exit 1; }
"$venv/bin/python" "$root/tests/python/openai_client_test.py" "http://127.0.0.1:$port/v1" tiny
