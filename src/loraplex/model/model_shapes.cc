#include "loraplex/model/model_shapes.h"

#include "loraplex/core/error.h"
#include "loraplex/model/quant_config.h"

namespace loraplex::model {
namespace {

ModelConfig llama(int64_t vocab, int64_t hidden, int64_t inter, int64_t layers, int64_t heads,
                  int64_t kv_heads, double theta, int64_t max_pos) {
  ModelConfig c;
  c.arch = Architecture::kLlama;
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_layers = layers;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = hidden / heads;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = theta;
  c.max_position_embeddings = max_pos;
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  return c;
}

// The published FP8-dynamic format: per-channel weight scales, dynamic per-token activations.
QuantConfig fp8_dynamic() {
  QuantConfig q;
  q.method = QuantConfig::Method::kCompressedTensors;
  q.weight_scale = Fp8WeightScale::kPerChannel;
  q.activations = Fp8Activations::kDynamicPerToken;
  q.weight_scale_names = {"weight_scale"};
  q.input_scale_names = {"input_scale"};
  return q;
}

}  // namespace

std::vector<std::string> model_shape_names() {
  return {"llama3-8b",     "llama3-70b",     "mistral-7b",    "qwen2-7b",
          "mixtral-8x7b",  "qwen3-8b",       "qwen3-30b-a3b", "tiny",
          "llama3-8b-fp8", "llama3-70b-fp8", "tiny-fp8"};
}

ModelConfig model_shape(const std::string& name, int64_t layers) {
  if (name.ends_with("-fp8")) {
    const std::string base = name.substr(0, name.size() - 4);
    if (base == "llama3-8b" || base == "llama3-70b" || base == "tiny") {
      ModelConfig c = model_shape(base, layers);
      c.quant = fp8_dynamic();
      return c;
    }
  }
  ModelConfig c;
  if (name == "llama3-8b") {
    c = llama(128256, 4096, 14336, 32, 32, 8, 500000.0, 8192);
  } else if (name == "llama3-70b") {
    c = llama(128256, 8192, 28672, 80, 64, 8, 500000.0, 8192);
  } else if (name == "mistral-7b") {
    c = llama(32768, 4096, 14336, 32, 32, 8, 1000000.0, 32768);
    c.arch = Architecture::kMistral;
  } else if (name == "qwen2-7b") {
    c = llama(152064, 3584, 18944, 28, 28, 4, 1000000.0, 32768);
    c.arch = Architecture::kQwen2;
    c.qkv_bias = true;
    c.rms_norm_eps = 1e-6;
  } else if (name == "mixtral-8x7b") {
    c = llama(32000, 4096, 14336, 32, 32, 8, 1000000.0, 32768);
    c.arch = Architecture::kMixtral;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
  } else if (name == "qwen3-8b" || name == "qwen3-30b-a3b") {
    const bool moe = name == "qwen3-30b-a3b";
    c = moe ? llama(151936, 2048, 768, 48, 32, 4, 1000000.0, 40960)
            : llama(151936, 4096, 12288, 36, 32, 8, 1000000.0, 40960);
    c.arch = moe ? Architecture::kQwen3Moe : Architecture::kQwen3;
    c.head_dim = 128;  // not hidden / heads (64) for the MoE
    c.qk_norm = true;
    c.rms_norm_eps = 1e-6;
    c.bos_token_id = 151643;
    c.eos_token_ids = {151645};
    if (moe) {
      c.num_experts = 128;
      c.num_experts_per_tok = 8;
      c.moe_renormalize = true;  // norm_topk_prob
    }
  } else if (name == "tiny") {
    c = llama(1000, 64, 160, 2, 4, 2, 10000.0, 1024);
  } else {
    std::string known;
    for (const std::string& n : model_shape_names()) known += (known.empty() ? "" : ", ") + n;
    LORAPLEX_FAIL("unknown model shape '", name, "' (known: ", known, ")");
  }
  if (layers > 0) {
    LORAPLEX_CHECK(layers <= c.num_layers, "shape ", name, " has ", c.num_layers,
                   " layers; --layers ", layers, " is more");
    c.num_layers = layers;
  }
  return c;
}

int64_t decode_weight_bytes(const ModelConfig& c, DType dtype) {
  const int64_t h = c.hidden_size;
  const int64_t attn = h * (c.q_size() + 2 * c.kv_size()) + c.q_size() * h;
  const int64_t experts = c.is_moe() ? c.num_experts : 1;
  const int64_t mlp = experts * 3 * h * c.intermediate_size;
  const int64_t router = c.is_moe() ? c.num_experts * h : 0;
  const int64_t norms = 2 * h + (c.qk_norm ? 2 * c.head_dim : 0);
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  const int64_t rest = c.num_layers * (router + norms) + h + c.vocab_size * h;
  if (!c.quant.quantized()) return (c.num_layers * (attn + mlp) + rest) * es;
  // One float32 scale per output row of q/k/v, o, gate/up and down.
  const int64_t rows = c.q_size() + 2 * c.kv_size() + h + experts * (2 * c.intermediate_size + h);
  return c.num_layers * (attn + mlp + 4 * rows) + rest * es;
}

double step_flops(const ModelConfig& c, int64_t tokens, int64_t attention_pairs, int64_t sampled) {
  const double h = static_cast<double>(c.hidden_size);
  const double attn_proj = h * static_cast<double>(c.q_size() + 2 * c.kv_size() + c.q_size());
  const double active = c.is_moe() ? static_cast<double>(c.num_experts_per_tok) : 1.0;
  const double mlp = active * 3.0 * h * static_cast<double>(c.intermediate_size);
  const double layer = 2.0 * static_cast<double>(tokens) * (attn_proj + mlp) +
                       // QK^T and PV: 2 FLOPs per multiply-add, two products, every head.
                       4.0 * static_cast<double>(attention_pairs) * static_cast<double>(c.q_size());
  return static_cast<double>(c.num_layers) * layer +
         2.0 * static_cast<double>(sampled) * h * static_cast<double>(c.vocab_size);
}

}  // namespace loraplex::model
