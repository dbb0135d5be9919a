#!/usr/bin/env python3
"""Generates the tokenizer test data under testdata/tokenizer/ with the Hugging Face `tokenizers`
package, which is the reference the C++ tokenizer must match.

Run from the repository root:
    pip install tokenizers==0.23.3
    python3 scripts/gen_tokenizer_expectations.py [--fixture /work/shared/fixtures/tiny-llama/model/tokenizer.json]

It writes, for each tokenizer NAME:
  testdata/tokenizer/NAME.json               the tokenizer.json (copied fixture or trained here)
  testdata/tokenizer/NAME.expected.json      ids and strings produced by `tokenizers`
The BPE trainer breaks some ties in hash order, so a re-run may learn a slightly different
vocabulary; each tokenizer file is always regenerated together with its expectations.
"""

import argparse
import json
import os
import random
import shutil

import tokenizers
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testdata", "tokenizer")

# The exact Split patterns of the published Llama 3 and Qwen2 tokenizer.json files.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Training text: mostly English prose and code, with a little of other scripts so that the
# vocabulary holds some multi-byte pieces while most CJK/emoji stay out of it.
TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "It's a truth universally acknowledged that a server must batch its requests.",
    "We're serving many adapters at once; they'll share one base model and we've measured it.",
    "I'm sure you'd like the numbers: 12345, 2024, 3.14159 and 1,000,000 tokens per second.",
    "def forward(self, x):\n    return self.linear(x) + self.lora_b(self.lora_a(x)) * scale\n",
    "for (int i = 0; i < n; ++i) {\n  y[i] += alpha * x[i];\n}\n",
    "Café, naïve, résumé, déjà vu, São Paulo, Zürich, Ærø, façade, coöperate.",
    "Привет, мир! Как дела? Это тест токенизатора.",
    "مرحبا بالعالم، هذا اختبار.",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji are fun 😀🎉 and so are flags 🇫🇷.",
    "Low-rank adaptation trains two small matrices A and B instead of the full weight.",
    "Multi-tenant serving means each request may name a different adapter, or none at all.",
    "The scheduler groups tokens by adapter slot so that each kernel launch covers them all.",
    "    Indented lines, tabs\tand\ttabs, and trailing spaces   \n\n\nnew paragraphs.",
    "HELLO WORLD, THIS IS LOUD. Don't shout; it's rude. THEY'RE HERE, WE'VE WON, I'D GO.",
    "https://example.com/path?query=value&other=42 and email someone@example.org",
    "The year 1999 was followed by 2000, 2001 and eventually 2025; pi is 3.14159265358979.",
]


def training_lines():
    # Repetition gives the trainer stable pair counts; variety keeps merges interesting.
    lines = []
    for rep in range(6):
        for i, line in enumerate(TRAIN_TEXT):
            lines.append(line if (rep + i) % 3 else line.lower())
    return lines


def byte_level_alphabet():
    return pre_tokenizers.ByteLevel.alphabet()


def build_llama3_style():
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=900, initial_alphabet=byte_level_alphabet(),
                                  show_progress=False,
                                  special_tokens=["<|begin_of_text|>", "<|end_of_text|>"])
    tok.train_from_iterator(training_lines(), trainer)
    tok.add_special_tokens([
        AddedToken("<|start_header_id|>", special=True, normalized=False),
        AddedToken("<|end_header_id|>", special=True, normalized=False),
        AddedToken("<|eot_id|>", special=True, normalized=False),
    ])
    # A non-special added token that is kept by skip_special_tokens.
    tok.add_tokens([AddedToken("loraplex", special=False, normalized=False)])
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
            special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))]),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def build_qwen2_style():
    tok = Tokenizer(models.BPE(ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=byte_level_alphabet(),
                                  show_progress=False, special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(training_lines(), trainer)
    tok.add_special_tokens([
        AddedToken("<|im_start|>", special=True, normalized=False),
        AddedToken("<|im_end|>", special=True, normalized=False),
        # lstrip/rstrip: swallows the whitespace around it.
        AddedToken("<|fim_pad|>", special=True, normalized=False, lstrip=True, rstrip=True),
    ])
    tok.add_tokens([
        AddedToken("<tool_call>", special=False, normalized=False),
        # single_word: only matches when not inside a word.
        AddedToken("adapter", special=False, normalized=True, single_word=True),
    ])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def build_gpt2_digits_style():
    # GPT-2's own pre-tokenizer (ByteLevel with its regex) behind NFKC and Digits.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True),
    ])
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=byte_level_alphabet(),
                                  show_progress=False, special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(training_lines(), trainer)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_sentencepiece_model():
    """Returns (vocab, merges) laid out like Llama 2: <unk> <s> </s>, 256 byte tokens, pieces."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False, limit_alphabet=90,
                                  special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(training_lines(), trainer)
    trained = json.loads(tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    return vocab, merges


def sentencepiece_tokenizer(vocab, merges):
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ["<unk>", "<s>", "</s>"]])
    return tok


def build_sentencepiece_style(vocab, merges):
    # Llama 2 / Mistral v0.1 ("legacy") layout.
    tok = sentencepiece_tokenizer(vocab, merges)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.add_special_tokens([AddedToken("[INST]", special=True, normalized=False),
                            AddedToken("[/INST]", special=True, normalized=False)])
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False),
                    # Normalized added token: matched after Prepend/Replace ran.
                    AddedToken("multi tenant", special=False, normalized=True)])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", 1)])
    return tok


def build_metaspace_style(vocab, merges):
    # Newer ("non-legacy") Llama/Mistral layout: Metaspace pre-tokenizer, no normalizer.
    tok = sentencepiece_tokenizer(vocab, merges)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                 split=False)
    tok.add_special_tokens([AddedToken("[INST]", special=True, normalized=False),
                            AddedToken("[/INST]", special=True, normalized=False)])
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(
        replacement="▁", prepend_scheme="first", split=False), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1", special_tokens=[("<s>", 1), ("</s>", 2)])
    return tok


def long_text():
    # About 3k tokens of mixed prose, numbers and other scripts: checks that long prompts (one
    # single BPE word for SentencePiece-style files, which have no pre-tokenizer) come out right.
    rng = random.Random(7)
    words = " ".join(TRAIN_TEXT).split(" ") + ["東京", "😀", "Привет", "١٢٣", "naïve"]
    return " ".join(rng.choice(words) for _ in range(1200))


def build_components_style(vocab, merges, with_decoder):
    # Not a real model's layout: exercises the remaining supported options (split behaviors,
    # invert, Digits grouping, Metaspace splitting, regex Replace, unknown-token fusing without
    # byte fallback, "a b" merges, lstrip/rstrip-only and single_word raw added tokens, and no
    # decoder at all).
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=False,
                               fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(),
                                           normalizers.Replace(Regex(r"\d{5,}"), "<num>")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[,.!?;:]"), behavior="merged_with_previous"),
        pre_tokenizers.Split(Regex(r"[()\[\]{}]"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"[\p{L}\p{M}]+"), behavior="contiguous", invert=True),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ["<unk>", "<s>", "</s>"]])
    tok.add_special_tokens([AddedToken("<sep>", special=True, normalized=False, rstrip=True),
                            AddedToken("<lft>", special=True, normalized=False, lstrip=True)])
    tok.add_tokens([AddedToken("foo", special=False, normalized=False, single_word=True)])
    tok.post_processor = processors.Sequence([processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1", special_tokens=[("<s>", 1), ("</s>", 2)])])
    if with_decoder:
        tok.decoder = decoders.Sequence([
            decoders.Replace(Regex("▁+"), " "), decoders.Strip(" ", 1, 0), decoders.Fuse()])
    data = json.loads(tok.to_str())
    # Write the merges in the older "left right" string form.
    data["model"]["merges"] = [" ".join(m) for m in data["model"]["merges"]]
    return json.dumps(data, ensure_ascii=False, indent=1)


def build_strip_style():
    # Strip with stop > 0 on single tokens, including tokens HF 0.23 panics on (recorded as null).
    # No unk_token: characters outside the vocabulary are dropped.
    pieces = ["e", "ee", "eee", "eeee", "Café", "ée", "xee", "éé e", "aéee", "eéx", "é", "x", "a",
              " ", "éeée", "eexee", "ex", "xe"]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # "x*" matches empty strings: checks the regex iteration over empty matches.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="isolated"),
        pre_tokenizers.Split(Regex("x*"), behavior="merged_with_next")])
    tok.decoder = decoders.Sequence([decoders.Strip("e", 1, 2)])
    return tok


COMMON_CASES = [
    "",
    " ",
    "  ",
    "\n",
    "\t",
    "Hello world",
    "Hello world!",
    " Hello world",
    "Hello world ",
    "  leading and trailing  ",
    "The quick brown fox jumps over the lazy dog.",
    "It's it's IT'S don't DON'T you're YOU'RE we've WE'VE I'm I'M we'll WE'LL he'd HE'D",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'VE 'M 'LL 'D",
    "the cat's toy",
    "Numbers: 0 7 42 123 1234 12345 123456789012345",
    "3.14159265358979 and 1,000,000 and 2024-01-31",
    "tabs\tand\t\ttabs",
    "line one\nline two\r\nline three\n\n\nafter blank lines",
    "spaces    between     words",
    "trailing newline\n",
    "   \n  \n\t\n",
    "Café naïve résumé déjà vu",
    "e\u0301 (e + combining acute) vs \u00e9",
    "A\u030a and \u212b (Angstrom) and \u00c5",
    "ﬁ ligature and ① and ｆｕｌｌ ｗｉｄｔｈ",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "東京は日本の首都です。",
    "北京是中国的首都",
    "한국어 텍스트",
    "Emoji 😀🎉👍🏽 and 👨‍👩‍👧‍👦 family",
    "flags 🇫🇷🇯🇵",
    "Math: ∑ x² ≤ ∞ ≠ π",
    "Arabic-Indic digits ٠١٢٣٤٥ and full width １２３",
    "non\u00a0breaking\u3000ideographic\u2028line sep",
    "zero\u200bwidth\u200djoiner",
    "code: def f(x):\n    return x**2 + 1\n",
    "for (int i = 0; i < n; ++i) { y[i] += a * x[i]; }",
    "https://example.com/a/b?c=d&e=f#g",
    "someone@example.org",
    "UPPER lower MiXeD",
    "!!!???...;;;:::",
    "(parentheses) [brackets] {braces} <angles>",
    "a",
    "ab",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "abababababababababab",
    "xyzzy qwfp zxcv",
    "multi tenant serving",
    "multi-tenant serving",
    "adapter adapters readapter adapter.",
    "loraplex is a loraplexserver",
    "▁already▁has▁metaspace",
    "\u2581 leading metaspace",
    "Ġ Ċ byte level lookalikes",
    "<0x41> is not a byte token",
    "ÿ þ ý ü",
    "\x7f\x01\x02 control chars",
    "mixed 中文 and English 混合",
    "😀",
    "中",
    "é",
    " 😀 ",
    "The model said: \"I'm done.\"",
    "x" * 300,
    " ".join(["word"] * 40),
    "Long prose. " + " ".join(TRAIN_TEXT[:6]),
    long_text(),
]


def special_cases(specials):
    out = []
    for s in specials:
        out += [s, f"{s}hello", f"hello{s}", f"a {s} b", f"a{s}b", f"{s}{s}", f" {s} ",
                f"\n{s}\n", f"{s} text after", f"text before {s}"]
    if len(specials) >= 2:
        a, b = specials[0], specials[1]
        out += [f"{a}user\n\nHi there!{b}", f"{a}{b}{a}", f"{a}x {b} y{a}z",
                f"{a[:-1]} partial {b[1:]}"]
    return out


def safe_decode(tok, ids, skip):
    # Some HF decoders panic on degenerate tokens; those cases are recorded as null (and the
    # Rust panic message, written straight to fd 2, is silenced).
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        return tok.decode(ids, skip_special_tokens=skip)
    except BaseException as e:  # pyo3's PanicException derives from BaseException
        if type(e).__name__ != "PanicException":
            raise
        return None
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def sample_windows(ids, rng, count):
    windows = []
    for _ in range(count):
        if not ids:
            break
        start = rng.randrange(len(ids))
        length = rng.randint(1, 4)
        windows.append(ids[start:start + length])
    return windows


def expectations(tok, name, specials, include_long):
    rng = random.Random(1234 + len(name))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    added = tok.get_added_tokens_decoder()
    max_id = max([i for i in tok.get_vocab(with_added_tokens=True).values()])
    cases = []
    texts = COMMON_CASES if include_long else COMMON_CASES[:-1]
    for text in texts + special_cases(specials):
        with_special = tok.encode(text, add_special_tokens=True).ids
        without = tok.encode(text, add_special_tokens=False).ids
        cases.append({
            "text": text,
            "ids": with_special,
            "ids_no_special": without,
            "decode_skip_special": safe_decode(tok, with_special, True),
            "decode_keep_special": safe_decode(tok, with_special, False),
        })
    # Id sequences to decode: every single id, windows of real encodings (which cut multi-byte
    # characters apart) and random id strings.
    decode_cases = []
    all_ids = [c["ids"] for c in cases]
    for ids in all_ids:
        decode_cases += sample_windows(ids, rng, 3)
    for _ in range(150):
        decode_cases.append([rng.randrange(max_id + 1) for _ in range(rng.randint(1, 6))])
    decode = [{"ids": ids,
               "skip_special": safe_decode(tok, ids, True),
               "keep_special": safe_decode(tok, ids, False)} for ids in decode_cases]
    single = [safe_decode(tok, [i], False) for i in range(max_id + 1)]
    vocab = tok.get_vocab(with_added_tokens=True)
    return {
        "generator": f"tokenizers {tokenizers.__version__} via scripts/gen_tokenizer_expectations.py",
        "tokenizer": f"{name}.json",
        "max_id": max_id,
        "vocab_size_hf": vocab_size,
        "special_ids": sorted(i for i, t in added.items() if t.special),
        "token_to_id": {t: vocab[t] for t in sorted(vocab)[:: max(1, len(vocab) // 97)]} |
                       {t.content: i for i, t in added.items()},
        "encode": cases,
        "decode": decode,
        "decode_single_keep_special": single,
    }


def write(name, tok, specials, json_text=None, include_long=True):
    path = os.path.join(OUT_DIR, f"{name}.json")
    if json_text is None:
        json_text = tok.to_str(pretty=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json_text)
    # Reload from the written file so expectations come from exactly what the C++ side reads.
    tok = Tokenizer.from_file(path)
    exp = expectations(tok, name, specials, include_long)
    with open(os.path.join(OUT_DIR, f"{name}.expected.json"), "w", encoding="utf-8") as f:
        # One case per line keeps the file small and diffs readable.
        f.write("{\n")
        for i, (key, value) in enumerate(exp.items()):
            f.write(json.dumps(key) + ": ")
            if isinstance(value, list) and value and isinstance(value[0], dict):
                f.write("[\n" + ",\n".join(json.dumps(v, ensure_ascii=False) for v in value) + "\n]")
            else:
                f.write(json.dumps(value, ensure_ascii=False))
            f.write(",\n" if i + 1 < len(exp) else "\n")
        f.write("}\n")
    print(f"{name}: {os.path.getsize(path)} bytes, {len(exp['encode'])} encode cases, "
          f"{len(exp['decode'])} decode cases")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixture", default="/work/shared/fixtures/tiny-llama/model/tokenizer.json")
    args = parser.parse_args()
    os.makedirs(OUT_DIR, exist_ok=True)

    with open(args.fixture, encoding="utf-8") as f:
        fixture_text = f.read()
    write("tiny_llama_byte_level", None, ["<|begin_of_text|>", "<|end_of_text|>"], fixture_text)
    write("llama3_style", build_llama3_style(),
          ["<|start_header_id|>", "<|eot_id|>", "<|begin_of_text|>", "loraplex"])
    write("qwen2_style", build_qwen2_style(),
          ["<|im_start|>", "<|im_end|>", "<|fim_pad|>", "<tool_call>", "adapter"])
    write("gpt2_digits_style", build_gpt2_digits_style(), ["<|endoftext|>"])
    vocab, merges = train_sentencepiece_model()
    write("sentencepiece_style", build_sentencepiece_style(vocab, merges),
          ["[INST]", "[/INST]", "<s>", "</s>", "<tool>", "multi tenant", "<unk>"])
    write("metaspace_style", build_metaspace_style(vocab, merges),
          ["[INST]", "[/INST]", "<s>", "<tool>"])
    components_specials = ["<sep>", "<lft>", "foo", "<s>", "<unk>"]
    write("components_style", None, components_specials,
          build_components_style(vocab, merges, with_decoder=True), include_long=False)
    write("components_no_decoder", None, components_specials,
          build_components_style(vocab, merges, with_decoder=False), include_long=False)
    write("strip_style", build_strip_style(), ["ee"], include_long=False)


if __name__ == "__main__":
    main()
