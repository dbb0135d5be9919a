#include "loraplex/kernels/planner/lora_tuning.h"

#include <charconv>
#include <string>

namespace loraplex::kernels::planner {
namespace {

// One row per field: its name, where it lives and its range. Checking, parsing and reporting
// all read this table, so a new value is one row here plus its member.
struct Field {
  const char* name;
  int LoraTuning::*member;
  int lo;
  int hi;
  bool pow2;
  bool zero_means_auto;  // 0 is accepted besides [lo, hi]
};

constexpr Field kFields[] = {
    {"decode_max_tokens", &LoraTuning::decode_max_tokens, 0, 1 << 30, false, false},
    {"decode_cluster", &LoraTuning::decode_cluster, 0, 2, false, false},
    {"layer_pdl", &LoraTuning::layer_pdl, 0, 2, false, false},
    {"gather_max_token_ranks", &LoraTuning::gather_max_token_ranks, 0, 1 << 30, false, false},
    {"gather_group", &LoraTuning::gather_group, 1, 2, false, true},
    {"gather_rows", &LoraTuning::gather_rows, 8, 16, true, true},
    {"gather_shrink", &LoraTuning::gather_shrink, 1, 2, false, true},
    {"cluster_size", &LoraTuning::cluster_size, 1, 16, true, true},
    {"prefill_mma", &LoraTuning::prefill_mma, 1, 2, false, true},
    {"prefill_k_split", &LoraTuning::prefill_k_split, 1, 8, true, true},
    {"prefill_ctas_per_sm", &LoraTuning::prefill_ctas_per_sm, 1, 8, false, false},
    {"prefill_stages", &LoraTuning::prefill_stages, 3, 4, false, true},
    {"prefill_reduce", &LoraTuning::prefill_reduce, 1, 2, false, true},
    {"prefill_sum", &LoraTuning::prefill_sum, 1, 2, false, true},
    {"prefill_wave_spare_sms", &LoraTuning::prefill_wave_spare_sms, 0, 64, false, false},
    {"expand_ctas_per_sm", &LoraTuning::expand_ctas_per_sm, 1, 16, false, true},
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

LoraTuning lora_tuning_for(int, int) { return LoraTuning{}; }

Status check_lora_tuning(const LoraTuning& t) {
  for (const Field& f : kFields) LORAPLEX_RETURN_IF_ERROR(check_field(f, t.*f.member));
  return Status();
}

Status parse_lora_tuning(const std::string& text, LoraTuning& out) {
  LoraTuning t = out;
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
    t.*field->member = v;
  }
  LORAPLEX_RETURN_IF_ERROR(check_lora_tuning(t));
  out = t;
  return Status();
}

std::vector<std::pair<std::string, int>> lora_tuning_values(const LoraTuning& t) {
  std::vector<std::pair<std::string, int>> values;
  for (const Field& f : kFields) values.emplace_back(f.name, t.*f.member);
  return values;
}

}  // namespace loraplex::kernels::planner
