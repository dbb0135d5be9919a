#!/usr/bin/env python3
"""CLI-level checks of `loraplex bench serve` on the tiny Llama fixture (CPU): --help, option
errors, and the JSON of small runs (structure and counts, never timings).

usage: check_bench_serve_cli.py LORAPLEX_BINARY TESTDATA_DIR
Prints 'N passed, N failed' and exits non-zero on any failure.
"""

import json
import os
import subprocess
import sys
import tempfile

BIN, DATA = sys.argv[1], sys.argv[2]
FIX = os.path.join(DATA, "tiny-llama")
results = []


def run(args):
    p = subprocess.run([BIN, "bench", "serve", *args], capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout, p.stderr


def check(name, cond, detail=""):
    results.append(cond)
    print(("PASS " if cond else "FAIL ") + name + ("" if cond else ": " + detail))


code, out, err = run(["--help"])
check("--help exits 0", code == 0 and "--rate" in out and "--lora-dir" in out, out + err)
p = subprocess.run([BIN, "--help"], capture_output=True, text=True)
check("the command table lists it", "bench serve" in p.stdout, p.stdout)
code, out, err = run(["--model", os.path.join(FIX, "model"), "--bogus", "1"])
check("an unknown option exits 1", code == 1 and "--bogus" in err, err)
code, out, err = run(["--model", os.path.join(FIX, "model"), "--prompt-len", "9-x"])
check("a bad length names the option", code == 1 and "--prompt-len" in err, err)
code, out, err = run(["--model", os.path.join(FIX, "model"), "--lora", "sql=/nonexistent"])
check("a missing adapter names it", code == 1 and "adapter 'sql'" in err, err)
code, out, err = run(["--model", os.path.join(FIX, "model"), "--prompt-len", "1000",
                      "--output-len", "100", "--device", "cpu"])
check("requests longer than the model exit 1",
      code == 1 and "max_model_len 1024" in err, err)

BASE = ["--model", os.path.join(FIX, "model"), "--lora-dir", os.path.join(FIX, "adapters"),
        "--device", "cpu", "--num-requests", "24", "--prompt-len", "6-20", "--output-len", "5",
        "--max-num-seqs", "8", "--max-loras", "2", "--kv-block-size", "4", "--no-progress"]

with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "run.json")
    code, out, err = run(BASE + ["--rate", "400", "--shared-prefix", "5", "--json", path])
    check("a Poisson run exits 0", code == 0, out + err)
    if code == 0:
        doc = json.load(open(path))
        check("sections", list(doc.keys()) == ["config", "lora", "base", "lora_vs_base"],
              str(doc.keys()))
        cfg = doc["config"]
        check("config echoes the options",
              cfg["adapters"] == 4 and cfg["max_loras"] == 2 and cfg["rate"] == 400 and
              cfg["prompt_len"] == "6-20" and cfg["kv_block_size"] == 4 and
              cfg["lora_evict_after_s"] == 0.02, str(cfg))
        check("evictions counted", doc["lora"]["lora_evictions"] >= 0 and
              doc["base"]["lora_evictions"] == 0, str(doc))
        lora, base = doc["lora"], doc["base"]
        for name, r in (("lora", lora), ("base", base)):
            check(f"{name}: every request completes",
                  r["completed"] == 24 and r["failed"] == 0 and r["output_tokens"] == 24 * 5,
                  str(r))
            t = r["ttft_ms"]
            check(f"{name}: percentiles are ordered",
                  0 < t["p50"] <= t["p90"] <= t["p99"] <= t["max"], str(t))
            check(f"{name}: steps counted", r["steps"] >= 5 and r["seqs_per_step"] >= 1, str(r))
        check("the same trace twice", lora["input_tokens"] == base["input_tokens"])
        check("adapters per step", 0 < lora["adapters_per_step"] <= 2 and
              1 <= lora["max_adapters_per_step"] <= 2 and base["adapters_per_step"] == 0 and
              base["max_adapters_per_step"] == 0, json.dumps([lora, base]))
        check("the shared prefix hits the cache", lora["prefix_cache_hits"] > 0 and
              0 < lora["prefix_cache_hit_rate"] <= 1, str(lora))
        check("first token per adapter", lora["adapter_first_token_wait"]["adapters"] == 4)
        check("ratios", doc["lora_vs_base"]["throughput_ratio"] > 0)
        check("a table on stdout", "TTFT p99 (ms)" in out and "lora / base" in out, out)

    path = os.path.join(tmp, "once.json")
    code, out, err = run(BASE + ["--adapter-dist", "uniform", "--no-base-run",
                                 "--lora-evict-after", "-1", "--json", path])
    check("all at once without the base run exits 0", code == 0, out + err)
    if code == 0:
        doc = json.load(open(path))
        check("only the lora run", "base" not in doc and doc["config"]["rate"] == "inf",
              str(doc.keys()))
        check("it completes", doc["lora"]["completed"] == 24, str(doc["lora"]))
        check("a negative --lora-evict-after turns eviction off",
              doc["config"]["lora_evict_after_s"] == -1 and doc["lora"]["lora_evictions"] == 0,
              json.dumps(doc))

passed = sum(results)
failed = len(results) - passed
print(f"{passed} passed, {failed} failed")
sys.exit(0 if failed == 0 else 1)
