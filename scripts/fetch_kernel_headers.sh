#!/usr/bin/env bash
# Fetches the GPU kernel header libraries from pinned PyPI wheels into third_party/ (ignored by git), so the
# CUDA build needs nothing at build time:
#   third_party/flashinfer/  FlashInfer 0.7.2.post1 headers (include/), its bundled CUTLASS 4.5 (cutlass/),
#                            CCCL 3.6 (cccl/) and spdlog (spdlog/)    -- paged attention
#   third_party/cutlass42/   CUTLASS 4.2 (include/, util_include/)   -- grouped expert GEMMs
#   third_party/kernel_headers.tar.xz  both trees packed, for the GPU machine (carry; it has no registry)
# Idempotent: a tree whose stamp matches its wheel's hash is kept. Needs python3 -m pip and unzip.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=third_party
mkdir -p "$dest/wheels"

fetch() {  # name version sha256 -> wheel path on stdout
  local name=$1 version=$2 sha=$3 wheel
  wheel=$(ls "$dest/wheels/${name//-/_}-${version}-"*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$wheel" ] || ! echo "$sha  $wheel" | sha256sum -c --quiet - >/dev/null 2>&1; then
    rm -f "$dest/wheels/${name//-/_}-${version}-"*.whl
    python3 -m pip download --quiet --no-deps --only-binary=:all: "$name==$version" -d "$dest/wheels" >&2
    wheel=$(ls "$dest/wheels/${name//-/_}-${version}-"*.whl | head -n1)
    echo "$sha  $wheel" | sha256sum -c --quiet - >&2 || { echo "fetch_kernel_headers: $wheel: sha256 mismatch" >&2; exit 1; }
  fi
  echo "$wheel"
}

unpack() {  # wheel tree stamp -> unzips the listed members of the wheel into a temp dir, moves them
  local wheel=$1 tree=$2 sha=$3
  [ -f "$dest/$tree/.stamp" ] && [ "$(cat "$dest/$tree/.stamp")" = "$sha" ] && return 0
  rm -rf "$dest/$tree" "$dest/.unpack"
  mkdir -p "$dest/.unpack" "$dest/$tree"
  case $tree in
    flashinfer)
      unzip -q "$wheel" 'flashinfer/data/include/*' 'flashinfer/data/cutlass/include/*' \
        'flashinfer/data/cutlass/tools/util/include/*' 'flashinfer/data/cccl/*' 'flashinfer/data/spdlog/include/*' \
        -d "$dest/.unpack"
      mv "$dest/.unpack/flashinfer/data/include" "$dest/$tree/include"
      mv "$dest/.unpack/flashinfer/data/cutlass" "$dest/$tree/cutlass"
      mv "$dest/.unpack/flashinfer/data/cccl" "$dest/$tree/cccl"
      mv "$dest/.unpack/flashinfer/data/spdlog" "$dest/$tree/spdlog"
      ;;
    cutlass42)
      unzip -q "$wheel" 'cutlass_library/source/include/*' 'cutlass_library/source/tools/util/include/*' -d "$dest/.unpack"
      mv "$dest/.unpack/cutlass_library/source/include" "$dest/$tree/include"
      mv "$dest/.unpack/cutlass_library/source/tools/util/include" "$dest/$tree/util_include"
      ;;
  esac
  rm -rf "$dest/.unpack"
  echo "$sha" > "$dest/$tree/.stamp"
}

fi_sha=bfdc18b9e1e4d8d0730fe4343dc0e284cd0c160086de80f99888bc4867922d49
cl_sha=f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6
unpack "$(fetch flashinfer-python 0.7.2.post1 $fi_sha)" flashinfer $fi_sha
unpack "$(fetch nvidia-cutlass 4.2.0.0 $cl_sha)" cutlass42 $cl_sha
if [ ! -f "$dest/kernel_headers.tar.xz" ] || [ "$dest/flashinfer/.stamp" -nt "$dest/kernel_headers.tar.xz" ] ||
   [ "$dest/cutlass42/.stamp" -nt "$dest/kernel_headers.tar.xz" ]; then
  tar -C "$dest" -cJf "$dest/kernel_headers.tar.xz.tmp" flashinfer cutlass42
  mv "$dest/kernel_headers.tar.xz.tmp" "$dest/kernel_headers.tar.xz"
fi
