#pragma once
// Named shapes of real models, for benchmarks on random weights (Decoder::create_random): the
// hyper-parameters of their config.json files, no weights.

#include <cstdint>
#include <string>
#include <vector>

#include "loraplex/model/config.h"

namespace loraplex::model {

/// llama3-8b, llama3-70b, mistral-7b, qwen2-7b, mixtral-8x7b, qwen3-8b, qwen3-30b-a3b (and
/// "tiny", a few-MB model for tests). layers > 0 keeps only that many decoder layers (a large shape
/// on one GPU). Throws naming the shape and listing the known ones.
/// llama3-8b-fp8, llama3-70b-fp8 and tiny-fp8 are those shapes as FP8-dynamic checkpoints
/// (compressed-tensors: float8_e4m3 projections with per-channel scales, dynamic per-token
/// activations), the format of the published Llama 3 FP8 models.
ModelConfig model_shape(const std::string& name, int64_t layers = 0);
std::vector<std::string> model_shape_names();

/// Bytes a decode step must read at least: every weight of the decoder layers, the final norm
/// and the lm_head, in `dtype` (the embedding table is gathered a row per token, not read);
/// in an FP8 model the projections in one byte each, with a float32 scale per output row.
int64_t decode_weight_bytes(const ModelConfig& config, DType dtype);
/// Matmul FLOPs of a step over `tokens` tokens whose causal contexts sum to `attention_pairs`
/// (query, key) pairs, with `sampled` rows through the lm_head.
double step_flops(const ModelConfig& config, int64_t tokens, int64_t attention_pairs,
                  int64_t sampled);

}  // namespace loraplex::model
