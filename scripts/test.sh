#!/usr/bin/env bash
# Builds everything (CUDA targets too when nvcc is found) and runs all CPU tests, then the Python module's tests,
# the official openai client against `fulcrum serve` (scripts/openai_client_test.sh), then every fuzz harness
# for a bounded time (scripts/fuzz.sh; FULCRUM_FUZZ=0 skips it, FUZZ_SECONDS sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"
FULCRUM_BIN="$PWD/build/bin/fulcrum" python/run_tests.sh
# The torch peer script's CPU half (no torch needed): bench/peer/test_*.py.
! command -v python3 >/dev/null || python3 -m unittest discover -s bench/peer -p 'test_*.py'
# The official `openai` client against `fulcrum serve` (installs it into build/openai-venv from PyPI).
OPENAI_VENV="$PWD/build/openai-venv" scripts/openai_client_test.sh "$PWD/build/bin/fulcrum"
[ "${FULCRUM_FUZZ:-1}" = 0 ] || scripts/fuzz.sh
