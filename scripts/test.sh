#!/usr/bin/env bash
# Builds loraplex (with the CUDA backend when nvcc is present) and runs every test: the
# GoogleTest suites through CTest, the Python package's pytest suite, the format check, the
# sanitizer builds and the fuzzer.
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
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLORAPLEX_PYTHON=ON
cmake --build build -j "$jobs"

stage "tests (ctest)"
ctest --test-dir build -j "$jobs" --output-on-failure --timeout 900

stage "Python package tests (pytest, on the build's loraplex package)"
PYTHONPATH="$PWD/build/python" LORAPLEX_CLI="$PWD/build/tools/loraplex" \
  python3 -m pytest -q -p no:cacheprovider python/tests

if [ -f scripts/ci_sanitizers_and_fuzz.sh ]; then
  stage "sanitizer builds and fuzzing"
  bash scripts/ci_sanitizers_and_fuzz.sh
fi

stage "done"
echo "=== all tests passed in $(( $(date +%s) - total_start )) s"
