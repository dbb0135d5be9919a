"""The offline API (loraplex.LLM) against the fixtures' PEFT outputs (expected.jsonl) and
`loraplex generate`, adapters added and removed between calls, streaming, chat, and errors
carrying the C++ message."""

import os
import subprocess
import threading

import pytest

import loraplex
from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.lora.request import LoRARequest as VllmPathLoRARequest

from conftest import FIXTURES, TESTDATA, adapters_of, fixture_dir, read_jsonl

# What the fixtures' expected.jsonl holds: greedy, 12 tokens, EOS not stopping.
GREEDY_12 = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LLAMA_MODEL = os.path.join(fixture_dir("tiny-llama"), "model")
LLAMA_ADAPTERS = adapters_of("tiny-llama")


def expected_of(fixture):
    return read_jsonl(os.path.join(fixture_dir(fixture), "expected.jsonl"))


def cli_generate(cli, fixture, tmp_path):
    args = [cli, "generate", "--model", os.path.join(fixture_dir(fixture), "model"),
            "--requests", os.path.join(fixture_dir(fixture), "requests.jsonl"),
            "--max-tokens", "12", "--ignore-eos", "--device", "cpu",
            "--output", str(tmp_path / "out.jsonl")]
    for name, path in adapters_of(fixture).items():
        args += ["--lora", f"{name}={path}"]
    subprocess.run(args, check=True, capture_output=True, timeout=300)
    return read_jsonl(str(tmp_path / "out.jsonl"))


@pytest.mark.parametrize("fixture", FIXTURES)
def test_greedy_outputs_equal_peft_and_generate(fixture, cli, tmp_path):
    adapters = adapters_of(fixture)
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    requests = read_jsonl(os.path.join(fixture_dir(fixture), "requests.jsonl"))
    llm = LLM(os.path.join(fixture_dir(fixture), "model"), enable_lora=True,
              max_loras=len(adapters), max_lora_rank=64)
    try:
        outputs = llm.generate(
            [r["prompt"] for r in requests], GREEDY_12,
            lora_request=[None if r["adapter"] is None else
                          LoRARequest(r["adapter"], ids[r["adapter"]], adapters[r["adapter"]])
                          for r in requests])
        decode = llm.get_tokenizer().decode
        # The text comes out incrementally, as vLLM's does: a character released when its
        # token came stays, even where later byte-fallback tokens turn the whole sequence into
        # U+FFFDs. `generate` decodes the whole output at once; the texts are compared where
        # no later token rewrites an earlier character.
        stable = [all(decode(o.outputs[0].token_ids).startswith(
                      decode(o.outputs[0].token_ids[:k])) for k in range(1, 13))
                  for o in outputs]
    finally:
        llm.shutdown()
    expected = expected_of(fixture)
    reference = cli_generate(cli, fixture, tmp_path)
    assert len(outputs) == len(expected) == len(reference) == len(requests)
    assert sum(stable) >= 0.8 * len(outputs)
    for i, (out, want, ref) in enumerate(zip(outputs, expected, reference)):
        assert out.prompt == want["prompt"]
        assert out.prompt_token_ids == want["prompt_token_ids"], i
        assert out.outputs[0].token_ids == want["output_token_ids"], i
        assert out.outputs[0].token_ids == ref["output_token_ids"], i
        if stable[i]:
            assert out.outputs[0].text == ref["output_text"], i
        assert out.outputs[0].finish_reason == "length"
        assert out.finished and out.request_id
        lora = out.lora_request
        assert (lora.lora_name if lora else None) == want["adapter"]


@pytest.mark.parametrize("kwargs", [{"tensor_parallel_size": 2}, {"async_scheduling": False}],
                         ids=["tp2", "sync"])
def test_tensor_parallel_and_synchronous_steps_give_the_same_tokens(kwargs):
    expected = expected_of("tiny-llama")
    llm = LLM(LLAMA_MODEL, enable_lora=True, max_loras=4, **kwargs)
    try:
        outs = llm.generate([e["prompt"] for e in expected], GREEDY_12, lora_request=[
            None if e["adapter"] is None else
            LoRARequest(e["adapter"], 1 + sorted(LLAMA_ADAPTERS).index(e["adapter"]),
                        LLAMA_ADAPTERS[e["adapter"]]) for e in expected])
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [e["output_token_ids"] for e in expected]


def test_adapters_added_and_removed_between_calls(tiny_llama):
    expected = expected_of("tiny-llama")
    prompt = expected[0]["prompt"]
    want = {e["adapter"]: e["output_token_ids"] for e in expected if e["prompt"] == prompt}
    sql = LoRARequest("sql-added", 11, LLAMA_ADAPTERS["sql"])
    pirate = LoRARequest("pirate-added", 12, LLAMA_ADAPTERS["pirate"])

    assert tiny_llama.add_lora(sql)
    assert 11 in tiny_llama.list_loras()
    out = tiny_llama.generate([prompt, prompt, prompt], GREEDY_12,
                              lora_request=[sql, None, pirate])  # pirate loads on first use
    assert [o.outputs[0].token_ids for o in out] == [want["sql"], want[None], want["pirate"]]
    assert {11, 12} <= tiny_llama.list_loras()

    assert tiny_llama.remove_lora(11)
    assert not tiny_llama.remove_lora(11)
    assert 11 not in tiny_llama.list_loras()
    # The same name again, now with other weights: the new ones serve.
    tiny_llama.llm_engine.add_lora(LoRARequest("sql-added", 11, LLAMA_ADAPTERS["rslora"]))
    out = tiny_llama.generate(prompt, GREEDY_12,
                              lora_request=LoRARequest("sql-added", 11, LLAMA_ADAPTERS["rslora"]))
    assert out[0].outputs[0].token_ids == want["rslora"]
    assert tiny_llama.remove_lora(11) and tiny_llama.remove_lora(12)

    # An id names one adapter: another path under it is refused until it is removed.
    tiny_llama.add_lora(pirate)
    with pytest.raises(ValueError, match="lora_int_id 12"):
        tiny_llama.generate(prompt, GREEDY_12, lora_request=LoRARequest("x", 12, "/elsewhere"))
    assert tiny_llama.remove_lora(12)


def test_prompt_forms_give_the_same_tokens(tiny_llama):
    prompt = expected_of("tiny-llama")[5]
    ids = prompt["prompt_token_ids"]
    outs = tiny_llama.generate(
        [prompt["prompt"], {"prompt": prompt["prompt"]}, {"prompt_token_ids": ids}], GREEDY_12)
    assert [o.outputs[0].token_ids for o in outs] == [prompt["output_token_ids"]] * 3
    assert [o.prompt_token_ids for o in outs] == [ids] * 3
    assert outs[2].prompt is None


def test_stream_in_order_and_delta_pieces_add_up(tiny_llama):
    expected = [e for e in expected_of("tiny-llama") if e["adapter"] is None][:3]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    last = {}
    for out in tiny_llama.stream([e["prompt"] for e in expected], params):
        previous = last.get(out.request_id)
        if previous is not None:
            assert out.outputs[0].token_ids[: len(previous)] == previous
        last[out.request_id] = list(out.outputs[0].token_ids)
    assert sorted(last.values()) == sorted(e["output_token_ids"] for e in expected)

    pieces = {}
    finished = set()
    for out in tiny_llama.stream([e["prompt"] for e in expected], params, delta=True):
        assert out.request_id not in finished
        pieces.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        if out.finished:
            finished.add(out.request_id)
    assert len(finished) == 3
    assert sorted(pieces.values()) == sorted(e["output_token_ids"] for e in expected)


def test_closing_a_stream_aborts_the_rest(tiny_llama):
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    stream = tiny_llama.stream(["The function returns"] * 4, long)
    first = next(stream)
    assert not first.finished
    stream.close()
    # The engine serves on after the abort.
    out = tiny_llama.generate("The function returns", GREEDY_12)
    assert out[0].outputs[0].token_ids == expected_of("tiny-llama")[0]["output_token_ids"]


def test_logprobs_stop_tokens_and_seeds(tiny_llama):
    want = expected_of("tiny-llama")[0]
    tokens = want["output_token_ids"]
    out = tiny_llama.generate(
        want["prompt"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                       logprobs=0))[0].outputs[0]
    assert out.token_ids == tokens
    assert len(out.logprobs) == 12
    assert [list(d) for d in out.logprobs] == [[t] for t in tokens]
    values = [d[t].logprob for d, t in zip(out.logprobs, tokens)]
    assert all(v <= 0.0 for v in values)
    assert out.cumulative_logprob == pytest.approx(sum(values))
    # PEFT's log-probability of the first token (expected.jsonl, float64).
    assert values[0] == pytest.approx(want["first_token_top5_logprobs"][0][1], abs=1e-4)

    stop_at = 3
    out = tiny_llama.generate(
        want["prompt"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                       stop_token_ids=[tokens[stop_at]]))[0].outputs[0]
    first = tokens.index(tokens[stop_at])
    assert out.finish_reason == "stop"
    assert out.stop_reason == tokens[stop_at]
    assert out.token_ids == tokens[: first + 1]

    sampled = [tiny_llama.generate(want["prompt"], SamplingParams(temperature=1.0, seed=7,
                                                                  max_tokens=12))
               [0].outputs[0].token_ids for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_min_p_keeps_only_tokens_near_the_most_probable(tiny_llama):
    want = expected_of("tiny-llama")[0]
    tokens = want["output_token_ids"]
    # min_p 1 keeps only the most probable token, so even a hot sampler follows PEFT's greedy
    # tokens; without it the same seed wanders off them.
    hot = dict(temperature=5.0, seed=3, max_tokens=12, ignore_eos=True)
    out = tiny_llama.generate(want["prompt"], SamplingParams(min_p=1.0, **hot))[0].outputs[0]
    assert out.token_ids == tokens
    out = tiny_llama.generate(want["prompt"], SamplingParams(**hot))[0].outputs[0]
    assert out.token_ids != tokens


def test_top_logprobs_are_pefts(tiny_llama):
    want = expected_of("tiny-llama")[0]
    out = tiny_llama.generate(
        want["prompt"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                       logprobs=5))[0].outputs[0]
    first = out.logprobs[0]
    # The sampled token first, then the five most likely (here the sampled one is rank 1).
    assert list(first)[0] == out.token_ids[0]
    assert len(first) == 5
    for rank, (token, logprob) in enumerate(want["first_token_top5_logprobs"], start=1):
        assert first[token].rank == rank
        assert first[token].logprob == pytest.approx(logprob, abs=1e-4)
    with pytest.raises(ValueError, match="logprobs=21"):
        SamplingParams(logprobs=21)


def test_logits_processing_fields_reach_the_engine(tiny_llama):
    want = expected_of("tiny-llama")[0]
    greedy = want["output_token_ids"]
    only = greedy[1]
    out = tiny_llama.generate(want["prompt"], SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, allowed_token_ids=[only]))[0].outputs[0]
    assert out.token_ids == [only] * 4
    biased = tiny_llama.generate(want["prompt"], SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={only: 100}))[0].outputs[0]
    assert biased.token_ids == [only] * 4
    penalised = tiny_llama.generate(want["prompt"], SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=2.0))[0].outputs[0]
    assert penalised.token_ids != greedy
    with pytest.raises(loraplex.RequestError, match="logprobs together with"):
        tiny_llama.generate(want["prompt"], SamplingParams(logprobs=0, presence_penalty=1.0))


def test_structured_outputs_hold_the_text(tiny_llama):
    import json
    import re
    from loraplex import GuidedDecodingParams, StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    params = [
        SamplingParams(temperature=0.8, seed=s, max_tokens=40, structured_outputs=StructuredOutputsParams(
            json=schema, disable_any_whitespace=True)) for s in range(3)
    ] + [
        SamplingParams(temperature=0.0, max_tokens=10,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        SamplingParams(temperature=1.0, seed=4, max_tokens=10,
                       guided_decoding=GuidedDecodingParams(regex="[0-9]{3}-[a-z]{2}")),
    ]
    outs = [o.outputs[0] for o in tiny_llama.generate(["Answer:"] * len(params), params)]
    for o in outs[:3]:
        value = json.loads(o.text)
        assert value["n"] in (1, 2, 3) and isinstance(value["ok"], bool) and len(value) == 2
        assert o.finish_reason == "stop"
    assert outs[3].text in ("yes", "no")
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", outs[4].text)
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="whitespace_pattern"):
        StructuredOutputsParams(regex="a", whitespace_pattern=" ")
    with pytest.raises(loraplex.RequestError, match="regex"):
        tiny_llama.generate("x", SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="(unclosed")))


def test_n_truncation_and_detokenize(tiny_llama):
    want = expected_of("tiny-llama")[0]
    outs = tiny_llama.generate(
        want["prompt"], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8))[0].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    # Choice i samples as a request of its own with seed 11 + i.
    for i, o in enumerate(outs):
        alone = tiny_llama.generate(
            want["prompt"], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8))
        assert o.token_ids == alone[0].outputs[0].token_ids
    greedy = tiny_llama.generate(
        want["prompt"], SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert [o.token_ids for o in greedy.outputs] == [want["output_token_ids"]] * 2
    # Truncation keeps a text prompt's BOS in front, and the last ids of an id prompt.
    ids = want["prompt_token_ids"]
    out = tiny_llama.generate(want["prompt"],
                              SamplingParams(truncate_prompt_tokens=3, max_tokens=1))[0]
    assert out.prompt_token_ids == [ids[0]] + ids[-2:]
    out = tiny_llama.generate({"prompt_token_ids": ids},
                              SamplingParams(truncate_prompt_tokens=3, max_tokens=1))[0]
    assert out.prompt_token_ids == ids[-3:]
    plain = tiny_llama.generate(want["prompt"], SamplingParams(
        detokenize=False, temperature=0.0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert plain.text == "" and plain.token_ids == want["output_token_ids"][:4]
    # A stream of n = 2 yields each completion under its index.
    seen = {}
    for o in tiny_llama.stream(want["prompt"], SamplingParams(n=2, temperature=0.0, max_tokens=5,
                                                              ignore_eos=True)):
        seen[o.outputs[0].index] = o.outputs[0]
    assert sorted(seen) == [0, 1]
    assert all(c.finish_reason == "length" and c.token_ids == want["output_token_ids"][:5]
               for c in seen.values())


def test_chat_renders_the_template_and_generates_from_it(tiny_llama):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "The function"}]}]
    template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    out = tiny_llama.chat(messages, GREEDY_12, chat_template=template)[0]
    text = "<|begin_of_text|><system>Be brief.\n<user>The function\n<assistant>"
    assert out.prompt == text
    tokenizer = tiny_llama.get_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    plain = tiny_llama.generate({"prompt_token_ids": ids}, GREEDY_12)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_chat_template_file_renders_as_jinja2(tiny_llama):
    jinja2 = pytest.importorskip("jinja2")
    path = os.path.join(TESTDATA, "chat_templates", "mistral-7b-instruct-v0.2.jinja")
    conversations = [[{"role": "user", "content": "Hello"}],
                     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                      {"role": "user", "content": "Bye"}]]
    outs = tiny_llama.chat(conversations, GREEDY_12, chat_template=path)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    with open(path, encoding="utf-8") as f:
        template = jinja2.Environment().from_string(f.read())
    for out, conversation in zip(outs, conversations):
        assert out.prompt == template.render(
            messages=conversation, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
            add_generation_prompt=True, raise_exception=raise_exception)
    with pytest.raises(loraplex.LoraplexError, match="Conversation roles must alternate"):
        tiny_llama.chat([{"role": "assistant", "content": "first"}], GREEDY_12,
                        chat_template=path)


def test_errors_are_python_exceptions_with_the_cpp_message(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="not a model directory"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(loraplex.LoraplexError) as e:
        tiny_llama.add_lora(LoRARequest("broken", 21, str(tmp_path / "no-adapter")))
    assert str(tmp_path / "no-adapter") in str(e.value)
    assert 21 not in tiny_llama.list_loras()
    with pytest.raises(loraplex.RequestError, match="exceeds max_model_len 1024") as e:
        tiny_llama.generate("The function returns", SamplingParams(max_tokens=5000))
    assert isinstance(e.value, ValueError) and isinstance(e.value, loraplex.LoraplexError)
    with pytest.raises(loraplex.RequestError, match="top_p"):
        tiny_llama.generate("The function returns", SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="SamplingParams.n=0"):
        SamplingParams(n=0)
    # Read by slow tokenizers only (vLLM ignores it with tokenizer.json, as loraplex does).
    SamplingParams(spaces_between_special_tokens=False)
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs=1"):
        SamplingParams(prompt_logprobs=1)
    with pytest.raises(ValueError, match=r"SamplingParams.min_p=1.5, expected a value in \[0, 1\]"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match="no chat template"):
        tiny_llama.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        LLM(LLAMA_MODEL, no_such_option=1)


def test_adapter_above_max_lora_rank_is_refused_naming_it():
    llm = LLM(LLAMA_MODEL, enable_lora=True, max_lora_rank=8, max_num_seqs=4)
    try:
        with pytest.raises(loraplex.LoraplexError, match="pirate") as e:
            llm.add_lora(LoRARequest("pirate", 1, LLAMA_ADAPTERS["pirate"]))
        assert "16" in str(e.value) and "8" in str(e.value)
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            LLM(LLAMA_MODEL, max_num_seqs=4).generate(
                "x", lora_request=LoRARequest("sql", 1, LLAMA_ADAPTERS["sql"]))
    finally:
        llm.shutdown()


def test_vllm_module_paths():
    import loraplex.outputs
    import loraplex.sampling_params

    assert VllmPathLoRARequest is LoRARequest
    assert loraplex.sampling_params.SamplingParams is SamplingParams
    assert loraplex.outputs.RequestOutput is loraplex.RequestOutput


def test_load_progress_from_every_rank_thread():
    """The callback runs on the loading threads (two CPU ranks here), which take the GIL for
    each call: the load releases it, or this would deadlock."""
    calls = []
    options = loraplex._C.EngineOptions()
    options.max_num_seqs = 4
    options.max_num_batched_tokens = 64
    options.tensor_parallel_size = 2

    def progress(done, total):
        calls.append((done, total, threading.get_ident()))

    model = loraplex._C.load_model(LLAMA_MODEL, options, "float32", "cpu", False, progress)
    assert model.architecture
    size = os.path.getsize(os.path.join(LLAMA_MODEL, "model.safetensors"))
    totals = {t for _, t, _ in calls}
    assert len(totals) == 1
    total = totals.pop()
    # Two ranks, each reading the checkpoint's tensors (bf16 on disk: about the file size).
    assert size < total < 2 * size + 1
    assert calls[-1][:2] == (total, total)
    done = [d for d, _, _ in calls]
    assert done == sorted(done) and len(done) > 10
    assert threading.get_ident() not in {t for _, _, t in calls[:-1]}


def test_progress_callback_errors_stop_the_load():
    options = loraplex._C.EngineOptions()
    options.max_num_seqs = 4
    options.max_num_batched_tokens = 64

    def progress(done, total):
        raise KeyboardInterrupt

    with pytest.raises(loraplex.LoraplexError, match="progress callback"):
        loraplex._C.load_model(LLAMA_MODEL, options, "float32", "cpu", False, progress)


def test_progress_bar_lines_in_logs():
    import io

    from loraplex._progress import ProgressBar

    now = [0.0]
    stream = io.StringIO()
    bar = ProgressBar("Loading m", delay_s=1.0, stream=stream, clock=lambda: now[0])
    bar(10, 100)  # before the delay: nothing
    assert stream.getvalue() == ""
    for done in range(0, 101, 5):
        now[0] = 2.0 + done / 10
        bar(done, 100)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11  # one line per tenth when the stream is not a terminal
    assert lines[0].startswith("Loading m:   0%|") and "0 B/100 B" in lines[0]
    assert lines[-1].startswith("Loading m: 100%|" + "#" * 30 + "|")


def test_waiting_for_the_engine_releases_the_gil(tiny_llama):
    """A thread blocked on a request leaves the interpreter to the others: the main thread
    aborts the request while the waiting thread is inside the wait (were the GIL held there,
    the abort could only come after the request's 1000 tokens, and it would end "length")."""
    request = loraplex._C.Request()
    request.prompt_ids = expected_of("tiny-llama")[0]["prompt_token_ids"]
    request.options.max_tokens = 1000
    request.options.ignore_eos = True
    request.options.temperature = 0.0
    (handle,) = tiny_llama._engine.submit_all([request])
    entering = threading.Event()
    result = {}

    def wait():
        entering.set()
        result["out"] = handle.wait()

    waiter = threading.Thread(target=wait)
    waiter.start()
    entering.wait()
    handle.abort()
    waiter.join()
    assert result["out"].finish_reason == "abort"
    assert len(result["out"].token_ids) < 1000
