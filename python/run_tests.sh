#!/usr/bin/env bash
# Installs the fulcrum_eplb module with `pip install .` into a virtual environment (build-python/venv) and runs
# its tests (python/tests). FULCRUM_BIN names the `fulcrum` binary the CLI-equality tests compare against
# (scripts/test.sh passes build/bin/fulcrum); without it they look in build/ and build-cpu/, else skip and say so.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v python3 >/dev/null; then
  echo "python tests SKIPPED: python3 not found (fulcrum_eplb is neither built nor tested)"
  exit 0
fi
venv=build-python/venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check . numpy pytest
"$venv/bin/python" -m pytest -q -rs python/tests "$@"
