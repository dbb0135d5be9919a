#!/usr/bin/env bash
# The issue-3 status run on the GPU machine (meant for an H200, the targets' GPU), from the
# repository root with the prebuilt binaries in .device/bin (see scripts/device_prebuilt_tests.sh):
# every GPU test and `loraplex generate`; two `loraplex bench kernels` runs (the second traced);
# the stream and decode floor probes (bench/probes/, built here with nvcc when it is there), twice.
# Everything goes to $OUT/status.tgz; prints the tests' summary and scripts/bench_table.py's.
#   COMMIT=<sha> bash scripts/device_prebuilt_status.sh
set -uo pipefail
: "${OUT:=/tmp/loraplex_out}"
mkdir -p "$OUT"
w=$(mktemp -d)
trap 'tar -C "$w" -czf "$OUT/status.tgz" .' EXIT
export LD_LIBRARY_PATH=$PWD/.device/bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$w/gpu.txt"
OUT=$w bash scripts/device_prebuilt_tests.sh >"$w/tests.txt" 2>&1
grep -E "_tests:|requests" "$w/tests.txt"
B=.device/bin/loraplex
timeout 280 $B bench kernels --json "$w/bench.json" --commit "${COMMIT:-unknown}" >"$w/bench.log" 2>&1
echo "bench $?"
timeout 280 $B bench kernels --json "$w/bench2.json" --commit "${COMMIT:-unknown}" \
  --no-path-comparison --trace "$w/trace.jsonl" >"$w/bench2.log" 2>&1
echo "bench2 $?"
gzip -f "$w/trace.jsonl"
python3 scripts/bench_table.py "$w/bench.json" >"$w/bench_table.txt" 2>&1; head -40 "$w/bench_table.txt"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
for probe in stream_probe decode_floor_probe; do
  "$nvcc" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o "$w/$probe" \
    "bench/probes/$probe.cu" >"$w/${probe}_build.log" 2>&1 || { echo "$probe: no build"; continue; }
  for run in 1 2; do timeout 120 "$w/$probe" >"$w/${probe}_$run.txt" 2>&1; done
  echo "$probe:"; cat "$w/${probe}_1.txt"
done
