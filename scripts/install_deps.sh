#!/usr/bin/env bash
# Installs what loraplex needs to build and test on a fresh Debian/Ubuntu machine. Packages
# already present are not touched, so this is quick on a prepared machine.
set -euo pipefail
packages=(cmake ninja-build g++ pkg-config libgtest-dev nlohmann-json3-dev libonig-dev
          clang clang-format libclang-rt-14-dev git libicu-dev libcli11-dev)
# scripts/fetch_flashinfer.sh downloads a wheel with pip.
python3 -m pip --version >/dev/null 2>&1 || packages+=(python3-pip)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# FlashInfer's C++ headers (PyPI wheel) for the CUDA backend's paged attention.
bash "$(dirname "$0")/fetch_flashinfer.sh"
