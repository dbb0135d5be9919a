#!/usr/bin/env python3
"""Builds testdata/tiny-llama-fp8: the tiny Llama quantized to FP8 in three checkpoint formats.

How it was run (CPU only, about a minute; the venv of scripts/gen_model_fixtures.py):
    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install torch transformers==5.17.0 \
        peft==0.21.0 safetensors tokenizers
    /tmp/venv/bin/python scripts/gen_fp8_fixtures.py --out testdata

Each format quantizes the seven projections of every decoder layer of testdata/tiny-llama (bf16
weights) the way its tool does, stores float8_e4m3 codes and float32 scales with the
quantization_config that describes them, and keeps the embedding, lm_head and norms as they are:

- dynamic/: compressed-tensors "FP8-dynamic" (llm-compressor): one scale per output channel,
  weight_scale [out, 1] = amax(|row|) / 448, q = (w / scale) clamped to +-448; activations
  dynamic per token (no input scales).
- static/: compressed-tensors "FP8": one scale per tensor, weight_scale [1] = amax(|W|) / 448;
  static activation scales input_scale [1] = amax(|x|) / 448 over the inputs each projection
  sees on the fixture's prompts (base model); layer 0's down_proj is listed in `ignore` and
  kept in bf16 (a quantized model with an unquantized projection).
- block/: transformers' fine-grained "fp8" (DeepSeek's layout): 128x128 blocks, with partial
  blocks at the edges of every projection of this small model, weight_scale_inv
  [ceil(out / 128), ceil(in / 128)] = 1 / (448 / amax(|block|)), q = w * (448 / amax);
  activations dynamic.

expected.jsonl in each: what transformers + PEFT generate for tiny-llama's 30 requests (its
four adapters, used unchanged) from the DEQUANTIZED weights, q.float() * scale in float32 (every
other tensor as stored), float32 on the CPU, one request at a time, greedy, 12 tokens, no EOS
stop, no KV cache: exactly what loraplex's CPU path computes, since it keeps the codes and
scales and dequantizes each weight element the same way.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

import peft
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_model_fixtures as fixtures  # noqa: E402  (reference() and write_expected())

HERE = os.path.dirname(os.path.abspath(__file__))
FP8_MAX = 448.0
PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
IGNORED_IN_STATIC = "model.layers.0.mlp.down_proj"


def to_fp8(values):
    return values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_per_channel(w):
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).to(torch.float32)
    return to_fp8(w / scale), scale


def quantize_per_tensor(w):
    scale = (w.abs().amax() / FP8_MAX).to(torch.float32).reshape(1)
    return to_fp8(w / scale), scale


def quantize_blocks(w, block):
    """transformers' Fp8Quantize: zero-padded blocks, scale = 448 / amax, stored as 1 / scale."""
    rows, cols = w.shape
    rb, cb = math.ceil(rows / block), math.ceil(cols / block)
    padded = torch.zeros(rb * block, cb * block, dtype=torch.float32)
    padded[:rows, :cols] = w
    blocks = padded.reshape(rb, block, cb, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    q = to_fp8(blocks * scales[:, None, :, None]).reshape(rb * block, cb * block)[:rows, :cols]
    return q.contiguous(), (1.0 / scales).to(torch.float32)


def dequantize(q, scale, group_n, group_k):
    """q.float() * scale, each element's scale from its (row group, column group)."""
    rows, cols = q.shape
    s = scale.reshape(math.ceil(rows / group_n), math.ceil(cols / group_k))
    full = s.repeat_interleave(group_n, dim=0)[:rows].repeat_interleave(group_k, dim=1)[:, :cols]
    return q.to(torch.float32) * full


@torch.no_grad()
def input_amax(model_dir, tok, prompts):
    """amax(|x|) of every projection's input over the prompts, from the float model."""
    model = fixtures.load_f32(transformers.LlamaForCausalLM, model_dir)
    amax = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            def hook(mod, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(hook))
    for p in prompts:
        model(torch.tensor([tok(p)["input_ids"]]))
    for h in hooks:
        h.remove()
    return amax


def compressed_tensors_config(weights, activations, ignore):
    def args(strategy, dynamic):
        return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None,
                "num_bits": 8, "observer": None if dynamic else "minmax", "observer_kwargs": {},
                "strategy": strategy, "symmetric": True, "type": "float"}
    return {
        "config_groups": {"group_0": {
            "input_activations": args(*activations),
            "output_activations": None,
            "targets": ["Linear"],
            "weights": args(weights, False)}},
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
    }


FORMATS = {
    "dynamic": {
        "config": compressed_tensors_config("channel", ("token", True), ["lm_head"]),
        "summary": "compressed-tensors FP8-dynamic: per-channel weight scales [out, 1], "
                   "dynamic per-token activations",
    },
    "static": {
        "config": compressed_tensors_config("tensor", ("tensor", False),
                                            ["lm_head", IGNORED_IN_STATIC]),
        "summary": "compressed-tensors FP8: per-tensor weight scales [1], static per-tensor "
                   "input scales [1]; " + IGNORED_IN_STATIC + " left in bf16 (ignore list)",
    },
    "block": {
        "config": {"activation_scheme": "dynamic", "dequantize": False,
                   "modules_to_not_convert": None, "quant_method": "fp8", "scale_fmt": "float",
                   "weight_block_size": [128, 128]},
        "summary": "transformers fp8: 128x128 block scales weight_scale_inv "
                   "[ceil(out / 128), ceil(in / 128)], dynamic activations",
    },
}


def build(fmt, src_model, out_dir, tok, prompts, amax):
    model_dir = os.path.join(out_dir, "model")
    os.makedirs(model_dir)
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(os.path.join(src_model, f), model_dir)
    with open(os.path.join(src_model, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = FORMATS[fmt]["config"]
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    tensors = load_file(os.path.join(src_model, "model.safetensors"))
    stored, dequantized = {}, {}
    for name, t in tensors.items():
        module = name[:-len(".weight")]
        if not any(module.endswith(p) for p in PROJECTIONS) or (
                fmt == "static" and module == IGNORED_IN_STATIC):
            stored[name] = t
            dequantized[name] = t.to(torch.float32)
            continue
        w = t.to(torch.float32)
        if fmt == "dynamic":
            q, scale = quantize_per_channel(w)
            stored[module + ".weight_scale"] = scale
            dequantized[name] = dequantize(q, scale, 1, w.shape[1])
        elif fmt == "static":
            q, scale = quantize_per_tensor(w)
            stored[module + ".weight_scale"] = scale
            stored[module + ".input_scale"] = torch.tensor([amax[module] / FP8_MAX],
                                                           dtype=torch.float32)
            dequantized[name] = dequantize(q, scale, w.shape[0], w.shape[1])
        else:
            q, scale = quantize_blocks(w, 128)
            stored[module + ".weight_scale_inv"] = scale
            dequantized[name] = dequantize(q, scale, 128, 128)
        stored[name] = q
    save_file(stored, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})

    # transformers + PEFT on the dequantized weights, from a float32 copy of the checkpoint.
    with tempfile.TemporaryDirectory() as tmp:
        for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json",
                  "config.json"]:
            shutil.copy(os.path.join(src_model, f), tmp)
        save_file(dequantized, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        adapters = os.path.join(HERE, "..", "testdata", "tiny-llama", "adapters")
        adapter_dirs = {n: os.path.join(adapters, n) for n in sorted(os.listdir(adapters))}
        requests = [(p, a) for p in prompts for a in [None] + sorted(adapter_dirs)]
        lines = fixtures.write_expected(out_dir, transformers.LlamaForCausalLM, tmp, tok,
                                        requests, adapter_dirs)
    return min(line["min_top1_margin"] for line in lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "..", "testdata"))
    args = parser.parse_args()
    assert transformers.__version__ == "5.17.0" and peft.__version__ == "0.21.0", (
        transformers.__version__, peft.__version__)
    torch.set_num_threads(2)
    src_model = os.path.join(HERE, "..", "testdata", "tiny-llama", "model")
    tok = transformers.AutoTokenizer.from_pretrained(src_model)
    prompts = []
    with open(os.path.join(HERE, "..", "testdata", "tiny-llama", "requests.jsonl")) as f:
        for line in f:
            p = json.loads(line)["prompt"]
            if p not in prompts:
                prompts.append(p)
    amax = input_amax(src_model, tok, prompts)
    root = os.path.join(args.out, "tiny-llama-fp8")
    shutil.rmtree(root, ignore_errors=True)
    margins = {}
    for fmt in FORMATS:
        margins[fmt] = build(fmt, src_model, os.path.join(root, fmt), tok, prompts, amax)
    with open(os.path.join(root, "README.md"), "w") as f:
        f.write("# tiny-llama-fp8\n\n" + __doc__.split("\n\n", 2)[2].strip() + "\n\n")
        for fmt in FORMATS:
            f.write(f"- `{fmt}`: {FORMATS[fmt]['summary']}; smallest top-1 margin "
                    f"{margins[fmt]:.3g}\n")
        f.write("\nGenerated by scripts/gen_fp8_fixtures.py (transformers 5.17.0, peft 0.21.0); "
                "do not edit by hand. The adapters are testdata/tiny-llama/adapters.\n")
    print(json.dumps(margins))


if __name__ == "__main__":
    main()
