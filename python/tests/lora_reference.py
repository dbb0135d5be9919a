"""float64 references of the multi-LoRA ops (written from their definitions, token by token,
not from loraplex's code) and the test cases' data: Punica's segment distributions over odd
sizes, never zeros."""

import numpy as np

# How tokens pick slots (-1 = base model), as Punica's and FlashInfer's tests name them.
DISTRIBUTIONS = ["one_adapter", "each_own", "mixed_with_base", "zipf"]


def mapping_of(distribution, num_tokens, max_loras, rng):
    if distribution == "one_adapter":
        return np.full(num_tokens, max_loras - 1, dtype=np.int32)
    if distribution == "each_own":
        return (np.arange(num_tokens) % max_loras).astype(np.int32)
    if distribution == "mixed_with_base":
        return rng.integers(-1, max_loras, num_tokens).astype(np.int32)
    if distribution == "zipf":
        return np.minimum(rng.zipf(1.5, num_tokens) - 1, max_loras - 1).astype(np.int32)
    if distribution == "all_base":
        return np.full(num_tokens, -1, dtype=np.int32)
    raise ValueError(distribution)


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float64)


def shrink(x, lora_a, mapping, scale):
    """out[s, t] = scale * x[t] @ A_s[slot(t)]^T; rows of tokens without LoRA are zero."""
    rank = lora_a[0].shape[1]
    out = np.zeros((len(lora_a), x.shape[0], rank))
    for t, slot in enumerate(mapping):
        if slot < 0:
            continue
        for s, a in enumerate(lora_a):
            out[s, t] = scale * (a[slot] @ x[t])
    return out


def expand(inputs, lora_b, y0, mapping, offset_start, add_inputs):
    """y[t, off_s : off_s + n_s] (+)= inputs[s, t] @ B_s[slot(t)]^T for tokens with LoRA."""
    y = y0.copy()
    for t, slot in enumerate(mapping):
        if slot < 0:
            continue
        col = offset_start
        for s, b in enumerate(lora_b):
            n = b.shape[1]
            delta = b[slot] @ inputs[s, t]
            y[t, col:col + n] = (y0[t, col:col + n] if add_inputs else 0.0) + delta
            col += n
    return y


def lora_linear(y0, x, lora_a, lora_b, mapping, scale):
    return expand(shrink(x, lora_a, mapping, scale), lora_b, y0, mapping, 0, True)


def fused_moe(out0, x, lora_a, lora_b, topk_ids, topk_weights, mapping, adapter_enabled,
              mul_routed_weight, offset, add_inputs):
    """For each routed pair (t, k) of a token with an enabled adapter and a local expert:
    out[t, k, offset + s*n : offset + (s+1)*n] (+)= w * B_s[slot, e] @ (A_s[slot, e] @ x_row)."""
    out = out0.copy()
    num_tokens, top_k = topk_ids.shape
    pairs_are_rows = x.shape[0] == num_tokens * top_k and top_k > 1
    n = lora_b[0].shape[2]
    for t in range(num_tokens):
        slot = mapping[t]
        if slot < 0 or (adapter_enabled is not None and not adapter_enabled[slot]):
            continue
        for k in range(top_k):
            e = topk_ids[t, k]
            if e < 0:
                continue
            row = x[t * top_k + k] if pairs_are_rows else x[t]
            w = topk_weights[t, k] if mul_routed_weight else 1.0
            for s, (a, b) in enumerate(zip(lora_a, lora_b)):
                cols = slice(offset + s * n, offset + (s + 1) * n)
                delta = w * (b[slot, e] @ (a[slot, e] @ row))
                out[t, k, cols] = (out0[t, k, cols] if add_inputs else 0.0) + delta
    return out


def assert_close(got, ref, tol, what=""):
    """|got - ref| <= tol * max(|ref|, 1) everywhere: tol is the output dtype's relative
    precision with room for the accumulation order."""
    got = np.asarray(got, dtype=np.float64)
    scale = max(float(np.max(np.abs(ref))) if ref.size else 0.0, 1.0)
    err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:.3g} x {scale:.3g}"
