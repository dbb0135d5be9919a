#include "loraplex/model/quant_config.h"

#include <nlohmann/json.hpp>

#include "loraplex/core/error.h"

namespace loraplex::model {
namespace {

using nlohmann::json;

// A field of `obj` at `where` ("quantization_config.config_groups.group_0.weights."), or null.
const json& field(const json& obj, const char* key) {
  static const json null_value;
  return obj.contains(key) ? obj.at(key) : null_value;
}

std::string text_or(const json& obj, const char* key, const std::string& fallback) {
  const json& v = field(obj, key);
  return v.is_string() ? v.get<std::string>() : fallback;
}

// compressed-tensors' QuantizationArgs of weights or input activations: float, 8 bits,
// symmetric. Returns the strategy.
std::string float8_args(const json& args, const std::string& where, const std::string& source) {
  LORAPLEX_CHECK(args.is_object(), source, ": ", where, " is ", args.dump(),
                 ", expected an object");
  const json& bits = field(args, "num_bits");
  LORAPLEX_CHECK(bits.is_number_integer() && bits.get<int64_t>() == 8, source, ": ", where,
                 "num_bits is ", bits.dump(), ": only 8-bit float (FP8) is supported");
  const std::string type = text_or(args, "type", "int");
  LORAPLEX_CHECK(type == "float", source, ": ", where, "type is \"", type,
                 "\": only float (FP8) quantization is supported");
  const json& symmetric = field(args, "symmetric");
  LORAPLEX_CHECK(symmetric.is_null() || symmetric == true, source, ": ", where,
                 "symmetric is false: FP8 scales are symmetric (expected true)");
  return text_or(args, "strategy", "tensor");
}

QuantConfig parse_compressed_tensors(const json& q, const std::string& source) {
  QuantConfig c;
  c.method = QuantConfig::Method::kCompressedTensors;
  c.weight_scale_names = {"weight_scale"};
  c.input_scale_names = {"input_scale"};
  const std::string format = text_or(q, "format", "float-quantized");
  LORAPLEX_CHECK(format == "float-quantized" || format == "naive-quantized", source,
                 ": quantization_config.format \"", format,
                 "\" is not supported (expected \"float-quantized\": FP8 weights as they are)");
  const json& kv = field(q, "kv_cache_scheme");
  LORAPLEX_CHECK(kv.is_null(), source, ": quantization_config.kv_cache_scheme is ", kv.dump(),
                 ": a quantized KV cache is not supported (expected null)");
  const json& sparsity = field(q, "sparsity_config");
  LORAPLEX_CHECK(sparsity.is_null() || sparsity.empty(), source,
                 ": quantization_config.sparsity_config is ", sparsity.dump(),
                 ": sparse checkpoints are not supported (expected null)");
  const json& groups = field(q, "config_groups");
  LORAPLEX_CHECK(groups.is_object() && groups.size() == 1, source,
                 ": quantization_config.config_groups has ",
                 groups.is_object() ? std::to_string(groups.size()) : groups.dump(),
                 " groups, expected exactly one (one FP8 scheme for every Linear)");
  const auto group = groups.begin();
  const std::string name = group.key();
  const json& g = group.value();
  const std::string where = "quantization_config.config_groups." + name + ".";
  LORAPLEX_CHECK(g.is_object(), source, ": ", where, " is ", g.dump(), ", expected an object");
  const json& targets = field(g, "targets");
  LORAPLEX_CHECK(targets == json::array({"Linear"}), source, ": ", where, "targets is ",
                 targets.dump(), ", expected [\"Linear\"]");
  LORAPLEX_CHECK(field(g, "output_activations").is_null(), source, ": ", where,
                 "output_activations is ", field(g, "output_activations").dump(),
                 ": output quantization is not supported (expected null)");
  const json& weights = field(g, "weights");
  const std::string ws = float8_args(weights, where + "weights.", source);
  LORAPLEX_CHECK(field(weights, "dynamic") != true, source, ": ", where,
                 "weights.dynamic is true: weights quantized at run time are not supported");
  if (ws == "tensor") {
    c.weight_scale = Fp8WeightScale::kPerTensor;
  } else if (ws == "channel") {
    c.weight_scale = Fp8WeightScale::kPerChannel;
  } else if (ws == "block") {
    c.weight_scale = Fp8WeightScale::kBlock;
    const json& b = field(weights, "block_structure");
    LORAPLEX_CHECK(b.is_array() && b.size() == 2 && b[0].is_number_integer() &&
                       b[1].is_number_integer() && b[0].get<int64_t>() >= 1 &&
                       b[1].get<int64_t>() >= 1,
                   source, ": ", where, "weights.block_structure is ", b.dump(),
                   ", expected [rows, columns] of a scale block");
    c.block_n = b[0].get<int64_t>();
    c.block_k = b[1].get<int64_t>();
  } else {
    LORAPLEX_FAIL(source, ": ", where, "weights.strategy \"", ws,
                  "\" is not supported (expected \"tensor\", \"channel\" or \"block\")");
  }
  const json& act = field(g, "input_activations");
  if (act.is_null()) return c;  // weight-only: per token on CUDA
  const std::string as = float8_args(act, where + "input_activations.", source);
  const bool dynamic = field(act, "dynamic") == true;
  if (!dynamic) {
    LORAPLEX_CHECK(as == "tensor" && c.weight_scale != Fp8WeightScale::kBlock, source, ": ", where,
                   "input_activations: static \"", as, "\" scales",
                   c.weight_scale == Fp8WeightScale::kBlock ? " with block weights" : "",
                   " are not supported (expected static per tensor, or dynamic)");
    c.activations = Fp8Activations::kStatic;
    return c;
  }
  LORAPLEX_CHECK(as == "token" || as == "tensor" || as == "group", source, ": ", where,
                 "input_activations.strategy \"", as,
                 "\" is not supported (expected \"token\", \"tensor\" or \"group\")");
  c.activations = Fp8Activations::kDynamicPerToken;
  return c;
}

QuantConfig parse_fp8(const json& q, const std::string& source) {
  QuantConfig c;
  c.method = QuantConfig::Method::kFp8;
  const std::string scheme = text_or(q, "activation_scheme", "dynamic");
  LORAPLEX_CHECK(scheme == "dynamic" || scheme == "static", source,
                 ": quantization_config.activation_scheme \"", scheme,
                 "\" is not supported (expected \"dynamic\" or \"static\")");
  const std::string fmt = text_or(q, "scale_fmt", "float");
  LORAPLEX_CHECK(fmt == "float", source, ": quantization_config.scale_fmt \"", fmt,
                 "\" is not supported (expected \"float\": float32 scales)");
  const json& convert = field(q, "modules_to_convert");
  LORAPLEX_CHECK(convert.is_null() || convert.empty(), source,
                 ": quantization_config.modules_to_convert is ", convert.dump(),
                 ": only the decoder layers' projections may be FP8 (expected null)");
  const json& block = field(q, "weight_block_size");
  if (block.is_null()) {
    c.weight_scale = Fp8WeightScale::kPerTensor;
    c.weight_scale_names = {"weight_scale_inv", "weight_scale"};
    c.input_scale_names = {"activation_scale", "input_scale"};
    c.activations = scheme == "static" ? Fp8Activations::kStatic : Fp8Activations::kDynamicPerToken;
    return c;
  }
  LORAPLEX_CHECK(block.is_array() && block.size() == 2 && block[0].is_number_integer() &&
                     block[1].is_number_integer() && block[0].get<int64_t>() >= 1 &&
                     block[1].get<int64_t>() >= 1,
                 source, ": quantization_config.weight_block_size is ", block.dump(),
                 ", expected [rows, columns] of a scale block");
  LORAPLEX_CHECK(scheme == "dynamic", source,
                 ": quantization_config.activation_scheme \"static\" with weight_block_size is "
                 "not supported (expected \"dynamic\")");
  c.weight_scale = Fp8WeightScale::kBlock;
  c.block_n = block[0].get<int64_t>();
  c.block_k = block[1].get<int64_t>();
  c.weight_scale_names = {"weight_scale_inv"};
  return c;
}

}  // namespace

std::string QuantConfig::describe() const {
  if (method == Method::kNone) return "not quantized";
  std::string s = method == Method::kFp8 ? "fp8" : "compressed-tensors float8";
  switch (weight_scale) {
    case Fp8WeightScale::kPerTensor:
      s += ", per-tensor weight scales";
      break;
    case Fp8WeightScale::kPerChannel:
      s += ", per-channel weight scales";
      break;
    case Fp8WeightScale::kBlock:
      s += ", " + std::to_string(block_n) + "x" + std::to_string(block_k) + " block weight scales";
      break;
  }
  s += activations == Fp8Activations::kStatic ? ", static activation scales"
                                              : ", dynamic per-token activation scales";
  return s;
}

QuantConfig parse_quantization_config(const json& q, const std::string& source) {
  LORAPLEX_CHECK(q.is_object(), source, ": quantization_config is ", q.dump(),
                 ", expected an object");
  const json& m = field(q, "quant_method");
  LORAPLEX_CHECK(m.is_string(), source, ": quantization_config.quant_method is ", m.dump(),
                 ", expected \"compressed-tensors\" or \"fp8\"");
  const std::string method = m.get<std::string>();
  if (method == "compressed-tensors") return parse_compressed_tensors(q, source);
  if (method == "fp8") return parse_fp8(q, source);
  LORAPLEX_FAIL(source, ": quantization_config.quant_method \"", method,
                "\" is not supported (expected \"compressed-tensors\" float8 or \"fp8\")");
}

}  // namespace loraplex::model
