#!/usr/bin/env bash
# Packs what a build on the GPU machine needs and cannot install there (it has no registry): static PCRE2 and
# utf8proc with their headers and pkg-config files, static http-parser, and cpp-httplib (Debian builds it as a shared library, with
# its OpenSSL / zlib / brotli headers; the GPU machine's own libssl.so.3 and libz.so.1 serve it at run time,
# brotli's libraries travel along), from this machine's Debian packages, into .devdeps/ (ignored by git; carry
# it). scripts/cuda_tests.sh and scripts/gpu_machine_run.sh put .devdeps/lib/pkgconfig on PKG_CONFIG_PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
out=.devdeps
rm -rf "$out"
mkdir -p "$out/include" "$out/lib/pkgconfig"
lib=/usr/lib/x86_64-linux-gnu
cp /usr/include/pcre2.h /usr/include/utf8proc.h "$out/include/"
cp "$lib/libpcre2-8.a" "$lib/libutf8proc.a" "$out/lib/"
root='${pcfiledir}/../..'
for pc in libpcre2-8 libutf8proc; do
  # Static only, relocated: the prefix is the folder the .pc file sits in, two levels up.
  sed -e "s|^prefix=.*|prefix=$root|" -e "s|^libdir=.*|libdir=\${prefix}/lib|" -e "s|^includedir=.*|includedir=\${prefix}/include|" \
      -e "s|^exec_prefix=.*|exec_prefix=\${prefix}|" "$lib/pkgconfig/$pc.pc" > "$out/lib/pkgconfig/$pc.pc"
done
# http-parser (the server's HTTP/1.1 parser): its header and static library; CMake finds them in .devdeps.
cp /usr/include/http_parser.h "$out/include/"
cp "$lib/libhttp_parser.a" "$out/lib/"
# cpp-httplib: its header, the headers it includes with Debian's build flags, the library and brotli's.
cp -r /usr/include/httplib.h /usr/include/openssl /usr/include/zlib.h /usr/include/zconf.h /usr/include/brotli "$out/include/"
cp -a "$lib"/x86_64-linux-gnu/openssl/. "$out/include/openssl/" 2>/dev/null || true
cp /usr/include/x86_64-linux-gnu/openssl/*.h "$out/include/openssl/" 2>/dev/null || true
cp -a "$lib"/libcpp-httplib.so* "$lib"/libbrotlidec.so.1* "$lib"/libbrotlienc.so.1* "$lib"/libbrotlicommon.so.1* "$out/lib/"
cat > "$out/lib/pkgconfig/cpp-httplib.pc" <<PC
prefix=$root
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: cpp-httplib
Description: cpp-httplib $(pkg-config --modversion cpp-httplib) as Debian builds it (carried to the GPU machine)
Version: $(pkg-config --modversion cpp-httplib)
Libs: -L\${libdir} -lcpp-httplib -Wl,-rpath,\${libdir} -Wl,-rpath-link,\${libdir} -pthread
Cflags: -I\${includedir} -DCPPHTTPLIB_OPENSSL_SUPPORT -DCPPHTTPLIB_ZLIB_SUPPORT -DCPPHTTPLIB_BROTLI_SUPPORT
PC
du -sh "$out"
# What the CUDA tests read from ../shared (the golden fixtures, the load matrices and real configs), as
# .devshared/: scripts/gpu_machine_run.sh links ../shared to it there.
if [ -d ../shared ]; then
  rm -rf .devshared
  mkdir -p .devshared/golden .devshared/data
  cp -r ../shared/golden/hf .devshared/golden/  # the FP8 fixture too: the GPU engine loads it dequantized
  cp -r ../shared/data/loads ../shared/data/configs .devshared/data/
  du -sh .devshared
fi
