#!/usr/bin/env python3
"""Renders the real chat templates of testdata/chat_templates with Python's jinja2, configured
as transformers' apply_chat_template configures it, and with loraplex's engine (through the
loraplex_render_chat helper), and checks that the two agree byte for byte: the same text, or
both failing (with the same message for raise_exception).

usage: check_chat_templates.py RENDER_BINARY TEMPLATE_DIR
Prints 'N passed, N failed'; exits 77 (skipped) when jinja2 is not installed.
"""

import json
import os
import random
import subprocess
import sys
import tempfile
from datetime import datetime

try:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    print("jinja2 is not installed (pip install jinja2): skipped")
    sys.exit(77)

BIN, DIR = sys.argv[1], sys.argv[2]

SPECIAL_TOKENS = {
    "llama3.3-70b-instruct.jinja": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "llama3.2-3b-instruct.jinja": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "mistral-7b-instruct-v0.3.jinja": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "mistral-7b-instruct-v0.2.jinja": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    # Qwen2's tokenizer_config has "bos_token": null, so transformers passes none.
    "qwen2-7b-instruct.jinja": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "openhermes-2.5-mistral-7b.jinja": {"bos_token": "<s>", "eos_token": "<|im_end|>",
                                         "unk_token": "<unk>"},
}


class TemplateRaise(Exception):
    pass


def make_env():
    # transformers: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
    # extensions=[AssistantTracker, loopcontrols]), its own tojson, raise_exception and
    # strftime_now.
    def raise_exception(message):
        raise TemplateRaise(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render_reference(env, source, case, special):
    template = env.from_string(source)
    try:
        text = template.render(messages=case["messages"], tools=case.get("tools"),
                               documents=None,
                               add_generation_prompt=case.get("add_generation_prompt", False),
                               **special, **case.get("kwargs", {}))
    except TemplateRaise as e:
        return {"ok": False, "raise": str(e)}
    except Exception as e:  # noqa: BLE001 - any jinja2 failure must be a loraplex failure too
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if case.get("continue_final_message"):
        # transformers' cut after the final message (apply_chat_template).
        final = case["messages"][-1]["content"]
        if final.strip() not in text:
            return {"ok": False, "error": "final message not in render"}
        loc = text.rindex(final.strip())
        if text[loc:loc + len(final.lstrip())] == final:
            text = text[:loc + len(final.lstrip())]
        else:
            text = text[:loc + len(final.strip())]
    return {"ok": True, "text": text}


def random_conversation(rng):
    pieces = ["hello", "  padded  ", "line\nbreak", "tab\there", "naïve café", "数学",
              "emoji 🙂", "'single'", '"double"', "back\\slash", "{{ braces }}", "", "\n",
              "trailing space ", " 42 ", "x" * 40]
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(pieces)})
    turns = rng.randint(1, 6)
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        content = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 3)))
        messages.append({"role": role, "content": content})
    return {"messages": messages, "add_generation_prompt": messages[-1]["role"] == "user"}


def main():
    env = make_env()
    conversations = json.load(open(os.path.join(DIR, "conversations.json")))
    rng = random.Random(1234)
    for i in range(12):
        conversations[f"random_{i}"] = random_conversation(rng)
    cases, expected, names = [], [], []
    for template_name, special in SPECIAL_TOKENS.items():
        path = os.path.join(DIR, template_name)
        source = open(path, encoding="utf-8").read()
        for conv_name, conv in conversations.items():
            if "only" in conv and template_name not in conv["only"]:
                continue
            case = {k: v for k, v in conv.items() if k != "only"}
            # A fixed date keeps the Llama 3.2 template's strftime_now out of the comparison.
            if template_name.startswith("llama"):
                case.setdefault("kwargs", {}).setdefault("date_string", "26 Jul 2024")
            cases.append(dict(case, template=path, special_tokens=special))
            expected.append(render_reference(env, source, case, special))
            names.append(f"{template_name} / {conv_name}")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cases, f)
        cases_path = f.name
    try:
        p = subprocess.run([BIN, cases_path], capture_output=True, text=True, timeout=120)
    finally:
        os.unlink(cases_path)
    if p.returncode != 0:
        print("FAIL loraplex_render_chat exited", p.returncode, p.stderr)
        print("0 passed, 1 failed")
        sys.exit(1)
    got = json.loads(p.stdout)
    passed = failed = 0
    rendered_ok = 0
    for name, want, have in zip(names, expected, got):
        if want["ok"]:
            good = have["ok"] and have["text"] == want["text"]
            rendered_ok += 1
            detail = "" if good else (
                f"\n  jinja2:   {want['text']!r}\n  loraplex: {have.get('text', have.get('error'))!r}")
        elif "raise" in want:
            good = not have["ok"] and have["stage"] == "render" and have["error"] == want["raise"]
            detail = "" if good else f"\n  jinja2 raised {want['raise']!r}\n  loraplex: {have!r}"
        else:
            good = not have["ok"] and have["stage"] == "render"
            detail = "" if good else f"\n  jinja2 failed ({want['error']})\n  loraplex: {have!r}"
        print(("PASS " if good else "FAIL ") + name + detail)
        passed += good
        failed += not good
    # The comparison must exercise real renders, not only shared failures.
    if rendered_ok < len(names) // 2:
        print(f"FAIL only {rendered_ok} of {len(names)} cases rendered under jinja2")
        failed += 1
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
