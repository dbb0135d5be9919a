#!/usr/bin/env bash
# The whole GPU procedure in one call: build (or use prebuilt binaries), run the CUDA op tests
# against the CPU reference, run `loraplex bench kernels`, print a short table last.
#
# Usage, from the repository root on the GPU machine:
#   scripts/device_run.sh [OUT_DIR]
# Environment:
#   LORAPLEX_BIN   folder holding prebuilt `loraplex` and `loraplex_cuda_kernel_tests`
#                  (built elsewhere for sm_90a; libcudart.so.13 may sit beside them). When
#                  unset or missing, the project is configured and built in ./build with
#                  the dependencies from scripts/pack_device_deps.sh found in $LORAPLEX_DEPS
#                  (default ../deps).
#   LORAPLEX_COMMIT  recorded in the benchmark JSON.
#   BENCH_ARGS     extra arguments of `loraplex bench kernels` (e.g. --quick).
#   SKIP_TESTS=1 / SKIP_BENCH=1  leave a part out.
#   TEST_TIMEOUT / BENCH_TIMEOUT  seconds per test / for the benchmark (default 120 / 420), so
#                  that a hanging kernel cannot eat the whole lease.
set -uo pipefail
out=${1:-${OUT:-/tmp/loraplex_out}}
mkdir -p "$out"
root=$(pwd)

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true

bin=${LORAPLEX_BIN:-}
if [[ -n "$bin" && -x "$bin/loraplex" && -x "$bin/loraplex_cuda_kernel_tests" ]]; then
  bin=$(cd "$bin" && pwd)
  export LD_LIBRARY_PATH="$bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
  echo "== using prebuilt binaries in $bin"
  tests_cmd=(timeout "$((${TEST_TIMEOUT:-120} * 4))" "$bin/loraplex_cuda_kernel_tests" --gtest_brief=1)
  cli="$bin/loraplex"
else
  deps=${LORAPLEX_DEPS:-$root/../deps}
  echo "== building in ./build (deps: $deps)"
  export LD_LIBRARY_PATH="$deps/lib:${LD_LIBRARY_PATH:-}"
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$deps" \
    -DLORAPLEX_GTEST_SOURCE_DIR="$deps/src/googletest" >"$out/build.log" 2>&1 &&
    ninja -C build -j16 loraplex loraplex_cuda_kernel_tests >>"$out/build.log" 2>&1
  status=$?
  tail -5 "$out/build.log"
  if [[ $status -ne 0 ]]; then
    echo "build failed (see build.log)"
    exit 1
  fi
  tests_cmd=(ctest --test-dir build -R '^Cuda' --output-on-failure --timeout "${TEST_TIMEOUT:-120}")
  cli="$root/build/tools/loraplex"
fi

if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  echo "== CUDA op tests (GPU against the CPU reference)"
  "${tests_cmd[@]}" >"$out/tests.log" 2>&1
  test_status=$?
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests passed|FAILED|Failure|error" "$out/tests.log" | head -40
  echo "tests exit status: $test_status"
fi

if [[ "${SKIP_BENCH:-0}" != 1 ]]; then
  echo "== loraplex bench kernels"
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-420}" "$cli" bench kernels --json "$out/bench.json" \
    --commit "${LORAPLEX_COMMIT:-unknown}" ${BENCH_ARGS:-} >"$out/bench.log" 2>&1
  echo "bench exit status: $?"
  tail -3 "$out/bench.log"
  python3 "$root/scripts/bench_table.py" "$out/bench.json" || true
fi
