#!/usr/bin/env bash
# The main job on its embedded default: build, then `fulcrum demo` (no GPU, no downloaded model).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh >/dev/null
exec build/bin/fulcrum demo "$@"
