"""loraplex: multi-tenant LoRA serving (one base model, many PEFT LoRA adapters, batched
together in every forward pass) from Python.

- `LLM`, `SamplingParams`, `LoRARequest`: vLLM's offline API (`from vllm import LLM` becomes
  `from loraplex import LLM`); `loraplex.lora.request`, `loraplex.outputs` and
  `loraplex.sampling_params` mirror vLLM's module paths.
- `loraplex.ops`: the multi-LoRA ops on DLPack arrays with vLLM's Triton op conventions.

Errors from the library raise `LoraplexError` (a RuntimeError) with the C++ message; a
refused request raises `RequestError` (also a ValueError).
"""

from loraplex._C import LoraplexError, RequestError, __version__, built_with_cuda
from loraplex import ops
from loraplex.llm import LLM
from loraplex.lora_request import LoRARequest
from loraplex.outputs import CompletionOutput, Logprob, RequestOutput
from loraplex.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
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
