#!/usr/bin/env bash
# The lead's full GPU check, run on the GPU machine from the repository root: builds every
# target (with the dependencies packed by scripts/pack_device_deps.sh into .device/deps),
# runs the whole CTest suite, `loraplex generate` on the tiny fixture in float32 and
# bfloat16 against PEFT's tokens, and optionally the kernel benchmark (BENCH=1) and the
# load-while-serving benchmark (ADAPTER_BENCH=1).
# Results go to a scratch folder, archived at the end into $OUT/full_run.tgz (ctest.log,
# build.log, generate_*.jsonl, bench.json, ...); ctest.log and bench.json are also copied to
# $OUT (the device tool returns a few files).
set -uo pipefail
final=${OUT:-/tmp/loraplex_out}
out=$(mktemp -d)
mkdir -p "$final"
trap 'tar -C "$out" -czf "$final/full_run.tgz" . && cp "$out"/ctest.log "$out"/bench.json "$final/" 2>/dev/null; true' EXIT
deps=${LORAPLEX_DEPS:-$PWD/.device/deps}
export LD_LIBRARY_PATH="$deps/lib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
start=$(date +%s)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$deps" \
  -DLORAPLEX_GTEST_SOURCE_DIR="$deps/src/googletest" >"$out/build.log" 2>&1 &&
  ninja -C build -j16 >>"$out/build.log" 2>&1
status=$?
echo "build status $status in $(( $(date +%s) - start )) s"
if [[ $status -ne 0 ]]; then grep -E "error|FAILED" "$out/build.log" | head -30; exit 1; fi

start=$(date +%s)
ctest --test-dir build -j8 --output-on-failure --timeout 600 ${CTEST_ARGS:-} >"$out/ctest.log" 2>&1
echo "ctest status $? in $(( $(date +%s) - start )) s"
grep -E "tests passed|tests failed|\(Failed\)|Not Run|Timeout" "$out/ctest.log" | head -40
echo "skipped: $(grep -c '\*\*\*Skipped' "$out/ctest.log")"
grep '\*\*\*Skipped' "$out/ctest.log" | sed 's/\.\.\..*//' | head -20

bash scripts/device_generate_check.sh build/tools/loraplex "$out"

if [[ "${ADAPTER_BENCH:-0}" == 1 ]]; then
  for mode in async sync; do
    timeout 300 build/tools/loraplex bench adapter-load --upload $mode \
      --json "$out/adapter_load_$mode.json" --commit "${LORAPLEX_COMMIT:-unknown}" 2>&1 | tail -12
    echo "bench adapter-load ($mode) status $?"
  done
fi

if [[ "${BENCH:-0}" == 1 ]]; then
  timeout 420 build/tools/loraplex bench kernels --json "$out/bench.json" --commit "${LORAPLEX_COMMIT:-unknown}" \
    ${BENCH_ARGS:-} >"$out/bench.log" 2>&1
  echo "bench status $?"
  python3 scripts/bench_table.py "$out/bench.json" | tail -60
fi
