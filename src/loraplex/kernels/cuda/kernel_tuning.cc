#include "loraplex/kernels/cuda/kernel_tuning.h"

#include <charconv>
#include <string>

namespace loraplex::kernels::cuda {
namespace {

KernelTuning g_tuning;

bool is_pow2(int v) { return v > 0 && (v & (v - 1)) == 0; }

Status check_field(const char* name, int value, int lo, int hi, bool pow2) {
  if (value < lo || value > hi || (pow2 && !is_pow2(value))) {
    return invalid_argument("kernel tuning: ", name, " = ", value, ", expected ",
                            pow2 ? "a power of two in " : "an integer in ", "[", lo, ", ", hi, "]");
  }
  return Status();
}

}  // namespace

KernelTuning kernel_tuning() { return g_tuning; }

Status set_kernel_tuning(const KernelTuning& t) {
  LORAPLEX_RETURN_IF_ERROR(check_field("decode_k_chunks", t.decode_k_chunks, 1, 16, true));
  LORAPLEX_RETURN_IF_ERROR(check_field("decode_cols", t.decode_cols, 8, 256, true));
  LORAPLEX_RETURN_IF_ERROR(check_field("prefill_k_split", t.prefill_k_split, 1, 8, true));
  LORAPLEX_RETURN_IF_ERROR(check_field("prefill_ctas_per_sm", t.prefill_ctas_per_sm, 1, 8, false));
  LORAPLEX_RETURN_IF_ERROR(check_field("expand_ctas_per_sm", t.expand_ctas_per_sm, 1, 16, false));
  LORAPLEX_RETURN_IF_ERROR(check_field("decode_ctas_per_sm", t.decode_ctas_per_sm, 0, 4, false));
  LORAPLEX_RETURN_IF_ERROR(check_field("decode_persistent", t.decode_persistent, 0, 1, false));
  if (t.gather_group != 0) {
    LORAPLEX_RETURN_IF_ERROR(check_field("gather_group", t.gather_group, 1, 4, true));
  }
  LORAPLEX_RETURN_IF_ERROR(
      check_field("gather_max_token_ranks", t.gather_max_token_ranks, 1, 1 << 30, false));
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
    if (key == "decode_k_chunks") {
      out.decode_k_chunks = v;
    } else if (key == "decode_cols") {
      out.decode_cols = v;
    } else if (key == "prefill_k_split") {
      out.prefill_k_split = v;
    } else if (key == "prefill_ctas_per_sm") {
      out.prefill_ctas_per_sm = v;
    } else if (key == "expand_ctas_per_sm") {
      out.expand_ctas_per_sm = v;
    } else if (key == "decode_ctas_per_sm") {
      out.decode_ctas_per_sm = v;
    } else if (key == "decode_persistent") {
      out.decode_persistent = v;
    } else if (key == "gather_group") {
      out.gather_group = v;
    } else if (key == "gather_max_token_ranks") {
      out.gather_max_token_ranks = v;
    } else {
      return invalid_argument("kernel tuning: unknown key '", key,
                              "', expected decode_k_chunks, decode_cols, prefill_k_split or "
                              "prefill_ctas_per_sm");
    }
  }
  return Status();
}

}  // namespace loraplex::kernels::cuda
