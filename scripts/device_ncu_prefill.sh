#!/usr/bin/env bash
# Nsight Compute on the prefill kernels (4096 tokens), on the GPU machine from the repository
# root with the prebuilt `loraplex` in .device/bin (see scripts/device_prebuilt_tests.sh): one
# launch each of the prefill shrink and the tensor-core expand for the cases in $SPECS, at the
# GPU's own clocks (ncu would otherwise lock the SM at 1.35 GHz and make memory look faster
# relative to the instructions); writes the reports, their details pages, the SASS with stall
# samples and the raw metrics to $OUT and prints the headline metrics.
set -uo pipefail
: "${OUT:=/tmp/loraplex_out}"
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.device/bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
B=.device/bin/loraplex
for spec in ${SPECS:-shrink:16:1:4096:1 shrink:64:1:4096:3 expand:16:1:4096:1}; do
  name=$(echo "$spec" | tr ':' '_')
  timeout 150 ncu --set full --clock-control none --import-source no -k regex:"${KERNELS:-prefill_shrink|expand_tc}" \
    -s 2 -c 1 -o "$OUT/$name" $B bench kernels --iters 3 --no-path-comparison --no-metadata \
    --only "$spec" > "$OUT/$name.log" 2>&1
  echo "ncu $spec rc=$?"
  ncu --import "$OUT/$name.ncu-rep" --page details > "$OUT/$name.txt" 2>&1
  ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name.sass.csv" 2>&1
  ncu --import "$OUT/$name.ncu-rep" --page raw --csv > "$OUT/$name.raw.csv" 2>&1
  grep -E "^  [a-z_]+|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Executed Ipc A|Warp Cycles Per Issued|L2 Hit Rate|Block Limit" "$OUT/$name.txt" | head -30
done
