#!/usr/bin/env bash
# On the GPU machine (the device tool), with the ignored folders carried: third_party/kernel_headers.tar.xz
# (scripts/fetch_kernel_headers.sh), .devdeps (scripts/pack_gpu_deps.sh) and .devshared (a copy of what the
# tests read from ../shared). Unpacks them, builds build-cuda/ (16 cores; BUILD_TARGETS, default fulcrum and
# fulcrum_cuda_tests) and runs "$@" there; logs in $OUT, and
# at the end everything under $OUT also as $OUT/0_outputs.tgz; exits with the status of "$@".
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -d third_party/flashinfer ] || tar -C third_party -xJf third_party/kernel_headers.tar.xz
[ -e ../shared ] || ln -s "$PWD/.devshared" ../shared
export PKG_CONFIG_PATH="$PWD/.devdeps/lib/pkgconfig"
server=ON
pkg-config --exists cpp-httplib || server=OFF
start=$(date +%s)
cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DFULCRUM_ENABLE_CUDA=ON -DFULCRUM_BUILD_SERVER=$server \
  -DFULCRUM_BUILD_BENCH=OFF > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
# shellcheck disable=SC2086
cmake --build build-cuda -j "$(nproc)" --target ${BUILD_TARGETS:-fulcrum fulcrum_cuda_tests} > "$OUT/build.log" 2>&1 ||
  { grep -E "error|Error" -A3 "$OUT/build.log" | head -80; exit 1; }
echo "# built in $(( $(date +%s) - start )) s (server $server)"
rc=0
"$@" || rc=$?
# The device tool brings back only the first few files under $OUT (eight, by name, in the 2026-12-02 session, which
# lost three JSONs that way): everything also as one archive whose name sorts first.
tar -C "$OUT" -czf /tmp/0_outputs.tgz --exclude=0_outputs.tgz . && mv /tmp/0_outputs.tgz "$OUT/0_outputs.tgz" ||
  echo "# could not archive $OUT" >&2
exit "$rc"
