#!/usr/bin/env bash
# `loraplex generate` on the GPU, on the bundled tiny Llama with its four adapters, in float32
# and bfloat16, each compared token for token with PEFT's outputs (testdata/.../expected.jsonl).
# Usage, from the repository root: scripts/device_generate_check.sh LORAPLEX_BINARY OUT_DIR
set -uo pipefail
bin=${1:?usage: device_generate_check.sh LORAPLEX_BINARY OUT_DIR}
out=${2:?usage: device_generate_check.sh LORAPLEX_BINARY OUT_DIR}
fx=testdata/tiny-llama/adapters
for dt in float32 bfloat16; do
  "$bin" generate --model testdata/tiny-llama/model --lora sql=$fx/sql \
    --lora pirate=$fx/pirate --lora rslora=$fx/rslora --lora vocab=$fx/vocab \
    --requests testdata/tiny-llama/requests.jsonl --max-tokens 12 --ignore-eos --device cuda \
    --dtype "$dt" --output "$out/generate_$dt.jsonl" >/dev/null 2>"$out/generate_$dt.err"
  echo "generate $dt status $?"
  python3 - "$out/generate_$dt.jsonl" testdata/tiny-llama/expected.jsonl <<'PY'
import json, sys
got = [json.loads(l) for l in open(sys.argv[1])]
exp = [json.loads(l) for l in open(sys.argv[2])]
same = sum(g["output_token_ids"] == e["output_token_ids"] for g, e in zip(got, exp))
first = sum(g["output_token_ids"][:1] == e["output_token_ids"][:1] for g, e in zip(got, exp))
print(f"  {len(got)} requests: all 12 tokens equal in {same}, first token equal in {first}")
PY
done
