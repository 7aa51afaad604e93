#!/usr/bin/env bash
# Configures and builds Fulcrum into build/ (CUDA targets too when nvcc is found).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
cuda_args=()
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  cuda_args+=("-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc")
fi
# The GPU kernels' header libraries (pinned PyPI wheels, unpacked into third_party/) when CUDA is built.
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  scripts/fetch_kernel_headers.sh
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${cuda_args[@]}" >/dev/null
cmake --build build -j "$(nproc)"
