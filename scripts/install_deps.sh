#!/usr/bin/env bash
# Installs the Debian packages Fulcrum builds with, if any is missing. Idempotent; quiet when all present.
set -euo pipefail
packages=(cmake ninja-build g++ nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev libbenchmark-dev libpcre2-dev libutf8proc-dev libcpp-httplib-dev libhttp-parser-dev python3-dev pkg-config unzip xz-utils curl)
# Callers add what only they need (scripts/fuzz.sh: clang and its libFuzzer runtime).
read -r -a extra <<<"${FULCRUM_EXTRA_PACKAGES:-}"
packages+=("${extra[@]}")
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# pip downloads the pinned kernel-header wheels (scripts/fetch_kernel_headers.sh) on machines with nvcc.
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
# venv: the Python module's tests (python/run_tests.sh) install it into build-python/venv.
python3 -c "import ensurepip, venv" >/dev/null 2>&1 || missing+=(python3-venv)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing missing packages: ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "error: need root or sudo to install ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
