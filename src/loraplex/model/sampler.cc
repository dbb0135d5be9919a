#include "loraplex/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "loraplex/core/error.h"

namespace loraplex::model {

std::mt19937_64 make_sequence_rng(uint64_t seed, uint64_t request_index) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (request_index + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return std::mt19937_64(z ^ (z >> 31));
}

int32_t argmax_lowest(std::span<const float> logits) {
  int32_t best = 0;
  bool found = false;
  for (size_t j = 0; j < logits.size(); ++j) {
    if (std::isnan(logits[j])) continue;
    if (!found || logits[j] > logits[static_cast<size_t>(best)]) {
      best = static_cast<int32_t>(j);
      found = true;
    }
  }
  return best;
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& p, std::mt19937_64& rng) {
  LORAPLEX_CHECK(!logits.empty(), "sample_token: empty logits");
  LORAPLEX_CHECK(p.temperature >= 0.0f && std::isfinite(p.temperature),
                 "temperature must be a finite number >= 0, got ", p.temperature);
  LORAPLEX_CHECK(p.top_k >= 0, "top_k must be >= 0 (0 = off), got ", p.top_k);
  LORAPLEX_CHECK(p.top_p > 0.0f && p.top_p <= 1.0f, "top_p must be in (0, 1], got ", p.top_p);
  if (p.temperature == 0.0f) return argmax_lowest(logits);

  // Candidates sorted by logit, descending; equal logits keep ascending token order so the
  // result does not depend on the sort's stability.
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const auto key = [&](int32_t i) {
    const float v = logits[static_cast<size_t>(i)];
    return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v;
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return key(a) > key(b); });
  size_t keep = order.size();
  if (p.top_k > 0) keep = std::min(keep, static_cast<size_t>(p.top_k));

  std::vector<double> probs(keep);
  const double top = static_cast<double>(key(order[0])) / p.temperature;
  double sum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    probs[i] = std::exp(static_cast<double>(key(order[i])) / p.temperature - top);
    sum += probs[i];
  }
  if (p.top_p < 1.0f) {
    // Smallest prefix whose probability reaches top_p (the best token always stays).
    double cum = 0.0;
    size_t cut = keep;
    for (size_t i = 0; i < keep; ++i) {
      cum += probs[i] / sum;
      if (cum >= p.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = std::accumulate(probs.begin(), probs.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
  }
  const double u = std::uniform_real_distribution<double>(0.0, sum)(rng);
  double cum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cum += probs[i];
    if (u < cum) return order[i];
  }
  return order[keep - 1];
}

}  // namespace loraplex::model
