#!/usr/bin/env bash
# Nsight Compute on the cluster layer, on the GPU machine from the repository root, with the
# prebuilt `loraplex` in .device/bin (see scripts/device_prebuilt_tests.sh): one launch of
# cluster_lora_kernel in `loraplex bench kernels --only $SPEC` (default 8 adapters, 16 tokens,
# one slice) with the cluster path forced; writes the report, its details page and the SASS
# with per-instruction counts and stall samples (sass.csv) to $OUT.
set -uo pipefail
: "${OUT:=/tmp/loraplex_out}"
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.device/bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
B=.device/bin/loraplex
timeout 200 ncu --set full --import-source no -k regex:cluster_lora -s 5 -c 1 -o $OUT/cl $B bench kernels --iters 5 --no-path-comparison --no-metadata --only ${SPEC:-linear:16:8:16:1} --tune decode_cluster=2 > $OUT/ncu.log 2>&1; echo ncu $?
ncu --import $OUT/cl.ncu-rep --page details > $OUT/ncu_details.txt 2>&1
ncu --import $OUT/cl.ncu-rep --page source --csv --print-source sass > $OUT/sass.csv 2>&1
grep -E "Duration|Elapsed Cycles|SM Active|Executed Instructions  " $OUT/ncu_details.txt
