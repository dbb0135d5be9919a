#include "loraplex/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "loraplex/core/error.h"

namespace loraplex::model {

std::mt19937_64 make_sequence_rng(uint64_t seed, uint64_t request_index) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (request_index + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return std::mt19937_64(z ^ (z >> 31));
}

double next_uniform(std::mt19937_64& rng) {
  // 53 random bits: every value is exactly representable and strictly below 1.
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
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

void check_sampling_params(const SamplingParams& p) {
  LORAPLEX_CHECK(p.temperature >= 0.0f && std::isfinite(p.temperature),
                 "temperature must be a finite number >= 0, got ", p.temperature);
  LORAPLEX_CHECK(p.top_k >= 0, "top_k must be >= 0 (0 = off), got ", p.top_k);
  LORAPLEX_CHECK(p.top_p > 0.0f && p.top_p <= 1.0f, "top_p must be in (0, 1], got ", p.top_p);
}

int32_t sample_row(std::span<const float> logits, const SamplingParams& p, double uniform,
                   std::span<const int32_t> banned) {
  LORAPLEX_CHECK(!logits.empty(), "sample_row: empty logits");
  check_sampling_params(p);
  const size_t n = logits.size();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const bool greedy = p.temperature == 0.0f || p.top_k == 1;
  // Scaled logits, NaN and banned ids at -inf.
  std::vector<float> l(n);
  for (size_t j = 0; j < n; ++j) {
    const float v = logits[j];
    l[j] = std::isnan(v) ? neg_inf : (greedy ? v : v / p.temperature);
  }
  bool any_allowed = false;
  for (int32_t b : banned) {
    if (b >= 0 && static_cast<size_t>(b) < n) l[static_cast<size_t>(b)] = neg_inf;
  }
  for (size_t j = 0; j < n && !any_allowed; ++j) any_allowed = l[j] != neg_inf;
  if (!any_allowed) return argmax_lowest(logits);
  if (greedy) return argmax_lowest(l);

  float m = neg_inf;
  for (float v : l) m = std::max(m, v);
  std::vector<char> keep(n, 0);
  for (size_t j = 0; j < n; ++j) keep[j] = l[j] != neg_inf;
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < n) {
    std::vector<float> sorted(l);
    std::nth_element(sorted.begin(), sorted.begin() + (p.top_k - 1), sorted.end(),
                     std::greater<float>());
    const float kth = sorted[static_cast<size_t>(p.top_k - 1)];
    for (size_t j = 0; j < n; ++j) keep[j] = keep[j] && l[j] >= kth;
  }
  std::vector<double> prob(n, 0.0);
  double total = 0.0;
  for (size_t j = 0; j < n; ++j) {
    if (!keep[j]) continue;
    prob[j] = static_cast<double>(std::exp(l[j] - m));
    total += prob[j];
  }
  if (p.top_p < 1.0f) {
    std::vector<double> sorted;
    for (size_t j = 0; j < n; ++j) {
      if (keep[j]) sorted.push_back(prob[j]);
    }
    std::sort(sorted.begin(), sorted.end(), std::greater<double>());
    const double need = static_cast<double>(p.top_p) * total;
    double cum = 0.0;
    double threshold = sorted.back();
    for (double v : sorted) {
      cum += v;
      if (cum >= need) {
        threshold = v;
        break;
      }
    }
    total = 0.0;
    for (size_t j = 0; j < n; ++j) {
      keep[j] = keep[j] && prob[j] >= threshold;
      if (keep[j]) total += prob[j];
    }
  }
  const double target = uniform * total;
  double cum = 0.0;
  int32_t last = -1;
  for (size_t j = 0; j < n; ++j) {
    if (!keep[j]) continue;
    cum += prob[j];
    last = static_cast<int32_t>(j);
    if (cum > target) return last;
  }
  return last;
}

float token_logprob(std::span<const float> logits, int32_t id) {
  LORAPLEX_CHECK(id >= 0 && static_cast<size_t>(id) < logits.size(), "token_logprob: id ", id,
                 " outside the vocabulary of ", logits.size());
  double m = -std::numeric_limits<double>::infinity();
  for (float v : logits) {
    if (!std::isnan(v)) m = std::max(m, static_cast<double>(v));
  }
  double sum = 0.0;
  for (float v : logits) {
    if (!std::isnan(v)) sum += std::exp(static_cast<double>(v) - m);
  }
  return static_cast<float>(static_cast<double>(logits[static_cast<size_t>(id)]) - m -
                            std::log(sum));
}

}  // namespace loraplex::model
