#!/usr/bin/env bash
# Launch-shape sweep on the GPU machine, from the repository root: builds (deps packed by
# scripts/pack_device_deps.sh into .device/deps), runs the CUDA kernel tests, then
# `loraplex bench kernels --tune ...` for each decode and prefill setting below, one JSON per
# setting in $OUT (sweep_<name>.json), and a summary table (scripts/sweep_table.py).
set -uo pipefail
# Work in a scratch folder; $OUT receives the archive, the table and the test log only (the
# device tool returns a few files).
final=${OUT:-/tmp/loraplex_out}
out=$(mktemp -d)
mkdir -p "$final"
deps=${LORAPLEX_DEPS:-$PWD/.device/deps}
export LD_LIBRARY_PATH="$deps/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
start=$(date +%s)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$deps" \
  -DLORAPLEX_GTEST_SOURCE_DIR="$deps/src/googletest" >"$out/build.log" 2>&1 &&
  ninja -C build -j16 >>"$out/build.log" 2>&1
status=$?
echo "build status $status in $(( $(date +%s) - start )) s"
if [[ $status -ne 0 ]]; then grep -E "error|FAILED" "$out/build.log" | head -30; cp "$out/build.log" "$final/"; exit 1; fi

if [[ "${TESTS:-1}" == 1 ]]; then
  start=$(date +%s)
  ctest --test-dir build -j8 --output-on-failure --timeout 300 -R "${TEST_REGEX:-Cuda|KernelTuning}" \
    >"$out/ctest.log" 2>&1
  echo "ctest status $? in $(( $(date +%s) - start )) s"
  grep -E "tests passed|tests failed|\(Failed\)|Timeout" "$out/ctest.log" | head -20
  echo "skipped: $(grep -c '\*\*\*Skipped' "$out/ctest.log")"
fi

bench() {  # name, --only filter, --tune spec
  timeout 240 build/tools/loraplex bench kernels --iters 30 --no-path-comparison --no-metadata \
    --only "$2" --tune "$3" --json "$out/sweep_$1.json" --commit "${LORAPLEX_COMMIT:-unknown}" \
    >"$out/sweep_$1.log" 2>&1
  echo "sweep $1 ($2, $3): status $?"
}
# SWEEPS: entries ONLY@TUNE separated by spaces (default: the decode and prefill sets below).
default_sweeps=""
for spec in decode_k_chunks=16 decode_k_chunks=8 decode_k_chunks=4 decode_cols=256 \
  decode_k_chunks=8,decode_cols=256 decode_k_chunks=4,decode_cols=256; do
  for tok in 16 64; do default_sweeps+=" linear:16:*:$tok:*@$spec"; done
done
for spec in prefill_k_split=4 prefill_ctas_per_sm=4 prefill_k_split=8,prefill_ctas_per_sm=4 \
  prefill_k_split=2 prefill_k_split=1; do
  default_sweeps+=" shrink:*:*:4096:*@$spec"
done
default_sweeps+=" expand:*:*:4096:*@prefill_k_split=4"
for entry in ${SWEEPS:-$default_sweeps}; do
  only=${entry%@*}
  spec=${entry#*@}
  name=$(echo "${only}_$spec" | tr ':*=,' '_x__')
  bench "$name" "$only" "$spec"
done
python3 scripts/sweep_table.py "$out"/sweep_*.json >"$out/sweep_table.txt"
cat "$out/sweep_table.txt"
tar -C "$out" -czf "$final/sweep_all.tgz" . && echo "archived"
cp "$out/sweep_table.txt" "$out/ctest.log" "$final/" 2>/dev/null || true
