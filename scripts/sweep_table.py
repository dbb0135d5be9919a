#!/usr/bin/env python3
"""Summarises the JSON files of `scripts/gpu.sh sweep`: one line per (file, case) with the op,
the case, the graph-rotating and cold times and the tuning values."""
import gzip
import json
import sys

for path in sys.argv[1:]:
    doc = json.load(gzip.open(path, "rt") if path.endswith(".gz") else open(path))
    tune = ",".join(f"{k}={v}" for k, v in doc.get("tuning", {}).items())
    for r in doc["results"]:
        print(f"{path.rsplit('/', 1)[-1]:48s} {r['op']:7s} r{r['rank']:<3d} a{r['adapters']:<3d} "
              f"t{r['tokens']:<5d} s{r['slices']} "
              f"rot {r['graph_rotating_us']:8.2f} cold {r['cold_us']:8.2f} "
              f"cold%bw {r['cold_pct_copy_bw']:5.1f}  [{tune}]")
