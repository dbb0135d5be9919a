#!/usr/bin/env bash
# The one script for GPU work, run on the GPU machine from the repository root:
#
#   scripts/gpu.sh build            configure and build everything in ./build (dependencies
#                                   packed by scripts/pack_device_deps.sh into .device/deps)
#   scripts/gpu.sh test [REGEX]     the whole CTest suite (or the tests matching REGEX) with
#                                   LORAPLEX_REQUIRE_GPU set to the machine's GPU count: a test
#                                   that needs up to that many GPUs fails instead of skipping
#                                   when they are missing or broken (on two GPUs the NCCL
#                                   tensor-parallel tests run); the skipped tests are listed
#   scripts/gpu.sh generate         `loraplex generate` on the tiny Llama with its four adapters,
#                                   float32 and bfloat16, compared with PEFT's tokens
#   scripts/gpu.sh kernels [ARGS]   `loraplex bench kernels` (JSON into $OUT/kernels.json)
#   scripts/gpu.sh sweep ONLY@TUNE...  one `bench kernels --only ONLY --tune TUNE` per entry
#                                   (TUNE "-": the defaults), then a table of them all
#   scripts/gpu.sh profile REGEX ONLY [TUNE]  Nsight Compute (--set full, the GPU's own clocks)
#                                   on one launch of the kernels matching REGEX in
#                                   `bench kernels --only ONLY`: report, details, SASS with
#                                   stall samples into $OUT
#   scripts/gpu.sh e2e [ARGS]       `loraplex bench e2e` (JSON into $OUT/e2e*.json)
#   scripts/gpu.sh serve [ARGS]     `loraplex bench serve` (JSON into $OUT/serve*.json)
#   scripts/gpu.sh adapter-load [ARGS]  `loraplex bench adapter-load` (JSON into $OUT)
#   scripts/gpu.sh probes           the copy-bandwidth and decode-floor probes (bench/probes/)
#   scripts/gpu.sh hf [ARGS]        the HF transformers + PEFT anchor (bench/anchors/e2e, copied
#                                   there from ../shared/anchors before the call) on a checkpoint
#                                   written by its make_model.py into /tmp/e2e_model
#   scripts/gpu.sh python [ARGS]    the Python package (built by `build` when nanobind was packed
#                                   into .device/deps): its GPU tests (python/tests/
#                                   test_ops_cuda.py, a GPU required), then
#                                   bench/python_ops_bench.py against `bench kernels` (ARGS go to
#                                   the bench, e.g. --quick; JSON into $OUT/python_ops.json)
#
# Several verbs run in order: `scripts/gpu.sh build test kernels`. Logs and JSON go to $OUT
# (the device tool brings it back); each verb prints a short summary last.
set -uo pipefail
out=${OUT:-/tmp/loraplex_out}
mkdir -p "$out"
deps=${LORAPLEX_DEPS:-$PWD/.device/deps}
export LD_LIBRARY_PATH="$deps/lib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The device's copy of the repository may carry a stale .git: pass LORAPLEX_COMMIT=<hash> with
# the command so that the JSON records the commit that ran.
export LORAPLEX_COMMIT=${LORAPLEX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
bin=$PWD/build/tools/loraplex
verbs=" build test generate kernels sweep profile e2e serve adapter-load probes hf python "

verb_build() {
  local start=$SECONDS
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  # The Python package when nanobind was packed and this Python has its headers.
  local python=()
  if [[ -d "$deps/nanobind/cmake" ]] && python3 -c "import os, sysconfig, sys
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
    python=(-DLORAPLEX_PYTHON=ON -Dnanobind_DIR="$deps/nanobind/cmake")
  fi
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$deps" \
    -DLORAPLEX_GTEST_SOURCE_DIR="$deps/src/googletest" "${python[@]}" >"$out/build.log" 2>&1 &&
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
  local gpus
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [[ $gpus -lt 1 ]] && gpus=1
  LORAPLEX_REQUIRE_GPU=$gpus ctest --test-dir build -j8 --output-on-failure --timeout 600 \
    "${filter[@]}" >"$out/ctest.log" 2>&1
  echo "ctest status $? in $((SECONDS - start)) s on $gpus GPU(s) (LORAPLEX_REQUIRE_GPU=$gpus)"
  grep -E "tests passed|tests failed|\(Failed\)|Not Run|Timeout" "$out/ctest.log" | head -40
  echo "skipped: $(grep -c '\*\*\*Skipped' "$out/ctest.log")"
  grep '\*\*\*Skipped' "$out/ctest.log" | sed 's/ *\.\.\..*//; s/^.*Test *#[0-9]*: /  /' | head -40
}

verb_generate() {
  local fx=testdata/tiny-llama
  for dt in float32 bfloat16; do
    "$bin" generate --model $fx/model --lora sql=$fx/adapters/sql \
      --lora pirate=$fx/adapters/pirate --lora rslora=$fx/adapters/rslora \
      --lora vocab=$fx/adapters/vocab --requests $fx/requests.jsonl --max-tokens 12 \
      --ignore-eos --device cuda --dtype "$dt" --output "$out/generate_$dt.jsonl" \
      >/dev/null 2>"$out/generate_$dt.err"
    echo "generate $dt status $?"
    python3 - "$out/generate_$dt.jsonl" $fx/expected.jsonl <<'PY'
import json, sys
got = [json.loads(l) for l in open(sys.argv[1])]
exp = [json.loads(l) for l in open(sys.argv[2])]
same = sum(g["output_token_ids"] == e["output_token_ids"] for g, e in zip(got, exp))
first = sum(g["output_token_ids"][:1] == e["output_token_ids"][:1] for g, e in zip(got, exp))
print(f"  {len(got)} requests: all 12 tokens equal in {same}, first token equal in {first}")
PY
  done
}

verb_kernels() {
  timeout 600 "$bin" bench kernels --json "$out/kernels.json" "$@" >"$out/kernels.log" 2>&1
  echo "bench kernels status $?"
  python3 scripts/benchmarks_md.py --summary --kernels "$out/kernels.json" 2>&1 | tail -30
}

verb_sweep() {
  [[ $# -gt 0 ]] || { echo "sweep needs ONLY@TUNE entries"; return; }
  for entry in "$@"; do
    local only=${entry%@*} spec=${entry#*@}
    local name
    name=$(echo "${only}_$spec" | tr ':*=,' '_x__')
    local tune=()
    [[ "$spec" != "-" ]] && tune=(--tune "$spec")
    timeout 300 "$bin" bench kernels --iters "${ITERS:-30}" --no-path-comparison --no-metadata \
      --only "$only" "${tune[@]}" --json "$out/sweep_$name.json" >"$out/sweep_$name.log" 2>&1
    echo "sweep $name: status $?"
  done
  python3 scripts/sweep_table.py "$out"/sweep_*.json | tee "$out/sweep_table.txt"
}

verb_profile() {
  local regex=${1:?profile needs a kernel regex} only=${2:?profile needs an --only spec}
  local tune=()
  [[ $# -ge 3 ]] && tune=(--tune "$3")
  local name
  name=$(echo "$only" | tr ':*' '_x')
  timeout 300 ncu --set full --clock-control none --import-source no -k "regex:$regex" -s 2 -c 1 \
    -o "$out/$name" "$bin" bench kernels --iters 3 --no-path-comparison --no-metadata \
    --only "$only" "${tune[@]}" >"$out/$name.ncu.log" 2>&1
  echo "ncu $regex $only status $?"
  ncu --import "$out/$name.ncu-rep" --page details >"$out/$name.txt" 2>&1
  ncu --import "$out/$name.ncu-rep" --page source --csv --print-source sass >"$out/$name.sass.csv" 2>&1
  grep -E "Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Executed Ipc A|Warp Cycles Per Issued" \
    "$out/$name.txt" | head -20
}

runs=0
verb_bench() {  # verb_bench NAME ARGS...: `loraplex bench NAME`, JSON into $OUT/NAME_<n>.json
  local name=$1
  shift
  runs=$((runs + 1))
  # A later gpu.sh in the same call continues the numbering instead of overwriting.
  while [[ -e "$out/${name}_$runs.json" || -e "$out/${name}_$runs.log" ]]; do runs=$((runs + 1)); done
  local file=${name}_$runs start=$SECONDS
  timeout 900 "$bin" bench "$name" --json "$out/$file.json" "$@" >"$out/$file.log" \
    2>"$out/$file.err"
  echo "bench $name $*: status $? in $((SECONDS - start)) s"
  grep -E "^bench $name:" "$out/$file.err" | tr '\r' '\n' | grep -v "run [0-9]" | tail -8
  tail -4 "$out/$file.log"
}

verb_probes() {
  local nvcc
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  for probe in stream_probe decode_floor_probe; do
    "$nvcc" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o "$out/$probe" \
      "bench/probes/$probe.cu" >"$out/${probe}_build.log" 2>&1 || { echo "$probe: no build"; continue; }
    timeout 120 "$out/$probe" >"$out/$probe.txt" 2>&1
    echo "$probe status $?:"
    cat "$out/$probe.txt"
  done
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

verb_python() {
  local start=$SECONDS
  PYTHONPATH=$PWD/build/python LORAPLEX_REQUIRE_GPU=1 timeout 900 python3 -m pytest -q \
    -p no:cacheprovider python/tests/test_ops_cuda.py >"$out/python_tests.log" 2>&1
  echo "python GPU tests status $? in $((SECONDS - start)) s"
  tail -3 "$out/python_tests.log"
  PYTHONPATH=$PWD/build/python timeout 1800 python3 bench/python_ops_bench.py --cli "$bin" \
    --json "$out/python_ops.json" "$@" >"$out/python_ops.log" 2>&1
  echo "python ops bench status $? in $((SECONDS - start)) s"
  tail -3 "$out/python_ops.log"
}

while [[ $# -gt 0 ]]; do
  verb=$1
  shift
  args=()
  while [[ $# -gt 0 && "$verbs" != *" $1 "* ]]; do
    args+=("$1")
    shift
  done
  case $verb in
    build) verb_build ;;
    test) verb_test "${args[@]}" ;;
    generate) verb_generate ;;
    kernels) verb_kernels "${args[@]}" ;;
    sweep) verb_sweep "${args[@]}" ;;
    profile) verb_profile "${args[@]}" ;;
    e2e) verb_bench e2e "${args[@]}" ;;
    serve) verb_bench serve "${args[@]}" ;;
    adapter-load) verb_bench adapter-load "${args[@]}" ;;
    probes) verb_probes ;;
    hf) verb_hf "${args[@]}" ;;
    python) verb_python "${args[@]}" ;;
    *) echo "unknown verb '$verb' (${verbs# })"; exit 2 ;;
  esac
done
