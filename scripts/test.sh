#!/usr/bin/env bash
# Builds everything (CUDA targets too when nvcc is found) and runs all CPU tests, then the Python module's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"
FULCRUM_BIN="$PWD/build/bin/fulcrum" python/run_tests.sh
