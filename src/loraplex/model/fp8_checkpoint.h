#pragma once
// Reading one projection's base weight from an FP8 checkpoint: its float8_e4m3 codes and the
// scales its quantization_config says it has (quant_config.h), checked against the weight.

#include <string>

#include "loraplex/layers/fp8_weight.h"
#include "loraplex/model/checkpoint.h"
#include "loraplex/model/quant_config.h"

namespace loraplex::model {

/// "<module>.weight" of `shape` ([out, in]) with, when it is float8_e4m3, its weight scale and
/// (static activations) input scale as float32 CPU tensors. A float weight comes back alone (a
/// projection the checkpoint left unquantized). Throws naming the checkpoint, the tensor and the
/// shapes when a scale is missing, has a shape the format does not give it, or is not a finite
/// non-negative number (input scales: positive); and when an fp8 weight comes without a
/// quantization_config, or is float8_e5m2.
BaseWeight read_linear_weight(const Checkpoint& ckpt, const QuantConfig& quant,
                              const std::string& module, const Shape& shape);

}  // namespace loraplex::model
