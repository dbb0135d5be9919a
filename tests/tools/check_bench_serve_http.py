#!/usr/bin/env python3
"""`loraplex bench serve --server URL` against a `loraplex serve` started here on the tiny-llama
fixture (CPU, 127.0.0.1, a free port): the JSON of a small run (counts and structure, never
timings) and the errors of a wrong API key, an unreachable server and a malformed URL.

usage: check_bench_serve_http.py LORAPLEX_BINARY TESTDATA_DIR
Prints 'N passed, N failed' and exits non-zero on any failure.
"""

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading

BIN, DATA = sys.argv[1], sys.argv[2]
FIX = os.path.join(DATA, "tiny-llama")
MODEL = os.path.join(FIX, "model")
NAMES = ["sql", "pirate", "rslora", "vocab"]
KEY = "bench-key-7"
results = []


def check(name, cond, detail=""):
    results.append(bool(cond))
    print(("PASS " if cond else "FAIL ") + name + ("" if cond else ": " + str(detail)[:3000]),
          flush=True)


def bench(args):
    p = subprocess.run([BIN, "bench", "serve", *args], capture_output=True, text=True,
                       timeout=120)
    return p.returncode, p.stdout, p.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


loras = [a for n in NAMES for a in ("--lora", f"{n}={os.path.join(FIX, 'adapters', n)}")]
server = subprocess.Popen([BIN, "serve", "--model", MODEL, "--device", "cpu", "--port", "0",
                           "--api-key", KEY, "--served-model-name", "tiny", *loras],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
log = []
port = None
for line in server.stderr:
    log.append(line)
    m = re.search(r"listening on http://[^ ]+:(\d+)", line)
    if m:
        port = int(m.group(1))
        break
if port is None:
    server.wait()
    print("the server did not start: " + "".join(log))
    sys.exit(1)
threading.Thread(target=lambda: [log.append(x) for x in server.stderr], daemon=True).start()
URL = f"http://127.0.0.1:{port}"

try:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "http.json")
        # --lora NAME alone: the server has the adapters.
        code, out, err = bench(["--server", URL, "--api-key", KEY, "--model", MODEL,
                                *[a for n in NAMES for a in ("--lora", n)],
                                "--num-requests", "16", "--rate", "inf", "--prompt-len", "16",
                                "--output-len", "8", "--adapter-dist", "uniform",
                                "--no-progress", "--json", path])
        check("a run over HTTP exits 0", code == 0, out + err)
        if code == 0:
            doc = json.load(open(path))
            check("sections", list(doc.keys()) == ["config", "lora", "base", "lora_vs_base"],
                  doc.keys())
            cfg = doc["config"]
            check("config says HTTP and the URL", cfg["transport"] == "http" and
                  cfg["server"] == URL and cfg["model"] == "tiny" and
                  cfg["adapter_names"] == NAMES and cfg["vocab_size"] == 1024, cfg)
            for name in ("lora", "base"):
                r = doc[name]
                check(f"{name}: every request completes", r["completed"] == 16 and
                      r["failed"] == 0 and r["output_tokens"] == 16 * 8 and
                      r["input_tokens"] == 16 * 16, r)
                t, i = r["ttft_ms"], r["itl_ms"]
                check(f"{name}: TTFT and ITL measured", 0 < t["p50"] <= t["p99"] <= t["max"] and
                      0 < i["p50"] <= i["max"] and r["e2e_s"]["p50"] > 0, r)
                check(f"{name}: no engine counters over HTTP", "steps" not in r and
                      "queue_ms" not in r, r.keys())
            check("adapters were used", doc["lora"]["adapter_first_token_wait"]["adapters"] >= 2,
                  doc["lora"])
            check("a table on stdout", "TTFT p99 (ms)" in out and "over HTTP" in out, out)
            # The same trace in process (the prompts must be the same requests).
            inproc = os.path.join(tmp, "inproc.json")
            code, out, err = bench(["--model", MODEL, "--device", "cpu", *loras,
                                    "--num-requests", "16", "--rate", "inf", "--prompt-len",
                                    "16", "--output-len", "8", "--adapter-dist", "uniform",
                                    "--no-progress", "--no-base-run", "--json", inproc])
            check("the in-process run of the same trace", code == 0 and
                  json.load(open(inproc))["lora"]["input_tokens"] == 16 * 16, out + err)

        code, out, err = bench(["--server", URL, "--api-key", "wrong", "--lora", "sql",
                                "--vocab-size", "1024", "--num-requests", "2"])
        check("a wrong key: exit 1 naming the 401 and --api-key",
              code == 1 and "401" in err and "--api-key" in err, err)
        code, out, err = bench(["--server", f"http://127.0.0.1:{free_port()}", "--lora", "sql",
                                "--vocab-size", "1024", "--num-requests", "2"])
        check("no server there: exit 1", code == 1 and "cannot connect" in err, err)
        code, out, err = bench(["--server", "127.0.0.1:8000", "--vocab-size", "1024"])
        check("a malformed URL: exit 1", code == 1 and "http://HOST:PORT" in err, err)
        code, out, err = bench(["--server", URL, "--api-key", KEY, "--lora", "sql"])
        check("no vocabulary size: exit 1", code == 1 and "--vocab-size" in err, err)
        code, out, err = bench(["--server", URL, "--api-key", KEY, "--lora", "nosuch",
                                "--vocab-size", "1024", "--num-requests", "2", "--no-base-run"])
        check("an adapter the server lacks: exit 1 with its 404",
              code == 1 and "404" in err and "nosuch" in err, err)
        check("the server is still up", server.poll() is None, "".join(log))
finally:
    server.terminate()
    server.wait(30)

print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
sys.exit(0 if all(results) else 1)
