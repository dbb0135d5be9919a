#include "loraplex/adapters/peft_adapter.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string_view>
#include <type_traits>

#include "loraplex/adapters/safetensors.h"
#include "loraplex/core/allocator.h"

namespace loraplex {
namespace {

constexpr std::string_view kPrefix = "base_model.model.";

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// Prefixes every message with the adapter and the file it is about.
struct Where {
  const std::string& adapter;
  const std::string& file;

  template <typename... Args>
  [[noreturn]] void fail(Args&&... args) const {
    LORAPLEX_FAIL("adapter '", adapter, "' (", file, "): ", std::forward<Args>(args)...);
  }
};

enum class Role { kA, kB, kEmbeddingA, kEmbeddingB, kBaseCopy };

struct ParsedName {
  std::string module;
  Role role = Role::kA;
  int depth = 0;  // nested ".base_layer" wrappers (several target_parameters on one module)
};

ParsedName parse_weight_name(const std::string& full, const Where& where) {
  std::string_view name = full;
  if (name.substr(0, kPrefix.size()) == kPrefix) name.remove_prefix(kPrefix.size());
  struct Suffix {
    std::string_view text;
    Role role;
  };
  static constexpr Suffix kSuffixes[] = {
      {".lora_A.weight", Role::kA},
      {".lora_B.weight", Role::kB},
      {".lora_embedding_A", Role::kEmbeddingA},
      {".lora_embedding_B", Role::kEmbeddingB},
      {".base_layer.weight", Role::kBaseCopy},
  };
  for (const Suffix& s : kSuffixes) {
    if (!ends_with(name, s.text) || name.size() == s.text.size()) continue;
    ParsedName parsed;
    std::string_view module = name.substr(0, name.size() - s.text.size());
    if (s.role == Role::kA || s.role == Role::kB) {
      while (ends_with(module, ".base_layer")) {
        module.remove_suffix(std::string_view(".base_layer").size());
        ++parsed.depth;
      }
    }
    parsed.module = std::string(module);
    parsed.role = s.role;
    return parsed;
  }
  if (ends_with(name, ".lora_B.bias") || ends_with(name, ".lora_A.bias"))
    where.fail("tensor '", full, "': LoRA bias terms (lora_bias) are not served");
  if (name.find("lora_magnitude_vector") != std::string_view::npos)
    where.fail("tensor '", full, "': DoRA magnitude vectors (use_dora) are not served yet");
  where.fail("tensor '", full,
             "' is not a LoRA weight as PEFT saves them (<module>.lora_A.weight, "
             "<module>.lora_B.weight, <module>.lora_embedding_A/B or "
             "<module>.base_layer.weight)");
}

// Index of the first NaN or infinity in a contiguous float tensor, or -1.
int64_t first_non_finite(const Tensor& t) {
  int64_t bad = -1;
  const bool is_float = dispatch_activation_dtype(t.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* p = t.data<const T>();
    const int64_t n = t.numel();
    // Blocks without an early exit (vectorised), then the exact index inside a bad block.
    constexpr int64_t kBlock = 4096;
    for (int64_t lo = 0; lo < n; lo += kBlock) {
      const int64_t hi = std::min(n, lo + kBlock);
      bool finite = true;
      if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
        // An all-ones exponent is inf or NaN: a test on the bits, without converting.
        constexpr uint16_t kExp = std::is_same_v<T, BFloat16> ? 0x7f80u : 0x7c00u;
        for (int64_t i = lo; i < hi; ++i) finite &= (p[i].bits & kExp) != kExp;
      } else {
        for (int64_t i = lo; i < hi; ++i) finite &= std::isfinite(load_float(p[i]));
      }
      if (finite) continue;
      for (int64_t i = lo; i < hi; ++i) {
        if (!std::isfinite(load_float(p[i]))) {
          bad = i;
          return;
        }
      }
    }
  });
  return is_float ? bad : -1;
}

std::string index_str(const Shape& shape, int64_t flat) {
  Shape idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    const int64_t s = std::max<int64_t>(shape[d], 1);
    idx[d] = flat % s;
    flat /= s;
  }
  return shape_str(idx);
}

// Host tensors in the packing dtype, pinned when options.pinned and the caller asks. Pinned ones
// are carved from
// chunks of kPinnedChunkBytes: each pinned allocation is a slow driver call, and a 128-expert
// adapter holds tens of thousands of tensors.
class HostPacker {
 public:
  explicit HostPacker(const AdapterLoadOptions& options) : options_(options) {}

  Tensor empty(const Shape& shape, bool pinned) {
    if (!options_.pinned || !pinned) return Tensor::empty(shape, options_.dtype);
    const int64_t bytes = shape_numel(shape) * static_cast<int64_t>(dtype_size(options_.dtype));
    if (bytes > kPinnedChunkBytes / 4) {
      return Tensor::empty_with(shape, options_.dtype, Device::cpu(), pinned_host_allocator());
    }
    if (!chunk_.defined() || used_ + bytes > kPinnedChunkBytes) {
      chunk_ = Tensor::empty_with({kPinnedChunkBytes}, DType::kU8, Device::cpu(),
                                  pinned_host_allocator());
      used_ = 0;
    }
    void* at = static_cast<char*>(chunk_.data_ptr()) + used_;
    used_ += (bytes + kAlign - 1) / kAlign * kAlign;
    return Tensor::from_blob(at, shape, options_.dtype, Device::cpu(), chunk_.storage(), true);
  }

  // A copy of `a` (any layout) in the packing dtype.
  Tensor pack_a(const Tensor& a, bool pinned) {
    Tensor out = empty(a.shape(), pinned);
    out.copy_from(a);
    return out;
  }

  // scale * b (any layout), computed in float32 and rounded to the packing dtype once.
  Tensor pack_b(const Tensor& b, double scale, bool pinned) {
    Tensor f = Tensor::empty(b.shape(), DType::kF32);
    f.copy_from(b);
    float* p = f.data<float>();
    const int64_t n = f.numel();
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(static_cast<double>(p[i]) * scale);
    Tensor out = empty(b.shape(), pinned);
    out.copy_from(f);
    return out;
  }

 private:
  static constexpr int64_t kPinnedChunkBytes = int64_t{64} << 20;
  static constexpr int64_t kAlign = 256;  // each tensor starts where a 16-byte copy may read it
  const AdapterLoadOptions& options_;
  Tensor chunk_;
  int64_t used_ = 0;
};

// What one (module, nesting depth) of the file holds.
struct FilePair {
  std::string a;  // tensor names; empty when absent
  std::string b;
  bool embedding = false;
};

void check_base_copy(const Where& where, const SafetensorsFile& file, const std::string& tensor,
                     const LoraTarget& target) {
  const Tensor& base = target.base_weight;
  if (!base.defined())
    where.fail("tensor '", tensor, "' is a copy of the base weight of '", target.module,
               "', which cannot be checked because the model did not register that weight");
  const SafetensorsTensorInfo& info = file.info(tensor);
  if (info.shape != base.shape())
    where.fail("tensor '", tensor, "' has shape ", shape_str(info.shape),
               " but the base weight of '", target.module, "' has shape ", shape_str(base.shape()));
  if (!is_floating(info.dtype))
    where.fail("tensor '", tensor, "' has dtype ", info.file_dtype, "; a float dtype is expected");
  const Tensor copy = file.tensor(tensor);
  // Compared in the base model's dtype: a float32 copy of bfloat16 weights is equal, a copy
  // that was trained (embedding or lm_head in modules_to_save) is not.
  const int64_t rows = base.dim() > 0 ? base.size(0) : 1;
  const int64_t chunk =
      std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, base.numel() / rows));
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t n = std::min(chunk, rows - r0);
    Tensor base_rows = base.dim() > 0 ? base.narrow(0, r0, n) : base;
    Tensor copy_rows = copy.dim() > 0 ? copy.narrow(0, r0, n) : copy;
    const std::vector<double> want = base_rows.to(Device::cpu()).to_double_vector();
    const std::vector<double> got = copy_rows.to(base.dtype()).to_double_vector();
    for (size_t i = 0; i < want.size(); ++i) {
      if (got[i] != want[i]) {
        const int64_t cols = static_cast<int64_t>(want.size()) / n;
        where.fail("tensor '", tensor, "' differs from the base weight of '", target.module,
                   "' at [", r0 + static_cast<int64_t>(i) / cols, ", ",
                   static_cast<int64_t>(i) % cols, "] (", got[i], " vs ", want[i],
                   "): adapters that change base weights are not served");
      }
    }
  }
}

}  // namespace

std::string adapter_config_path(const std::string& dir) { return dir + "/adapter_config.json"; }
std::string adapter_weights_path(const std::string& dir) {
  return dir + "/adapter_model.safetensors";
}

PeftLoraConfig read_peft_adapter_config(const std::string& name, const std::string& dir) {
  const std::string config_path = adapter_config_path(dir);
  const Where at_config{name, config_path};
  if (!file_exists(config_path))
    at_config.fail("file not found (a PEFT adapter directory has one)");
  try {
    return PeftLoraConfig::from_file(config_path);
  } catch (const Error& e) {
    LORAPLEX_FAIL("adapter '", name, "': ", e.what());
  }
}

PackedAdapter load_peft_adapter(const std::string& name, const std::string& dir,
                                const LoraTargetRegistry& registry,
                                const AdapterLoadOptions& options) {
  LORAPLEX_CHECK(is_floating(options.dtype) && !is_fp8(options.dtype), "adapter '", name,
                 "': packing dtype must be float32, float16 or bfloat16, got ", options.dtype);
  struct stat st {};
  LORAPLEX_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "adapter '", name, "' (",
                 dir, "): not a directory");

  const PeftLoraConfig config = read_peft_adapter_config(name, dir);

  const std::string weights_path = adapter_weights_path(dir);
  const Where at{name, weights_path};
  if (!file_exists(weights_path)) {
    if (file_exists(dir + "/adapter_model.bin"))
      at.fail(
          "file not found; the directory has adapter_model.bin, a PyTorch pickle, which is "
          "not read (convert it to safetensors)");
    at.fail("file not found");
  }
  std::optional<SafetensorsFile> file_holder;
  try {
    file_holder.emplace(SafetensorsFile::open(weights_path));
  } catch (const Error& e) {
    LORAPLEX_FAIL("adapter '", name, "': ", e.what());
  }
  const SafetensorsFile& file = *file_holder;

  HostPacker packer(options);
  std::map<std::pair<std::string, int>, FilePair> pairs;
  std::vector<std::pair<std::string, std::string>> base_copies;  // (module, tensor)
  for (const std::string& tensor : file.names()) {
    const ParsedName parsed = parse_weight_name(tensor, at);
    if (parsed.role == Role::kBaseCopy) {
      base_copies.emplace_back(parsed.module, tensor);
      continue;
    }
    FilePair& pair = pairs[{parsed.module, parsed.depth}];
    const bool is_embedding = parsed.role == Role::kEmbeddingA || parsed.role == Role::kEmbeddingB;
    const bool is_a = parsed.role == Role::kA || parsed.role == Role::kEmbeddingA;
    if (!pair.a.empty() || !pair.b.empty()) {
      if (pair.embedding != is_embedding)
        at.fail("tensor '", tensor, "' mixes lora_embedding_A/B with lora_A/B on one module");
    }
    pair.embedding = is_embedding;
    std::string& slot = is_a ? pair.a : pair.b;
    if (!slot.empty()) at.fail("tensors '", slot, "' and '", tensor, "' are the same weight");
    slot = tensor;
  }
  if (pairs.empty()) at.fail("holds no LoRA weights (no *.lora_A.weight / *.lora_B.weight)");

  PackedAdapter out;
  out.name = name;
  out.dir = dir;
  out.scale = config.default_scale();
  out.layers.resize(registry.layers().size());
  std::map<const LoraTarget*, std::string> used;

  for (const auto& [key, pair] : pairs) {
    const auto& [module, depth] = key;
    const std::string& any_tensor = pair.a.empty() ? pair.b : pair.a;
    if (pair.a.empty())
      at.fail("tensor '", pair.b, "' has no matching ",
              pair.embedding ? "lora_embedding_A" : "lora_A", " tensor");
    if (pair.b.empty())
      at.fail("tensor '", pair.a, "' has no matching ",
              pair.embedding ? "lora_embedding_B" : "lora_B", " tensor");

    // The target this pair belongs to.
    const LoraTarget* target = nullptr;
    std::string target_key = module;
    const LoraTarget* module_target = depth == 0 ? registry.find_module(module) : nullptr;
    if (module_target != nullptr) {
      target = module_target;
      if (!config.targets_module(module, target->kind == TargetKind::kLinear))
        at.fail("tensor '", any_tensor, "': module '", module,
                "' is not selected by adapter_config.json (target_modules, exclude_modules, "
                "layers_to_transform, layers_pattern)");
      if ((target->kind == TargetKind::kEmbedding) != pair.embedding)
        at.fail("tensor '", any_tensor, "': module '", module, "' is ",
                target->kind == TargetKind::kEmbedding
                    ? "an embedding, whose weights are lora_embedding_A / lora_embedding_B"
                    : "not an embedding, whose weights are lora_A.weight / lora_B.weight");
    } else {
      const std::vector<const LoraTarget*> params = registry.parameters_of(module);
      if (params.empty())
        at.fail("tensor '", any_tensor, "': the model has no LoRA target named '", module,
                depth > 0 ? "' (with nested base_layer wrappers)" : "'");
      std::vector<const LoraTarget*> targeted;
      for (const LoraTarget* p : params)
        if (config.targets_parameter(module, p->parameter)) targeted.push_back(p);
      if (targeted.empty())
        at.fail("tensor '", any_tensor, "': no parameter of module '", module,
                "' is selected by adapter_config.json target_parameters");
      if (pair.embedding)
        at.fail("tensor '", any_tensor, "': expert parameters take lora_A / lora_B weights");
      const int k = static_cast<int>(targeted.size());
      if (depth >= k)
        at.fail("tensor '", any_tensor, "': ", depth, " nested base_layer wrappers, but only ", k,
                " parameter(s) of '", module, "' are targeted");
      // PEFT wraps the targeted parameters in the module's parameter order, each wrapper
      // around the previous one, so the first parameter ends up innermost.
      target = targeted[static_cast<size_t>(k - 1 - depth)];
      target_key = module + "." + target->parameter;
    }
    if (auto [it, inserted] = used.emplace(target, any_tensor); !inserted)
      at.fail("tensors '", it->second, "' and '", any_tensor, "' both target '", target_key, "'");

    // Shapes, rank and values.
    const SafetensorsTensorInfo& ia = file.info(pair.a);
    const SafetensorsTensorInfo& ib = file.info(pair.b);
    for (const auto& [info, tensor] :
         {std::pair<const SafetensorsTensorInfo*, const std::string*>{&ia, &pair.a},
          std::pair<const SafetensorsTensorInfo*, const std::string*>{&ib, &pair.b}}) {
      if (info->dtype != DType::kF32 && info->dtype != DType::kF16 && info->dtype != DType::kBF16)
        at.fail("tensor '", *tensor, "' has dtype ", info->file_dtype,
                "; LoRA weights must be F32, F16 or BF16");
      if (info->shape.size() != 2)
        at.fail("tensor '", *tensor, "' has shape ", shape_str(info->shape),
                "; LoRA weights are 2-D");
    }
    const int rank = config.rank_for(target_key);
    const double scale = config.scale_for(target_key);
    const int64_t experts = target->kind == TargetKind::kExperts3d ? target->num_experts : 1;
    const int64_t file_rank = ia.shape[0];
    // A 3-D parameter stored [E, out, in] was saved with A and B swapped by PEFT < 0.19
    // (A [r E, out], B [in, r E]); newer PEFT saves the standard A [r E, in], B [out, r E].
    // The shapes tell which, unless in == out, where the config's peft_version decides.
    bool swapped_roles = false;
    if (target->kind == TargetKind::kExperts3d && target->parameter_out_in) {
      const bool standard =
          ia.shape[1] == target->in_features && ib.shape[0] == target->out_features;
      const bool legacy = ia.shape[1] == target->out_features && ib.shape[0] == target->in_features;
      swapped_roles = legacy && (!standard || config.peft_version < std::pair<int, int>{0, 19});
    }
    int64_t a_cols = target->in_features;
    int64_t b_rows = target->out_features;
    if (swapped_roles) std::swap(a_cols, b_rows);
    if (file_rank != static_cast<int64_t>(rank) * experts) {
      at.fail("tensor '", pair.a, "' has ", file_rank, " rows but adapter_config.json gives '",
              target_key, "' rank ", rank, experts > 1 ? " x " : "",
              experts > 1 ? std::to_string(experts) + " experts" : "",
              " (field 'r', or a 'rank_pattern' key)");
    }
    if (rank > options.max_lora_rank)
      at.fail("tensor '", pair.a, "': rank ", rank, " exceeds max_lora_rank ",
              options.max_lora_rank);
    const Shape want_a{file_rank, a_cols};
    const Shape want_b{b_rows, file_rank};
    if (ia.shape != want_a)
      at.fail("tensor '", pair.a, "' has shape ", shape_str(ia.shape), " but '", target_key, "' (",
              target_kind_name(target->kind), ", in ", target->in_features, ", out ",
              target->out_features, ") needs ", shape_str(want_a));
    if (ib.shape != want_b)
      at.fail("tensor '", pair.b, "' has shape ", shape_str(ib.shape), " but '", target_key, "' (",
              target_kind_name(target->kind), ", in ", target->in_features, ", out ",
              target->out_features, ") needs ", shape_str(want_b));

    const Tensor a = file.tensor(pair.a);
    const Tensor b = file.tensor(pair.b);
    for (const auto& [t, tensor] : {std::pair<const Tensor*, const std::string*>{&a, &pair.a},
                                    std::pair<const Tensor*, const std::string*>{&b, &pair.b}}) {
      const int64_t bad = first_non_finite(*t);
      if (bad >= 0)
        at.fail("tensor '", *tensor, "' holds ", t->item({bad / t->size(1), bad % t->size(1)}),
                " at ", index_str(t->shape(), bad), "; LoRA weights must be finite");
    }

    LoraSliceWeights slice;
    const bool pin = !target->staged_on_host;
    if (target->kind != TargetKind::kExperts3d) {
      slice.a = packer.pack_a(a, pin);
      slice.b = packer.pack_b(b, scale, pin);
    } else {
      // PEFT's 3-D layout: A [E * r, .] with expert-major rows, B [., r * E] with rank-major
      // columns (ParamWrapper reshapes A to [E, r, .] and B to [., r, E]). Repacked per
      // expert in forward orientation: a [E, r, in], b [E, out, r]; with swapped roles
      // a[e] = B_e^T and b[e] = A_e^T.
      const int64_t e = experts;
      const int64_t r = rank;
      if (!swapped_roles) {
        slice.a = packer.pack_a(a.view({e, r, a_cols}), pin);
        slice.b = packer.pack_b(b.view({b_rows, r, e}).permute({2, 0, 1}), scale, pin);
      } else {
        slice.a = packer.pack_a(b.view({b_rows, r, e}).permute({2, 1, 0}), pin);
        slice.b = packer.pack_b(a.view({e, r, a_cols}).permute({0, 2, 1}), scale, pin);
      }
    }
    const int64_t bad = first_non_finite(slice.b);
    if (bad >= 0)
      at.fail("tensor '", pair.b, "' overflows ", options.dtype, " once scaled by ", scale,
              " (at packed index ", index_str(slice.b.shape(), bad), ")");

    out.bytes += slice.a.nbytes() + slice.b.nbytes();
    out.max_rank = std::max(out.max_rank, rank);
    out.modules.push_back({target_key, target->kind, rank, scale});
    std::vector<LoraSliceWeights>& layer = out.layers[registry.layer_index(*target)];
    if (layer.empty()) layer.resize(static_cast<size_t>(target->layer.num_slices()));
    layer[static_cast<size_t>(target->slice)] = std::move(slice);
  }

  for (const auto& [module, tensor] : base_copies) {
    const LoraTarget* target = registry.find_module(module);
    if (target == nullptr ||
        (target->kind != TargetKind::kEmbedding && target->kind != TargetKind::kLmHead))
      at.fail("tensor '", tensor, "' replaces the base weight of '", module,
              "', which is not served (only copies of embedding or lm_head weights identical to "
              "the base model are accepted)");
    check_base_copy(at, file, tensor, *target);
  }
  return out;
}

}  // namespace loraplex
