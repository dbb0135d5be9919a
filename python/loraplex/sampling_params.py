"""vLLM's SamplingParams: the fields loraplex's engine implements, and the others refused."""

from __future__ import annotations

import json as _json
from typing import Any, Optional, Sequence, Union

# Fields loraplex does not implement, with the value that means "off": a request that asks
# for anything else is refused (ValueError naming the field), never run differently.
_UNSUPPORTED_DEFAULTS = {
    "prompt_logprobs": None,
    "logits_processors": None,
}

# The most top log-probabilities a step returns per token (the engine's limit).
_MAX_LOGPROBS = 20


class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: the generated text held to one grammar, given as a JSON
    schema (`json`: a dict or its JSON text), any JSON object (`json_object=True`), a regular
    expression, a list of choices or an EBNF grammar whose start rule is `root`.
    `disable_any_whitespace` keeps JSON free of whitespace beyond one space after ':' and ','.
    Compiled by xgrammar's C++ core inside the engine."""

    def __init__(
        self,
        json: Any = None,
        regex: Optional[str] = None,
        choice: Optional[Sequence[str]] = None,
        grammar: Optional[str] = None,
        json_object: Optional[bool] = None,
        disable_fallback: bool = False,
        disable_any_whitespace: bool = False,
        disable_additional_properties: bool = False,
        whitespace_pattern: Optional[str] = None,
        structural_tag: Optional[str] = None,
        backend: Optional[str] = None,
    ) -> None:
        self.json = json
        self.regex = regex
        self.choice = choice
        self.grammar = grammar
        self.json_object = json_object
        self.disable_fallback = disable_fallback
        self.disable_any_whitespace = disable_any_whitespace
        self.disable_additional_properties = disable_additional_properties
        self.whitespace_pattern = whitespace_pattern
        self.structural_tag = structural_tag
        self.backend = backend
        self.engine_args()  # refuses what cannot run, naming it

    def engine_args(self) -> tuple:
        """(kind, spec, choices, any_whitespace) for the engine's request options."""
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"StructuredOutputsParams.{name} is not supported by loraplex")
        if self.disable_additional_properties:
            raise ValueError(
                "StructuredOutputsParams.disable_additional_properties is not supported by loraplex"
            )
        kinds = []
        if self.json is not None:
            spec = self.json if isinstance(self.json, str) else _json.dumps(self.json)
            kinds.append(("json", spec, []))
        if self.json_object:
            kinds.append(("json_object", "", []))
        if self.regex is not None:
            kinds.append(("regex", self.regex, []))
        if self.choice is not None:
            choices = [self.choice] if isinstance(self.choice, str) else list(self.choice)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings")
            kinds.append(("choice", "", choices))
        if self.grammar is not None:
            kinds.append(("grammar", self.grammar, []))
        if len(kinds) != 1:
            raise ValueError(
                "StructuredOutputsParams takes exactly one of json, json_object, regex, choice and "
                f"grammar, got {len(kinds)}"
            )
        kind, spec, choices = kinds[0]
        return kind, spec, choices, not self.disable_any_whitespace


# vLLM's name for the same fields before StructuredOutputsParams.
GuidedDecodingParams = StructuredOutputsParams


class SamplingParams:
    """How to sample, with vLLM's names and defaults (vllm.SamplingParams).

    Implemented: temperature (0 = greedy), top_p, top_k (0 or -1 = off), min_p, seed, max_tokens
    (None = up to max_model_len), min_tokens, stop strings, stop_token_ids, ignore_eos,
    include_stop_str_in_output, skip_special_tokens, n (n requests of the prompt; with a seed,
    sample i uses seed + i), truncate_prompt_tokens, detokenize, logprobs (the sampled token's
    log-probability and up to 20 most likely tokens'), the presence, frequency and repetition
    penalties, logit_bias, allowed_token_ids, bad_words and structured_outputs (or
    guided_decoding). spaces_between_special_tokens is accepted and has no effect: only slow
    tokenizers read it, and loraplex reads tokenizer.json (vLLM ignores it there too, as the
    server does). The rest of vLLM's fields are accepted only at their default values.
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
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            raise ValueError(
                f"SamplingParams.logprobs={self.logprobs!r}, expected 0 to {_MAX_LOGPROBS}"
            )
        if self.structured_outputs is not None and self.guided_decoding is not None:
            raise ValueError("give structured_outputs or guided_decoding, not both")
        so = self.structured()
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                "SamplingParams.structured_outputs must be a StructuredOutputsParams, got "
                f"{type(so).__name__}"
            )
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n!r}, expected an integer >= 1")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"SamplingParams.best_of={self.best_of!r}: only best_of == n is supported "
                "(every sample is returned)"
            )
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or (k < 1 and k != -1)):
            raise ValueError(
                f"SamplingParams.truncate_prompt_tokens={k!r}, expected >= 1 or -1 (max_model_len)"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p={self.min_p!r}, expected a value in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens}, expected >= 1")

    def structured(self) -> Optional[StructuredOutputsParams]:
        """The request's grammar (structured_outputs, or guided_decoding), or None."""
        return self.structured_outputs if self.structured_outputs is not None else self.guided_decoding

    def clone(self) -> "SamplingParams":
        other = SamplingParams.__new__(SamplingParams)
        other.__dict__.update(self.__dict__)
        other.stop = list(self.stop)
        other.stop_token_ids = list(self.stop_token_ids)
        return other

    def __repr__(self) -> str:
        return (
            f"SamplingParams(temperature={self.temperature}, top_p={self.top_p}, "
            f"top_k={self.top_k}, min_p={self.min_p}, seed={self.seed}, stop={self.stop}, "
            f"stop_token_ids={self.stop_token_ids}, ignore_eos={self.ignore_eos}, "
            f"max_tokens={self.max_tokens}, min_tokens={self.min_tokens}, "
            f"logprobs={self.logprobs})"
        )
