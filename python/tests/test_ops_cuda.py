"""loraplex.ops on CUDA torch tensors against torch references in float64 (skipped without a
GPU; LORAPLEX_REQUIRE_GPU=1 turns the skip into a failure, as for the C++ tests). The CUDA
expands round the fp32 intermediate to the weights' dtype before multiplying, as vLLM's do:
the tolerances allow that rounding (vLLM's own kernel tests use 6e-2 for fp16/bf16)."""

import os

import numpy as np
import pytest

import loraplex
from loraplex import ops

import lora_reference as ref

torch = pytest.importorskip("torch")

if not (torch.cuda.is_available() and loraplex.built_with_cuda()):
    if os.environ.get("LORAPLEX_REQUIRE_GPU"):
        pytest.fail("LORAPLEX_REQUIRE_GPU is set but torch or loraplex sees no CUDA device",
                    pytrace=False)
    pytest.skip("needs a CUDA GPU and a CUDA build of loraplex", allow_module_level=True)

DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def dev(a, dtype):
    return torch.from_numpy(np.asarray(a, dtype=np.float64)).to("cuda", dtype)


def back(t):
    return t.detach().to("cpu", torch.float64).numpy()


def meta_for(mapping, max_loras, max_tokens=512):
    meta = ops.LoRAKernelMeta.make(max_loras, max_tokens, torch.device("cuda", 0))
    meta.prepare_tensors(torch.from_numpy(np.asarray(mapping, np.int32)).cuda())
    return meta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 32, 77, 300])
@pytest.mark.parametrize("distribution", ref.DISTRIBUTIONS)
@pytest.mark.parametrize("rank", [8, 64])
def test_shrink_expand_and_linear(dtype, num_tokens, distribution, rank):
    rng = np.random.default_rng(num_tokens + rank)
    max_loras, hidden, widths = 8, 1024, (1024, 256, 256)
    mapping = ref.mapping_of(distribution, num_tokens, max_loras, rng)
    x = back(dev(ref.rand(rng, num_tokens, hidden), dtype))
    lora_a = [back(dev(ref.rand(rng, max_loras, rank, hidden, scale=0.05), dtype)) for _ in widths]
    lora_b = [back(dev(ref.rand(rng, max_loras, n, rank, scale=0.05), dtype)) for n in widths]
    meta = meta_for(mapping, max_loras)
    args = meta.meta_args(num_tokens)

    shrunk = torch.full((3, num_tokens, rank), 5.0, device="cuda")
    ops.lora_shrink(dev(x, dtype), [dev(a, dtype) for a in lora_a], shrunk, *args, 0.5)
    want = ref.shrink(x, lora_a, mapping, 0.5)
    ref.assert_close(back(shrunk), want, 1e-4, "shrink")

    y0 = back(dev(ref.rand(rng, num_tokens, sum(widths)), dtype))
    y = dev(y0, dtype)
    ops.lora_expand(shrunk, [dev(b, dtype) for b in lora_b], y, *args, 0, True)
    ref.assert_close(back(y), ref.expand(back(shrunk), lora_b, y0, mapping, 0, True),
                     TOL[dtype], "expand")

    y = dev(y0, dtype)
    ops.add_lora_linear(y, dev(x, dtype), [dev(a, dtype) for a in lora_a],
                        [dev(b, dtype) for b in lora_b], 0.5, widths, args)
    torch.cuda.synchronize()
    ref.assert_close(back(y), ref.lora_linear(y0, x, lora_a, lora_b, mapping, 0.5), TOL[dtype],
                     "add_lora_linear")


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_run_on_the_callers_stream_and_in_cuda_graphs(dtype):
    rng = np.random.default_rng(1)
    max_loras, rank, hidden, n, num_tokens = 4, 16, 512, 512, 32
    mapping = ref.mapping_of("mixed_with_base", num_tokens, max_loras, rng)
    x = dev(ref.rand(rng, num_tokens, hidden), dtype)
    a = dev(ref.rand(rng, max_loras, rank, hidden, scale=0.05), dtype)
    b = dev(ref.rand(rng, max_loras, n, rank, scale=0.05), dtype)
    y0 = dev(ref.rand(rng, num_tokens, n), dtype)
    meta = meta_for(mapping, max_loras)
    args = meta.meta_args(num_tokens)
    eager = y0.clone()
    ops.add_lora_linear(eager, x, [a], [b], 1.0, [n], args)  # also warms up (ranks, scratch)
    want = ref.lora_linear(back(y0), back(x), [back(a)], [back(b)], mapping, 1.0)
    ref.assert_close(back(eager), want, TOL[dtype], "add_lora_linear")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = y0.clone()
        ops.add_lora_linear(on_side, x, [a], [b], 1.0, [n], args)
    torch.cuda.current_stream().wait_stream(side)
    # Split-K partial sums may be added in another order from run to run: one bf16/fp16 step.
    torch.testing.assert_close(on_side, eager, rtol=1e-2, atol=1e-2)

    captured = y0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.add_lora_linear(captured, x, [a], [b], 1.0, [n], args)
    captured.copy_(y0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, rtol=1e-2, atol=1e-2)
    assert not torch.equal(captured, y0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [2, 100])
def test_fused_moe_lora(dtype, num_tokens):
    rng = np.random.default_rng(num_tokens)
    max_loras, experts, top_k, rank, hidden, n = 4, 16, 4, 16, 256, 128
    mapping = ref.mapping_of("mixed_with_base", num_tokens, max_loras, rng)
    topk_ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(num_tokens)])
    weights = rng.random((num_tokens, top_k)).astype(np.float32)
    x = back(dev(ref.rand(rng, num_tokens * top_k, hidden), dtype))
    a = back(dev(ref.rand(rng, max_loras, experts, rank, hidden, scale=0.05), dtype))
    b = back(dev(ref.rand(rng, max_loras, experts, n, rank, scale=0.05), dtype))
    out0 = back(dev(ref.rand(rng, num_tokens, top_k, n), dtype))
    out = dev(out0, dtype)
    meta = meta_for(mapping, max_loras)
    ops.fused_moe_lora(out, dev(x, dtype), [dev(a, dtype)], [dev(b, dtype)],
                       torch.from_numpy(weights).cuda(),
                       torch.from_numpy(topk_ids.astype(np.int32)).cuda(),
                       meta.meta_args(num_tokens), mul_routed_weight=True)
    torch.cuda.synchronize()
    want = ref.fused_moe(out0, x, [a], [b], topk_ids, weights.astype(np.float64), mapping, None,
                         True, 0, True)
    ref.assert_close(back(out), want, TOL[dtype], "fused_moe_lora")
