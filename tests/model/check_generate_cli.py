#!/usr/bin/env python3
"""CLI-level checks of `loraplex generate`: exit statuses, error messages naming the file, line
or adapter, and the output file against the tiny-llama PEFT reference.

usage: check_generate_cli.py LORAPLEX_BINARY TESTDATA_DIR
Prints 'N passed, N failed' and exits non-zero on any failure.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

BIN, DATA = sys.argv[1], sys.argv[2]
FIX = os.path.join(DATA, "tiny-llama")
ADAPTERS = ["sql", "pirate", "rslora", "vocab"]
results = []


def run(args):
    p = subprocess.run([BIN, "generate", *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def check(name, cond, detail=""):
    results.append(cond)
    print(("PASS " if cond else "FAIL ") + name + ("" if cond else ": " + detail))


def lora_args(root=FIX):
    out = []
    for a in ADAPTERS:
        out += ["--lora", f"{a}={os.path.join(root, 'adapters', a)}"]
    return out


base = ["--model", os.path.join(FIX, "model"), "--device", "cpu", "--max-tokens", "12",
        "--ignore-eos"]
expected = [json.loads(l) for l in open(os.path.join(FIX, "expected.jsonl"))]

with tempfile.TemporaryDirectory() as tmp:
    out_path = os.path.join(tmp, "out.jsonl")
    code, out, err = run(base + lora_args() + ["--requests", os.path.join(FIX, "requests.jsonl"),
                                               "--output", out_path, "--max-num-seqs", "7"])
    check("all requests succeed", code == 0, err)
    if code == 0:
        got = [json.loads(l) for l in open(out_path)]
        check("one output line per request", len(got) == len(expected), str(len(got)))
        same = all(g["output_token_ids"] == e["output_token_ids"] and
                   g["prompt_token_ids"] == e["prompt_token_ids"] and
                   g["output_text"] == e["output_text"] and g["adapter"] == e["adapter"] and
                   g["prompt"] == e["prompt"] for g, e in zip(got, expected))
        check("outputs equal the PEFT reference, in input order", same)
        check("fields and their order",
              list(got[0].keys()) == ["prompt", "adapter", "prompt_token_ids",
                                      "output_token_ids", "output_text"], str(got[0].keys()))

    # Sharded over CPU threads (-tp, as vLLM spells it), adapters fully sharded: the same file.
    out_tp = os.path.join(tmp, "out_tp.jsonl")
    code, out, err = run(base + lora_args() + ["--requests", os.path.join(FIX, "requests.jsonl"),
                                               "--output", out_tp, "-tp", "2",
                                               "--fully-sharded-loras"])
    check("-tp 2 --fully-sharded-loras succeeds", code == 0, err)
    if code == 0:
        check("-tp 2 output equals the PEFT reference",
              [json.loads(l)["output_token_ids"] for l in open(out_tp)] ==
              [e["output_token_ids"] for e in expected])

    # An FP8 checkpoint (128x128 block scales) with the same adapters: its own PEFT reference.
    fp8 = os.path.join(DATA, "tiny-llama-fp8", "block")
    out_fp8 = os.path.join(tmp, "out_fp8.jsonl")
    code, out, err = run(["--model", os.path.join(fp8, "model"), "--device", "cpu",
                          "--max-tokens", "12", "--ignore-eos", "--output", out_fp8,
                          "--requests", os.path.join(fp8, "requests.jsonl")] + lora_args())
    check("an FP8 checkpoint succeeds", code == 0, err)
    if code == 0:
        check("FP8 output equals the PEFT reference on the dequantized weights",
              [json.loads(l)["output_token_ids"] for l in open(out_fp8)] ==
              [json.loads(l)["output_token_ids"] for l in open(os.path.join(fp8, "expected.jsonl"))])

    # fp8 adapter storage: the base model's requests keep PEFT's tokens.
    out_lora8 = os.path.join(tmp, "out_lora8.jsonl")
    code, out, err = run(base + lora_args() + ["--requests", os.path.join(FIX, "requests.jsonl"),
                                               "--output", out_lora8, "--lora-dtype", "fp8"])
    check("--lora-dtype fp8 succeeds", code == 0, err)
    if code == 0:
        got = [json.loads(l) for l in open(out_lora8)]
        check("--lora-dtype fp8: base requests equal the PEFT reference",
              all(g["output_token_ids"] == e["output_token_ids"]
                  for g, e in zip(got, expected) if e["adapter"] is None))
    code, out, err = run(base + ["--requests", os.path.join(FIX, "requests.jsonl"),
                                 "--lora-dtype", "int4"])
    check("--lora-dtype int4 is refused naming it", code != 0 and "'int4'" in err, err)

    code, out, err = run(base + ["--requests", os.path.join(FIX, "requests.jsonl"),
                                 "--tensor-parallel-size", "3"])
    check("tensor-parallel size that does not divide the heads names both",
          code != 0 and "tensor-parallel size 3" in err and "num_attention_heads 4" in err, err)

    code, out, err = run(base + ["--requests", os.path.join(FIX, "requests.jsonl"), "-tp", "0"])
    check("-tp 0 is refused", code != 0 and "tensor-parallel-size" in err, err)

    code, out, err = run(["--help"])
    check("--help exits 0", code == 0 and "usage: loraplex generate" in out, err)

    code, out, err = run(["--model", os.path.join(tmp, "nope"), "--requests",
                          os.path.join(FIX, "requests.jsonl"), "--device", "cpu"])
    check("missing model directory", code != 0 and "nope" in err and "does not exist" in err, err)

    code, out, err = run(base + ["--requests", os.path.join(tmp, "missing.jsonl")])
    check("missing request file", code != 0 and "missing.jsonl" in err, err)

    bad = os.path.join(tmp, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"prompt": "hello", "adapter": null}\n\n{"prompt": "x", "adapter": "sql"}\n')
    code, out, err = run(base + ["--requests", bad])
    check("unknown adapter names file and line",
          code != 0 and f"{bad}:3" in err and "unknown adapter 'sql'" in err, err)

    with open(bad, "w") as f:
        f.write('{"prompt": "hello"}\n{"prompt": "x", \n')
    code, out, err = run(base + ["--requests", bad])
    check("malformed line names file and line",
          code != 0 and f"{bad}:2" in err and "not valid JSON" in err, err)

    with open(bad, "w") as f:
        f.write('{"prompt": 3}\n')
    code, out, err = run(base + ["--requests", bad])
    check("non-string prompt", code != 0 and f"{bad}:1" in err and "prompt" in err, err)

    with open(bad, "w") as f:
        f.write('{"prompt": "a", "max_tokens": 0}\n')
    code, out, err = run(base + ["--requests", bad])
    check("bad max_tokens", code != 0 and f"{bad}:1" in err and "max_tokens" in err, err)

    # A broken adapter stops the program before any generation, naming adapter and file.
    broken_root = os.path.join(tmp, "broken")
    shutil.copytree(os.path.join(FIX, "adapters"), os.path.join(broken_root, "adapters"))
    weights = os.path.join(broken_root, "adapters", "rslora", "adapter_model.safetensors")
    os.chmod(weights, 0o644)
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    out2 = os.path.join(tmp, "out2.jsonl")
    code, out, err = run(base + lora_args(broken_root) +
                         ["--requests", os.path.join(FIX, "requests.jsonl"), "--output", out2])
    check("truncated adapter file", code != 0 and "adapter 'rslora'" in err and
          weights in err and not os.path.exists(out2), err)

    cfg = os.path.join(broken_root, "adapters", "sql", "adapter_config.json")
    os.chmod(cfg, 0o644)
    with open(cfg, "w") as f:
        f.write("{ not json")
    code, out, err = run(base + ["--lora", f"sql={os.path.dirname(cfg)}", "--requests",
                                 os.path.join(FIX, "requests.jsonl")])
    check("adapter config not JSON", code != 0 and "adapter 'sql'" in err and cfg in err, err)

    code, out, err = run(base + ["--lora", "sql=" + os.path.join(tmp, "nodir"), "--requests",
                                 os.path.join(FIX, "requests.jsonl")])
    check("adapter directory missing", code != 0 and "adapter 'sql'" in err and "nodir" in err,
          err)

    code, out, err = run(base + ["--requests", os.path.join(FIX, "requests.jsonl"), "--bogus",
                                 "1"])
    check("unknown option", code != 0 and "--bogus" in err, err)

    code, out, err = run(base + ["--lora", "sqlonly", "--requests",
                                 os.path.join(FIX, "requests.jsonl")])
    check("--lora without NAME=DIR", code != 0 and "NAME=DIR" in err, err)

    bad_model = os.path.join(tmp, "model")
    shutil.copytree(os.path.join(FIX, "model"), bad_model)
    os.chmod(os.path.join(bad_model, "config.json"), 0o644)
    conf = json.load(open(os.path.join(bad_model, "config.json")))
    conf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    json.dump(conf, open(os.path.join(bad_model, "config.json"), "w"))
    code, out, err = run(["--model", bad_model, "--device", "cpu", "--requests",
                          os.path.join(FIX, "requests.jsonl")])
    check("unsupported rope scaling names the field",
          code != 0 and "rope_parameters.rope_type 'yarn'" in err, err)

passed = sum(results)
failed = len(results) - passed
print(f"{passed} passed, {failed} failed")
sys.exit(0 if failed == 0 else 1)
