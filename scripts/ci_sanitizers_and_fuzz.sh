#!/usr/bin/env bash
# CI stage for the adapter code, the engine and the server's request path: the adapter stress
# test, the safetensors tests and the server's protocol and template tests under
# AddressSanitizer (+UBSan) and ThreadSanitizer, the engine tests under ThreadSanitizer, then
# the safetensors and OpenAI-request fuzzers for a bounded time each on their seed corpora.
# CPU only (sanitizers cannot run CUDA code here).
#
# Usage: scripts/ci_sanitizers_and_fuzz.sh
# Environment: JOBS (parallel build jobs, default nproc), FUZZ_SECONDS (default 60),
#              BUILD_PREFIX (build directories are <prefix>-asan, -tsan, -fuzz; default "build").
# Fuzzer findings are written to <prefix>-fuzz/artifacts/; new corpus entries to
# <prefix>-fuzz/corpus/ (the committed seed corpus is only read).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
JOBS="${JOBS:-$(nproc)}"
FUZZ_SECONDS="${FUZZ_SECONDS:-60}"
PREFIX="${BUILD_PREFIX:-build}"
# FOLDER:TARGET[:GTEST_FILTER], FOLDER under tests/.
TEST_TARGETS=(adapters:loraplex_adapters_stress_tests adapters:loraplex_safetensors_tests
              server:loraplex_server_protocol_tests template:loraplex_template_tests)
# The engine's step loop, handles, aborts and adapter loads across threads (tiny model, CPU),
# and the HTTP server's connection threads (against the fake backend), TSan only; the tests that exercise threads (about 15 s under TSan). The tensor-parallel
# ranks' threads, their collectives and their failures, likewise.
TSAN_ONLY_TARGETS=(
  "engine:loraplex_engine_tests:*Streams*:*Abort*:*Unload*:*ManyThreads*:*Refusals*:*PrefixCache*:*MaxWaiting*"
  "server:loraplex_server_http_tests"
  "model:loraplex_tensor_parallel_tests:*Failures*:*AFailedRank*:*tiny_llama_tp2:*tiny_mixtral_tp2")

TOTAL_START=$SECONDS
stage() {
  local name="$1"
  shift
  local start=$SECONDS
  echo "=== ${name}"
  "$@"
  echo "=== ${name}: $((SECONDS - start)) s"
}

configure() {
  local dir="$1"
  shift
  cmake -S . -B "$dir" -G Ninja -DLORAPLEX_ENABLE_CUDA=OFF "$@" >/dev/null
}

names() {
  local t rest
  for t in "$@"; do
    rest="${t#*:}"
    echo "${rest%%:*}"
  done
}

run_tests() {
  local dir="$1"
  shift
  local t folder rest target filter
  for t in "$@"; do
    folder="${t%%:*}"
    rest="${t#*:}"
    target="${rest%%:*}"
    filter="*"
    [[ "$rest" == *:* ]] && filter="${rest#*:}"
    "$dir/tests/$folder/$target" --gtest_brief=1 --gtest_filter="$filter"
  done
}

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"

stage "asan: configure" configure "${PREFIX}-asan" -DLORAPLEX_SANITIZE=address
stage "asan: build" ninja -C "${PREFIX}-asan" -j"$JOBS" $(names "${TEST_TARGETS[@]}")
stage "asan: run" run_tests "${PREFIX}-asan" "${TEST_TARGETS[@]}"

stage "tsan: configure" configure "${PREFIX}-tsan" -DLORAPLEX_SANITIZE=thread
stage "tsan: build" ninja -C "${PREFIX}-tsan" -j"$JOBS" $(names "${TEST_TARGETS[@]}" \
  "${TSAN_ONLY_TARGETS[@]}")
stage "tsan: run" run_tests "${PREFIX}-tsan" "${TEST_TARGETS[@]}" "${TSAN_ONLY_TARGETS[@]}"

FUZZ_DIR="${PREFIX}-fuzz"
stage "fuzz: configure" configure "$FUZZ_DIR" -DCMAKE_CXX_COMPILER=clang++ \
  -DLORAPLEX_BUILD_FUZZERS=ON -DLORAPLEX_BUILD_TESTS=OFF
stage "fuzz: build" ninja -C "$FUZZ_DIR" -j"$JOBS" loraplex_safetensors_fuzz \
  loraplex_openai_request_fuzz
mkdir -p "$FUZZ_DIR/corpus" "$FUZZ_DIR/corpus-openai" "$FUZZ_DIR/artifacts"
stage "fuzz: safetensors ${FUZZ_SECONDS} s" "$FUZZ_DIR/fuzz/loraplex_safetensors_fuzz" \
  -max_total_time="$FUZZ_SECONDS" -print_final_stats=1 -dict=fuzz/safetensors.dict \
  -artifact_prefix="$FUZZ_DIR/artifacts/" "$FUZZ_DIR/corpus" fuzz/corpus/safetensors
stage "fuzz: openai request ${FUZZ_SECONDS} s" "$FUZZ_DIR/fuzz/loraplex_openai_request_fuzz" \
  -max_total_time="$FUZZ_SECONDS" -print_final_stats=1 -dict=fuzz/openai_request.dict \
  -artifact_prefix="$FUZZ_DIR/artifacts/" "$FUZZ_DIR/corpus-openai" fuzz/corpus/openai_request

echo "=== sanitizers and fuzzing passed in $((SECONDS - TOTAL_START)) s"
