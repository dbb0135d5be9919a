#include "loraplex/model/fp8_checkpoint.h"

#include <cmath>

#include "loraplex/core/error.h"

namespace loraplex::model {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The first of `suffixes` the checkpoint has for `module`, or "" (none).
std::string find_tensor(const Checkpoint& ckpt, const std::string& module,
                        const std::vector<std::string>& suffixes) {
  for (const std::string& s : suffixes) {
    if (ckpt.has(module + "." + s)) return module + "." + s;
  }
  return "";
}

std::string names_of(const std::string& module, const std::vector<std::string>& suffixes) {
  std::string out;
  for (const std::string& s : suffixes)
    out += (out.empty() ? "'" : " or '") + module + "." + s + "'";
  return out;
}

// `name` as float32 on the CPU, every value finite and >= `min` (> 0 when `positive`).
Tensor scale_values(const Checkpoint& ckpt, const std::string& name, bool positive) {
  const Tensor t = ckpt.tensor(name);
  LORAPLEX_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kBF16 || t.dtype() == DType::kF16,
                 ckpt.dir(), ": tensor '", name, "' has dtype ", t.dtype(),
                 ", expected float32, bfloat16 or float16 scales");
  Tensor f = t.to(DType::kF32).contiguous();
  if (f.data_ptr() == t.data_ptr()) f = f.clone();  // not a view of the mapped file
  const float* v = f.data<float>();
  for (int64_t i = 0; i < f.numel(); ++i) {
    LORAPLEX_CHECK(std::isfinite(v[i]) && (positive ? v[i] > 0.0f : v[i] >= 0.0f), ckpt.dir(),
                   ": tensor '", name, "' holds ", v[i], " at element ", i, ", expected a finite ",
                   positive ? "positive" : "non-negative", " scale");
  }
  return f;
}

}  // namespace

BaseWeight read_linear_weight(const Checkpoint& ckpt, const QuantConfig& quant,
                              const std::string& module, const Shape& shape) {
  const std::string name = module + ".weight";
  BaseWeight b;
  b.weight = ckpt.tensor(name);
  LORAPLEX_CHECK(b.weight.shape() == shape, ckpt.dir(), ": tensor '", name, "' has shape ",
                 shape_str(b.weight.shape()), ", expected ", shape_str(shape));
  const DType dt = b.weight.dtype();
  if (dt == DType::kF32 || dt == DType::kF16 || dt == DType::kBF16) return b;
  LORAPLEX_CHECK(dt == DType::kF8E4M3, ckpt.dir(), ": tensor '", name, "' has dtype ", dt,
                 ", expected float32, float16, bfloat16 or (FP8 checkpoints) float8_e4m3");
  LORAPLEX_CHECK(quant.quantized(), ckpt.dir(), ": tensor '", name,
                 "' is float8_e4m3 but config.json has no quantization_config to scale it");
  const int64_t out = shape[0];
  const int64_t in = shape[1];
  const std::string scale_name = find_tensor(ckpt, module, quant.weight_scale_names);
  LORAPLEX_CHECK(!scale_name.empty(), ckpt.dir(), ": the float8_e4m3 weight '", name,
                 "' has no scale: expected ", names_of(module, quant.weight_scale_names), " (",
                 quant.describe(), ")");
  Tensor scale = scale_values(ckpt, scale_name, false);
  const Shape got = scale.shape();
  switch (quant.weight_scale) {
    case Fp8WeightScale::kPerTensor:
      LORAPLEX_CHECK(scale.numel() == 1 && scale.dim() <= 1, ckpt.dir(), ": tensor '", scale_name,
                     "' has shape ", shape_str(got),
                     ", expected [] or [1] (a per-tensor scale of the [", out, ", ", in,
                     "] weight)");
      b.group_n = out;
      b.group_k = in;
      break;
    case Fp8WeightScale::kPerChannel:
      LORAPLEX_CHECK(got == (Shape{out, 1}) || got == (Shape{out}), ckpt.dir(), ": tensor '",
                     scale_name, "' has shape ", shape_str(got), ", expected [", out,
                     ", 1] (per-channel scales of the [", out, ", ", in, "] weight)");
      b.group_n = 1;
      b.group_k = in;
      break;
    case Fp8WeightScale::kBlock: {
      const Shape want{ceil_div(out, quant.block_n), ceil_div(in, quant.block_k)};
      LORAPLEX_CHECK(got == want, ckpt.dir(), ": tensor '", scale_name, "' has shape ",
                     shape_str(got), ", expected ", shape_str(want), " (", quant.block_n, "x",
                     quant.block_k, " block scales of the [", out, ", ", in, "] weight)");
      b.group_n = quant.block_n;
      b.group_k = quant.block_k;
      break;
    }
  }
  b.scale = scale.view({ceil_div(out, b.group_n), ceil_div(in, b.group_k)});
  if (quant.activations == Fp8Activations::kStatic) {
    const std::string input = find_tensor(ckpt, module, quant.input_scale_names);
    LORAPLEX_CHECK(!input.empty(), ckpt.dir(), ": the float8_e4m3 weight '", name,
                   "' has no static activation scale: expected ",
                   names_of(module, quant.input_scale_names), " (", quant.describe(), ")");
    b.input_scale = scale_values(ckpt, input, true);
    LORAPLEX_CHECK(b.input_scale.numel() == 1 && b.input_scale.dim() <= 1, ckpt.dir(), ": tensor '",
                   input, "' has shape ", shape_str(b.input_scale.shape()),
                   ", expected [] or [1] (one static activation scale)");
    b.input_scale = b.input_scale.view({1});
  }
  return b;
}

}  // namespace loraplex::model
