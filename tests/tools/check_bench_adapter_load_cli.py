#!/usr/bin/env python3
"""CLI-level checks of `loraplex bench adapter-load` at tiny sizes on the CPU: --help, option
errors, and the JSON of a run in both upload modes (structure and counts, never timings).

usage: check_bench_adapter_load_cli.py LORAPLEX_BINARY
Prints 'N passed, N failed' and exits non-zero on any failure.
"""

import json
import os
import subprocess
import sys
import tempfile

BIN = sys.argv[1]
results = []


def run(args):
    p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def check(name, cond, detail=""):
    results.append(cond)
    print(("PASS " if cond else "FAIL ") + name + ("" if cond else ": " + detail))


code, out, err = run(["bench", "adapter-load", "--help"])
check("--help exits 0", code == 0 and "usage: loraplex bench adapter-load" in out, out + err)
code, out, err = run(["--help"])
check("the command table lists it", code == 0 and "bench adapter-load" in out, out)
code, out, err = run(["bench", "adapter-load", "--device", "cpu", "--bogus", "1"])
check("an unknown option exits 1", code == 1 and "unknown option '--bogus'" in err, err)
code, out, err = run(["bench", "adapter-load", "--device", "cpu", "--adapters", "4"])
check("--adapters below 5 exits 1", code == 1 and "--adapters expects an integer >= 5" in err,
      err)
code, out, err = run(["bench", "adapter-load", "--device", "cuda:99"])
check("a missing GPU exits 1", code == 1 and "needs a CUDA device" in err, err)

TINY = ["bench", "adapter-load", "--device", "cpu", "--layers", "2", "--hidden", "48",
        "--kv-hidden", "16", "--intermediate", "80", "--tokens", "9", "--steps", "3",
        "--warmup", "1", "--adapters", "6", "--rank", "4", "--max-lora-rank", "8",
        "--max-loras", "6", "--dtype", "float32", "--commit", "test"]

with tempfile.TemporaryDirectory() as tmp:
    for upload in ["async", "sync"]:
        path = os.path.join(tmp, upload + ".json")
        code, out, err = run(TINY + ["--upload", upload, "--min-loads", "3", "--json", path])
        check(f"{upload}: exits 0", code == 0, out + err)
        if code != 0:
            continue
        check(f"{upload}: prints both phases",
              "phase A" in out and "phase B" in out and "adapters loaded during phase B" in out,
              out)
        with open(path) as f:
            doc = json.load(f)
        cfg = doc["config"]
        check(f"{upload}: config echoes the options",
              cfg["layers"] == 2 and cfg["hidden"] == 48 and cfg["kv_hidden"] == 16
              and cfg["intermediate"] == 80 and cfg["tokens"] == 9 and cfg["adapter_rank"] == 4
              and cfg["max_loras"] == 6 and cfg["upload"] == upload and cfg["dtype"] == "float32"
              and doc["commit"] == "test" and doc["device"] == "cpu", json.dumps(cfg))
        # rank-4 A [4, in] and B [out, 4] of q, k, v, o, gate, up, down in float32, per layer
        ins = [48, 48, 48, 48, 48, 48, 80]
        outs = [48, 16, 16, 48, 80, 80, 48]
        per_layer = 4 * (sum(ins) + sum(outs)) * 4
        check(f"{upload}: the packed adapter has every projection",
              cfg["adapter_packed_bytes"] == 2 * per_layer, str(cfg["adapter_packed_bytes"]))
        a, b = doc["phase_a"], doc["phase_b"]
        check(f"{upload}: phase A ran the steps", a["steps"] == 3 and a["wall_ms"]["count"] == 3,
              json.dumps(a))
        check(f"{upload}: phase B ran until 3 loads",
              b["steps"] >= 3 and b["adapters_loaded"] >= 3
              and b["load_ms"]["count"] >= 3, json.dumps(b))
        check(f"{upload}: CPU runs have no GPU times",
              a["gpu_ms"] is None and b["gpu_ms"] is None, json.dumps(a))
        stats_ok = all(0 < s["min"] <= s["median"] <= s["p90"] <= s["max"]
                       for s in (a["wall_ms"], b["wall_ms"]))
        check(f"{upload}: step statistics are ordered", stats_ok, json.dumps([a, b]))

failed = results.count(False)
print(f"{len(results) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
