"""vLLM's SamplingParams: the fields loraplex's engine implements, and the others refused."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

# Fields loraplex does not implement, with the value that means "off": a request that asks
# for anything else is refused (ValueError naming the field), never run differently.
_UNSUPPORTED_DEFAULTS = {
    "n": 1,
    "best_of": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "bad_words": None,
    "prompt_logprobs": None,
    "detokenize": True,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "logits_processors": None,
    "truncate_prompt_tokens": None,
    "guided_decoding": None,
    "structured_outputs": None,
    "logit_bias": None,
    "allowed_token_ids": None,
}


class SamplingParams:
    """How to sample, with vLLM's names and defaults (vllm.SamplingParams).

    Implemented: temperature (0 = greedy), top_p, top_k (0 or -1 = off), seed, max_tokens
    (None = up to max_model_len), min_tokens, stop strings, stop_token_ids, ignore_eos and
    logprobs=0 (the sampled token's log-probability). The rest of vLLM's fields are accepted
    only at their default values.
    """

    def __init__(
        self,
        n: int = 1,
        best_of: Optional[int] = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: Optional[int] = None,
        stop: Optional[Union[str, Sequence[str]]] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        bad_words: Optional[Sequence[str]] = None,
        ignore_eos: bool = False,
        max_tokens: Optional[int] = 16,
        min_tokens: int = 0,
        logprobs: Optional[int] = None,
        prompt_logprobs: Optional[int] = None,
        detokenize: bool = True,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        logits_processors: Any = None,
        truncate_prompt_tokens: Optional[int] = None,
        output_kind: Any = None,
        guided_decoding: Any = None,
        structured_outputs: Any = None,
        logit_bias: Any = None,
        allowed_token_ids: Any = None,
        extra_args: Optional[dict] = None,
    ) -> None:
        self.n = n
        self.best_of = best_of
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.repetition_penalty = repetition_penalty
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = min_p
        self.seed = seed
        if stop is None:
            self.stop = []
        elif isinstance(stop, str):
            self.stop = [stop]
        else:
            self.stop = list(stop)
        self.stop_token_ids = list(stop_token_ids or [])
        self.bad_words = bad_words
        self.ignore_eos = ignore_eos
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.detokenize = detokenize
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.logits_processors = logits_processors
        self.truncate_prompt_tokens = truncate_prompt_tokens
        self.output_kind = output_kind
        self.guided_decoding = guided_decoding
        self.structured_outputs = structured_outputs
        self.logit_bias = logit_bias
        self.allowed_token_ids = allowed_token_ids
        self.extra_args = extra_args
        self._check()

    def _check(self) -> None:
        for name, default in _UNSUPPORTED_DEFAULTS.items():
            value = getattr(self, name)
            if value != default and not (default is None and not value):
                raise ValueError(
                    f"SamplingParams.{name}={value!r} is not supported by loraplex "
                    f"(only {default!r}); see docs/python.md"
                )
        if self.logprobs not in (None, 0):
            raise ValueError(
                f"SamplingParams.logprobs={self.logprobs!r}: loraplex returns only the sampled "
                "token's log-probability (logprobs=0), no top alternatives"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens}, expected >= 1")

    def clone(self) -> "SamplingParams":
        other = SamplingParams.__new__(SamplingParams)
        other.__dict__.update(self.__dict__)
        other.stop = list(self.stop)
        other.stop_token_ids = list(self.stop_token_ids)
        return other

    def __repr__(self) -> str:
        return (
            f"SamplingParams(temperature={self.temperature}, top_p={self.top_p}, "
            f"top_k={self.top_k}, seed={self.seed}, stop={self.stop}, "
            f"stop_token_ids={self.stop_token_ids}, ignore_eos={self.ignore_eos}, "
            f"max_tokens={self.max_tokens}, min_tokens={self.min_tokens}, "
            f"logprobs={self.logprobs})"
        )
