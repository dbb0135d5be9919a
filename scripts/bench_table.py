#!/usr/bin/env python3
"""Summarises the JSON of `loraplex bench kernels` against the issue's targets.

usage: bench_table.py BENCH_JSON [--markdown]

Without --markdown: a short plain-text table of the targets (decode layer time, prefill
bandwidth, metadata build). With --markdown: the full results table for BENCHMARKS.md.

vLLM anchor figures: only the two quoted in the issue are known here (the anchor CSV is not
available); every other case is marked "anchor unavailable".
"""
import gzip
import json
import sys

# (op, rank, adapters, tokens, slices) -> vLLM Triton graph time in microseconds, H200.
VLLM_ANCHOR_US = {
    ("linear", 16, 32, 64, "4096/1024/1024"): 132.0,
    ("linear", 16, 8, 16, "4096"): 9.0,
}


def key(r):
    return (r["op"], r["rank"], r["adapters"], r["tokens"], r["slices"])


def decode_target(r):
    """Target time for a decode layer: 10x vLLM, or 1.5x roofline + 1 us if that is larger."""
    bound = 1.5 * r["roofline_us"] + 1.0
    anchor = VLLM_ANCHOR_US.get(key(r))
    if anchor is None:
        return bound, None
    return max(anchor / 10.0, bound), anchor


def summary(doc):
    res = doc["results"]
    print(f"device {doc['device']}, commit {doc['commit']}, {doc['date']}, "
          f"copy bandwidth {doc['copy_bandwidth_gbs']:.0f} GB/s")
    print("decode layer (add_lora_linear, rank 16): graph with rotating weights")
    print(f"{'slices':<15} {'lora':>4} {'tok':>4} {'path':<6} {'rot_us':>8} {'graph_us':>8} "
          f"{'roof_us':>8} {'target':>8} {'vllm':>7} ok")
    for r in res:
        if r["op"] != "linear" or r["rank"] != 16 or r["tokens"] not in (16, 64) \
                or r["adapters"] not in (8, 32):
            continue
        target, anchor = decode_target(r)
        ok = "yes" if r["graph_rotating_us"] <= target else "NO"
        print(f"{r['slices']:<15} {r['adapters']:>4} {r['tokens']:>4} {r['path']:<6} "
              f"{r['graph_rotating_us']:8.2f} {r['graph_us']:8.2f} {r['roofline_us']:8.2f} "
              f"{target:8.2f} {anchor if anchor else '-':>7} {ok}")
    print("prefill, 4096 tokens, cold: % of copy bandwidth (target >= 70)")
    for r in res:
        if r["tokens"] != 4096 or r["op"] not in ("shrink", "expand"):
            continue
        ok = "yes" if r["cold_pct_copy_bw"] >= 70 else "NO"
        print(f"  {r['op']:<7} rank {r['rank']:>2} lora {r['adapters']:>2} {r['slices']:<15} "
              f"{r['cold_us']:8.2f} us {r['cold_pct_copy_bw']:6.1f}% {ok}")
    m = doc.get("metadata_build", {})
    if m:
        ok = "yes" if m["graph_us"] < 10 else "NO"
        print(f"metadata build 4096 tokens / 32 adapters: graph {m['graph_us']:.2f} us "
              f"(target < 10) {ok}; cold {m['cold_us']:.2f} us")
    comp = doc.get("path_comparison", [])
    if comp:
        print("layer paths, graph rotating us (cluster: one-kernel cluster layer; fused: "
              "persistent decode kernel; gather: per-token pair; split: shrink + expand kernels):")
        for c in comp:
            parts = []
            for name in ("cluster", "fused", "gather", "split"):
                v = c.get(f"{name}_graph_rotating_us")
                if v is not None:
                    parts.append(f"{name} {v:8.2f}")
            print(f"  r{c['rank']:<3} lora {c['adapters']:>2} tok {c['tokens']:>4} "
                  f"slices {c['slices']}: {' '.join(parts)} roof {c['roofline_us']:7.2f}")


def markdown(doc):
    print("| op | rank | adapters | tokens | slices | path | cold us | graph us | "
          "graph rotating us | roofline us | % copy bw (cold / rotating) | vLLM graph us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["results"]:
        anchor = VLLM_ANCHOR_US.get(key(r))
        a = f"{anchor:.1f}" if anchor else "anchor unavailable"
        print(f"| {r['op']} | {r['rank']} | {r['adapters']} | {r['tokens']} | {r['slices']} | "
              f"{r['path']} | {r['cold_us']:.2f} | {r['graph_us']:.2f} | "
              f"{r['graph_rotating_us']:.2f} | {r['roofline_us']:.2f} | "
              f"{r['cold_pct_copy_bw']:.1f} / {r['graph_rotating_pct_copy_bw']:.1f} | {a} |")


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    opener = gzip.open if sys.argv[1].endswith(".gz") else open
    with opener(sys.argv[1], "rt") as f:
        doc = json.load(f)
    if "--markdown" in sys.argv[2:]:
        markdown(doc)
    else:
        summary(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
