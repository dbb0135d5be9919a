"""loraplex's multi-LoRA ops on any DLPack array (torch, CuPy; numpy on the CPU), in place
and zero-copy, on the caller's current CUDA stream, with the argument conventions of vLLM's
Triton ops, so that a vLLM-style caller swaps its imports:

    from loraplex.ops import LoRAKernelMeta, lora_shrink, lora_expand

    meta = LoRAKernelMeta.make(max_loras, max_num_tokens, device="cuda:0")
    meta.prepare_tensors(token_lora_mapping)                  # slot per token, -1 = none
    lora_shrink(x, lora_a_stacked, buffer, *meta.meta_args(num_tokens), scale)
    lora_expand(buffer, lora_b_stacked, y, *meta.meta_args(num_tokens), offset_start=0,
                add_inputs=True)

Weights are slot-stacked as vLLM stacks them: LoRA-A [max_loras, (1,) rank, in], LoRA-B
[max_loras, (1,) out, rank]; every slot runs at the stacked rank. The ops read the metadata
that LoRAKernelMeta built (the arrays meta_args() returns are views of its buffers and name
it), so the metadata must come from loraplex's LoRAKernelMeta, not vLLM's.

Every op takes `stream=` (an int handle, a torch.cuda.Stream or a cupy Stream); by default
it runs on the current stream of the framework the inputs come from.
"""

from __future__ import annotations

import sys
from typing import Any, List, Optional, Sequence, Tuple

from loraplex import _C

__all__ = [
    "LoRAKernelMeta",
    "lora_shrink",
    "lora_expand",
    "add_lora_linear",
    "fused_moe_lora",
]

_KDL_CUDA = 2


def _device_name(device: Any) -> str:
    if isinstance(device, int):
        return f"cuda:{device}"
    name = str(device)
    if name == "cuda":
        torch = sys.modules.get("torch")
        index = torch.cuda.current_device() if torch is not None else 0
        return f"cuda:{index}"
    return name


def _stream_handle(array: Any, stream: Any) -> int:
    """The CUDA stream to run on: `stream` when given, else the current stream of the
    framework that `array` belongs to (0, the legacy default stream, for others)."""
    if stream is not None:
        for attr in ("cuda_stream", "ptr"):
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        return int(stream)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        # Not __dlpack_device__: for torch it asks whether the memory is pinned, which costs
        # more than the rest of a small op's call.
        return torch.cuda.current_stream(array.get_device()).cuda_stream if array.is_cuda else 0
    device_type, device_id = array.__dlpack_device__()
    if device_type != _KDL_CUDA:
        return 0
    if type(array).__module__.startswith("cupy"):
        return sys.modules["cupy"].cuda.get_current_stream().ptr
    return 0


def _dl(array: Any) -> Any:
    """`array` as nanobind should import it. torch tensors are handed over as DLPack capsules
    made by torch's C exporter: several times cheaper than nanobind calling the Python
    __dlpack__ method, and without stream synchronisation (the op runs on the caller's stream;
    the producer-side event older torch versions add costs time and breaks CUDA graph
    capture). Tensors that require grad are exported detached (torch refuses them otherwise)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        if array.requires_grad:
            array = array.detach()
        export = getattr(torch.utils.dlpack, "to_dlpack", None)
        return export(array) if export is not None else array.__dlpack__(stream=-1)
    return array


def _dl_list(arrays: Sequence[Any]) -> List[Any]:
    return [_dl(a) for a in arrays]


class LoRAKernelMeta:
    """vLLM's LoRAKernelMeta: the per-step grouping of tokens by adapter slot, built on the
    device once per step and read by every op of the step. make(), prepare_tensors() and
    meta_args() as in vLLM; the arrays come back in the framework of `framework` ("torch",
    "cupy", "numpy"; default: torch when the device is a torch.device or torch is imported,
    else numpy on the CPU and CuPy on a GPU)."""

    def __init__(self, impl: "_C.ops.KernelMeta", framework: str) -> None:
        self._impl = impl
        self._framework = framework
        self._args: dict = {}

    @staticmethod
    def make(
        max_loras: int,
        max_num_tokens: int,
        device: Any,
        captured_lora_counts: Optional[List[int]] = None,
        max_num_reqs: Optional[int] = None,
        *,
        framework: Optional[str] = None,
    ) -> "LoRAKernelMeta":
        if max_num_reqs is not None:
            raise ValueError("per-request LoRA scales (max_num_reqs) are not supported")
        if framework is None:
            is_torch_device = type(device).__module__.startswith("torch")
            if is_torch_device or "torch" in sys.modules:
                framework = "torch"
            else:
                framework = "numpy" if _device_name(device) == "cpu" else "cupy"
        impl = _C.ops.KernelMeta(max_loras, max_num_tokens, _device_name(device))
        return LoRAKernelMeta(impl, framework)

    @property
    def max_loras(self) -> int:
        return self._impl.max_loras

    def prepare_tensors(self, token_lora_mapping: Any, *, stream: Any = None) -> None:
        """Builds the metadata for a mapping (int32 or int64 [num_tokens], slot per token, -1 =
        base model), on the host or the device (then read back, as vLLM reads its no-LoRA
        flag)."""
        self._args.clear()
        self._impl.prepare(_dl(token_lora_mapping), _stream_handle(token_lora_mapping, stream))

    def _wrap(self, array: Any) -> Any:
        if self._framework == "torch":
            return sys.modules["torch"].from_dlpack(array)
        if self._framework == "cupy":
            import cupy

            return cupy.from_dlpack(array)
        import numpy

        return numpy.from_dlpack(array)

    def meta_args(self, token_nums: int, specialize_active_lora: bool = False) -> Tuple[Any, ...]:
        """The seven metadata arguments of lora_shrink / lora_expand: token_lora_mapping,
        token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc,
        lora_ids, no_lora_flag_cpu, num_active_loras (views of this object's buffers)."""
        key = (token_nums, bool(specialize_active_lora))
        args = self._args.get(key)
        if args is None:
            raw = self._impl.meta_args(token_nums, bool(specialize_active_lora))
            args = tuple(self._wrap(a) for a in raw)
            self._args[key] = args
        return args


def _meta_mapping(meta: Any) -> Any:
    """The token mapping that names the metadata: from a LoRAKernelMeta or its meta_args()."""
    if isinstance(meta, LoRAKernelMeta):
        raise TypeError("pass meta.meta_args(num_tokens), which fixes the token count")
    return meta[0]


def lora_shrink(
    inputs: Any,
    lora_a_weights: Sequence[Any],
    output_tensor: Any,
    token_lora_mapping: Any,
    token_indices_sorted_by_lora_ids: Any,
    num_tokens_per_lora: Any,
    lora_token_start_loc: Any,
    lora_ids: Any,
    no_lora_flag_cpu: Any,
    num_active_loras: Any,
    scaling: float,
    *,
    stream: Any = None,
) -> None:
    """output[s, t, :] = scaling * inputs[t] @ lora_a_weights[s][slot(t)]^T, output zeroed
    first (rows of tokens without LoRA stay zero), as vLLM's lora_shrink.
    inputs [num_tokens, hidden] (f16/bf16, or f32); lora_a_weights per slice [max_loras, (1,)
    rank, hidden] of the inputs' dtype; output_tensor float32 [num_slices, num_tokens, rank]."""
    _C.ops.lora_shrink(
        _dl(inputs), _dl_list(lora_a_weights), _dl(output_tensor), _dl(token_lora_mapping),
        float(scaling), _stream_handle(inputs, stream),
    )


def lora_expand(
    inputs: Any,
    lora_b_weights: Sequence[Any],
    output_tensor: Any,
    token_lora_mapping: Any,
    token_indices_sorted_by_lora_ids: Any,
    num_tokens_per_lora: Any,
    lora_token_start_loc: Any,
    lora_ids: Any,
    no_lora_flag_cpu: Any,
    num_active_loras: Any,
    offset_start: int = 0,
    add_inputs: bool = False,
    *,
    stream: Any = None,
) -> None:
    """output[t, off_s : off_s + n_s] (+)= inputs[s, t] @ lora_b_weights[s][slot(t)]^T with
    off_0 = offset_start, slices side by side, as vLLM's lora_expand. inputs [num_slices,
    num_tokens, rank] (f32 or the output's dtype); lora_b_weights per slice [max_loras, (1,)
    n_s, rank]; output_tensor [num_tokens, >= offset_start + sum n_s]."""
    _C.ops.lora_expand(
        _dl(inputs), _dl_list(lora_b_weights), _dl(output_tensor), _dl(token_lora_mapping),
        int(offset_start), bool(add_inputs), _stream_handle(inputs, stream),
    )


def add_lora_linear(
    y: Any,
    x: Any,
    lora_a_stacked: Sequence[Any],
    lora_b_stacked: Sequence[Any],
    scale: float,
    output_slices: Sequence[int],
    meta_args: Sequence[Any],
    *,
    buffer: Any = None,
    stream: Any = None,
) -> None:
    """y += LoRA(x) for every slice, slices side by side from column 0 (vLLM's
    PunicaWrapperGPU.add_lora_linear, with the metadata passed in): the shrink and expand of
    one layer, on the GPU as one planned launch sequence (the decode kernels at small
    batches). y [num_tokens, sum(output_slices)] (leading dimensions are flattened), x
    [num_tokens, in]. `buffer`: a float32 scratch of num_slices * num_tokens * rank elements;
    by default the metadata keeps one (one stream at a time per LoRAKernelMeta)."""
    _C.ops.add_lora_linear(
        _dl(y), _dl(x), _dl_list(lora_a_stacked), _dl_list(lora_b_stacked), float(scale),
        [int(n) for n in output_slices], _dl(_meta_mapping(meta_args)),
        None if buffer is None else _dl(buffer), _stream_handle(x, stream),
    )


def fused_moe_lora(
    output: Any,
    x: Any,
    lora_a_stacked: Sequence[Any],
    lora_b_stacked: Sequence[Any],
    topk_weights: Any,
    topk_ids: Any,
    meta_args: Sequence[Any],
    *,
    block_size: int = 16,
    adapter_enabled: Any = None,
    mul_routed_weight: bool = False,
    offset: int = 0,
    add_inputs: bool = True,
    stream: Any = None,
) -> None:
    """Fused MoE LoRA of one projection (vLLM's add_lora_fused_moe, with the expert alignment
    done here, as vLLM's moe_lora_align_block_size would): for each routed pair (t, k) of a
    token with an adapter, output[t, k, offset + s*n : offset + (s+1)*n] (+)=
    w * (x_row @ A_s[slot, e]^T) @ B_s[slot, e]^T, e = topk_ids[t, k], w = topk_weights[t, k]
    when mul_routed_weight (else 1), x_row = x[t] (w13) or x[t * top_k + k] (w2).
    output [num_tokens, top_k, width]; lora_a_stacked per slice [max_loras, num_experts, rank,
    K]; lora_b_stacked per slice [max_loras, num_experts, n, rank]; topk_ids int32
    [num_tokens, top_k]; topk_weights float32 [num_tokens, top_k] or None; adapter_enabled int32
    [max_loras] (nonzero = the slot has MoE LoRA) or None (all)."""
    _C.ops.fused_moe_lora(
        _dl(output), _dl(x), _dl_list(lora_a_stacked), _dl_list(lora_b_stacked),
        None if topk_weights is None else _dl(topk_weights), _dl(topk_ids),
        _dl(_meta_mapping(meta_args)), int(block_size),
        None if adapter_enabled is None else _dl(adapter_enabled), bool(mul_routed_weight),
        int(offset), bool(add_inputs), _stream_handle(x, stream),
    )
