#!/usr/bin/env python3
"""`loraplex serve` end to end on the tiny-llama fixture (CPU, float32): servers started here on
127.0.0.1 and a free port (--port 0), driven by the official `openai` client and by raw HTTP.

Checks: start-up failures (exit 1 and a message, never a crash); completions and chat, whole
and streamed, for the base model and every fixture adapter, against the tokens
`loraplex generate` gives (and chat prompts against jinja2's rendering); /v1/models,
/v1/load_lora_adapter, /v1/unload_lora_adapter and the --lora-dir resolver; every error of
issue 23 (400 malformed or mistyped, 404 unknown model, 400 prompt too long with its lengths,
400 broken adapter while the others keep serving, unload with requests in flight (they finish
first), 401, 413, 503); 32 concurrent streams of mixed adapters with a reload in the middle,
each equal to its sequential result; a client that hangs up mid-stream leaves nothing running;
/metrics through prometheus_client's parser; SIGTERM and SIGINT end the server with status 0.

usage: check_serve.py LORAPLEX_BINARY TESTDATA_DIR
Prints 'N passed, N failed'; exits 77 (skipped) when openai, jinja2 or prometheus_client is
missing (scripts/install_deps.sh installs them).
"""

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

try:
    import jinja2
    import openai
    from prometheus_client.parser import text_string_to_metric_families
except ImportError as e:
    print(f"{e.name} is not installed (bash scripts/install_deps.sh): skipped")
    sys.exit(77)

BIN, DATA = sys.argv[1], sys.argv[2]
FIX = os.path.join(DATA, "tiny-llama")
MODEL = os.path.join(FIX, "model")
ADAPTERS = os.path.join(FIX, "adapters")
NAMES = ["sql", "pirate", "rslora", "vocab"]
TEMPLATE = os.path.join(DATA, "chat_templates", "qwen2-7b-instruct.jinja")
KEY = "test-key-123"
BASE = "tiny"  # --served-model-name
results = []


def check(name, cond, detail=""):
    results.append(bool(cond))
    print(("PASS " if cond else "FAIL ") + name + ("" if cond else ": " + str(detail)[:2000]),
          flush=True)


# ----------------------------------------------------------------------------- plumbing


class Server:
    """A `loraplex serve` process; its port is read from the 'listening on' line."""

    def __init__(self, args, model=MODEL, port=0):
        where = ["--model", model] if model else []  # None: args give --shape
        self.proc = subprocess.Popen([BIN, "serve", *where, "--port", str(port), *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.log = []
        while True:
            line = self.proc.stderr.readline()
            if not line:
                self.proc.wait()
                raise RuntimeError("server exited at start-up: " + "".join(self.log))
            self.log.append(line)
            m = re.search(r"listening on http://[^ ]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line)

    def stop(self, sig=signal.SIGTERM, timeout=30):
        """Sends `sig`; returns (exit status, seconds to exit)."""
        t = time.time()
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = "hung"
        return rc, time.time() - t

    def client(self, key=KEY):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key,
                             max_retries=0, timeout=120)


def request(port, method, path, body=None, raw=None, headers=None, key=KEY):
    """Raw HTTP; returns (status, body bytes, headers)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"Content-Type": "application/json"}
    if key:
        h["Authorization"] = "Bearer " + key
    h.update(headers or {})
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    payload = r.read()
    hdrs = dict(r.getheaders())
    conn.close()
    return r.status, payload, hdrs


def post(port, path, body, **kw):
    status, payload, _ = request(port, "POST", path, body, **kw)
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode("utf-8", "replace")


def sse_events(payload):
    """The JSON of each `data:` event, and whether `data: [DONE]` closed the stream."""
    events, done = [], False
    for block in payload.decode().split("\n\n"):
        if not block.startswith("data: "):
            continue
        data = block[len("data: "):]
        if data == "[DONE]":
            done = True
        else:
            events.append(json.loads(data))
    return events, done


def error_of(body):
    return body.get("error", {}) if isinstance(body, dict) else {}


class RawStream:
    """A streaming request on a bare socket, to stop reading or hang up mid-stream."""

    def __init__(self, port, body, key=KEY):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        data = json.dumps(body).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        self.sock.sendall(head + data)
        self.got = b""

    def read_until(self, needle, count=1):
        while self.got.count(needle) < count:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.got += chunk
        return self.got

    def read_all(self):
        while True:
            chunk = self.sock.recv(65536)
            if not chunk:
                return self.got
            self.got += chunk

    def close(self):
        self.sock.close()


def metrics(port):
    status, payload, _ = request(port, "GET", "/metrics", key=None)
    assert status == 200, status
    return {f.name: f for f in text_string_to_metric_families(payload.decode())}


def sample(families, family, name=None, **labels):
    for s in families[family].samples:
        if s.name == (name or family) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


def wait_metrics(port, pred, timeout=30):
    deadline = time.time() + timeout
    while True:
        m = metrics(port)
        if pred(m) or time.time() > deadline:
            return m
        time.sleep(0.01)


def running(m):
    return sample(m, "vllm:num_requests_running")


def waiting(m):
    return sample(m, "vllm:num_requests_waiting")


def aborted(m):
    return sample(m, "vllm:request_success", "vllm:request_success_total", finished_reason="abort")


def extra(obj, key):
    return (obj.model_extra or {}).get(key)


def model_of(adapter):
    return adapter if adapter else BASE


# ------------------------------------------------------------------ the generate reference

lora_args = []
for n in NAMES:
    lora_args += ["--lora", f"{n}={os.path.join(ADAPTERS, n)}"]
gen = subprocess.run([BIN, "generate", "--model", MODEL, "--device", "cpu", "--max-tokens", "12",
                      "--ignore-eos", "--requests", os.path.join(FIX, "requests.jsonl"),
                      *lora_args], capture_output=True, text=True, timeout=300)
check("loraplex generate runs", gen.returncode == 0, gen.stderr)
reference = [json.loads(line) for line in gen.stdout.splitlines()]
check("generate gives a line per request", len(reference) == 30, len(reference))

tmp = tempfile.mkdtemp(prefix="loraplex-serve-test-")
try:
    # A copy of an adapter with its weights cut short: refused with the adapter named.
    broken = os.path.join(tmp, "broken")
    shutil.copytree(os.path.join(ADAPTERS, "rslora"), broken)
    weights = os.path.join(broken, "adapter_model.safetensors")
    os.chmod(weights, 0o644)
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)

    # ------------------------------------------------------------ start-up failures

    def start_fails(args, *needles, name):
        p = subprocess.run([BIN, "serve", *args], capture_output=True, text=True, timeout=120)
        ok = p.returncode == 1 and all(n in p.stderr for n in needles)
        check(name, ok, f"status {p.returncode}: {p.stderr}")

    start_fails(["--model", os.path.join(tmp, "nope")], "--model", "nope",
                name="a missing model directory: exit 1 naming it")
    os.mkdir(os.path.join(tmp, "empty"))
    start_fails(["--model", os.path.join(tmp, "empty"), "--port", "0"], "no config.json",
                name="a directory without config.json: exit 1")
    start_fails(["--model", MODEL, "--port", "0", "--lora", f"bad={broken}"], "adapter 'bad'",
                weights, name="a broken --lora adapter: exit 1 naming the adapter and the file")
    bad_cfg = os.path.join(tmp, "badcfg")
    shutil.copytree(os.path.join(ADAPTERS, "sql"), bad_cfg)
    os.chmod(os.path.join(bad_cfg, "adapter_config.json"), 0o644)
    with open(os.path.join(bad_cfg, "adapter_config.json"), "w") as f:
        f.write("{ not json")
    start_fails(["--model", MODEL, "--port", "0", "--lora", f"sql={bad_cfg}"], "adapter 'sql'",
                "adapter_config.json", name="an adapter config that is not JSON: exit 1")
    start_fails(["--model", MODEL, "--port", "0", "--lora", "sql=" + os.path.join(tmp, "nodir")],
                "sql", "nodir", name="a missing adapter directory: exit 1")
    bad_template = os.path.join(tmp, "bad.jinja")
    with open(bad_template, "w") as f:
        f.write("{% for m in messages %}\n{{ m.content | frobnicate }}{% endfor %}")
    start_fails(["--model", MODEL, "--port", "0", "--chat-template", bad_template], "bad.jinja",
                "frobnicate", name="an unsupported chat template: exit 1 naming file and filter")
    bad_model = os.path.join(tmp, "model")
    shutil.copytree(MODEL, bad_model)
    os.chmod(os.path.join(bad_model, "config.json"), 0o644)
    with open(os.path.join(bad_model, "config.json"), "w") as f:
        f.write('{"architectures": ["LlamaForCausalLM"], ')
    start_fails(["--model", bad_model, "--port", "0"], "config.json",
                name="a broken config.json: exit 1 naming the file")
    start_fails(["--model", MODEL, "--port", "0", "--bogus"], "--bogus",
                name="an unknown flag: exit 1 naming it")
    start_fails(["--model", MODEL, "--port", "0", "--max-model-len", "4096"], "--max-model-len 4096",
                "max_position_embeddings 1024", "--allow-long-max-model-len",
                name="--max-model-len beyond the model's positions: exit 1 naming both")
    start_fails(["--model", MODEL, "--port", "0", "--lora", f"a,b={os.path.join(ADAPTERS, 'sql')}"],
                "'a,b'", name="an adapter name outside the character set: exit 1 naming it")
    start_fails(["--model", MODEL, "--port", "0", "--enable-lora-loading"],
                "--allowed-lora-paths",
                name="--enable-lora-loading with nowhere to load from: exit 1 saying so")
    p = subprocess.run([BIN, "serve", "--help"], capture_output=True, text=True, timeout=60)
    check("--help exits 0", p.returncode == 0 and "--lora-dir" in p.stdout, p.stderr)
    start_fails(["--port", "0"], "--model DIR or --shape NAME",
                name="neither --model nor --shape: exit 1 saying so")
    start_fails(["--shape", "llama9", "--port", "0"], "llama9", "llama3-8b",
                name="an unknown --shape: exit 1 naming it and the known ones")

    # --shape: random weights of a named shape, no tokenizer: token-id prompts are served, a
    # text prompt is a 400 saying so, tokens in logprobs are vLLM's "token_id:N".
    shaped = Server(["--shape", "tiny", "--layers", "1", "--device", "cpu"], model=None)
    status, body = post(shaped.port, "/v1/completions",
                        {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 5, "ignore_eos": True,
                         "temperature": 0, "logprobs": 1, "return_token_ids": True})
    choice = body["choices"][0] if status == 200 else {}
    check("--shape: token-id prompts get their tokens and no text",
          status == 200 and len(choice.get("token_ids", [])) == 5 and choice.get("text") == ""
          and choice["logprobs"]["tokens"] == [f"token_id:{i}" for i in choice["token_ids"]],
          (status, body))
    status, body = post(shaped.port, "/v1/completions",
                        {"model": "tiny", "prompt": "hello", "max_tokens": 5})
    check("--shape: a text prompt is a 400 asking for token ids",
          status == 400 and "token ids" in error_of(body).get("message", ""), (status, body))
    rc, _ = shaped.stop()
    check("--shape: SIGTERM exits 0", rc == 0, "".join(shaped.log))

    # SIGTERM as soon as the server has blocked the signal (its first act), mostly while the
    # model loads: it exits 0 at once, whether start-up had finished or not.
    def blocked_signals(pid):
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigBlk:"):
                    return int(line.split()[1], 16)
        return 0

    statuses = []
    for delay in (0.0, 0.005, 0.02):
        proc = subprocess.Popen([BIN, "serve", "--model", MODEL, "--port", "0",
                                 *lora_args], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        term_bit = 1 << (signal.SIGTERM - 1)
        deadline = time.time() + 30
        while not blocked_signals(proc.pid) & term_bit and time.time() < deadline:
            time.sleep(0.0005)
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=30)
            statuses.append((proc.returncode, err.strip().splitlines()[-1:]))
        except subprocess.TimeoutExpired:
            proc.kill()
            statuses.append(("hung", []))
    check("SIGTERM during start-up: exit 0", all(rc == 0 for rc, _ in statuses), statuses)

    # ------------------------------------------------------------------ main server

    main = Server(["--served-model-name", BASE, "--api-key", KEY, "--chat-template", TEMPLATE,
                   "--lora", f"sql={os.path.join(ADAPTERS, 'sql')}",
                   "--lora", f"pirate={os.path.join(ADAPTERS, 'pirate')}",
                   "--lora-dir", ADAPTERS, "--num-kv-blocks", "640", "--max-num-seqs", "48",
                   "--max-model-len", "512", "--max-body-bytes", "65536", "--max-loras", "4",
                   "--max-cpu-loras", "8", "--enable-lora-loading", "--allowed-lora-paths", tmp])
    port = main.port
    start_fails(["--model", MODEL, "--port", str(port)], "cannot listen", str(port),
                "in use", name="a port in use: exit 1 naming the address")
    oa = main.client()

    status, payload, _ = request(port, "GET", "/health", key=None)
    check("/health without a key: 200", status == 200, status)
    status, body = post(port, "/v1/completions", {"model": BASE, "prompt": "x"}, key=None)
    check("missing API key: 401", status == 401 and error_of(body).get("type") ==
          "AuthenticationError", (status, body))
    try:
        main.client("wrong").completions.create(model=BASE, prompt="x", max_tokens=1)
        check("wrong API key: 401 (openai client)", False, "accepted")
    except openai.AuthenticationError as e:
        check("wrong API key: 401 (openai client)", e.status_code == 401)

    ids = [m.id for m in oa.models.list().data]
    check("/v1/models: the base model and the --lora adapters", ids == [BASE, "pirate", "sql"],
          ids)
    status, body = post(port, "/v1/completions", {"model": BASE, "prompt": "x"})  # warm-up

    # Completions for every fixture request: the base model, the two --lora adapters, and
    # rslora and vocab, which --lora-dir resolves on first use; whole and streamed.
    whole_ok, stream_ok, raw_ok = [], [], []
    for i, ref in enumerate(reference):
        model = model_of(ref["adapter"])
        c = oa.completions.create(model=model, prompt=ref["prompt"], max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True,
                                                             "return_token_ids": True})
        ch = c.choices[0]
        whole_ok.append(extra(ch, "token_ids") == ref["output_token_ids"] and
                        extra(ch, "prompt_token_ids") == ref["prompt_token_ids"] and
                        ch.text == ref["output_text"] and ch.finish_reason == "length" and
                        c.usage.completion_tokens == 12 and c.model == model)
        if not whole_ok[-1]:
            print("  request", i, ref, c.model_dump())
        text, toks, finish = "", [], None
        for chunk in oa.completions.create(model=model, prompt=ref["prompt"], max_tokens=12,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True,
                                                       "return_token_ids": True}):
            text += chunk.choices[0].text
            toks += extra(chunk.choices[0], "token_ids") or []
            finish = chunk.choices[0].finish_reason or finish
        stream_ok.append(toks == ref["output_token_ids"] and text == ref["output_text"] and
                         finish == "length")
        if i % 5 == 0:
            status, body = post(port, "/v1/completions",
                                {"model": model, "prompt": ref["prompt"], "max_tokens": 12,
                                 "temperature": 0, "ignore_eos": True,
                                 "return_token_ids": True})
            raw_ok.append(status == 200 and
                          body["choices"][0]["token_ids"] == ref["output_token_ids"])
    check("completions equal generate's tokens and text (30 requests, 5 models)", all(whole_ok),
          whole_ok)
    check("streamed completions equal generate's tokens and text", all(stream_ok), stream_ok)
    check("raw HTTP completions equal generate's tokens", all(raw_ok), raw_ok)
    listed = {m.id: m for m in oa.models.list().data}
    check("--lora-dir loaded rslora and vocab on first use, listed with parent = the base model",
          all(n in listed and extra(listed[n], "parent") == BASE and
              extra(listed[n], "root") == os.path.join(ADAPTERS, n) for n in NAMES),
          {k: v.model_dump() for k, v in listed.items()})
    check("the base model has no parent", extra(listed[BASE], "parent") is None and
          extra(listed[BASE], "max_model_len") == 512, listed[BASE].model_dump())

    # Chat: the prompt is jinja2's rendering of the same template, tokenized by the server
    # (a completion of that text has the same ids after its BOS); the tokens equal those of a
    # completion of the chat's prompt ids.
    env = jinja2.Environment()
    template = env.from_string(open(TEMPLATE).read())
    conversation = [{"role": "system", "content": "You write SQL."},
                    {"role": "user", "content": "List the tables."},
                    {"role": "assistant", "content": "SHOW TABLES;"},
                    {"role": "user", "content": "Now the größte one, please."}]
    rendered = template.render(messages=conversation, add_generation_prompt=True)
    for adapter in [None] + NAMES:
        model = model_of(adapter)
        c = oa.chat.completions.create(model=model, messages=conversation, max_tokens=10,
                                       temperature=0, extra_body={"ignore_eos": True,
                                                                  "return_token_ids": True})
        prompt_ids = extra(c, "prompt_token_ids")
        out_ids = extra(c.choices[0], "token_ids")
        text_comp = oa.completions.create(model=model, prompt=rendered, max_tokens=1,
                                          extra_body={"return_token_ids": True})
        comp_prompt = extra(text_comp.choices[0], "prompt_token_ids")
        check(f"chat ({model}): the prompt is jinja2's rendering, tokenized",
              comp_prompt is not None and prompt_ids == comp_prompt[1:] and comp_prompt[0] == 0,
              (prompt_ids, comp_prompt))
        comp = oa.completions.create(model=model, prompt=prompt_ids, max_tokens=10,
                                     temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
        check(f"chat ({model}): the tokens of a completion of the same prompt",
              out_ids == extra(comp.choices[0], "token_ids") and
              c.choices[0].message.content == comp.choices[0].text and
              c.usage.prompt_tokens == len(prompt_ids) and c.usage.completion_tokens == 10,
              (c.model_dump(), comp.model_dump()))
        text, toks, usage, roles, first_prompt = "", [], None, [], None
        for chunk in oa.chat.completions.create(
                model=model, messages=conversation, max_tokens=10, temperature=0, stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "return_token_ids": True}):
            if first_prompt is None:
                first_prompt = extra(chunk, "prompt_token_ids")
            if chunk.usage:
                usage = chunk.usage
            if chunk.choices:
                d = chunk.choices[0].delta
                roles.append(d.role)
                text += d.content or ""
                toks += extra(chunk.choices[0], "token_ids") or []
        check(f"streamed chat ({model}): same text and tokens, role first, usage last",
              text == c.choices[0].message.content and toks == out_ids and
              roles[0] == "assistant" and first_prompt == prompt_ids and usage is not None and
              usage.completion_tokens == 10, (text, toks, roles, usage))

    # The template found in the model directory: chat_template.jinja, or tokenizer_config.json's
    # chat_template; the same prompt as --chat-template gave.
    main_chat_prompt = prompt_ids
    for where in ("chat_template.jinja", "tokenizer_config.json"):
        model_copy = os.path.join(tmp, "with-template-" + where.split(".")[0])
        shutil.copytree(MODEL, model_copy)
        for f in os.listdir(model_copy):
            os.chmod(os.path.join(model_copy, f), 0o644)
        source = open(TEMPLATE).read()
        if where == "chat_template.jinja":
            with open(os.path.join(model_copy, where), "w") as f:
                f.write(source)
        else:
            config = json.load(open(os.path.join(model_copy, where)))
            config["chat_template"] = source
            with open(os.path.join(model_copy, where), "w") as f:
                json.dump(config, f)
        other = Server(["--num-kv-blocks", "64"], model=model_copy)
        status, body = post(other.port, "/v1/chat/completions",
                            {"messages": conversation, "max_tokens": 1,
                             "return_token_ids": True}, key=None)
        rc, _ = other.stop()
        got = body.get("prompt_token_ids") if status == 200 else (status, body)
        check(f"the model directory's {where} template renders the same prompt",
              got == main_chat_prompt and rc == 0, (got, rc))

    # ------------------------------------------------------------------------- errors

    def completion_tokens_of(port, body):
        status, got = post(port, "/v1/completions", dict(body, return_token_ids=True))
        return got["choices"][0]["token_ids"] if status == 200 else (status, got)

    def expect_error(name, status_want, path, body=None, raw=None, param=None, needles=(),
                     headers=None):
        status, payload, _ = request(port, "POST", path, body, raw=raw, headers=headers)
        try:
            err = json.loads(payload).get("error", {})
        except ValueError:
            err = {}
        ok = (status == status_want and err.get("code") == status_want and
              isinstance(err.get("message"), str) and "type" in err and
              (param is None or err.get("param") == param) and
              all(n in err.get("message", "") for n in needles))
        check(name, ok, (status, payload[:500]))

    expect_error("malformed JSON: 400", 400, "/v1/completions", raw=b'{"model": "tiny", "pro')
    expect_error("a body that is not an object: 400", 400, "/v1/completions", raw=b"[1, 2]")
    expect_error("max_tokens of the wrong type: 400 naming it", 400, "/v1/completions",
                 {"model": BASE, "prompt": "x", "max_tokens": "ten"}, param="max_tokens")
    expect_error("messages of the wrong type: 400 naming it", 400, "/v1/chat/completions",
                 {"model": BASE, "messages": "hello"}, param="messages")
    expect_error("top_p out of range: 400", 400, "/v1/completions",
                 {"model": BASE, "prompt": "x", "top_p": 1.5}, param="top_p")
    expect_error("a stop token id outside the vocabulary (the engine's check): 400", 400,
                 "/v1/completions", {"model": BASE, "prompt": "x", "stop_token_ids": [5000]},
                 needles=("5000", "1024"))
    expect_error("an unknown model: 404", 404, "/v1/completions",
                 {"model": "no-such-adapter", "prompt": "x"}, needles=("no-such-adapter",))
    expect_error("a path outside --lora-dir is not resolved: 404", 404, "/v1/completions",
                 {"model": "../adapters/sql", "prompt": "x"})
    expect_error("prompt too long: 400 naming the lengths", 400, "/v1/completions",
                 {"model": BASE, "prompt": [7] * 600, "max_tokens": 20},
                 needles=("600", "620", "512"))
    expect_error("prompt + max_tokens too long: 400 naming the lengths", 400, "/v1/completions",
                 {"model": "sql", "prompt": [7] * 500, "max_tokens": 13},
                 needles=("500", "13", "513", "512"))
    expect_error("chat prompt too long: 400 naming the lengths", 400, "/v1/chat/completions",
                 {"model": BASE, "messages": [{"role": "user", "content": "ab " * 600}]},
                 needles=("512",))
    expect_error("an over-size body: 413", 413, "/v1/completions",
                 raw=json.dumps({"model": BASE, "prompt": "x" * 70000}).encode())
    expect_error("n = 0 is refused: 400", 400, "/v1/completions",
                 {"model": BASE, "prompt": "x", "n": 0}, param="n")
    # n > 1: each choice as the same request alone with seed + i (vLLM's parallel sampling).
    several = oa.completions.create(model="pirate", prompt=reference[2]["prompt"], n=3,
                                    max_tokens=10, temperature=0.9, seed=21,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    alone = [completion_tokens_of(port, {"model": "pirate", "prompt": reference[2]["prompt"],
                                         "max_tokens": 10, "temperature": 0.9, "seed": 21 + i,
                                         "ignore_eos": True}) for i in range(3)]
    got = [extra(c, "token_ids") for c in sorted(several.choices, key=lambda c: c.index)]
    check("n=3: each choice equals the request alone with seed + i, usage counts all",
          got == alone and several.usage.completion_tokens == 30 and len(set(map(tuple, got))) > 1,
          (got, alone, several.usage))
    expect_error("max_tokens near 2^63 is refused, not wrapped: 400", 400, "/v1/completions",
                 {"model": BASE, "prompt": "x", "max_tokens": 2**63 - 1},
                 needles=("9223372036854775807", "512"))
    expect_error("a body not declared JSON: 415", 415, "/v1/completions",
                 raw=json.dumps({"model": BASE, "prompt": "x"}).encode(),
                 headers={"Content-Type": "text/plain"})
    expect_error("a load from outside the allowed roots: 400 naming lora_path", 400,
                 "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"},
                 param="lora_path")
    expect_error("an adapter name with a comma: 400 naming lora_name", 400,
                 "/v1/load_lora_adapter",
                 {"lora_name": "a,b", "lora_path": os.path.join(ADAPTERS, "sql")},
                 param="lora_name")
    greedy = completion_tokens_of(port, {"model": "sql", "prompt": reference[3]["prompt"],
                                         "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    tiny_t = completion_tokens_of(port, {"model": "sql", "prompt": reference[3]["prompt"],
                                         "max_tokens": 12, "temperature": 1e-40, "seed": 3,
                                         "ignore_eos": True})
    check("temperature 1e-40 samples greedily (below vLLM's 1e-5)", greedy == tiny_t and
          isinstance(greedy, list), (greedy, tiny_t))

    # vLLM's fields through the openai client: implemented ones change the result as vLLM's
    # do; unimplemented ones are a 400 naming the field, never ignored.
    ref = reference[3]
    plain = oa.completions.create(model=model_of(ref["adapter"]), prompt=ref["prompt"],
                                  max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    stop_at = plain.choices[0].text[3:6]
    cut = plain.choices[0].text.find(stop_at)
    for include in (False, True):
        c = oa.completions.create(model=model_of(ref["adapter"]), prompt=ref["prompt"],
                                  max_tokens=12, temperature=0, stop=[stop_at],
                                  extra_body={"ignore_eos": True,
                                              "include_stop_str_in_output": include})
        want = plain.choices[0].text[:cut + (len(stop_at) if include else 0)]
        check(f"include_stop_str_in_output={include}: the text up to the stop string"
              f"{', with it' if include else ''}", c.choices[0].text == want and
              c.choices[0].finish_reason == "stop", (c.choices[0].text, want))
    # Logits processing: a bias that forces an id, allowed ids that bound the output, a bad
    # word that removes greedy's first token, penalties; greedy outputs as the CPU engine's
    # own (the engine tests check those against the rule).
    forced = completion_tokens_of(port, {"model": "sql", "prompt": ref["prompt"],
                                         "max_tokens": 6, "temperature": 0,
                                         "ignore_eos": True, "logit_bias": {"321": 100}})
    check("logit_bias +100 forces its id", forced == [321] * 6, forced)
    bounded = completion_tokens_of(port, {"model": "sql", "prompt": ref["prompt"],
                                          "max_tokens": 12, "temperature": 0.9, "seed": 4,
                                          "ignore_eos": True,
                                          "allowed_token_ids": [17, 400, 803]})
    check("allowed_token_ids bound a sampled output",
          isinstance(bounded, list) and set(bounded) <= {17, 400, 803}, bounded)
    base_greedy = completion_tokens_of(port, {"model": "sql", "prompt": ref["prompt"],
                                              "max_tokens": 12, "temperature": 0,
                                              "ignore_eos": True})
    for penalty in ("presence_penalty", "frequency_penalty"):
        pen = completion_tokens_of(port, {"model": "sql", "prompt": ref["prompt"],
                                          "max_tokens": 12, "temperature": 0,
                                          "ignore_eos": True, penalty: 2.0})
        check(f"{penalty} leaves the first token and changes nothing before a repeat",
              isinstance(pen, list) and pen[0] == base_greedy[0] and
              (len(set(base_greedy)) < len(base_greedy) or pen == base_greedy), (pen, base_greedy))
    status, body = post(port, "/v1/completions", {"model": BASE, "prompt": "x",
                                                  "presence_penalty": 3})
    check("presence_penalty out of vLLM's range: 400 naming it", status == 400 and
          "presence_penalty" in error_of(body).get("message", ""), (status, body))
    # Top logprobs: greedy's token ranks first, with its own log-probability.
    c = oa.completions.create(model="vocab", prompt=ref["prompt"], max_tokens=6, temperature=0,
                              logprobs=3, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    check("completions logprobs=3: each token's top 3 (and it), greedy's the most probable",
          len(lp.top_logprobs) == 6 and all(
              len(top) >= 3 and max(top.values()) == top[tok] == tlp
              for top, tok, tlp in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs)),
          lp.model_dump())
    cc = oa.chat.completions.create(model="vocab", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    items = cc.choices[0].logprobs.content
    check("chat top_logprobs=2: two per token, the sampled one first",
          len(items) == 4 and all(len(i.top_logprobs) == 2 and
                                  i.top_logprobs[0].logprob == i.logprob and
                                  i.top_logprobs[1].logprob <= i.logprob for i in items),
          cc.model_dump())
    c = oa.completions.create(model=BASE, prompt=ref["prompt"], max_tokens=1,
                              extra_body={"truncate_prompt_tokens": 2, "return_token_ids": True})
    full_ids = ref["prompt_token_ids"]
    check("truncate_prompt_tokens keeps BOS and the prompt's last tokens",
          extra(c.choices[0], "prompt_token_ids") == [full_ids[0], full_ids[-1]],
          (extra(c.choices[0], "prompt_token_ids"), full_ids))
    c = oa.completions.create(model=BASE, prompt=ref["prompt"], max_tokens=8, temperature=0,
                              extra_body={"guided_choice": ["yes", "no"]})
    check("guided_choice: the text is one of the choices, then it stops",
          c.choices[0].text in ("yes", "no") and c.choices[0].finish_reason == "stop",
          c.model_dump())
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    cc = oa.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=0.8,
        seed=3, response_format={"type": "json_schema",
                                 "json_schema": {"name": "t", "schema": schema}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    try:
        value = json.loads(cc.choices[0].message.content)
    except ValueError:
        value = None
    check("response_format json_schema: the content is JSON of the schema",
          isinstance(value, dict) and value.get("n") in (1, 2, 3) and
          isinstance(value.get("ok"), bool) and len(value) == 2, cc.model_dump())
    try:
        oa.completions.create(model=BASE, prompt="x", max_tokens=1,
                              extra_body={"guided_regex": "(unclosed"})
        check("a regex that does not compile: 400 naming it", False, "accepted")
    except openai.BadRequestError as e:
        check("a regex that does not compile: 400 naming it", "regex" in str(e), str(e))
    for field, value in [("structural_tag", "{}"), ("use_beam_search", True),
                         ("prompt_logprobs", 1), ("logits_processors", ["a.b"])]:
        try:
            oa.completions.create(model=BASE, prompt="x", max_tokens=1,
                                  extra_body={field: value})
            check(f"'{field}' is refused, not ignored (400)", False, "accepted")
        except openai.BadRequestError as e:
            check(f"'{field}' is refused, not ignored (400)", field in str(e), str(e))
    status, payload, _ = request(port, "GET", "/v1/nothing")
    check("an unknown route: 404 in OpenAI's shape", status == 404 and
          json.loads(payload)["error"]["code"] == 404, (status, payload))
    try:
        oa.completions.create(model="nope", prompt="x")
        check("openai client: unknown model raises NotFoundError", False, "accepted")
    except openai.NotFoundError as e:
        check("openai client: unknown model raises NotFoundError", e.status_code == 404)

    # ---------------------------------------------------------- load / unload / list

    def completion_ids(model, prompt, max_tokens=12):
        status, body = post(port, "/v1/completions",
                            {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                             "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        return body["choices"][0]["token_ids"] if status == 200 else (status, body)

    sql_ref = [r for r in reference if r["adapter"] == "sql"]
    status, body = post(port, "/v1/load_lora_adapter",
                        {"lora_name": "sql2", "lora_path": os.path.join(ADAPTERS, "sql")})
    check("load_lora_adapter: 200", status == 200, (status, body))
    check("a loaded adapter serves its tokens",
          completion_ids("sql2", sql_ref[0]["prompt"]) == sql_ref[0]["output_token_ids"])
    listed = {m.id: m for m in oa.models.list().data}
    check("a loaded adapter is listed with parent = the base model",
          "sql2" in listed and extra(listed["sql2"], "parent") == BASE, list(listed))
    status, body = post(port, "/v1/load_lora_adapter",
                        {"lora_name": "sql2", "lora_path": os.path.join(ADAPTERS, "sql")})
    check("loading a loaded name: 400", status == 400, (status, body))
    status, body = post(port, "/v1/load_lora_adapter", {"lora_name": "x"})
    check("load without lora_path: 400", status == 400, (status, body))
    status, body = post(port, "/v1/load_lora_adapter",
                        {"lora_name": "x", "lora_path": os.path.join(tmp, "nowhere")})
    check("load from a missing directory: 404", status == 404, (status, body))
    status, body = post(port, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": broken})
    check("a broken adapter on load: 400 naming the adapter and the problem",
          status == 400 and "'bad'" in error_of(body).get("message", "") and
          "adapter_model.safetensors" in error_of(body).get("message", ""), (status, body))
    check("after a failed load the loaded adapters keep serving",
          completion_ids("sql", sql_ref[1]["prompt"]) == sql_ref[1]["output_token_ids"] and
          "bad" not in [m.id for m in oa.models.list().data])
    status, body = post(port, "/v1/unload_lora_adapter", {"lora_name": "sql2"})
    check("unload_lora_adapter: 200", status == 200, (status, body))
    check("an unloaded adapter is gone from /v1/models",
          "sql2" not in [m.id for m in oa.models.list().data])
    check("a request for an unloaded adapter: 404", completion_ids("sql2", "x")[0] == 404)
    status, body = post(port, "/v1/unload_lora_adapter", {"lora_name": "sql2"})
    check("unloading an unknown adapter: 404", status == 404, (status, body))

    # ----------------------------------- 32 concurrent streams with a reload in the middle

    prompts = sorted({r["prompt"] for r in reference})
    models = [BASE] + NAMES
    clients = []
    for i in range(32):
        params = {"model": models[i % 5], "prompt": prompts[i % len(prompts)] + " " * (i % 3),
                  "max_tokens": 40 + 3 * i, "ignore_eos": True, "return_token_ids": True}
        if i % 2:
            params.update(temperature=0.9, top_p=0.9, top_k=50, seed=1000 + i)
        else:
            params.update(temperature=0)
        clients.append(params)
    sequential = []
    for params in clients:
        status, body = post(port, "/v1/completions", params)
        sequential.append((body["choices"][0]["token_ids"], body["choices"][0]["text"])
                          if status == 200 else (status, body))
    outcome = [None] * 32
    first_pirate_chunk = threading.Event()

    def stream_client(i):
        try:
            text, toks, finish = "", [], None
            c = main.client()
            for chunk in c.completions.create(stream=True, **{
                    k: v for k, v in clients[i].items()
                    if k in ("model", "prompt", "max_tokens", "temperature", "top_p", "seed")},
                    extra_body={k: v for k, v in clients[i].items()
                                if k in ("ignore_eos", "return_token_ids", "top_k")}):
                if clients[i]["model"] == "pirate":
                    first_pirate_chunk.set()
                text += chunk.choices[0].text
                toks += extra(chunk.choices[0], "token_ids") or []
                finish = chunk.choices[0].finish_reason or finish
            outcome[i] = (toks, text, finish)
        except Exception as e:  # noqa: BLE001 - reported as a failed client
            outcome[i] = ("error", repr(e), None)

    threads = [threading.Thread(target=stream_client, args=(i,)) for i in range(32)]
    for t in threads[:16]:
        t.start()
    first_pirate_chunk.wait(60)
    unload_status, _ = post(port, "/v1/unload_lora_adapter", {"lora_name": "pirate"})
    pirates_in_flight = [i for i in range(16) if models[i % 5] == "pirate" and outcome[i] is None]
    for t in threads[16:]:
        t.start()
    reload_status, reload_body = post(port, "/v1/load_lora_adapter",
                                      {"lora_name": "pirate",
                                       "lora_path": os.path.join(ADAPTERS, "pirate")})
    for t in threads:
        t.join(300)
    check("the unload came while streams of that adapter were in flight", pirates_in_flight)
    check("the reload: unload 200, then load 200 (or 400: a request's --lora-dir load won)",
          unload_status == 200 and (reload_status == 200 or (
              reload_status == 400 and "already" in error_of(reload_body)["message"])),
          (unload_status, reload_status, reload_body))
    bad = [(i, outcome[i], sequential[i]) for i in range(32)
           if outcome[i] is None or outcome[i][2] != "length" or
           outcome[i][:2] != tuple(sequential[i])]
    check("32 concurrent streams (5 models, greedy and seeded sampling, a reload): every one "
          "complete and equal to its sequential result", not bad, bad)
    check("after the reload the adapter is listed once",
          [m.id for m in oa.models.list().data].count("pirate") == 1)

    # ------------------------------------------------- a client that hangs up mid-stream

    before = metrics(port)
    drop = RawStream(port, {"model": "vocab", "prompt": "The function returns",
                            "max_tokens": 500, "ignore_eos": True, "stream": True})
    drop.read_until(b"data: ", 2)
    drop.close()
    m = wait_metrics(port, lambda m: running(m) == 0 and waiting(m) == 0 and
                     aborted(m) == aborted(before) + 1)
    check("a client that hangs up mid-stream: its request is aborted, nothing runs (/metrics)",
          running(m) == 0 and waiting(m) == 0 and aborted(m) == aborted(before) + 1,
          (running(m), waiting(m), aborted(m), aborted(before)))
    gen_delta = (sample(m, "vllm:generation_tokens", "vllm:generation_tokens_total") -
                 sample(before, "vllm:generation_tokens", "vllm:generation_tokens_total"))
    check("... and it stopped generating early", 0 < gen_delta < 500, gen_delta)

    # ------------------------------------------------------------------------- /metrics

    m = metrics(port)
    for name, kind in [("vllm:num_requests_running", "gauge"),
                       ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"),
                       ("vllm:gpu_cache_usage_perc", "gauge"),
                       ("vllm:lora_requests_info", "gauge"),
                       ("vllm:prompt_tokens", "counter"), ("vllm:generation_tokens", "counter"),
                       ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:inter_token_latency_seconds", "histogram"),
                       ("vllm:e2e_request_latency_seconds", "histogram"),
                       ("vllm:request_prompt_tokens", "histogram"),
                       ("vllm:request_generation_tokens", "histogram"),
                       ("vllm:iteration_tokens_total", "histogram")]:
        check(f"/metrics: {name} is a {kind}", name in m and m[name].type == kind)
    info = m["vllm:lora_requests_info"].samples[0]
    check("/metrics: lora_requests_info labels as vLLM's (idle: nothing running or waiting)",
          info.labels.get("max_lora") == "4" and info.labels.get("running_lora_adapters") == ""
          and info.labels.get("waiting_lora_adapters") == "" and
          info.labels.get("model_name") is None, info.labels)
    ttft_count = sample(m, "vllm:time_to_first_token_seconds",
                        "vllm:time_to_first_token_seconds_count", model_name=BASE)
    check("/metrics: time to first token counted per request", ttft_count >= 100, ttft_count)
    check("/metrics: tokens per step observed once per step",
          sample(m, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") > 100)
    check("/metrics: generation tokens counted",
          sample(m, "vllm:generation_tokens", "vllm:generation_tokens_total") > 2000)

    # ------------------------------------------------------------- stop with SIGINT

    hold = RawStream(port, {"model": BASE, "prompt": "x", "max_tokens": 500,
                            "ignore_eos": True, "stream": True})
    hold.read_until(b"data: ", 1)
    rc, seconds = main.stop(signal.SIGINT)
    rest = hold.read_all()
    hold.close()
    check("SIGINT with a stream in flight: exit 0", rc == 0, (rc, "".join(main.log)[-2000:]))
    check("... the stream was cut short, not finished", b'"finish_reason":"length"' not in rest)
    check("... promptly", seconds < 10, seconds)

    # The same port again at once: the stopped server closed connections itself, so its side
    # of them waits in TIME_WAIT for a minute.
    try:
        again = Server(["--num-kv-blocks", "64"], port=port)
        status, _, _ = request(port, "GET", "/health", key=None)
        check("a restart on the same port comes up at once", status == 200, status)
        again.stop()
    except RuntimeError as e:
        check("a restart on the same port comes up at once", False, e)

    # ------- a full server (every sequence slot busy, one request waiting): 503, unload order

    # 32 long requests fill every sequence slot for a few seconds (32 x 1000 tokens), so that
    # what follows happens while they run; the test ends them early by hanging up.
    small = Server(["--lora", f"sql={os.path.join(ADAPTERS, 'sql')}", "--max-num-seqs", "32",
                    "--enable-lora-loading", "--allowed-lora-paths", ADAPTERS,
                    "--max-waiting", "1", "--num-kv-blocks", "2100"])
    sp = small.port
    sql_req = sql_ref[2]
    blockers = []
    for i in range(32):
        # One at a time (a burst would exceed --max-waiting 1 itself): each is running once
        # its first token arrives.
        blockers.append(RawStream(sp, {"model": MODEL, "prompt": f"The function {i} returns",
                                       "max_tokens": 1000, "ignore_eos": True, "stream": True}))
        blockers[-1].read_until(b"data: ")
    wait_metrics(sp, lambda m: running(m) == 32 and waiting(m) == 0)
    queued = {}

    def queued_client():
        status, payload, _ = request(sp, "POST", "/v1/completions",
                                     {"model": "sql", "prompt": sql_req["prompt"],
                                      "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                      "stream": True, "return_token_ids": True})
        queued["status"] = status
        queued["events"] = sse_events(payload)

    qt = threading.Thread(target=queued_client)
    qt.start()
    m = wait_metrics(sp, lambda m: waiting(m) == 1)
    info = m["vllm:lora_requests_info"].samples[0]
    check("/metrics while 32 run and one waits: running 32, waiting 1, waiting adapter sql",
          running(m) == 32 and waiting(m) == 1 and info.labels["waiting_lora_adapters"] == "sql"
          and info.labels["running_lora_adapters"] == "", (running(m), waiting(m), info.labels))
    status, body = post(sp, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}]})
    check("a model without a chat template: chat is a 400 saying so",
          status == 400 and "no chat template" in error_of(body).get("message", ""),
          (status, body))
    status, body = post(sp, "/v1/completions", {"model": MODEL, "prompt": "x"})
    check("overloaded (--max-waiting 1 exceeded): 503", status == 503 and
          error_of(body).get("type") == "ServiceUnavailableError", (status, body))
    status, body = post(sp, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    check("unload with a request in flight: 200 at once", status == 200, (status, body))
    status, payload, _ = request(sp, "GET", "/v1/models")
    check("... it leaves /v1/models", "sql" not in [d["id"] for d in json.loads(payload)["data"]])
    status, body = post(sp, "/v1/completions", {"model": "sql", "prompt": "x"})
    check("... new requests for it: 404", status == 404, (status, body))
    reload = {}

    def reloader():
        reload["result"] = post(sp, "/v1/load_lora_adapter",
                                {"lora_name": "sql", "lora_path": os.path.join(ADAPTERS, "sql")})

    rt = threading.Thread(target=reloader)
    rt.start()
    rt.join(0.3)
    check("... loading the name again waits for its request in flight", rt.is_alive())
    for b in blockers:  # their clients leave: the queued sql request runs
        b.close()
    qt.join(120)
    rt.join(120)
    events, done = queued.get("events", ([], False))
    toks = [t for e in events for t in e["choices"][0].get("token_ids") or []]
    check("... the request in flight finished first, with the adapter's tokens",
          queued.get("status") == 200 and done and toks == sql_req["output_token_ids"],
          (queued, sql_req["output_token_ids"]))
    check("... then the reload succeeded", reload.get("result", (0,))[0] == 200, reload)
    status, body = post(sp, "/v1/completions",
                        {"model": "sql", "prompt": sql_req["prompt"], "max_tokens": 12,
                         "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    check("... and the reloaded adapter serves its tokens",
          status == 200 and body["choices"][0]["token_ids"] == sql_req["output_token_ids"],
          (status, body))
    m = wait_metrics(sp, lambda m: running(m) == 0 and waiting(m) == 0)
    check("... and nothing is left running", running(m) == 0 and waiting(m) == 0)
    rc, seconds = small.stop(signal.SIGTERM)
    check("SIGTERM: exit 0", rc == 0 and seconds < 10, (rc, seconds, "".join(small.log)))

    # An adapter whose files are replaced after it left the CPU cache and its GPU slot (one of
    # each): the reload refuses it, the request fails saying why, and the server logs it.
    changing = os.path.join(tmp, "changing")
    shutil.copytree(os.path.join(ADAPTERS, "sql"), changing)
    for f in os.listdir(changing):
        os.chmod(os.path.join(changing, f), 0o644)
    swap = Server(["--lora", f"chg={changing}", "--lora", f"pirate={os.path.join(ADAPTERS, 'pirate')}",
                   "--max-loras", "1", "--max-cpu-loras", "1", "--num-kv-blocks", "64"])
    body = {"prompt": sql_req["prompt"], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    first = post(swap.port, "/v1/completions", dict(body, model="chg"))
    other = post(swap.port, "/v1/completions", dict(body, model="pirate"))
    weights = os.path.join(changing, "adapter_model.safetensors")
    os.remove(weights)
    shutil.copy(os.path.join(ADAPTERS, "pirate", "adapter_model.safetensors"), weights)
    status, body_after = post(swap.port, "/v1/completions", dict(body, model="chg"))
    message = error_of(body_after).get("message", "")
    check("an adapter reloaded unchanged serves its tokens",
          first[0] == 200 and first[1]["choices"][0]["token_ids"] == sql_req["output_token_ids"]
          and other[0] == 200, (first, other))
    check("an adapter whose files changed since it was loaded: refused, naming the file",
          status == 500 and "changed on disk" in message and weights in message,
          (status, body_after))
    swap.stop()
    check("... and the server logged it",
          any("failed: adapter 'chg'" in line for line in swap.log), "".join(swap.log))
finally:
    shutil.rmtree(tmp, ignore_errors=True)

passed = sum(results)
failed = len(results) - passed
print(f"{passed} passed, {failed} failed")
sys.exit(0 if failed == 0 else 1)
