"""vLLM's offline API (vllm.LLM) on loraplex's engine: one base model, any number of PEFT LoRA
adapters, every request with its own adapter, all continuously batched together."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Union

from loraplex import _C
from loraplex._progress import ProgressBar
from loraplex.lora_request import LoRARequest
from loraplex.outputs import CompletionOutput, Logprob, RequestOutput
from loraplex.sampling_params import SamplingParams

PromptType = Union[str, Dict[str, Any], List[int]]

# Without a device to measure, a CPU KV cache gets max_num_seqs sequences of max_model_len
# within this many bytes, unless kv_cache_memory_bytes says otherwise.
_CPU_KV_CACHE_BYTES = 1 << 30

# vLLM engine arguments that change nothing in loraplex (accepted with any value).
_IGNORED_ARGS = {
    "trust_remote_code",
    "revision",
    "tokenizer_revision",
    "code_revision",
    "download_dir",
    "load_format",
    "disable_log_stats",
    "disable_custom_all_reduce",
    "swap_space",
    "cpu_offload_gb",
    "max_seq_len_to_capture",
    "distributed_executor_backend",
    "compilation_config",
    "max_logprobs",
    "served_model_name",
    "hf_overrides",
}
# vLLM engine arguments loraplex implements only at their default (anything else is refused).
_DEFAULT_ONLY_ARGS = {
    "tokenizer_mode": "auto",
    "skip_tokenizer_init": False,
    "quantization": None,
    "lora_dtype": "auto",
    "pipeline_parallel_size": 1,
    "kv_cache_dtype": "auto",
    "enable_chunked_prefill": True,
    "speculative_config": None,
}

# How long a blocking wait on one request lasts before Python gets control back (Ctrl-C).
_POLL_S = 0.1


def _dtype_name(dtype: Any, cuda: bool) -> str:
    if dtype is None or dtype == "auto":
        # The checkpoint's dtype on a GPU would be vLLM's choice; bfloat16 is what loraplex's
        # GPU kernels are tuned for, and float32 is the CPU's exact path (as `serve`).
        return "bfloat16" if cuda else "float32"
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch.") :]
    return {"float": "float32", "half": "float16"}.get(name, name)


def _stop_reason(reason: str, params: SamplingParams) -> Union[int, str, None]:
    """vLLM's stop_reason: the stop string, the stop token id, or None (EOS or length)."""
    if not reason:
        return None
    if reason in params.stop:
        return reason
    try:
        token = int(reason)
    except ValueError:
        return reason
    return token if token in params.stop_token_ids else None


class _Accumulated:
    """What one request has produced so far."""

    def __init__(self) -> None:
        self.token_ids: List[int] = []
        self.text = ""
        self.logprobs: List[float] = []
        self.top_logprobs: List[List[tuple]] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason = ""
        self.error = ""
        self.cached_tokens = 0

    def add(self, out: "_C.RequestOutput") -> None:
        self.token_ids.extend(out.token_ids)
        self.text += out.text
        self.logprobs.extend(out.logprobs)
        self.top_logprobs.extend(out.top_logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.error = out.error
        self.cached_tokens = out.cached_tokens


class _Tokenizer:
    """The model's tokenizer.json (what LLM.get_tokenizer returns): encode and decode."""

    def __init__(self, engine: "_C.Engine") -> None:
        self._engine = engine
        self.eos_token_ids = list(engine.eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.vocab_size = engine.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return list(self._engine.encode(text, add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._engine.decode(list(token_ids), skip_special_tokens)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Dict[str, List[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}


class LLM:
    """An offline engine on a local Hugging Face checkpoint, with vLLM's arguments.

    `LLM(model, enable_lora=True, max_loras=4, max_lora_rank=16).generate(prompts, params,
    lora_request=LoRARequest("sql", 1, "/adapters/sql"))`. Adapters load on first use, or
    with add_lora; remove_lora forgets one. The model loads with a progress bar on standard
    error when it takes more than a second (show_progress=False: never).
    """

    def __init__(
        self,
        model: str,
        tokenizer: Optional[str] = None,
        *,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: Optional[int] = None,
        dtype: Any = "auto",
        tensor_parallel_size: int = 1,
        max_model_len: Optional[int] = None,
        seed: Optional[int] = 0,
        max_num_seqs: int = 256,
        max_num_batched_tokens: Optional[int] = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: Optional[int] = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        async_scheduling: bool = True,
        fully_sharded_loras: bool = False,
        enforce_eager: bool = False,
        device: str = "auto",
        show_progress: bool = True,
        **kwargs: Any,
    ) -> None:
        for name, value in kwargs.items():
            if name in _IGNORED_ARGS:
                continue
            if name in _DEFAULT_ONLY_ARGS:
                if value != _DEFAULT_ONLY_ARGS[name]:
                    raise ValueError(
                        f"LLM({name}={value!r}) is not supported by loraplex (only "
                        f"{_DEFAULT_ONLY_ARGS[name]!r})"
                    )
                continue
            raise TypeError(f"LLM() got an unexpected keyword argument '{name}'")
        model = os.path.expanduser(str(model))
        if not os.path.isdir(model):
            raise ValueError(
                f"{model}: not a model directory (loraplex loads a local Hugging Face checkpoint: "
                "config.json, safetensors weights, tokenizer.json)"
            )
        if tokenizer is not None and os.path.abspath(tokenizer) != os.path.abspath(model):
            raise ValueError("a tokenizer other than the model directory's is not supported")
        if device == "auto":
            device = "cuda:0" if _C.cuda_device_count() > 0 else "cpu"
        cuda = device.startswith("cuda")

        options = _C.EngineOptions()
        options.max_loras = max_loras
        options.max_lora_rank = max_lora_rank
        options.max_cpu_loras = max_cpu_loras or 0
        options.max_num_seqs = max_num_seqs
        options.max_num_batched_tokens = max(
            max_num_batched_tokens or options.max_num_batched_tokens, max_num_seqs
        )
        options.gpu_memory_utilization = gpu_memory_utilization
        options.kv_block_size = block_size
        options.max_model_len = max_model_len or 0
        options.enable_prefix_caching = enable_prefix_caching
        options.async_scheduling = async_scheduling
        options.seed = seed or 0
        options.tensor_parallel_size = tensor_parallel_size
        options.fully_sharded_loras = fully_sharded_loras
        # Offline calls submit everything at once and only the total time counts: evicting an
        # adapter for another's first token would only recompute its sequences (as `generate`).
        options.lora_evict_after_s = -1.0

        bar = ProgressBar(f"Loading {os.path.basename(os.path.normpath(model))}")
        loaded = _C.load_model(
            model, options, _dtype_name(dtype, cuda), device, enforce_eager,
            bar if show_progress else None,
        )
        bar.close()
        if kv_cache_memory_bytes is not None:
            options.num_kv_blocks = max(1, kv_cache_memory_bytes // loaded.kv_block_bytes)
        elif not cuda:
            max_len = options.max_model_len or loaded.max_model_len
            wanted = -(-max_len // block_size) * max_num_seqs
            options.num_kv_blocks = max(1, min(wanted, _CPU_KV_CACHE_BYTES // loaded.kv_block_bytes))
        self._engine = _C.Engine(loaded, options)
        self._model_dir = model
        self._enable_lora = enable_lora
        self._loras: Dict[int, LoRARequest] = {}
        self._chat_template: Optional["_C.ChatTemplate"] = None
        self._next_request_id = 0
        self.max_model_len = self._engine.options.max_model_len
        self.device = device

    # vLLM scripts reach the engine through llm.llm_engine (add_lora, remove_lora, ...).
    @property
    def llm_engine(self) -> "LLM":
        return self

    def get_tokenizer(self) -> _Tokenizer:
        return _Tokenizer(self._engine)

    # ---- adapters -------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads (and validates) an adapter now; requests can name it at once. Raises
        LoraplexError naming the adapter, file and problem when it cannot be served."""
        self._adapter_name(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter: requests already submitted with it finish first. False when no
        adapter has this id."""
        request = self._loras.pop(lora_id, None)
        if request is None:
            return False
        self._engine.unload_adapter(request.lora_name)
        return True

    def list_loras(self) -> set:
        return set(self._loras)

    def _adapter_name(self, request: Optional[LoRARequest]) -> str:
        if request is None:
            return ""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if not self._enable_lora:
            raise ValueError(
                f"{request!r}: LoRA is not enabled; create the LLM with enable_lora=True"
            )
        loaded = self._loras.get(request.lora_int_id)
        if loaded is not None:
            if loaded.lora_name == request.lora_name and loaded.lora_path == request.lora_path:
                return loaded.lora_name
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is {loaded!r}, not {request!r}; "
                f"remove_lora({request.lora_int_id}) first"
            )
        for other in self._loras.values():
            if other.lora_name == request.lora_name:
                raise ValueError(
                    f"lora_name {request.lora_name!r} is taken by lora_int_id "
                    f"{other.lora_int_id}"
                )
        # A name removed while its requests ran is free again once they have finished.
        if not self._engine.wait_until_unloaded(request.lora_name, 60.0):
            raise RuntimeError(
                f"adapter {request.lora_name!r} is still being unloaded after 60 s"
            )
        self._engine.load_adapter(request.lora_name, request.lora_path)
        self._loras[request.lora_int_id] = request
        return request.lora_name

    # ---- generation -----------------------------------------------------------------------

    def _prompts(self, prompts: Any) -> List[Dict[str, Any]]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif prompts and isinstance(prompts, (list, tuple)) and isinstance(prompts[0], int):
            prompts = [{"prompt_token_ids": list(prompts)}]
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append({"prompt": p, "ids": self._engine.encode(p, True), "special": True})
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                out.append({"prompt": p.get("prompt"), "ids": list(p["prompt_token_ids"])})
            elif isinstance(p, dict) and "prompt" in p:
                if p.get("multi_modal_data"):
                    raise ValueError("multi-modal prompts are not supported")
                out.append(
                    {"prompt": p["prompt"], "ids": self._engine.encode(p["prompt"], True),
                     "special": True}
                )
            else:
                raise TypeError(
                    "a prompt is a string, {'prompt': text} or {'prompt_token_ids': [ids]}, got "
                    f"{type(p).__name__}"
                )
        return out

    @staticmethod
    def _per_prompt(value: Any, n: int, what: str) -> List[Any]:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{len(value)} {what} for {n} prompts")
            return list(value)
        return [value] * n

    def _prompt_for(self, prompt: Dict[str, Any], p: SamplingParams) -> Dict[str, Any]:
        """The prompt as this request runs it: truncated to its last truncate_prompt_tokens
        tokens (-1: max_model_len) when asked, text prompts keeping their special tokens in
        front as vLLM's tokenizer call does."""
        k = p.truncate_prompt_tokens
        if k is None:
            return prompt
        k = self.max_model_len if k == -1 else k
        if "special" in prompt:
            ids = self._engine.encode_truncated(prompt["prompt"], prompt["special"], k)
        else:
            ids = self._engine.truncate_ids(prompt["ids"], k)
        return dict(prompt, ids=list(ids))

    def _submit(
        self,
        prompts: List[Dict[str, Any]],
        sampling_params: Any,
        lora_request: Any,
    ) -> tuple:
        """Submits every prompt's n requests; returns the handles, and per prompt its prompt as
        run, its params, its LoRARequest and the indices of its n handles."""
        params = [
            p if p is not None else SamplingParams()
            for p in self._per_prompt(sampling_params, len(prompts), "sampling_params")
        ]
        loras = self._per_prompt(lora_request, len(prompts), "lora_requests")
        requests = []
        run_prompts = []
        groups = []
        for prompt, p, lora in zip(prompts, params, loras):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
            prompt = self._prompt_for(prompt, p)
            run_prompts.append(prompt)
            groups.append(list(range(len(requests), len(requests) + p.n)))
            # n > 1: n requests of the same prompt (the prefix cache shares its blocks); with a
            # seed, choice i samples from seed + i, as the server's n does.
            for choice in range(p.n):
                requests.append(self._request(prompt, p, lora, choice))
        handles = self._engine.submit_all(requests)
        first_id = self._next_request_id
        self._next_request_id += len(prompts)
        return handles, run_prompts, params, loras, groups, first_id

    def _request(
        self, prompt: Dict[str, Any], p: SamplingParams, lora: Any, choice: int
    ) -> "_C.Request":
        r = _C.Request()
        r.prompt_ids = prompt["ids"]
        r.adapter = self._adapter_name(lora)
        o = r.options
        o.max_tokens = (
            p.max_tokens
            if p.max_tokens is not None
            else max(1, self.max_model_len - len(prompt["ids"]))
        )
        o.min_tokens = p.min_tokens
        o.temperature = p.temperature
        o.top_p = p.top_p
        o.top_k = p.top_k
        o.min_p = p.min_p
        o.seed = p.seed + choice if p.seed is not None else None
        o.stop = p.stop
        o.stop_token_ids = p.stop_token_ids
        o.ignore_eos = p.ignore_eos
        o.logprobs = p.logprobs is not None
        o.top_logprobs = p.logprobs or 0
        o.include_stop_str_in_output = p.include_stop_str_in_output
        o.skip_special_tokens = p.skip_special_tokens
        o.presence_penalty = p.presence_penalty
        o.frequency_penalty = p.frequency_penalty
        o.repetition_penalty = p.repetition_penalty
        o.logit_bias = {int(k): float(v) for k, v in (p.logit_bias or {}).items()}
        o.allowed_token_ids = list(p.allowed_token_ids or [])
        o.bad_words = list(p.bad_words or [])
        structured = p.structured()
        if structured is not None:
            o.set_structured_output(*structured.engine_args())
        r.options = o
        return r

    @staticmethod
    def _completion(
        index: int, params: SamplingParams, lora: Optional[LoRARequest], acc: _Accumulated
    ) -> CompletionOutput:
        logprobs = None
        cumulative = None
        if params.logprobs is not None:
            logprobs = []
            for i, (t, lp) in enumerate(zip(acc.token_ids, acc.logprobs)):
                top = acc.top_logprobs[i] if i < len(acc.top_logprobs) else []
                # vLLM's shape: the sampled token, then the most likely ones (rank 1 first).
                ranks = {tid: r + 1 for r, (tid, _) in enumerate(top)}
                entry = {t: Logprob(lp, ranks.get(t), None)}
                for r, (tid, tlp) in enumerate(top):
                    entry.setdefault(tid, Logprob(tlp, r + 1, None))
                logprobs.append(entry)
            cumulative = float(sum(acc.logprobs))
        return CompletionOutput(
            index=index,
            text=acc.text if params.detokenize else "",
            token_ids=list(acc.token_ids),
            cumulative_logprob=cumulative,
            logprobs=logprobs,
            finish_reason=acc.finish_reason,
            stop_reason=_stop_reason(acc.stop_reason, params),
            lora_request=lora,
        )

    @staticmethod
    def _output(
        request_id: int,
        prompt: Dict[str, Any],
        completions: List[CompletionOutput],
        lora: Optional[LoRARequest],
        cached_tokens: int,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=str(request_id),
            prompt=prompt["prompt"],
            prompt_token_ids=list(prompt["ids"]),
            prompt_logprobs=None,
            outputs=completions,
            finished=all(c.finish_reason is not None for c in completions),
            lora_request=lora,
            num_cached_tokens=cached_tokens,
        )

    def generate(
        self,
        prompts: Any,
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = True,
        lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
        **kwargs: Any,
    ) -> List[RequestOutput]:
        """Generates for every prompt (a string, {'prompt': ...}, {'prompt_token_ids': [...]},
        or a list of them) in one continuously batched run; returns one RequestOutput per
        prompt, in order. The GIL is released while the engine runs."""
        if kwargs.get("prompt_token_ids") is not None:
            prompts = [{"prompt_token_ids": ids} for ids in kwargs.pop("prompt_token_ids")]
        kwargs.pop("priority", None)
        if kwargs:
            raise TypeError(f"generate() got unexpected keyword arguments {sorted(kwargs)}")
        items = self._prompts(prompts)
        return self._run(items, sampling_params, lora_request, use_tqdm)

    def _run(
        self,
        items: List[Dict[str, Any]],
        sampling_params: Any,
        lora_request: Any,
        use_tqdm: bool,
    ) -> List[RequestOutput]:
        handles, prompts, params, loras, groups, first_id = self._submit(
            items, sampling_params, lora_request
        )
        bar = ProgressBar("Processed prompts", unit="it", delay_s=1.0 if use_tqdm else float("inf"))
        results: List[RequestOutput] = []
        try:
            for i, group in enumerate(groups):
                completions = []
                cached = 0
                for choice, h in enumerate(group):
                    acc = _Accumulated()
                    while acc.finish_reason is None:
                        acc.add(handles[h].next(_POLL_S))
                    if acc.finish_reason == "error":
                        raise _C.LoraplexError(f"request {i}: {acc.error}")
                    completions.append(self._completion(choice, params[i], loras[i], acc))
                    cached = max(cached, acc.cached_tokens)
                results.append(self._output(first_id + i, prompts[i], completions, loras[i], cached))
                bar(i + 1, len(groups))
        except BaseException:
            for handle in handles:
                handle.abort()
            raise
        finally:
            bar.close()
        return results

    def stream(
        self,
        prompts: Any,
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
        *,
        delta: bool = False,
    ) -> Iterator[RequestOutput]:
        """Submits the prompts and yields a RequestOutput each time one of their completions
        has new tokens (the whole completion so far, or only the new part with delta=True; with
        n > 1 the one completion that progressed, by its index), the last one of each with
        finished=True. Closing the iterator early aborts what is left."""
        items = self._prompts(prompts)
        handles, run_prompts, params, loras, groups, first_id = self._submit(
            items, sampling_params, lora_request
        )
        owner = {}
        for i, group in enumerate(groups):
            for choice, h in enumerate(group):
                owner[h] = (i, choice)
        accs = [_Accumulated() for _ in handles]
        pending = list(range(len(handles)))
        try:
            while pending:
                progressed = False
                # Each pending request is asked without waiting; when none had anything, the
                # oldest is waited on (briefly, so that the others are asked again soon).
                for n, h in enumerate(list(pending)):
                    out = handles[h].next(0.0 if n or progressed else 0.005)
                    if not out.token_ids and not out.finished and not out.text:
                        continue
                    progressed = True
                    i, choice = owner[h]
                    accs[h].add(out)
                    shown = accs[h]
                    if delta:
                        shown = _Accumulated()
                        shown.add(out)
                        shown.cached_tokens = accs[h].cached_tokens
                    completion = self._completion(choice, params[i], loras[i], shown)
                    yield self._output(
                        first_id + i, run_prompts[i], [completion], loras[i], shown.cached_tokens
                    )
                    if out.finished:
                        if accs[h].finish_reason == "error":
                            raise _C.LoraplexError(f"request {i}: {accs[h].error}")
                        pending.remove(h)
        finally:
            for h in pending:
                handles[h].abort()

    # ---- chat -----------------------------------------------------------------------------

    def _template(self, chat_template: Optional[str]) -> "_C.ChatTemplate":
        config = os.path.join(self._model_dir, "tokenizer_config.json")
        if chat_template is not None:
            if os.path.isfile(chat_template):
                return _C.ChatTemplate.from_file(chat_template, config)
            return _C.ChatTemplate.from_source(chat_template, config, "chat_template argument")
        if self._chat_template is None:
            jinja_file = os.path.join(self._model_dir, "chat_template.jinja")
            if os.path.isfile(jinja_file):
                self._chat_template = _C.ChatTemplate.from_file(jinja_file, config)
            else:
                has_template = False
                if os.path.isfile(config):
                    with open(config, encoding="utf-8") as f:
                        has_template = json.load(f).get("chat_template") is not None
                if not has_template:
                    raise ValueError(
                        f"{self._model_dir} has no chat template (neither chat_template.jinja "
                        "nor tokenizer_config.json's chat_template): pass chat_template="
                    )
                self._chat_template = _C.ChatTemplate.from_tokenizer_config(config)
        return self._chat_template

    @staticmethod
    def _text_messages(messages: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
        out = []
        for m in messages:
            m = dict(m)
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text":
                        raise ValueError(
                            f"message content part {part!r}: only text parts are supported"
                        )
                    texts.append(part.get("text", ""))
                m["content"] = "\n".join(texts)
            out.append(m)
        return out

    def chat(
        self,
        messages: Any,
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = True,
        lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
        chat_template: Optional[str] = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[List[Dict[str, Any]]] = None,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        mm_processor_kwargs: Optional[Dict[str, Any]] = None,
    ) -> List[RequestOutput]:
        """Renders each conversation (a list of {'role', 'content'} messages, or a list of such
        lists) with the model's chat template, as transformers' apply_chat_template does, and
        generates from it (the template writes the special tokens: none are added)."""
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: multi-modal inputs are not supported")
        template = self._template(chat_template)
        conversations = messages
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        items = []
        for conversation in conversations:
            text = template.render(
                json.dumps(self._text_messages(conversation)),
                add_generation_prompt,
                continue_final_message,
                json.dumps(tools) if tools is not None else "",
                json.dumps(chat_template_kwargs) if chat_template_kwargs else "",
            )
            items.append(
                {"prompt": text, "ids": self._engine.encode(text, False), "special": False}
            )
        return self._run(items, sampling_params, lora_request, use_tqdm)

    def shutdown(self) -> None:
        """Stops the engine now (requests in flight are aborted) instead of at garbage
        collection."""
        self._engine.shutdown()
