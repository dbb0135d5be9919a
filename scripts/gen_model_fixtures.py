#!/usr/bin/env python3
"""Builds the model fixtures under testdata/ (Qwen2, Mixtral, Qwen3, Qwen3-MoE) with transformers + PEFT.

How it was run (CPU only, about a minute):
    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install torch transformers==5.17.0 \
        peft==0.21.0 safetensors tokenizers
    /tmp/venv/bin/python scripts/gen_model_fixtures.py --out testdata

Each fixture is a tiny random checkpoint (bf16 weights) in the ordinary Hugging Face layout, a few
PEFT adapters as PEFT saves them, and expected.jsonl: what PEFT generates for each (prompt,
adapter) request, computed the same way as the shared tiny-llama fixture: float32 on the CPU from
exactly the stored bf16 values, one request at a time, greedy, no EOS stop, no KV cache (a full
forward over prompt + generated tokens at every step).

- tiny-qwen2: Qwen2ForCausalLM (q/k/v bias, tied embeddings, head_dim derived, rope_theta at the
  top level as transformers 4.x writes it), a SentencePiece-style tokenizer.json (BPE with a
  Prepend/Replace normalizer and byte fallback, trained here with `tokenizers`), adapters on
  attention, all-linear with rank_pattern/alpha_pattern, and on the embedding.
- tiny-mixtral: MixtralForCausalLM (4 experts, top-2, llama3 RoPE scaling), the byte-level
  tokenizer of tiny-llama, checkpoint with the 4.x weight names that transformers 5 still saves
  (block_sparse_moe.experts.N.w1/w2/w3), adapters on attention, on PEFT's 3-D expert parameters
  (target_parameters: mlp.experts.gate_up_proj / down_proj), and the same expert adapter
  converted to the per-expert 2-D form (block_sparse_moe.experts.N.w1/w2/w3), which must give
  the same tokens as the 3-D one.
- tiny-qwen3: Qwen3ForCausalLM (q_norm / k_norm, explicit head_dim unlike hidden / heads, tied
  embeddings), the byte-level tokenizer, adapters on attention and all-linear.
- tiny-qwen3-moe: Qwen3MoeForCausalLM (8 experts, top-3, norm_topk_prob), checkpoint with the
  4.x names that transformers 5 saves (mlp.experts.N.gate_proj/up_proj/down_proj), adapters on
  attention, on the 3-D expert parameters, on both, and the expert adapter in per-expert 2-D
  form (mlp.experts.N.gate_proj/up_proj/down_proj).
"""

import argparse
import json
import math
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

import transformers
import peft
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer, decoders, models, normalizers, trainers, processors
from transformers import PreTrainedTokenizerFast

NUM_TOKENS = 12
HERE = os.path.dirname(os.path.abspath(__file__))

PROMPTS = [
    "The function returns",
    "Return a new list of the",
    "If the file does not exist, raise",
    "A simple example:",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2192 output",
    "def add(a, b):",
]

CORPUS = [
    "The function returns a new list of the values in the file.",
    "If the file does not exist, raise an error and return None.",
    "This module provides a simple example of the parser.",
    "Convert the string to an integer and return the result.",
    "def add(a, b): return a + b",
    "for item in items: print(item)",
    "A simple example: the quick brown fox jumps over the lazy dog.",
    "Read the config file, parse the values, and build the model.",
    "class Tokenizer: encode and decode the text into token ids.",
    "The adapter changes the output of the model for each request.",
] * 20


def make_sentencepiece_tokenizer(path):
    """A Llama-2-style tokenizer.json: '▁' for spaces, BPE with byte fallback, BOS prepended."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    trained = json.loads(tok.to_str())
    # Byte-fallback tokens <0x00>..<0xFF> must be ordinary vocabulary entries (as in Llama 2's
    # tokenizer.json), right after the special tokens; the trained pieces follow.
    old_vocab = trained["model"]["vocab"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(old_vocab.items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    trained["model"]["vocab"] = vocab
    for added in trained["added_tokens"]:
        added["id"] = vocab[added["content"]]
    tok = Tokenizer.from_str(json.dumps(trained))
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.save(path)
    return len(vocab)


def hf_tokenizer(model_dir, bos, eos):
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"),
                                  bos_token=bos, eos_token=eos)
    tok.save_pretrained(model_dir)
    return tok


def save_bf16_checkpoint(model, model_dir):
    model.to(torch.bfloat16).save_pretrained(model_dir)


def load_f32(cls, model_dir, **config_overrides):
    model = cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                **config_overrides)
    model.eval()
    return model


def random_adapter(base, config, adapter_dir, stored_dtype, seed):
    """A PEFT adapter with random A and B (init_lora_weights=False), saved in stored_dtype."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
        if stored_dtype != torch.float32:
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.copy_(p.to(stored_dtype).to(torch.float32))
    peft_model.save_pretrained(adapter_dir)
    os.remove(os.path.join(adapter_dir, "README.md"))
    if stored_dtype != torch.float32:
        path = os.path.join(adapter_dir, "adapter_model.safetensors")
        tensors = {k: v.to(stored_dtype) for k, v in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    base = peft_model.unload()
    return base


@torch.no_grad()
def reference(model, tok, prompt):
    ids = tok(prompt)["input_ids"]
    seq = list(ids)
    out = []
    min_margin = math.inf
    top5 = None
    for step in range(NUM_TOKENS):
        logits = model(torch.tensor([seq])).logits[0, -1].to(torch.float64)
        logprobs = torch.log_softmax(logits, dim=-1)
        values, indices = torch.topk(logprobs, 5)
        if step == 0:
            top5 = [[int(i), float(v)] for v, i in zip(values, indices)]
        min_margin = min(min_margin, float(values[0] - values[1]))
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        seq.append(nxt)
    return {
        "prompt_token_ids": ids,
        "output_token_ids": out,
        "output_text": tok.decode(out, skip_special_tokens=True),
        "min_top1_margin": min_margin,
        "first_token_top5_logprobs": top5,
    }


def write_expected(fixture_dir, model_cls, model_dir, tok, requests, adapter_dirs, aliases=None,
                   config_overrides=None, name="expected"):
    """Runs every request alone through PEFT (or the base model) and writes <name>.jsonl (and,
    for "expected", requests.jsonl). `aliases` maps an extra adapter name to one whose outputs it
    must equal; `config_overrides` changes config.json's values for this run."""
    lines = []
    for prompt, adapter in requests:
        base = load_f32(model_cls, model_dir, **(config_overrides or {}))
        model = base if adapter is None else PeftModel.from_pretrained(base, adapter_dirs[adapter])
        model.eval()
        r = reference(model, tok, prompt)
        lines.append({"prompt": prompt, "adapter": adapter, **r})
    for alias, target in (aliases or {}).items():
        for line in list(lines):
            if line["adapter"] == target:
                lines.append({**line, "adapter": alias})
    with open(os.path.join(fixture_dir, name + ".jsonl"), "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    if name != "expected":
        return lines
    with open(os.path.join(fixture_dir, "requests.jsonl"), "w") as f:
        for line in lines:
            f.write(json.dumps({"prompt": line["prompt"], "adapter": line["adapter"]}) + "\n")
    return lines


def write_readme(fixture, summary):
    with open(os.path.join(fixture, "README.md"), "w") as f:
        f.write(summary.strip() + "\n\n" + """Generated by scripts/gen_model_fixtures.py (transformers 5.17.0, peft 0.21.0); do not
edit by hand. expected.jsonl holds what PEFT generates for each (prompt, adapter) request
alone: float32 on the CPU from exactly the stored bf16 weights, greedy, 12 tokens, no EOS stop,
no KV cache. requests.jsonl is the same requests for `loraplex generate --requests`.
""")


def build_qwen2(out_root):
    fixture = os.path.join(out_root, "tiny-qwen2")
    shutil.rmtree(fixture, ignore_errors=True)
    model_dir = os.path.join(fixture, "model")
    os.makedirs(model_dir)
    vocab = make_sentencepiece_tokenizer(os.path.join(model_dir, "tokenizer.json"))
    tok = hf_tokenizer(model_dir, "<s>", "</s>")
    cfg = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
    save_bf16_checkpoint(model, model_dir)
    # transformers 4.x spelling: rope_theta at the top level and no head_dim (derived).
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope["rope_theta"]
    config.pop("head_dim", None)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    adapters = {
        "attn": (LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                "o_proj"],
                            init_lora_weights=False), torch.float32),
        "mixed": (LoraConfig(r=8, lora_alpha=8, target_modules="all-linear",
                             rank_pattern={"down_proj": 4, "q_proj": 6},
                             alpha_pattern={"down_proj": 12},
                             init_lora_weights=False), torch.bfloat16),
        "embed": (LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "v_proj"],
                             use_rslora=True, init_lora_weights=False), torch.float32),
    }
    adapter_dirs = {}
    for i, (name, (config, dtype)) in enumerate(adapters.items()):
        base = load_f32(transformers.Qwen2ForCausalLM, model_dir)
        adapter_dirs[name] = os.path.join(fixture, "adapters", name)
        random_adapter(base, config, adapter_dirs[name], dtype, seed=100 + i)
    requests = [(p, a) for p in PROMPTS for a in [None, "attn", "mixed", "embed"]]
    write_expected(fixture, transformers.Qwen2ForCausalLM, model_dir, tok, requests, adapter_dirs)
    write_readme(fixture, """# tiny-qwen2

A random Qwen2ForCausalLM (2 layers, hidden 96, 6 heads / 2 KV heads, q/k/v bias, tied
embeddings, config.json in the transformers 4.x spelling: rope_theta at the top level, no
head_dim) with a SentencePiece-style tokenizer.json (BPE, Prepend/Replace normalizer, byte
fallback, BOS prepended) and three PEFT adapters: `attn` (q/k/v/o, r 8, fp32), `mixed`
(all-linear, r 8 with rank_pattern/alpha_pattern, bf16) and `embed` (embed_tokens + v_proj,
rsLoRA r 4, fp32).""")


# The per-expert 2-D module names of transformers 4.x: (module under the layer, gate, up, down).
MIXTRAL_2D = ("block_sparse_moe.experts", "w1", "w3", "w2")
QWEN3_MOE_2D = ("mlp.experts", "gate_proj", "up_proj", "down_proj")


def expert_adapter_to_2d(src_dir, dst_dir, num_experts, num_layers, intermediate,
                         names_2d=MIXTRAL_2D):
    """Rewrites a PEFT 3-D expert adapter (target_parameters gate_up_proj / down_proj) as the
    per-expert 2-D form on the 4.x module names, using PEFT's own layout:
    lora_A [r*E, in] is expert-major (rows e*r .. e*r+r-1), lora_B [out, r*E] is rank-major
    (column j*E + e), delta_e = B_e @ A_e * scale."""
    experts_2d, gate_2d, up_2d, down_2d = names_2d
    os.makedirs(dst_dir, exist_ok=True)
    with open(os.path.join(src_dir, "adapter_config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(src_dir, "adapter_model.safetensors"))
    out = {}
    prefix = "base_model.model.model.layers"
    for key, value in tensors.items():
        if ".mlp.experts." not in key:
            out[key] = value
    for layer in range(num_layers):
        # PEFT nests one ParamWrapper per target parameter: the first listed is innermost, so its
        # keys carry one more ".base_layer" than the next. Which is which follows from A's input
        # width: hidden for gate_up_proj, intermediate for down_proj.
        stem = f"{prefix}.{layer}.mlp.experts."
        for a_key in [k for k in tensors if k.startswith(stem) and k.endswith("lora_A.weight")]:
            a = tensors[a_key]
            b = tensors[a_key.replace("lora_A", "lora_B")]
            names = (down_2d,) if a.shape[1] == intermediate else (gate_2d, up_2d)
            if names == (gate_2d, up_2d):
                assert b.shape[0] == 2 * intermediate, (a_key, b.shape)
            r = a.shape[0] // num_experts
            a_e = a.reshape(num_experts, r, a.shape[-1])
            b_e = b.reshape(b.shape[0], r, num_experts).permute(2, 0, 1)
            for e in range(num_experts):
                rows = [b_e[e]] if len(names) == 1 else [b_e[e][:intermediate],
                                                         b_e[e][intermediate:]]
                for name, b_rows in zip(names, rows):
                    base = f"{prefix}.{layer}.{experts_2d}.{e}.{name}"
                    out[f"{base}.lora_A.weight"] = a_e[e].clone()
                    out[f"{base}.lora_B.weight"] = b_rows.contiguous()
    config["target_parameters"] = None
    config["target_modules"] = sorted(set(config["target_modules"] or [])
                                      | {gate_2d, up_2d, down_2d})
    with open(os.path.join(dst_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(out, os.path.join(dst_dir, "adapter_model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def check_2d_conversion(model_dir, adapter_dirs, cfg, model_cls=transformers.MixtralForCausalLM,
                        names_2d=MIXTRAL_2D, num_experts=None):
    """The per-expert 2-D adapter must hold exactly PEFT's own 3-D delta weights."""
    experts_2d, gate_2d, up_2d, down_2d = names_2d
    num_experts = num_experts or cfg.num_local_experts
    base = load_f32(model_cls, model_dir)
    model = PeftModel.from_pretrained(base, adapter_dirs["experts"])
    two_d = load_file(os.path.join(adapter_dirs["experts2d"], "adapter_model.safetensors"))
    with open(os.path.join(adapter_dirs["experts"], "adapter_config.json")) as f:
        lora_config = json.load(f)
    scale = lora_config["lora_alpha"] / lora_config["r"]
    checked = 0
    for name, module in model.named_modules():
        if type(module).__name__ != "ParamWrapper":
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        delta = module.get_delta_weight("default")  # [E, out, in]
        for e in range(num_experts):
            stem = f"base_model.model.model.layers.{layer}.{experts_2d}.{e}."
            if module.parameter_name == "gate_up_proj":
                parts = [two_d[stem + f"{w}.lora_B.weight"].float()
                         @ two_d[stem + f"{w}.lora_A.weight"].float() for w in (gate_2d, up_2d)]
                mine = torch.cat(parts, dim=0) * scale
            else:
                mine = (two_d[stem + f"{down_2d}.lora_B.weight"].float()
                        @ two_d[stem + f"{down_2d}.lora_A.weight"].float() * scale)
            torch.testing.assert_close(mine, delta[e], rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked == 2 * cfg.num_hidden_layers * num_experts, checked


def new_fixture(out_root, name, llama_tokenizer):
    """An empty testdata/<name> with model/ holding tiny-llama's byte-level tokenizer."""
    fixture = os.path.join(out_root, name)
    shutil.rmtree(fixture, ignore_errors=True)
    model_dir = os.path.join(fixture, "model")
    os.makedirs(model_dir)
    shutil.copy(llama_tokenizer, os.path.join(model_dir, "tokenizer.json"))
    tok = hf_tokenizer(model_dir, "<|begin_of_text|>", "<|end_of_text|>")
    return fixture, model_dir, tok


def build_mixtral(out_root, llama_tokenizer):
    fixture, model_dir, tok = new_fixture(out_root, "tiny-mixtral", llama_tokenizer)
    cfg = transformers.MixtralConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(2)
    model = transformers.MixtralForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "gate.weight" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.1)
    save_bf16_checkpoint(model, model_dir)
    names = load_file(os.path.join(model_dir, "model.safetensors")).keys()
    assert any(".block_sparse_moe.experts.0.w1.weight" in n for n in names), sorted(names)[:20]

    adapters = {
        "attn": (LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                "o_proj"],
                            init_lora_weights=False), torch.float32),
        "experts": (LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                               target_parameters=["mlp.experts.gate_up_proj",
                                                  "mlp.experts.down_proj"],
                               init_lora_weights=False), torch.float32),
    }
    adapter_dirs = {}
    for i, (name, (config, dtype)) in enumerate(adapters.items()):
        base = load_f32(transformers.MixtralForCausalLM, model_dir)
        adapter_dirs[name] = os.path.join(fixture, "adapters", name)
        random_adapter(base, config, adapter_dirs[name], dtype, seed=200 + i)
    adapter_dirs["experts2d"] = os.path.join(fixture, "adapters", "experts2d")
    expert_adapter_to_2d(adapter_dirs["experts"], adapter_dirs["experts2d"], cfg.num_local_experts,
                         cfg.num_hidden_layers, cfg.intermediate_size)
    check_2d_conversion(model_dir, adapter_dirs, cfg)
    requests = [(p, a) for p in PROMPTS[:5] for a in [None, "attn", "experts"]]
    write_expected(fixture, transformers.MixtralForCausalLM, model_dir, tok, requests,
                   adapter_dirs, aliases={"experts2d": "experts"})
    write_readme(fixture, """# tiny-mixtral

A random MixtralForCausalLM (2 layers, hidden 64, 4 experts, top-2, llama3 RoPE scaling) saved
by transformers 5 with the 4.x weight names (block_sparse_moe.experts.N.w1/w2/w3), the
byte-level tokenizer of tiny-llama, and adapters: `attn` (q/k/v/o), `experts` (q_proj plus
PEFT's 3-D target_parameters mlp.experts.gate_up_proj / down_proj, r 4) and `experts2d` (the
same expert LoRA converted to per-expert 2-D w1/w3/w2 modules; its expected lines are those of
`experts`). PEFT's 3-D layout, checked against ParamWrapper.get_delta_weight by the script:
lora_A [r*E, in] rows expert-major (row e*r + j), lora_B [out, r*E] columns rank-major
(column j*E + e); the first parameter in the module's order is the inner wrapper (its keys
carry `.base_layer`).""")


def init_weights(model, seed, router_scale=0.5):
    """Random weights of a useful size: norms (q_norm / k_norm included) near 1, routers wider
    than the projections so that routing is decided, everything else small."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p) * router_scale)
            else:
                p.copy_(torch.randn_like(p) * 0.1)


def build_qwen3(out_root, llama_tokenizer):
    fixture, model_dir, tok = new_fixture(out_root, "tiny-qwen3", llama_tokenizer)
    # head_dim 32 is not hidden / heads (16): the explicit head_dim is what counts.
    cfg = transformers.Qwen3Config(
        vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    model = transformers.Qwen3ForCausalLM(cfg)
    init_weights(model, seed=3)
    save_bf16_checkpoint(model, model_dir)
    names = load_file(os.path.join(model_dir, "model.safetensors")).keys()
    assert "model.layers.0.self_attn.q_norm.weight" in names, sorted(names)

    adapters = {
        "attn": (LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                "o_proj"],
                            init_lora_weights=False), torch.float32),
        "all": (LoraConfig(r=8, lora_alpha=8, target_modules="all-linear",
                           rank_pattern={"down_proj": 4, "k_proj": 6},
                           alpha_pattern={"down_proj": 12},
                           init_lora_weights=False), torch.bfloat16),
    }
    adapter_dirs = {}
    for i, (name, (config, dtype)) in enumerate(adapters.items()):
        base = load_f32(transformers.Qwen3ForCausalLM, model_dir)
        adapter_dirs[name] = os.path.join(fixture, "adapters", name)
        random_adapter(base, config, adapter_dirs[name], dtype, seed=300 + i)
    requests = [(p, a) for p in PROMPTS for a in [None, "attn", "all"]]
    write_expected(fixture, transformers.Qwen3ForCausalLM, model_dir, tok, requests, adapter_dirs)
    write_readme(fixture, """# tiny-qwen3

A random Qwen3ForCausalLM (2 layers, hidden 64, 4 heads / 2 KV heads, explicit head_dim 32 (not
hidden / heads), q_norm / k_norm RMSNorm weights per layer, tied embeddings, rope_theta 1e6)
with the byte-level tokenizer of tiny-llama, and two PEFT adapters: `attn` (q/k/v/o, r 8, fp32)
and `all` (all-linear, r 8 with rank_pattern/alpha_pattern, bf16).""")


def build_qwen3_moe(out_root, llama_tokenizer):
    fixture, model_dir, tok = new_fixture(out_root, "tiny-qwen3-moe", llama_tokenizer)
    num_experts = 8
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=num_experts, num_experts_per_tok=3, norm_topk_prob=True,
        max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    init_weights(model, seed=4)
    save_bf16_checkpoint(model, model_dir)
    names = load_file(os.path.join(model_dir, "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names, sorted(names)[:20]
    with open(os.path.join(model_dir, "config.json")) as f:
        saved = json.load(f)
    assert saved["num_local_experts"] == num_experts and saved["norm_topk_prob"], saved

    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapters = {
        "attn": (LoraConfig(r=8, lora_alpha=16, target_modules=attention,
                            init_lora_weights=False), torch.bfloat16),
        "experts": (LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=experts,
                               init_lora_weights=False), torch.bfloat16),
        "both": (LoraConfig(r=6, lora_alpha=12, target_modules=attention,
                            target_parameters=experts, init_lora_weights=False), torch.bfloat16),
    }
    adapter_dirs = {}
    for i, (name, (config, dtype)) in enumerate(adapters.items()):
        base = load_f32(transformers.Qwen3MoeForCausalLM, model_dir)
        adapter_dirs[name] = os.path.join(fixture, "adapters", name)
        random_adapter(base, config, adapter_dirs[name], dtype, seed=400 + i)
    adapter_dirs["experts2d"] = os.path.join(fixture, "adapters", "experts2d")
    expert_adapter_to_2d(adapter_dirs["experts"], adapter_dirs["experts2d"], num_experts,
                         cfg.num_hidden_layers, cfg.moe_intermediate_size, QWEN3_MOE_2D)
    check_2d_conversion(model_dir, adapter_dirs, cfg, transformers.Qwen3MoeForCausalLM,
                        QWEN3_MOE_2D, num_experts)
    requests = [(p, a) for p in PROMPTS[:5] for a in [None, "attn", "experts", "both"]]
    write_expected(fixture, transformers.Qwen3MoeForCausalLM, model_dir, tok, requests,
                   adapter_dirs, aliases={"experts2d": "experts"})
    # The same checkpoint with norm_topk_prob false: the top-3 weights not renormalised.
    write_expected(fixture, transformers.Qwen3MoeForCausalLM, model_dir, tok,
                   [(p, a) for p in PROMPTS[:5] for a in [None, "both"]], adapter_dirs,
                   config_overrides={"norm_topk_prob": False},
                   name="expected_norm_topk_prob_false")
    write_readme(fixture, """# tiny-qwen3-moe

A random Qwen3MoeForCausalLM (2 layers, hidden 64, 4 heads / 2 KV heads, head_dim 32, q_norm /
k_norm, 8 experts of width 32, top-3, norm_topk_prob true, no shared expert) saved by
transformers 5 with the 4.x weight names (mlp.experts.N.gate_proj/up_proj/down_proj,
mlp.gate) and `num_local_experts` for num_experts, the byte-level tokenizer of tiny-llama, and
adapters (bf16): `attn` (q/k/v/o, r 8), `experts` (only PEFT's 3-D target_parameters
mlp.experts.gate_up_proj / down_proj, r 4), `both` (q/k/v/o and the 3-D experts, r 6) and
`experts2d` (the `experts` LoRA converted to per-expert 2-D gate_proj/up_proj/down_proj modules,
as PEFT saves adapters of transformers 4.x Qwen3-MoE; its expected lines are those of
`experts`, and the script checks it against ParamWrapper.get_delta_weight).
expected_norm_topk_prob_false.jsonl: the base model and `both` with config.json's
norm_topk_prob set to false (the router's top-3 probabilities used as they are).""")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "..", "testdata"))
    parser.add_argument("--only", choices=["qwen2", "mixtral", "qwen3", "qwen3-moe"])
    args = parser.parse_args()
    assert transformers.__version__ == "5.17.0" and peft.__version__ == "0.21.0", (
        transformers.__version__, peft.__version__)
    torch.set_num_threads(2)
    llama_tokenizer = os.path.join(HERE, "..", "testdata", "tiny-llama", "model", "tokenizer.json")
    if args.only in (None, "qwen2"):
        build_qwen2(args.out)
    if args.only in (None, "mixtral"):
        build_mixtral(args.out, llama_tokenizer)
    if args.only in (None, "qwen3"):
        build_qwen3(args.out, llama_tokenizer)
    if args.only in (None, "qwen3-moe"):
        build_qwen3_moe(args.out, llama_tokenizer)


if __name__ == "__main__":
    main()
