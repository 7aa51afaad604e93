#!/usr/bin/env bash
# Packs what a build on the GPU machine needs and cannot install there (it has no registry): static PCRE2 and
# utf8proc with their headers and pkg-config files, from this machine's Debian packages, into .devdeps/
# (ignored by git; carry it). scripts/cuda_tests.sh puts .devdeps/lib/pkgconfig first on PKG_CONFIG_PATH.
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
# Link the archives, not a shared library of the same name that the GPU machine may lack.
sed -i 's|-lpcre2-8|${libdir}/libpcre2-8.a|; s|-lutf8proc|${libdir}/libutf8proc.a|' "$out"/lib/pkgconfig/*.pc
du -sh "$out"
