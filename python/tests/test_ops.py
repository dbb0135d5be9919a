"""loraplex.ops on the CPU against float64 references: numpy arrays (float32) and torch CPU
tensors (float32, float16, bfloat16), called as vLLM calls its Triton ops."""

import numpy as np
import pytest

import loraplex
from loraplex import ops

import lora_reference as ref

try:
    import torch
except ModuleNotFoundError:
    torch = None


class Numpy:
    name = "numpy-float32"
    framework = "numpy"
    tol = 1e-5  # outputs in float32

    def array(self, a, dtype=None):
        return np.ascontiguousarray(a, dtype=dtype or np.float32)

    def f32(self, a):
        return np.ascontiguousarray(a, dtype=np.float32)

    def i32(self, a):
        return np.ascontiguousarray(a, dtype=np.int32)

    def back(self, a):
        return np.asarray(a, dtype=np.float64)


class Torch:
    framework = "torch"

    def __init__(self, dtype, tol, device="cpu"):
        self.dtype = dtype
        self.tol = tol
        self.device = device
        self.name = f"torch-{str(dtype).replace('torch.', '')}"

    def array(self, a):
        return torch.from_numpy(np.asarray(a, dtype=np.float64)).to(self.device, self.dtype)

    def f32(self, a):
        return torch.from_numpy(np.asarray(a, dtype=np.float64)).to(self.device, torch.float32)

    def i32(self, a):
        return torch.from_numpy(np.asarray(a, dtype=np.int32)).to(self.device)

    def back(self, a):
        return a.detach().to("cpu", torch.float64).numpy()


FRAMEWORKS = [Numpy()]
if torch is not None:
    FRAMEWORKS += [Torch(torch.float32, 1e-5), Torch(torch.float16, 2e-3),
                   Torch(torch.bfloat16, 1.6e-2)]
FRAMEWORK_IDS = [f.name for f in FRAMEWORKS]


def rounded(fw, a):
    """The float64 values the op actually sees after conversion to the framework's dtype."""
    return fw.back(fw.array(a))


def make_meta(fw, mapping, max_loras):
    meta = ops.LoRAKernelMeta.make(max_loras, 128, "cpu", framework=fw.framework)
    meta.prepare_tensors(fw.i32(mapping))
    return meta


CASES = [(n, d) for n in (1, 3, 77) for d in ref.DISTRIBUTIONS]


@pytest.mark.parametrize("fw", FRAMEWORKS, ids=FRAMEWORK_IDS)
@pytest.mark.parametrize("num_tokens,distribution", CASES)
@pytest.mark.parametrize("num_slices", [1, 3])
def test_lora_shrink(fw, num_tokens, distribution, num_slices):
    rng = np.random.default_rng(num_tokens * 10 + num_slices)
    max_loras, rank, hidden, scale = 4, 8, 67, 0.5
    mapping = ref.mapping_of(distribution, num_tokens, max_loras, rng)
    x = rounded(fw, ref.rand(rng, num_tokens, hidden))
    lora_a = [rounded(fw, ref.rand(rng, max_loras, 1, rank, hidden, scale=0.1))
              for _ in range(num_slices)]
    # Never read: zeroed first, unless no token has LoRA (then vLLM's op returns at once).
    out = fw.f32(np.full((num_slices, num_tokens, rank), 7.0))
    meta = make_meta(fw, mapping, max_loras)
    ops.lora_shrink(fw.array(x), [fw.array(a) for a in lora_a], out,
                    *meta.meta_args(num_tokens), scale)
    want = ref.shrink(x, [a[:, 0] for a in lora_a], mapping, scale)
    if np.all(mapping < 0):
        want[:] = 7.0
    ref.assert_close(fw.back(out), want, 1e-5, "shrink")


@pytest.mark.parametrize("fw", FRAMEWORKS, ids=FRAMEWORK_IDS)
@pytest.mark.parametrize("num_tokens,distribution", CASES)
@pytest.mark.parametrize("add_inputs", [True, False])
def test_lora_expand(fw, num_tokens, distribution, add_inputs):
    rng = np.random.default_rng(num_tokens + add_inputs)
    max_loras, rank, offset = 4, 16, 5
    widths = [33, 17, 17]  # q, k, v of different widths (GQA)
    mapping = ref.mapping_of(distribution, num_tokens, max_loras, rng)
    inputs = ref.rand(rng, len(widths), num_tokens, rank).astype(np.float32).astype(np.float64)
    lora_b = [rounded(fw, ref.rand(rng, max_loras, n, rank, scale=0.2)) for n in widths]
    y0 = rounded(fw, ref.rand(rng, num_tokens, offset + sum(widths) + 3))
    y = fw.array(y0)
    meta = make_meta(fw, mapping, max_loras)
    ops.lora_expand(fw.f32(inputs), [fw.array(b) for b in lora_b], y,
                    *meta.meta_args(num_tokens), offset_start=offset, add_inputs=add_inputs)
    want = ref.expand(inputs, lora_b, y0, mapping, offset, add_inputs)
    got = fw.back(y)
    ref.assert_close(got, want, fw.tol, "expand")
    # Tokens without LoRA and the columns outside the slices are left exactly as they were.
    base = mapping < 0
    assert np.array_equal(got[base], y0[base])
    assert np.array_equal(got[:, :offset], y0[:, :offset])
    assert np.array_equal(got[:, offset + sum(widths):], y0[:, offset + sum(widths):])


@pytest.mark.parametrize("fw", FRAMEWORKS, ids=FRAMEWORK_IDS)
@pytest.mark.parametrize("num_tokens,distribution", CASES)
@pytest.mark.parametrize("own_buffer", [False, True])
def test_add_lora_linear(fw, num_tokens, distribution, own_buffer):
    rng = np.random.default_rng(3 * num_tokens + own_buffer)
    max_loras, rank, hidden, scale = 3, 8, 45, 1.0
    widths = (24, 24)  # gate and up
    mapping = ref.mapping_of(distribution, num_tokens, max_loras, rng)
    x = rounded(fw, ref.rand(rng, num_tokens, hidden))
    lora_a = [rounded(fw, ref.rand(rng, max_loras, rank, hidden, scale=0.1)) for _ in widths]
    lora_b = [rounded(fw, ref.rand(rng, max_loras, 1, n, rank, scale=0.1)) for n in widths]
    y0 = rounded(fw, ref.rand(rng, num_tokens, sum(widths)))
    y = fw.array(y0)
    meta = make_meta(fw, mapping, max_loras)
    buffer = fw.f32(np.zeros(len(widths) * num_tokens * rank)) if own_buffer else None
    ops.add_lora_linear(y, fw.array(x), [fw.array(a) for a in lora_a],
                        [fw.array(b) for b in lora_b], scale, widths,
                        meta.meta_args(num_tokens), buffer=buffer)
    want = ref.lora_linear(y0, x, lora_a, [b[:, 0] for b in lora_b], mapping, scale)
    ref.assert_close(fw.back(y), want, fw.tol, "add_lora_linear")


@pytest.mark.parametrize("fw", FRAMEWORKS, ids=FRAMEWORK_IDS)
@pytest.mark.parametrize("num_tokens", [2, 37])  # 2: vLLM's naive blocks; 37: aligned blocks
@pytest.mark.parametrize("projection", ["w13", "w2"])
def test_fused_moe_lora(fw, num_tokens, projection):
    rng = np.random.default_rng(num_tokens)
    max_loras, experts, top_k, rank, hidden, n, offset = 4, 8, 2, 8, 40, 24, 3
    w13 = projection == "w13"
    num_slices = 2 if w13 else 1
    mapping = ref.mapping_of("mixed_with_base", num_tokens, max_loras, rng)
    topk_ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(num_tokens)])
    topk_ids[0, 0] = -1  # an expert of another rank
    topk_weights = rng.random((num_tokens, top_k)).astype(np.float32).astype(np.float64)
    enabled = np.array([1, 1, 0, 1], dtype=np.int32)  # slot 2 has no MoE LoRA
    rows = num_tokens if w13 else num_tokens * top_k
    x = rounded(fw, ref.rand(rng, rows, hidden))
    lora_a = [rounded(fw, ref.rand(rng, max_loras, experts, rank, hidden, scale=0.1))
              for _ in range(num_slices)]
    lora_b = [rounded(fw, ref.rand(rng, max_loras, experts, n, rank, scale=0.1))
              for _ in range(num_slices)]
    out0 = rounded(fw, ref.rand(rng, num_tokens, top_k, offset + num_slices * n))
    out = fw.array(out0)
    meta = make_meta(fw, mapping, max_loras)
    ops.fused_moe_lora(out, fw.array(x), [fw.array(a) for a in lora_a],
                       [fw.array(b) for b in lora_b], fw.f32(topk_weights), fw.i32(topk_ids),
                       meta.meta_args(num_tokens), block_size=4, adapter_enabled=fw.i32(enabled),
                       mul_routed_weight=not w13, offset=offset)
    want = ref.fused_moe(out0, x, lora_a, lora_b, topk_ids, topk_weights, mapping, enabled,
                         not w13, offset, True)
    ref.assert_close(fw.back(out), want, fw.tol, "fused_moe_lora")


@pytest.mark.parametrize("fw", FRAMEWORKS[:2], ids=FRAMEWORK_IDS[:2])
def test_kernel_meta_as_vllm_builds_it(fw):
    max_loras = 3
    mapping = np.array([2, -1, 0, 2, 2, -1, 1, 0, 2], dtype=np.int32)
    meta = ops.LoRAKernelMeta.make(max_loras, 16, "cpu", framework=fw.framework)
    wide = mapping.astype(np.int64)
    meta.prepare_tensors(wide if fw.framework == "numpy" else torch.from_numpy(wide))
    (token_map, sorted_ids, counts, start, ids, no_lora, active) = meta.meta_args(len(mapping))
    assert type(token_map).__module__.split(".")[0] == fw.framework
    ids_want, counts_want = np.unique(mapping, return_counts=True)
    k = len(ids_want)
    assert np.asarray(token_map).tolist() == mapping.tolist()
    assert np.asarray(sorted_ids).tolist() == np.argsort(mapping, kind="stable").tolist()
    assert np.asarray(ids)[:k].tolist() == ids_want.tolist()
    assert np.asarray(counts)[:k].tolist() == counts_want.tolist()
    assert np.asarray(start)[: k + 1].tolist() == [0, *np.cumsum(counts_want).tolist()]
    assert np.asarray(ids).shape == (max_loras + 1,) and np.asarray(start).shape == (5,)
    assert bool(np.asarray(no_lora)[0]) is False
    assert int(np.asarray(active)[0]) == max_loras + 1  # vLLM's value unless specialising
    assert int(np.asarray(meta.meta_args(len(mapping), True)[6])[0]) == k

    meta.prepare_tensors(fw.i32(np.full(4, -1)))
    no_lora = meta.meta_args(4)[5]
    assert bool(np.asarray(no_lora)[0]) is True


def test_no_lora_batches_leave_outputs_alone():
    """As vLLM: when no token has an adapter the ops return before touching anything."""
    fw = Numpy()
    meta = make_meta(fw, np.full(5, -1), 2)
    out = fw.f32(np.full((1, 5, 4), 3.0))
    ops.lora_shrink(fw.f32(np.ones((5, 8))), [fw.f32(np.ones((2, 4, 8)))], out,
                    *meta.meta_args(5), 1.0)
    assert np.all(out == 3.0)


def test_column_slice_of_a_wider_array_is_used_in_place():
    """x and y may be column slices (contiguous rows, row stride above the width)."""
    rng = np.random.default_rng(5)
    max_loras, rank, hidden, n = 2, 4, 16, 8
    mapping = np.array([1, 0, -1, 1], dtype=np.int32)
    wide_x = rng.standard_normal((4, hidden + 5)).astype(np.float32)
    wide_y = rng.standard_normal((4, n + 7)).astype(np.float32)
    before = wide_y.copy()
    a = rng.standard_normal((max_loras, rank, hidden)).astype(np.float32)
    b = rng.standard_normal((max_loras, n, rank)).astype(np.float32)
    meta = make_meta(Numpy(), mapping, max_loras)
    ops.add_lora_linear(wide_y[:, 2:2 + n], wide_x[:, :hidden], [a], [b], 1.0, [n],
                        meta.meta_args(4))
    want = ref.lora_linear(before[:, 2:2 + n].astype(np.float64),
                           wide_x[:, :hidden].astype(np.float64), [a.astype(np.float64)],
                           [b.astype(np.float64)], mapping, 1.0)
    ref.assert_close(wide_y[:, 2:2 + n], want, 1e-5, "slice")
    assert np.array_equal(wide_y[:, :2], before[:, :2])
    assert np.array_equal(wide_y[:, 2 + n:], before[:, 2 + n:])


def test_op_errors_carry_the_cpp_message():
    fw = Numpy()
    meta = make_meta(fw, np.array([0, 1, 0]), 2)
    x = fw.f32(np.ones((3, 8)))
    out = fw.f32(np.zeros((1, 3, 4)))
    with pytest.raises(loraplex.LoraplexError, match="not from loraplex.ops.LoRAKernelMeta"):
        ops.lora_shrink(x, [fw.f32(np.ones((2, 4, 8)))], out, np.zeros(3, np.int32),
                        *meta.meta_args(3)[1:], 1.0)
    with pytest.raises(loraplex.LoraplexError, match=r"input size 9, x has 8"):
        ops.lora_shrink(x, [fw.f32(np.ones((2, 4, 9)))], out, *meta.meta_args(3), 1.0)
    with pytest.raises(loraplex.LoraplexError, match=r"stacks 3 slots, expected max_loras 2"):
        ops.lora_shrink(x, [fw.f32(np.ones((3, 4, 8)))], out, *meta.meta_args(3), 1.0)
    with pytest.raises(loraplex.LoraplexError, match="the inputs have 4 tokens"):
        ops.lora_shrink(fw.f32(np.ones((4, 8))), [fw.f32(np.ones((2, 4, 8)))], out,
                        *meta.meta_args(3), 1.0)
    with pytest.raises(loraplex.LoraplexError, match="must be contiguous"):
        ops.lora_shrink(x, [fw.f32(np.ones((2, 8, 4))).transpose(0, 2, 1)], out,
                        *meta.meta_args(3), 1.0)
    with pytest.raises(loraplex.LoraplexError, match="token_nums 5"):
        meta.meta_args(5)
    with pytest.raises(loraplex.LoraplexError, match=r"token_lora_mapping\[1\] = -2"):
        meta.prepare_tensors(np.array([0, -2], dtype=np.int32))
