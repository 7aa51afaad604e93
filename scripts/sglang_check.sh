#!/usr/bin/env bash
# Issue 13's manual interop check: SGLang's own frontend (RuntimeEndpoint + the gsm8k few-shot program of its
# benchmark) against `fulcrum serve` on a tiny model. sglang imports torch, so this runs where torch is (the GPU
# machine, which has no registry): carry .devdeps/sglang (the sglang 0.5.23 wheel's Python sources as
# sglang_py.tar.xz, its .so extensions dropped: the frontend does not load them; orjson, psutil and pybase64 wheels),
# made here by `pip download`), or anywhere with SGLANG_PYTHON naming an interpreter that imports sglang (a venv
# with `pip install --no-deps sglang==0.5.23`, torch, and the modules its import asks for). Usage:
# scripts/sglang_check.sh FULCRUM_BIN [DEVICE] (DEVICE cpu or cuda); logs and the JSON result in $OUT.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
fulcrum="$1"
device="${2:-cpu}"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
site="$(mktemp -d)"
work="$(mktemp -d)"
server=""
cleanup() {
  if [[ -n "$server" ]]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  rm -rf "$site" "$work"
}
trap cleanup EXIT
python="${SGLANG_PYTHON:-}"
if [[ -z "$python" ]]; then
  python=python3
  python3 -m pip install --quiet --no-deps --no-index --target "$site" "$root"/.devdeps/sglang/*.whl
  tar -C "$site" -xJf "$root/.devdeps/sglang/sglang_py.tar.xz"
fi
tokenizer="$root/../shared/golden/tokenizer/bpe-qwen-style-2k/tokenizer.json"
"$fulcrum" make-model --preset tiny --layers 2 --seed 7 --tokenizer "$tokenizer" --output "$work/tiny" >/dev/null
"$fulcrum" serve --model "$work/tiny" --device "$device" --port 0 --kv-pages 256 --page-size 16 >"$OUT/sglang_serve.log" 2>&1 &
server=$!
port=""
for _ in $(seq 1 600); do
  port="$(grep -oE 'http://[0-9.]+:[0-9]+' "$OUT/sglang_serve.log" | head -1 | sed -E 's/.*://')" || true
  if [[ -n "$port" ]] && curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then break; fi
  kill -0 "$server" 2>/dev/null || { tail -5 "$OUT/sglang_serve.log" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$port" ]] || { echo "sglang_check: the server did not start" >&2; exit 1; }
PYTHONPATH="$site" "$python" "$root/bench/peer/sglang_frontend_check.py" "http://127.0.0.1:$port" --json "$OUT/sglang_frontend_check.json"
