#!/usr/bin/env bash
# On a GPU machine: builds the CUDA targets into build-cuda/ and runs the CUDA tests (fulcrum_cuda_tests: the
# CUDA backend against the CPU reference, paged KV, the GPU MoE layer, NCCL on 2 GPUs when there are 2).
# The server is left out when cpp-httplib is missing; a .devdeps/ folder (static PCRE2 / utf8proc with their
# .pc files) is used when present. NVLink multicast stays off. Logs go to $LOG_DIR (default build-cuda/).
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -d .devdeps ] && export PKG_CONFIG_PATH="$PWD/.devdeps/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
server=ON
pkg-config --exists cpp-httplib || server=OFF
cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DFULCRUM_ENABLE_CUDA=ON \
  -DFULCRUM_BUILD_SERVER="$server" >/dev/null
cmake --build build-cuda -j "$(nproc)" --target fulcrum fulcrum_cuda_tests
log_dir="${LOG_DIR:-build-cuda}"
mkdir -p "$log_dir"
build-cuda/bin/fulcrum_cuda_tests "$@" 2>&1 | tee "$log_dir/cuda_tests.txt"
