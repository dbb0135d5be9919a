"""vLLM's output classes (vllm.outputs): what LLM.generate, LLM.chat and LLM.stream return."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

from loraplex.lora_request import LoRARequest


@dataclass
class Logprob:
    """vLLM's Logprob: the log-probability of one token (rank and decoded text unknown)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    """One generated sequence (vllm.outputs.CompletionOutput)."""

    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, Logprob]]]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    lora_request: Optional[LoRARequest] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's result (vllm.outputs.RequestOutput): the prompt and its completions."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    prompt_logprobs: None
    outputs: List[CompletionOutput]
    finished: bool
    lora_request: Optional[LoRARequest] = None
    num_cached_tokens: int = 0
    metrics: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None
    multi_modal_placeholders: dict = field(default_factory=dict)
