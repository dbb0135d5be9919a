#!/usr/bin/env python3
"""Writes BENCHMARKS.md from result files: the method, then one section per device with the LoRA
kernel grid (vLLM's Triton kernels beside each case), the end-to-end runs and the serving runs,
each with its device, date, commit and command.

usage: benchmarks_md.py [--sources FILE] [--out FILE | --check FILE] [--summary]
       benchmarks_md.py [--kernels JSON]... [--vllm CSV [--vllm-run TEXT]]
                        [--e2e JSON]... [--paths JSON...]... [--serve JSON]... [--out FILE]
                        [--summary]

  --kernels   `loraplex bench kernels --json` output
  --vllm      vLLM's Triton kernels on the same grid (../shared/anchors/vllm_bench's CSV),
              matched to the kernel runs of the same device
  --vllm-run  where and when that CSV was measured (printed beside it)
  --e2e       `loraplex bench e2e --json` output
  --paths     `bench e2e` runs of one call that differ only in --lora-decode: one table
  --serve     `loraplex bench serve --json` output (PATH=DEVICE for a run over HTTP)
  --sources   a JSON file naming all of the above (keys kernels, vllm, vllm_run, hf, e2e,
              paths, ab, note [{device, text}], serve [{path, device?}]); the default when no
              result file is named: bench/benchmarks_sources.json, where the committed
              BENCHMARKS.md's inputs and notes live
  --out       where to write (default: standard output)
  --check     regenerate and compare with this file instead of writing; exit 1 with a diff
              when they differ (CI runs it on BENCHMARKS.md)
  --summary   a few plain-text lines per kernel run instead of the document

Every table says which file it came from; the command line that made the document is at its end.
"""
import argparse
import csv
import json
import shlex
import statistics
import sys
import textwrap
from collections import defaultdict

SLICES = {"4096": 1, "4096/1024/1024": 3}
VLLM_OP = {"linear": "layer", "shrink": "shrink", "expand": "expand"}

METHOD = """\
## Method

- **LoRA kernels** (`loraplex bench kernels`): the ops the layers call (`add_lora_linear`, and
  `add_shrink` / `add_expand` alone) on the grid hidden 4096 x rank {16, 64} x adapters {1, 8, 32}
  x tokens {1, 16, 64, 256, 1024, 4096} x slices {one of 4096, q/k/v 4096/1024/1024}, bf16,
  tokens spread round-robin over the adapters. Three timings per case: *cold* (a 512 MB read
  before each call, CUDA events, median of 100), *graph* (20 calls in one CUDA graph, replayed)
  and *rotating* (the graph's calls cycle through >= 128 MB of distinct adapter weights, so the
  weights come from HBM, as in a model). Decode sizes (<= 64 tokens) are compared on rotating
  graphs, prefill sizes cold. `% bw`: the bytes the op must move (x, the active adapters' A and
  B at their own rank, y read and written, the intermediate unless fused) over the time,
  against the device-to-device copy bandwidth measured at start-up.
- **vLLM** (`../shared/anchors/vllm_bench`): vLLM's own Triton `_lora_shrink`, `_lora_expand` and
  `add_lora_linear` (default configs, no PDL) on the same grid with the same three timings,
  every case checked against an fp32 reference. `x` = vLLM's time / loraplex's.
- **End to end** (`loraplex bench e2e`): random weights of a real model's shape, requests of a
  fixed prompt and output length, the base model, 8 adapters mixed in the batch and one adapter
  for all; tokens per second, prefill time, decode step, against the floor measured in the
  same run (weights read once per decode step at the copy bandwidth, prefill FLOPs at the
  measured matmul rate).
- **Serving** (`loraplex bench serve`): a seeded trace played against the engine in process,
  with the requests' adapters and again without any; throughput, TTFT, inter-token latency.

Timings compare only within one device and one call; each table names its run.
"""


def fmt(v, spec="%.2f"):
    return "-" if v is None else spec % v


def speedup(theirs, ours):
    if theirs is None or ours is None or ours <= 0:
        return None
    return theirs / ours


def load_vllm(path):
    rows = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            if r.get("ok", "1") not in ("1", "True", "true"):
                continue
            key = (r["device"], r["op"], int(r["rank"]), int(r["num_loras"]),
                   int(r["num_tokens"]), int(r["num_slices"]))
            num = lambda k: float(r[k]) if r.get(k) not in (None, "") else None
            rows[key] = {"cold_us": num("time_us"), "graph_us": num("time_graph_us"),
                         "graph_rotating_us": num("time_graph_rot_us")}
    return rows


def vllm_of(vllm, device, r):
    key = (device, VLLM_OP[r["op"]], r["rank"], r["adapters"], r["tokens"],
           SLICES[r["slices"]])
    return vllm.get(key)


def para(text):
    return textwrap.fill(text, 100, break_on_hyphens=False)


def kernel_tables(doc, vllm, source, vllm_line=None):
    device = doc["device"]
    by_case = defaultdict(dict)
    for r in doc["results"]:
        by_case[(r["rank"], r["adapters"], r["tokens"], r["slices"])][r["op"]] = r
    out = []
    decode = lambda t: t <= 64
    ratios = {"decode": [], "prefill": []}
    for phase, timing, label in (("decode", "graph_rotating_us", "rotating graph"),
                                 ("prefill", "cold_us", "cold")):
        out.append(f"#### {'Decode sizes' if phase == 'decode' else 'Prefill sizes'} ({label}, us)")
        out.append("")
        out.append("| rank | adapters | tokens | slices | path | layer | vLLM | x | shrink | vLLM | "
                   "expand | vLLM | % bw |")
        out.append("|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for case in sorted(by_case, key=lambda c: (c[2], c[0], c[1], c[3])):
            if decode(case[2]) != (phase == "decode"):
                continue
            ops = by_case[case]
            cells = []
            lin = ops.get("linear")
            for op in ("linear", "shrink", "expand"):
                r = ops.get(op)
                ours = r.get(timing) if r else None
                v = vllm_of(vllm, device, r) if r and vllm else None
                theirs = v.get(timing) if v else None
                cells.append((ours, theirs))
            x = speedup(cells[0][1], cells[0][0])
            if x is not None:
                ratios[phase].append(x)
            pct = lin.get("graph_rotating_pct_copy_bw" if phase == "decode" else
                          "cold_pct_copy_bw") if lin else None
            out.append("| %d | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                case[0], case[1], case[2], "q/k/v" if case[3] != "4096" else "1",
                lin.get("path", "-") if lin else "-",
                fmt(cells[0][0]), fmt(cells[0][1]), fmt(x, "%.1f"),
                fmt(cells[1][0]), fmt(cells[1][1]), fmt(cells[2][0]), fmt(cells[2][1]),
                fmt(pct, "%.0f")))
        out.append("")
    summary = []
    for phase, values in ratios.items():
        if values:
            summary.append(f"{phase} layers: vLLM / loraplex median {statistics.median(values):.1f}x "
                           f"(min {min(values):.1f}x, max {max(values):.1f}x, {len(values)} cases)")
    run = (f"{doc.get('date', '?')}, commit `{doc.get('commit', '?')}`, "
           f"`loraplex bench kernels` ({doc.get('dtype', 'bfloat16')}); copy bandwidth "
           f"{doc.get('copy_bandwidth_gbs', 0):.0f} GB/s, SM clock "
           f"{doc.get('sm_clock_mhz_start', 0):.0f}-{doc.get('sm_clock_mhz_end', 0):.0f} MHz, "
           f"{doc.get('sm_count', '?')} SMs.")
    meta = doc.get("metadata_build")
    if meta:
        run += (f" Metadata build ({meta['tokens']} tokens, {meta['adapters']} adapters): "
                f"cold {meta['cold_us']:.2f} us, graph {meta['graph_us']:.2f} us.")
    if vllm_line:
        run += " " + vllm_line
    head = [f"### LoRA kernels (`{source}`)", "", para(run)]
    if summary:
        head += ["", para("; ".join(summary) + ".")]
    head.append("")
    return head + out, summary


def e2e_table(doc, source, hf=None, explain=True):
    """explain: the breakdown table says what its columns mean (the first one does)."""
    w = doc.get("workload", {})
    tp = w.get("tensor_parallel_size", 1)
    text = (f"{doc.get('date', '?')}, commit `{doc.get('commit', '?')}`, `loraplex bench e2e`: "
            f"{doc.get('shape', '?')} ({doc.get('layers', '?')} layers, {doc.get('dtype', '?')})"
            f"{', tensor-parallel size %d' % tp if tp and tp > 1 else ''}, "
            f"{w.get('requests', '?')} requests of {w.get('prompt_len', '?')} + "
            f"{w.get('gen_len', '?')} tokens, {w.get('adapters', '?')} adapters of rank "
            f"{w.get('rank', '?')} ({w.get('distribution', '?')}); copy "
            f"{doc.get('copy_bandwidth_gbs', 0):.0f} GB/s, bf16 matmul "
            f"{doc.get('matmul_tflops_bf16', 0):.0f} TFLOP/s, decode-step floor "
            f"{doc.get('decode_step_floor_ms', 0):.2f} ms")
    if doc.get("decode_collectives_ms"):
        text += f" (of which the collectives, timed alone, {doc['decode_collectives_ms']:.2f} ms)"
    text += f", load {doc.get('load_s', 0):.2f} s."
    if doc.get("note"):
        text += " " + doc["note"] + "."
    hf_cfg = hf.get("configs", {}) if hf else {}
    # The anchor runs Llama-3-8B shapes only.
    hf_fits = hf and doc.get("shape") == "llama3-8b" and w.get("requests") == 32 and \
        w.get("prompt_len") == 128 and w.get("gen_len") == 64 and tp in (None, 1)
    if hf_fits:
        text += (f" HF transformers {hf['versions'].get('transformers', '?')} + PEFT "
                 f"{hf['versions'].get('peft', '?')} on the same GPU type ({hf.get('device', '?')}), "
                 "same workload shape, from `bench/results/" +
                 "h200_hf_peft_anchor.json`.")
    out = [f"### End to end (`{source}`)", "", para(text), "",
           "| configuration | tok/s | vs base | prefill s | decode step ms | % of floor |" +
           (" HF tok/s | x HF |" if hf_fits else ""),
           "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if hf_fits else "")]
    for name, r in doc.get("results", {}).items():
        row = "| %s | %s | %s | %s | %s | %s |" % (
            name, fmt(r.get("tok_s"), "%.1f"), fmt(r.get("ratio_to_base"), "%.3f"),
            fmt(r.get("prefill_s"), "%.3f"), fmt(r.get("decode_step_ms")),
            fmt(r.get("percent_of_floor"), "%.1f"))
        if hf_fits:
            h = hf_cfg.get(name, {}).get("tok_per_s")
            row += " %s | %s |" % (fmt(h, "%.1f"), fmt(r["tok_s"] / h if h else None, "%.1f"))
        out.append(row)
    parts = [(n, r["decode_step_breakdown_ms"]) for n, r in doc.get("results", {}).items()
             if r.get("decode_step_breakdown_ms")]
    if parts:
        comps = ["base_gemm", "attention", "lora", "norm_rope_act", "sampling", "other",
                 "host_gaps"]
        text = ("Where a decode step's time goes (CUPTI kernel records of a separate pass, "
                "ms per step; kernels on the LoRA stream overlap the base GEMMs, so the "
                "components can add up to more than the step; host_gaps: wall time with "
                "no kernel running, launch gaps inside the graph included):" if explain else
                "Where a decode step's time goes (ms per step, as above):")
        out += ["", para(text), "",
                "| configuration | " + " | ".join(comps) + " |",
                "|---|" + "---:|" * len(comps)]
        for n, b in parts:
            out.append(f"| {n} | " + " | ".join(fmt(b.get(c), "%.3f") for c in comps) + " |")
    return out + [""]


def paths_table(paths):
    """`bench e2e` runs of one call that differ only in --lora-decode: one row per workload and
    path, against its own base run, or, without one, a run of the same workload's."""
    docs = [(p, json.load(open(p))) for p in paths]
    key = lambda d: tuple(d.get("workload", {}).get(k) for k in
                          ("requests", "adapters", "prompt_len", "gen_len", "max_num_seqs"))
    bases = {key(d): d["results"]["base"] for _, d in docs if "base" in d.get("results", {})}
    first = docs[0][1]
    text = (f"{first.get('date', '?')}, commit `{first.get('commit', '?')}`, one call: "
            f"`loraplex bench e2e --shape {first.get('shape', '?')} --lora-decode PATH` "
            f"({first.get('dtype', '?')}, adapters of rank {first['workload'].get('rank', '?')} "
            "on all seven projections, uniform), the workloads of the targets: 32 requests of "
            "128 + 64 tokens, 256 of 128 + 16 over 64 adapters, one request. *fused*: the "
            "shrink as extra rows of each base GEMM, the expand in the op after it; *overlap*: "
            "the LoRA kernels on a second stream. HEAD's default (auto) takes overlap for steps of "
            "up to 16 tokens and fused above. The step's components "
            "(CUPTI, ms) come from the runs that were profiled. Files: " +
            ", ".join(f"`{p}`" for p, _ in docs) + ".")
    out = ["### LoRA in decode steps: the paths side by side", "", para(text), "",
           "| workload | path | base step ms | mixed step ms | mixed / base step | "
           "mixed / base tok/s | single / base tok/s | GEMMs ms | norm, RoPE, act ms |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for _, d in docs:
        w = d["workload"]
        base = d["results"].get("base") or bases.get(key(d), {})
        mixed = d["results"].get("mixed", {})
        single = d["results"].get("single", {})
        ratio = lambda r, k: (r[k] / base[k]) if r.get(k) and base.get(k) else None
        comp = mixed.get("decode_step_breakdown_ms", {})
        out.append("| %d x %d adapters | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            w.get("requests", 0), w.get("adapters", 0), d.get("lora_decode", "?"),
            fmt(base.get("decode_step_ms")), fmt(mixed.get("decode_step_ms")),
            fmt(ratio(mixed, "decode_step_ms"), "%.3f"), fmt(ratio(mixed, "tok_s"), "%.3f"),
            fmt(ratio(single, "tok_s"), "%.3f"), fmt(comp.get("base_gemm"), "%.2f"),
            fmt(comp.get("norm_rope_act"), "%.2f")))
    return out + [""]


def ab_table(old_path, new_path):
    """The kernel benchmark of two builds in one call: the ratio of every case and figure."""
    old, new = json.load(open(old_path)), json.load(open(new_path))
    key = lambda c: (c["op"], c["rank"], c["adapters"], c["tokens"], c["slices"])
    o = {key(c): c for c in old["results"]}
    ratios = []
    for c in new["results"]:
        if key(c) not in o:
            continue
        for m in ("cold_us", "graph_us", "graph_rotating_us"):
            if o[key(c)].get(m) and c.get(m):
                ratios.append((c[m] / o[key(c)][m], key(c), m))
    ratios.sort()
    med = ratios[len(ratios) // 2][0] if ratios else float("nan")
    worst = ratios[-1] if ratios else None
    line = (f"`loraplex bench kernels --quick` of commit `{old.get('commit', '?')}` (`{old_path}`) "
            f"and `{new.get('commit', '?')}` (`{new_path}`) in one call on an {new.get('device', '?')}: "
            f"{len(ratios)} figures, median new/old {med:.3f}")
    if worst:
        line += (f", slowest {worst[0]:.3f} ({worst[1][0]}, rank {worst[1][1]}, {worst[1][2]} "
                 f"adapters, {worst[1][3]} tokens, slices {worst[1][4]}, {worst[2]})")
    return ["### Kernel A/B", "", para(line + "."), ""]


def serve_table(doc, source):
    c = doc.get("config", {})
    runs = [k for k in ("lora", "base") if k in doc]
    how = (f"over HTTP against a running `loraplex serve` ({c.get('server', '?')}, on the same "
           "machine)" if c.get("transport") == "http" else "in process")
    out = [f"### Serving (`{source}`)", "",
           para(f"{c.get('date', '?')}, commit `{c.get('commit', '?')}`, `loraplex bench serve` "
           f"{how}: {c.get('model', '?')}, {c.get('num_requests', '?')} requests at rate "
           f"{c.get('rate', '?')}, prompts {c.get('prompt_len', '?')}, outputs "
           f"{c.get('output_len', '?')}, {c.get('adapters', '?')} adapters "
           f"({c.get('adapter_dist', '?')})" +
           (f", max_loras {c['max_loras']}" if "max_loras" in c else "") +
           (f", {c['dtype']}" if "dtype" in c else "") + "."), "",
           "| | " + " | ".join(runs) + " |", "|---|" + "---:|" * len(runs)]
    rows = [("output tokens/s", lambda j: fmt(j.get("output_throughput"), "%.1f")),
            ("requests/s", lambda j: fmt(j.get("request_throughput"))),
            ("TTFT p50 / p99 ms", lambda j: "%s / %s" % (fmt(j["ttft_ms"]["p50"], "%.1f"),
                                                        fmt(j["ttft_ms"]["p99"], "%.1f"))),
            ("ITL p50 / p99 ms", lambda j: "%s / %s" % (fmt(j["itl_ms"]["p50"]),
                                                       fmt(j["itl_ms"]["p99"]))),
            ("request latency p50 / p99 s", lambda j: "%s / %s" % (
                fmt(j["e2e_s"]["p50"], "%.3f"), fmt(j["e2e_s"]["p99"], "%.3f"))),
            ("queueing p99 ms", lambda j: fmt(j.get("queue_ms", {}).get("p99"), "%.1f")),
            ("adapters per step", lambda j: fmt(j.get("adapters_per_step"))),
            ("preemptions", lambda j: str(j.get("preemptions", "-"))),
            ("adapter evictions", lambda j: str(j.get("lora_evictions", "-")))]
    for name, f in rows:
        cells = [f(doc[k]) for k in runs]
        if any(v != "-" for v in cells):  # the engine's counters are not seen over HTTP
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    if doc.get("lora_vs_base"):
        r = doc["lora_vs_base"]
        out += ["", para(f"LoRA / no LoRA: output throughput x{r['throughput_ratio']:.3f}, "
                         f"p99 TTFT x{r['ttft_p99_ratio']:.1f}.")]
    return out + [""]


def read_sources(a, path):
    """Fills the arguments from a sources file (see --sources)."""
    with open(path) as f:
        src = json.load(f)
    a.kernels = src.get("kernels", [])
    a.vllm = src.get("vllm")
    a.vllm_run = src.get("vllm_run", "")
    a.hf = src.get("hf")
    a.e2e = src.get("e2e", [])
    a.paths = src.get("paths", [])
    a.ab = [tuple(pair) for pair in src.get("ab", [])]
    a.note = [n["device"] + "=" + n["text"] for n in src.get("note", [])]
    a.serve = [s["path"] + ("=" + s["device"] if s.get("device") else "")
               for s in src.get("serve", [])]
    a.from_sources = path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", action="append", default=[])
    p.add_argument("--vllm")
    p.add_argument("--vllm-run", default="")
    p.add_argument("--e2e", action="append", default=[])
    p.add_argument("--serve", action="append", default=[])
    p.add_argument("--hf", help="the HF transformers + PEFT anchor's JSON (hf_peft_bench.py)")
    p.add_argument("--paths", nargs="+", action="append", default=[], metavar="JSON",
                   help="`bench e2e` runs of one call that differ only in --lora-decode")
    p.add_argument("--ab", nargs=2, action="append", default=[], metavar=("OLD", "NEW"),
                   help="two `bench kernels` JSON files of one call: old and new build")
    p.add_argument("--note", action="append", default=[],
                   help="DEVICE=TEXT: a paragraph for a device's section (figures without JSON)")
    p.add_argument("--sources")
    p.add_argument("--out")
    p.add_argument("--check")
    p.add_argument("--summary", action="store_true")
    a = p.parse_args()
    named = a.kernels or a.e2e or a.serve or a.paths or a.ab or a.vllm or a.hf or a.note
    if a.sources or not named:
        read_sources(a, a.sources or "bench/benchmarks_sources.json")
    a.from_sources = getattr(a, "from_sources", None)
    vllm = load_vllm(a.vllm) if a.vllm else {}

    sections = defaultdict(list)  # device -> lines
    for path in a.kernels:
        doc = json.load(open(path))
        vllm_line = None
        if a.vllm:
            vllm_line = f"vLLM: `{a.vllm}`" + (f" ({a.vllm_run})." if a.vllm_run else ".")
        lines, summary = kernel_tables(doc, vllm, path, vllm_line)
        if a.summary:
            print(f"{path}: {doc['device']} at {doc.get('commit', '?')}: " +
                  ("; ".join(summary) if summary else "no vLLM figures matched"))
            continue
        sections[doc["device"]] += lines
    if a.summary:
        return
    hf = json.load(open(a.hf)) if a.hf else None
    for k, path in enumerate(a.e2e):
        doc = json.load(open(path))
        sections[doc.get("device", "?")] += e2e_table(doc, path, hf, explain=k == 0)
    for group in a.paths:
        sections[json.load(open(group[0])).get("device", "?")] += paths_table(group)
    for old, new in a.ab:
        sections[json.load(open(new)).get("device", "?")] += ab_table(old, new)
    for note in a.note:
        device, _, text = note.partition("=")
        sections[device] += [para(text), ""]
    for arg in a.serve:
        # PATH=DEVICE names the device of a run measured over HTTP (its client does not know it).
        path, _, device = arg.partition("=")
        doc = json.load(open(path))
        c = doc.get("config", {})
        sections[device or c.get("device_name", c.get("device", "?"))] += serve_table(doc, path)

    text = ["# Benchmarks", "",
            para("Generated by `scripts/benchmarks_md.py` from the result files in "
                 "`bench/results/`; do not edit by hand. Earlier results, and what each change did "
                 "to them, are in the git history of this file and of `bench/results/`."), "",
            METHOD]
    for device, lines in sections.items():
        text += [f"## {device}", ""] + lines
    made_by = ("python3 scripts/benchmarks_md.py --out BENCHMARKS.md" if a.from_sources else
               "python3 scripts/benchmarks_md.py " + shlex.join(sys.argv[1:]))
    text += ["Made by" + (f" (inputs and notes: `{a.from_sources}`)" if a.from_sources else "") +
             ":", "", "    " + made_by, ""]
    doc = "\n".join(text)
    if a.check:
        with open(a.check) as f:
            old = f.read()
        if old != doc:
            import difflib
            sys.stdout.writelines(difflib.unified_diff(
                old.splitlines(True), doc.splitlines(True), a.check, "regenerated"))
            sys.exit(f"{a.check} differs from what scripts/benchmarks_md.py makes of its "
                     "sources: regenerate it (see its end)")
        return
    if a.out:
        with open(a.out, "w") as f:
            f.write(doc)
    else:
        sys.stdout.write(doc)


if __name__ == "__main__":
    main()
