#!/usr/bin/env bash
# Knob sweeps with prebuilt binaries (as scripts/device_prebuilt_tests.sh: built on the CPU
# machine, carried in .device/bin), from the repository root on the GPU machine. Runs the CUDA
# kernel tests first unless TESTS=0, then one `loraplex bench kernels --tune` per entry of
# SWEEPS ("ONLY@TUNE ONLY@TUNE ...", ONLY as --only, TUNE as --tune or "-" for the defaults),
# each three ways as the bench always times. Everything lands in $OUT/sweep_all.tgz and a
# table in $OUT/sweep_table.txt (scripts/sweep_table.py).
set -uo pipefail
final=${OUT:-/tmp/loraplex_out}
out=$(mktemp -d)
mkdir -p "$final"
export LD_LIBRARY_PATH=$PWD/.device/bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
bin=.device/bin
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
if [[ "${TESTS:-1}" == 1 ]]; then
  start=$(date +%s)
  timeout 400 $bin/loraplex_cuda_kernel_tests --gtest_brief=1 >"$out/cuda_kernel_tests.log" 2>&1
  echo "cuda kernel tests: exit $? in $(($(date +%s) - start)) s"
  grep -E "PASSED|FAILED|SKIPPED" "$out/cuda_kernel_tests.log" | head -20
fi
for entry in ${SWEEPS:?SWEEPS is empty}; do
  only=${entry%@*}
  spec=${entry#*@}
  name=$(echo "${only}_$spec" | tr ':*=,' '_x__')
  tune=()
  [[ "$spec" != "-" ]] && tune=(--tune "$spec")
  start=$(date +%s)
  timeout 300 $bin/loraplex bench kernels --iters "${ITERS:-30}" --no-path-comparison \
    --no-metadata --only "$only" "${tune[@]}" --json "$out/sweep_$name.json" \
    --commit "${LORAPLEX_COMMIT:-unknown}" >"$out/sweep_$name.log" 2>&1
  echo "sweep $name: status $? in $(($(date +%s) - start)) s"
done
python3 scripts/sweep_table.py "$out"/sweep_*.json >"$out/sweep_table.txt"
cat "$out/sweep_table.txt"
tar -C "$out" -czf "$final/sweep_all.tgz" . && echo "archived"
cp "$out/sweep_table.txt" "$final/" 2>/dev/null || true
