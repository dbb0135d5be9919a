#!/usr/bin/env bash
# The one script for GPU work, run on the GPU machine from the repository root:
#
#   scripts/gpu.sh build          configure and build everything in ./build (dependencies packed
#                                 by scripts/pack_device_deps.sh into .device/deps)
#   scripts/gpu.sh test [REGEX]   the whole CTest suite (or the tests matching REGEX) with
#                                 LORAPLEX_REQUIRE_GPU=1: a missing or broken GPU fails the CUDA
#                                 tests instead of skipping them
#   scripts/gpu.sh e2e [ARGS]     `loraplex bench e2e` (JSON into $OUT/e2e*.json)
#   scripts/gpu.sh kernels [ARGS] `loraplex bench kernels` (JSON into $OUT/kernels.json)
#   scripts/gpu.sh serve [ARGS]   `loraplex bench serve` (JSON into $OUT/serve*.json)
#   scripts/gpu.sh hf [ARGS]      the HF transformers + PEFT anchor (bench/anchors/e2e, copied
#                                 there from ../shared/anchors before the call) on a checkpoint
#                                 written by its make_model.py into /tmp/e2e_model
#
# Several verbs run in order: `scripts/gpu.sh build test e2e`. Logs and JSON go to $OUT (the
# device tool brings it back); each verb prints a short summary last.
set -uo pipefail
out=${OUT:-/tmp/loraplex_out}
mkdir -p "$out"
deps=${LORAPLEX_DEPS:-$PWD/.device/deps}
export LD_LIBRARY_PATH="$deps/lib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LORAPLEX_COMMIT=${LORAPLEX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
bin=$PWD/build/tools/loraplex

verb_build() {
  local start=$SECONDS
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$deps" \
    -DLORAPLEX_GTEST_SOURCE_DIR="$deps/src/googletest" >"$out/build.log" 2>&1 &&
    ninja -C build -j"$(nproc)" >>"$out/build.log" 2>&1
  local status=$?
  echo "build status $status in $((SECONDS - start)) s"
  if [[ $status -ne 0 ]]; then
    grep -E "error|FAILED" "$out/build.log" | head -30
    exit 1
  fi
}

verb_test() {
  local start=$SECONDS
  local filter=()
  if [[ $# -gt 0 && "$1" != -* ]]; then filter=(-R "$1"); fi
  LORAPLEX_REQUIRE_GPU=1 ctest --test-dir build -j8 --output-on-failure --timeout 600 \
    "${filter[@]}" >"$out/ctest.log" 2>&1
  echo "ctest status $? in $((SECONDS - start)) s"
  grep -E "tests passed|tests failed|\(Failed\)|Not Run|Timeout" "$out/ctest.log" | head -40
  echo "skipped: $(grep -c '\*\*\*Skipped' "$out/ctest.log")"
}

e2e_runs=0
verb_e2e() {
  e2e_runs=$((e2e_runs + 1))
  local name=e2e${E2E_TAG:-}_$e2e_runs
  local args=("$@")
  local start=$SECONDS
  timeout 900 "$bin" bench e2e --json "$out/$name.json" "${args[@]}" >"$out/$name.log" 2>"$out/$name.err"
  echo "bench e2e ${args[*]}: status $? in $((SECONDS - start)) s"
  grep -E "^bench e2e:" "$out/$name.err" | tr '\r' '\n' | grep -v "run [0-9]" | tail -8
}

serve_runs=0
verb_serve() {
  serve_runs=$((serve_runs + 1))
  local name=serve_$serve_runs
  local start=$SECONDS
  timeout 900 "$bin" bench serve --no-progress --json "$out/$name.json" "$@" >"$out/$name.log" 2>&1
  echo "bench serve $*: status $? in $((SECONDS - start)) s"
  tail -30 "$out/$name.log"
}

verb_kernels() {
  timeout 600 "$bin" bench kernels --json "$out/kernels.json" "$@" >"$out/kernels.log" 2>&1
  echo "bench kernels status $?"
}

verb_hf() {
  local start=$SECONDS
  if [[ ! -f /tmp/e2e_model/model/config.json ]]; then
    python3 bench/anchors/e2e/make_model.py /tmp/e2e_model >"$out/hf_make.log" 2>&1
  fi
  PYTHONUNBUFFERED=1 timeout 900 python3 bench/anchors/e2e/hf_peft_bench.py /tmp/e2e_model \
    --out "$out/hf.json" "$@" >"$out/hf.log" 2>&1
  echo "hf anchor status $? in $((SECONDS - start)) s"
  tail -5 "$out/hf.log"
}

while [[ $# -gt 0 ]]; do
  verb=$1
  shift
  args=()
  while [[ $# -gt 0 && "$1" != build && "$1" != test && "$1" != e2e && "$1" != kernels &&
    "$1" != hf && "$1" != serve ]]; do
    args+=("$1")
    shift
  done
  case $verb in
    build) verb_build ;;
    test) verb_test "${args[@]}" ;;
    e2e) verb_e2e "${args[@]}" ;;
    kernels) verb_kernels "${args[@]}" ;;
    hf) verb_hf "${args[@]}" ;;
    serve) verb_serve "${args[@]}" ;;
    *) echo "unknown verb '$verb' (build, test, e2e, kernels, hf, serve)"; exit 2 ;;
  esac
done
