#!/usr/bin/env bash
# The main job on its embedded default: build, then `fulcrum demo` (no GPU, no downloaded model): a synthetic
# Qwen3-MoE with real-trace routing, EP 4 CPU ranks, live EPLB, tokens checked against a run without EPLB.
# The planning demo on the real load matrix: `build/bin/fulcrum demo --planning`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh >/dev/null
exec build/bin/fulcrum demo "$@"
