#!/usr/bin/env bash
# Builds everything (CUDA targets too when nvcc is found) and runs all CPU tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"
