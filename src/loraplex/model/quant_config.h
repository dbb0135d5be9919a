#pragma once
// The FP8 formats of quantized checkpoints, from config.json's quantization_config:
//
//   compressed-tensors float8 (llm-compressor's "FP8", "FP8-dynamic", "FP8-block" schemes):
//     weights float8_e4m3 with `weight_scale` per tensor ([] or [1]), per output channel
//     ([out, 1]) or per block ([ceil(out / bn), ceil(in / bk)]); activations static
//     (`input_scale`, one per layer), dynamic per token, or absent (weight-only).
//   fp8 (transformers' FineGrainedFP8, DeepSeek's layout): weights float8_e4m3 with
//     `weight_scale_inv` per block of weight_block_size, activations dynamic per token and
//     block; without weight_block_size one scale per tensor (`weight_scale_inv` or, as
//     AutoFP8 wrote it, `weight_scale`), activations static (`activation_scale` or
//     `input_scale`) or dynamic.
//
// Every scale multiplies: w = q * scale (`_inv` is the name, not the operation). Any other
// quantization method, and any field value that would change the math, is refused naming it.
// Which projections are quantized is read from the weights themselves: a float8_e4m3 weight
// has its scales, a float one is used as it is (a checkpoint's ignore lists name those).

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace loraplex::model {

/// How a checkpoint's FP8 weights are scaled.
enum class Fp8WeightScale { kPerTensor, kPerChannel, kBlock };

/// How activations are quantized for the W8A8 GEMM on CUDA (the CPU never quantizes them).
/// Weight-only checkpoints and dynamic per-tensor activations run per token: finer than the
/// checkpoint asks, never coarser.
enum class Fp8Activations { kDynamicPerToken, kStatic };

struct QuantConfig {
  enum class Method { kNone, kCompressedTensors, kFp8 };
  Method method = Method::kNone;
  Fp8WeightScale weight_scale = Fp8WeightScale::kPerTensor;
  int64_t block_n = 0;  // kBlock: rows and columns of a scale block
  int64_t block_k = 0;
  Fp8Activations activations = Fp8Activations::kDynamicPerToken;
  // Tensor name suffixes (after the module's "<module>.") in the order they are looked for.
  std::vector<std::string> weight_scale_names;
  std::vector<std::string> input_scale_names;

  bool quantized() const { return method != Method::kNone; }
  /// "compressed-tensors float8, per-channel weight scales, dynamic per-token activations".
  std::string describe() const;
};

/// Parses config.json's quantization_config; `source` names the file in errors.
QuantConfig parse_quantization_config(const nlohmann::json& q, const std::string& source);

}  // namespace loraplex::model
