#!/usr/bin/env bash
# Fetches xgrammar's C++ core (structured output: JSON schema, regex, choice and EBNF grammars
# compiled to token masks) into .cache/xgrammar (git-ignored), from the pinned PyPI sdist:
#   cpp/            the library's sources (cpp/nanobind, the Python bindings, left out)
#   include/        its public headers
#   3rdparty/       picojson and dlpack, the headers it includes
#   LICENSE, NOTICE, VERSION
# CMake builds it as a static library of its own (src/loraplex/engine/CMakeLists.txt).
#
# Usage: scripts/fetch_xgrammar.sh [DEST]   (default .cache/xgrammar; skips when DEST already
#        holds this version). LORAPLEX_XGRAMMAR_SDIST=path uses a local sdist.
set -euo pipefail
version=0.1.27
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/.cache/xgrammar}

if [[ -f "$dest/VERSION" && "$(cat "$dest/VERSION")" == "$version" ]]; then
  echo "xgrammar $version sources present in $dest"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sdist=${LORAPLEX_XGRAMMAR_SDIST:-}
if [[ -z "$sdist" ]]; then
  echo "downloading the xgrammar==$version sdist from PyPI"
  python3 -m pip download --quiet --no-deps --no-binary=:all: --dest "$work" \
    "xgrammar==$version"
  sdist=$(ls "$work"/xgrammar-"$version".tar.gz)
fi
tar -xzf "$sdist" -C "$work"
src="$work/xgrammar-$version"
rm -rf "$dest"
mkdir -p "$dest/3rdparty/dlpack"
cp -r "$src/cpp" "$src/include" "$dest/"
rm -rf "$dest/cpp/nanobind"
cp -r "$src/3rdparty/picojson" "$dest/3rdparty/"
cp -r "$src/3rdparty/dlpack/include" "$dest/3rdparty/dlpack/"
cp "$src/LICENSE" "$src/NOTICE" "$dest/"
echo "$version" > "$dest/VERSION"
echo "xgrammar $version sources in $dest"
