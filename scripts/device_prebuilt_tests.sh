#!/usr/bin/env bash
# The GPU tests without building on the GPU machine: run from the repository root there, with
# binaries built on a CPU machine (sm_90a is named explicitly, so no GPU is needed to build) and
# carried by the device tool in .device/bin:
#   ninja -C build && mkdir -p .device/bin &&
#   cp build/tools/loraplex build/tests/{kernels_cuda,layers,model,adapters}/*_tests .device/bin/ &&
#   strip .device/bin/* && cp -L /lib/x86_64-linux-gnu/{libonig.so.5,libicuuc.so.72,libicudata.so.72} .device/bin/
# Runs every test binary there with --gtest_brief=1 (one summary line each, the skipped and
# failed tests named), then `loraplex generate` on the tiny fixture in float32 and bfloat16
# against PEFT's tokens. Logs go to $OUT.
set -uo pipefail
: "${OUT:=/tmp/loraplex_out}"
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.device/bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for t in .device/bin/*_tests; do
  timeout 400 $t --gtest_brief=1 > $OUT/$(basename $t).log 2>&1; st=$?
  p=$(grep -oP '\[  PASSED  \] \K[0-9]+' $OUT/$(basename $t).log); f=$(grep -oP '\[  FAILED  \] \K[0-9]+(?= test)' $OUT/$(basename $t).log); s=$(grep -oP '\[  SKIPPED \] \K[0-9]+' $OUT/$(basename $t).log)
  echo "$(basename $t): exit $st passed ${p:-0} failed ${f:-0} skipped ${s:-0}"
  grep -E "^\[  SKIPPED \] [A-Za-z]|^\[  FAILED  \] [A-Za-z]" $OUT/$(basename $t).log | head -20
done
bash scripts/device_generate_check.sh .device/bin/loraplex "$OUT"
