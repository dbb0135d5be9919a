#!/usr/bin/env python3
"""One line per configuration of the `bench e2e` JSON files given: the variant (LoRA decode path,
fused-path token limit, GEMM autotune), tok/s, decode step, ratio to base, prefill time."""
import json
import sys

for path in sys.argv[1:]:
    with open(path) as f:
        d = json.load(f)
    w = d.get("workload", {})
    variant = "%s max%s%s" % (d.get("lora_decode", "-"), d.get("fused_lora_max_tokens", "-"),
                              " autotune" if d.get("gemm_autotune") else "")
    for name, r in d["results"].items():
        print("%-28s %3d req x %3d adapters %-22s %-6s %8.1f tok/s  step %6.2f ms  x%.3f  prefill %.1f ms"
              % (path.split("/")[-1], w.get("requests", 0), w.get("adapters", 0), variant, name,
                 r["tok_s"], r["decode_step_ms"], r.get("ratio_to_base", 0), r["prefill_s"] * 1e3))
