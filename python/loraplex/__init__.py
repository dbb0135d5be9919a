"""loraplex: multi-tenant LoRA serving (one base model, many PEFT LoRA adapters, batched
together in every forward pass) from Python.

- `LLM`, `SamplingParams`, `LoRARequest`: vLLM's offline API (`from vllm import LLM` becomes
  `from loraplex import LLM`); `loraplex.lora.request`, `loraplex.outputs` and
  `loraplex.sampling_params` mirror vLLM's module paths.
- `loraplex.ops`: the multi-LoRA ops on DLPack arrays with vLLM's Triton op conventions.

Errors from the library raise `LoraplexError` (a RuntimeError) with the C++ message; a
refused request raises `RequestError` (also a ValueError).
"""

import importlib.util

from loraplex._build_config import WITH_CUDA

if WITH_CUDA and importlib.util.find_spec("torch") is not None:
    # The extension links the CUDA toolkit's libraries (cudart, cuBLASLt, NCCL) and torch
    # loads its own copies under the same names; whichever loads first serves both, and
    # torch's wheels carry the newer ones (the toolkit's NCCL lacks symbols torch needs, so
    # torch would fail to import after loraplex). Loading torch first lets both work.
    import torch  # noqa: F401

from loraplex._C import LoraplexError, RequestError, __version__, built_with_cuda
from loraplex import ops
from loraplex.llm import LLM
from loraplex.lora_request import LoRARequest
from loraplex.outputs import CompletionOutput, Logprob, RequestOutput
from loraplex.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "LoraplexError",
    "RequestError",
    "ops",
    "built_with_cuda",
    "__version__",
]
