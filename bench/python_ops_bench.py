#!/usr/bin/env python3
"""loraplex.ops from Python against the C++ benchmark (`loraplex bench kernels`) on the same
cases: hidden 4096, bf16, ranks {16, 64}, adapters {1, 8, 32}, decode-sized token counts
{1, 16, 64} (round-robin over the adapters), slices {1: 4096, 3: 4096/1024/1024}.

Per case and op (linear = add_lora_linear, shrink = lora_shrink, expand = lora_expand):
  graph_us   20 calls captured in one CUDA graph, replayed; GPU time per call (what the
             kernels cost, binding included: lora_shrink zeroes its output first, as vLLM's,
             unless every token has an adapter and the kernel writes the whole output)
  eager_us   200 calls back to back on one stream, events around them, per call: the GPU time
             when the host keeps up, else the host's launch rate
  host_us    the Python call alone (perf_counter around the same 200 calls, no sync)
  cpp_graph_us  `loraplex bench kernels` graph figure of the same case; ratio = graph_us /
             cpp_graph_us (the binding-overhead target is <= 1.05)
With --vllm-anchor DIR (the shared harness's vllm_lora_ops and Triton installed), each case
also runs vLLM's _lora_shrink / _lora_expand on the same tensors, the same call, and prints the
largest difference from loraplex's outputs.

usage (GPU machine, after building with -DLORAPLEX_PYTHON=ON, e.g. scripts/gpu.sh build):
  PYTHONPATH=build/python python3 bench/python_ops_bench.py --cli build/tools/loraplex \
      [--quick] [--json out.json] [--vllm-anchor ../shared/anchors/vllm_bench]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from loraplex import ops

HIDDEN = 4096
GRAPH_CALLS = 20
EAGER_CALLS = 200


def make_case(rank, adapters, tokens, slices, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    widths = [HIDDEN] if slices == 1 else [HIDDEN, 1024, 1024]

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    case = {
        "widths": widths,
        "x": randn(tokens, HIDDEN, scale=1.0),
        "a": [randn(adapters, rank, HIDDEN, scale=0.02) for _ in widths],
        "b": [randn(adapters, n, rank, scale=0.02) for n in widths],
        "y": randn(tokens, sum(widths), scale=1.0),
        "mid": torch.zeros(len(widths), tokens, rank, device="cuda"),
        "mapping": (torch.arange(tokens, device="cuda") % adapters).to(torch.int32),
    }
    meta = ops.LoRAKernelMeta.make(adapters, tokens, torch.device("cuda", torch.cuda.current_device()))
    meta.prepare_tensors(case["mapping"])
    case["meta"] = meta
    case["args"] = meta.meta_args(tokens)
    return case


def calls(case):
    args = case["args"]
    return {
        "linear": lambda: ops.add_lora_linear(case["y"], case["x"], case["a"], case["b"], 1.0,
                                              case["widths"], args),
        "shrink": lambda: ops.lora_shrink(case["x"], case["a"], case["mid"], *args, 1.0),
        "expand": lambda: ops.lora_expand(case["mid"], case["b"], case["y"], *args, 0, True),
    }


def time_graph(fn, replays=20):
    fn()  # first call: slot ranks and scratch are set up outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / GRAPH_CALLS)
    times.sort()
    return times[len(times) // 2]


def time_eager(fn):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(EAGER_CALLS):
        fn()
    host = (time.perf_counter() - t0) * 1e6 / EAGER_CALLS
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / EAGER_CALLS, host


def cpp_graph_times(cli, tokens_list, quick):
    """(op, rank, adapters, tokens, slices) -> graph_us from `loraplex bench kernels`."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in tokens_list:
            path = os.path.join(tmp, f"k{tokens}.json")
            cmd = [cli, "bench", "kernels", "--json", path, "--iters", "10",
                   "--no-path-comparison", "--no-metadata", "--only", f"*:*:*:{tokens}:*"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(path) as f:
                for r in json.load(f)["results"]:
                    slices = 1 if r["slices"] == "4096" else 3
                    key = (r["op"], r["rank"], r["adapters"], r["tokens"], slices)
                    out[key] = r["graph_us"]
    return out


def vllm_difference(anchor, case, rank, adapters, tokens):
    """Largest |loraplex - vLLM| of shrink and expand outputs for the same call."""
    sys.path.insert(0, anchor)
    import vllm_lora_ops as V

    vmeta = V.LoRAKernelMeta.make(adapters, tokens, "cuda")
    vmeta.prepare_tensors(case["mapping"])
    vargs = vmeta.meta_args(tokens, False)
    ours_mid = torch.empty_like(case["mid"])
    theirs_mid = torch.empty_like(case["mid"])
    ops.lora_shrink(case["x"], case["a"], ours_mid, *case["args"], 0.5)
    V._lora_shrink(case["x"], case["a"], theirs_mid, *vargs, 0.5)
    ours_y, theirs_y = case["y"].clone(), case["y"].clone()
    ops.lora_expand(ours_mid, case["b"], ours_y, *case["args"], 0, True)
    V._lora_expand(ours_mid, case["b"], theirs_y, *vargs, 0, True)
    torch.cuda.synchronize()
    return (float((ours_mid - theirs_mid).abs().max()),
            float((ours_y.float() - theirs_y.float()).abs().max()))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cli", help="the loraplex binary (for the C++ figures); none: Python only")
    p.add_argument("--quick", action="store_true", help="adapters 8 and tokens 16 only")
    p.add_argument("--json", help="write the rows as JSON")
    p.add_argument("--vllm-anchor", help="folder holding vllm_lora_ops (needs Triton)")
    a = p.parse_args()
    ranks = [16, 64]
    adapters_list = [8] if a.quick else [1, 8, 32]
    tokens_list = [16] if a.quick else [1, 16, 64]
    cpp = cpp_graph_times(a.cli, tokens_list, a.quick) if a.cli else {}
    print(f"device {torch.cuda.get_device_name()}, bf16, hidden {HIDDEN}")
    print(f"{'op':7} {'rank':>4} {'lora':>4} {'tok':>4} {'sl':>2} {'graph_us':>9} "
          f"{'cpp_us':>8} {'ratio':>6} {'eager_us':>9} {'host_us':>8}")
    rows = []
    for rank in ranks:
        for adapters in adapters_list:
            for tokens in tokens_list:
                for slices in (1, 3):
                    case = make_case(rank, adapters, tokens, slices)
                    for op, fn in calls(case).items():
                        graph_us = time_graph(fn)
                        eager_us, host_us = time_eager(fn)
                        ref = cpp.get((op, rank, adapters, tokens, slices))
                        ratio = graph_us / ref if ref else None
                        rows.append({"op": op, "rank": rank, "adapters": adapters,
                                     "tokens": tokens, "slices": slices, "graph_us": graph_us,
                                     "cpp_graph_us": ref, "ratio": ratio, "eager_us": eager_us,
                                     "host_us": host_us})
                        print(f"{op:7} {rank:4} {adapters:4} {tokens:4} {slices:2} "
                              f"{graph_us:9.2f} {ref or float('nan'):8.2f} "
                              f"{ratio or float('nan'):6.3f} {eager_us:9.2f} {host_us:8.2f}")
                    if a.vllm_anchor:
                        mid, y = vllm_difference(a.vllm_anchor, case, rank, adapters, tokens)
                        print(f"        vs vLLM Triton: shrink max |diff| {mid:.3g}, "
                              f"expand max |diff| {y:.3g}")
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    if ratios:
        worst = max(ratios)
        print(f"graph time / C++ graph time: median {sorted(ratios)[len(ratios) // 2]:.3f}, "
              f"worst {worst:.3f} ({'within' if worst <= 1.05 else 'above'} 1.05)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
