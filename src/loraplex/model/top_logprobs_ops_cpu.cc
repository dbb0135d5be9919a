#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "loraplex/model/sampler.h"
#include "loraplex/model/top_logprobs_ops.h"

namespace loraplex::model::ops::cpu {

Status top_logprobs(const TopLogprobsArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_top_logprobs_args(a));
  std::vector<float> row(static_cast<size_t>(a.vocab));
  std::vector<int32_t> order(static_cast<size_t>(a.vocab));
  for (int64_t r = 0; r < a.num_rows; ++r) {
    const int64_t base = r * a.row_stride;
    for (int64_t j = 0; j < a.vocab; ++j) {
      const size_t i = static_cast<size_t>(j);
      if (a.dtype == DType::kF32) {
        row[i] = static_cast<const float*>(a.logits)[base + j];
      } else {
        const uint16_t bits = static_cast<const uint16_t*>(a.logits)[base + j];
        row[i] = a.dtype == DType::kF16 ? f16_bits_to_float(bits) : bf16_bits_to_float(bits);
      }
    }
    const LogSoftmaxNorm norm = log_softmax_norm(row);
    std::iota(order.begin(), order.end(), 0);
    const auto before = [&](int32_t x, int32_t y) {
      const float vx = row[static_cast<size_t>(x)];
      const float vy = row[static_cast<size_t>(y)];
      if (std::isnan(vx) != std::isnan(vy)) return std::isnan(vy);
      return vx > vy || (vx == vy && x < y) || (std::isnan(vx) && x < y);
    };
    std::partial_sort(order.begin(), order.begin() + a.k, order.end(), before);
    for (int t = 0; t < a.k; ++t) {
      const int32_t id = order[static_cast<size_t>(t)];
      const double x = row[static_cast<size_t>(id)];
      a.ids[r * a.k + t] = id;
      a.logprobs[r * a.k + t] =
          static_cast<float>((x == norm.max ? 0.0 : x - norm.max) - norm.log_sum);
    }
  }
  return Status();
}

}  // namespace loraplex::model::ops::cpu
