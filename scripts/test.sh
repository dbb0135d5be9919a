#!/usr/bin/env bash
# Builds loraplex (with the CUDA backend when nvcc is present) and runs every test: the
# GoogleTest suites through CTest, the format check, the sanitizer builds and the fuzzer.
# CUDA tests skip themselves on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
total_start=$(date +%s)

stage "install dependencies"
bash scripts/install_deps.sh

stage "clang-format check"
git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror

stage "configure and build (Release)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$jobs"

stage "tests (ctest)"
ctest --test-dir build -j "$jobs" --output-on-failure --timeout 900

if [ -f scripts/ci_sanitizers_and_fuzz.sh ]; then
  stage "sanitizer builds and fuzzing"
  bash scripts/ci_sanitizers_and_fuzz.sh
fi

stage "done"
echo "=== all tests passed in $(( $(date +%s) - total_start )) s"
