#include "loraplex/kernels/cuda/kernel_tuning.h"

#include <charconv>
#include <string>

namespace loraplex::kernels::cuda {
namespace {

KernelTuning g_tuning;

// One row per field: its name, where it lives and its range. Checking, parsing and reporting
// all read this table, so a new knob is one row here plus its member.
struct Field {
  const char* name;
  int KernelTuning::*member;
  int lo;
  int hi;
  bool pow2;
  bool zero_means_auto;  // 0 is accepted besides [lo, hi]
};

constexpr Field kFields[] = {
    {"decode_k_chunks", &KernelTuning::decode_k_chunks, 1, 16, true, false},
    {"decode_cols", &KernelTuning::decode_cols, 8, 256, true, false},
    {"prefill_k_split", &KernelTuning::prefill_k_split, 1, 8, true, true},
    {"prefill_ctas_per_sm", &KernelTuning::prefill_ctas_per_sm, 1, 8, false, false},
    {"prefill_max_ctas_per_sm", &KernelTuning::prefill_max_ctas_per_sm, 1, 4, false, true},
    {"prefill_reduce", &KernelTuning::prefill_reduce, 1, 2, false, true},
    {"prefill_mma", &KernelTuning::prefill_mma, 1, 2, false, true},
    {"prefill_sum", &KernelTuning::prefill_sum, 1, 2, false, true},
    {"prefill_stages", &KernelTuning::prefill_stages, 3, 6, false, true},
    {"expand_ctas_per_sm", &KernelTuning::expand_ctas_per_sm, 1, 16, false, true},
    {"expand_pipelined", &KernelTuning::expand_pipelined, 1, 2, false, true},
    {"decode_ctas_per_sm", &KernelTuning::decode_ctas_per_sm, 1, 4, false, true},
    {"decode_persistent", &KernelTuning::decode_persistent, 0, 1, false, false},
    {"gather_group", &KernelTuning::gather_group, 1, 4, true, true},
    {"gather_max_token_ranks", &KernelTuning::gather_max_token_ranks, 1, 1 << 30, false, false},
    {"gather_shrink", &KernelTuning::gather_shrink, 1, 2, false, true},
    {"gather_rows", &KernelTuning::gather_rows, 8, 16, true, true},
    {"decode_cluster", &KernelTuning::decode_cluster, 0, 2, false, false},
    {"layer_pdl", &KernelTuning::layer_pdl, 0, 2, false, false},
    {"meta_early", &KernelTuning::meta_early, 0, 1, false, false},
    {"pair_launch_first", &KernelTuning::pair_launch_first, 0, 1, false, false},
    {"cluster_size", &KernelTuning::cluster_size, 1, 16, true, true},
    {"split_pdl", &KernelTuning::split_pdl, 0, 1, false, false},
    {"prefill_mma_first", &KernelTuning::prefill_mma_first, 0, 1, false, false},
};

bool is_pow2(int v) { return v > 0 && (v & (v - 1)) == 0; }

Status check_field(const Field& f, int value) {
  if (f.zero_means_auto && value == 0) return Status();
  if (value < f.lo || value > f.hi || (f.pow2 && !is_pow2(value))) {
    return invalid_argument("kernel tuning: ", f.name, " = ", value, ", expected ",
                            f.pow2 ? "a power of two in " : "an integer in ", "[", f.lo, ", ", f.hi,
                            "]", f.zero_means_auto ? " or 0 (automatic)" : "");
  }
  return Status();
}

std::string field_names() {
  std::string names;
  for (const Field& f : kFields) names += names.empty() ? f.name : std::string(", ") + f.name;
  return names;
}

}  // namespace

KernelTuning kernel_tuning() { return g_tuning; }

Status set_kernel_tuning(const KernelTuning& t) {
  for (const Field& f : kFields) LORAPLEX_RETURN_IF_ERROR(check_field(f, t.*f.member));
  g_tuning = t;
  return Status();
}

Status parse_kernel_tuning(const std::string& text, KernelTuning& out) {
  out = KernelTuning{};
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(pos, end - pos);
    pos = end + 1;
    const size_t eq = item.find('=');
    if (eq == std::string::npos) {
      return invalid_argument("kernel tuning: '", item, "' is not key=value");
    }
    const std::string key = item.substr(0, eq);
    const std::string value = item.substr(eq + 1);
    int v = 0;
    const auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
    if (value.empty() || ec != std::errc() || ptr != value.data() + value.size()) {
      return invalid_argument("kernel tuning: ", key, " expects an integer, got '", value, "'");
    }
    const Field* field = nullptr;
    for (const Field& f : kFields) {
      if (key == f.name) field = &f;
    }
    if (field == nullptr) {
      return invalid_argument("kernel tuning: unknown key '", key, "', expected one of ",
                              field_names());
    }
    out.*field->member = v;
  }
  return Status();
}

std::vector<std::pair<std::string, int>> kernel_tuning_values(const KernelTuning& t) {
  std::vector<std::pair<std::string, int>> values;
  for (const Field& f : kFields) values.emplace_back(f.name, t.*f.member);
  return values;
}

}  // namespace loraplex::kernels::cuda
