#!/usr/bin/env bash
# Builds the `loraplex` command and runs the main job: `loraplex generate` on the bundled tiny
# model, all 30 requests of the fixture (four adapters and the base model) in one batch, on
# the GPU when one is present, else the CPU. Extra arguments go to `loraplex generate`.
# Standard output is only generate's JSON lines: set-up and build output go to standard error.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
{
  bash scripts/install_deps.sh
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
  cmake --build build -j "$jobs" --target loraplex
} >&2
# The bundled tiny Llama with its four PEFT adapters and the base model mixed in one batch.
fx=testdata/tiny-llama
./build/tools/loraplex generate --model $fx/model \
  --lora sql=$fx/adapters/sql --lora pirate=$fx/adapters/pirate \
  --lora rslora=$fx/adapters/rslora --lora vocab=$fx/adapters/vocab \
  --requests $fx/requests.jsonl --max-tokens 12 --ignore-eos "$@"
