#!/usr/bin/env bash
# Copies the build dependencies that the GPU machines lack (GoogleTest source, nlohmann_json,
# Oniguruma, ICU) from this machine's Debian packages into DEST, so that the project can be
# configured there with:
#   cmake -S . -B build -G Ninja -DCMAKE_PREFIX_PATH=DEST -DLORAPLEX_GTEST_SOURCE_DIR=DEST/src/googletest
# DEST must be a git-ignored folder of the repository (e.g. .device/deps) named in the device
# tool's `carry` list.
set -euo pipefail
dest=${1:?usage: pack_device_deps.sh DEST}
mkdir -p "$dest/include" "$dest/lib" "$dest/share/cmake" "$dest/src" "$dest/lib/pkgconfig"
cp -r /usr/src/googletest "$dest/src/"
cp -r /usr/include/nlohmann "$dest/include/"
cp -r /usr/include/CLI "$dest/include/"
cp -r /usr/share/cmake/CLI11 "$dest/share/cmake/"
# cpp-httplib (for `loraplex serve`): Debian's is a shared library built with OpenSSL, zlib and
# brotli support, whose header needs those headers. The runtime libraries OpenSSL and zlib are
# on the GPU machines; the .pc file is rewritten without the private requirements (their .pc
# files are not there) and with a prefix relative to itself.
if [ -f /usr/include/httplib.h ]; then
  cp /usr/include/httplib.h /usr/include/zlib.h /usr/include/zconf.h "$dest/include/"
  cp -r /usr/include/openssl /usr/include/brotli "$dest/include/"
  cp -P /usr/lib/x86_64-linux-gnu/libcpp-httplib.so* /usr/lib/x86_64-linux-gnu/libbrotli*.so* \
    "$dest/lib/"
  sed 's|^prefix=.*|prefix=${pcfiledir}/../..|; s|^libdir=.*|libdir=${prefix}/lib|; /^Requires.private/d' \
    /usr/lib/x86_64-linux-gnu/pkgconfig/cpp-httplib.pc >"$dest/lib/pkgconfig/cpp-httplib.pc"
fi
cp -r /usr/share/cmake/nlohmann_json "$dest/share/cmake/"
cp /usr/include/oniguruma.h /usr/include/oniggnu.h /usr/include/onigposix.h "$dest/include/"
cp -P /usr/lib/x86_64-linux-gnu/libonig.so* "$dest/lib/"
# ICU (NFC/NFKC tokenizer normalizers) is optional and 33 MB, more than a device call can
# carry beside the repository: the GPU build goes without it (its NFC tests skip) unless asked.
if [ "${WITH_ICU:-0}" = 1 ]; then
  cp -r /usr/include/unicode "$dest/include/"
  cp -P /usr/lib/x86_64-linux-gnu/libicuuc.so* /usr/lib/x86_64-linux-gnu/libicudata.so* "$dest/lib/"
fi
# The prefix is written relative to the .pc file so the folder can move to another machine.
sed 's|^prefix=.*|prefix=${pcfiledir}/../..|' /usr/lib/x86_64-linux-gnu/pkgconfig/oniguruma.pc \
  >"$dest/lib/pkgconfig/oniguruma.pc"
# nanobind (the Python package's bindings; pure Python and C++ sources, about 1 MB): scripts/
# gpu.sh builds the Python package when it finds it here.
nanobind=$(python3 -c "import nanobind, os; print(os.path.dirname(nanobind.__file__))" \
  2>/dev/null || true)
if [ -n "$nanobind" ]; then
  rm -rf "$dest/nanobind"
  cp -r "$nanobind" "$dest/nanobind"
  rm -rf "$dest/nanobind/__pycache__"
fi
echo "packed into $dest: $(du -sh "$dest" | cut -f1)"
