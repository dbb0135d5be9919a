#!/usr/bin/env bash
# Builds the `loraplex` command and runs the main job on this machine: the GPU when one is
# present, else the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
bash scripts/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$jobs" --target loraplex
./build/tools/loraplex selftest --tokens 77 --loras 8 --rank 16 --hidden 512
