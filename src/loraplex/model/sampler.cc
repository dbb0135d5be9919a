#include "loraplex/model/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>

#include "loraplex/core/error.h"
#include "loraplex/model/sampling_math.h"

namespace loraplex::model {
namespace {

// IEEE float operations, one rounding each (std::fma included); this file is built with
// -ffp-contract=off so the compiler fuses nothing else (sampling_math.h).
struct HostArith {
  static float add(float a, float b) { return a + b; }
  static float sub(float a, float b) { return a - b; }
  static float mul(float a, float b) { return a * b; }
  static float fma(float a, float b, float c) { return std::fma(a, b, c); }
  static float floor(float a) { return std::floor(a); }
  static float from_bits(uint32_t bits) { return std::bit_cast<float>(bits); }
};

// Replaces the dropped ids' l by -1 and the kept ids' by their weight exp(l - m); returns the
// kept mass (double, in id order).
template <typename Arith>
[[gnu::always_inline]] inline double weigh(float* l, size_t n, float kth, float m) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  double total = 0.0;
  for (size_t j = 0; j < n; ++j) {
    const bool keep = l[j] != neg_inf && l[j] >= kth;
    l[j] = keep ? sampling_detail::weight<Arith>(l[j], m) : -1.0f;
    if (keep) total += l[j];
  }
  return total;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// x86-64 builds target CPUs without FMA, where std::fma is a library call (tens of ns); on the
// CPUs that have it the same loop runs with the instruction inlined. Both round fma exactly
// once, so the weights are the same bits either way.
__attribute__((target("fma"))) double weigh_with_fma(float* l, size_t n, float kth, float m) {
  return weigh<HostArith>(l, n, kth, m);
}
double weigh_dispatch(float* l, size_t n, float kth, float m) {
  static const bool has_fma = __builtin_cpu_supports("fma");
  return has_fma ? weigh_with_fma(l, n, kth, m) : weigh<HostArith>(l, n, kth, m);
}
#else
double weigh_dispatch(float* l, size_t n, float kth, float m) {
  return weigh<HostArith>(l, n, kth, m);
}
#endif

}  // namespace

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
  LORAPLEX_CHECK(p.min_p >= 0.0f && p.min_p <= 1.0f, "min_p must be in [0, 1], got ", p.min_p);
}

int32_t sample_row(std::span<const float> logits, const SamplingParams& p, double uniform,
                   std::span<const int32_t> banned) {
  std::vector<float> scratch(2 * logits.size());
  return sample_row(logits, p, uniform, banned, scratch);
}

int32_t sample_row(std::span<const float> logits, const SamplingParams& p, double uniform,
                   std::span<const int32_t> banned, std::span<float> scratch) {
  LORAPLEX_CHECK(!logits.empty(), "sample_row: empty logits");
  check_sampling_params(p);
  const size_t n = logits.size();
  LORAPLEX_CHECK(scratch.size() >= 2 * n, "sample_row: scratch of ", scratch.size(),
                 " floats, need ", 2 * n);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const bool greedy = p.temperature == 0.0f || p.top_k == 1;
  // Scaled logits, NaN and banned ids at -inf.
  float* l = scratch.data();
  float* tmp = scratch.data() + n;
  for (size_t j = 0; j < n; ++j) {
    const float v = logits[j];
    l[j] = std::isnan(v) ? neg_inf : (greedy ? v : v / p.temperature);
  }
  for (int32_t b : banned) {
    if (b >= 0 && static_cast<size_t>(b) < n) l[static_cast<size_t>(b)] = neg_inf;
  }
  const std::span<const float> scaled(l, n);
  const int32_t top = argmax_lowest(scaled);
  const float m = l[static_cast<size_t>(top)];
  if (m == neg_inf) return argmax_lowest(logits);  // every id banned, NaN or -inf
  if (greedy) return top;

  float kth = neg_inf;
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < n) {
    std::copy(l, l + n, tmp);
    std::nth_element(tmp, tmp + (p.top_k - 1), tmp + n, std::greater<float>());
    kth = tmp[p.top_k - 1];
  }
  // From here l[j] is the weight exp(l - m) of a kept id and -1 for the others. Weights are
  // floats; sums are in double, in ascending id order.
  double total = weigh_dispatch(l, n, kth, m);
  if (p.min_p > 0.0f) {
    // The largest weight is 1, so a weight is its id's probability over the largest one.
    total = 0.0;
    for (size_t j = 0; j < n; ++j) {
      if (l[j] < 0.0f) continue;
      if (l[j] < p.min_p) {
        l[j] = -1.0f;
      } else {
        total += l[j];
      }
    }
  }
  float threshold = 0.0f;  // kept: weight >= threshold
  if (p.top_p < 1.0f) {
    // The weights in descending order until their running sum reaches top_p * total. Ids
    // below `floor` hold at most n * floor = half of the mass top-p drops, so the threshold
    // is above it and only the weights above it are sorted (all of them if the sum falls
    // short, by rounding).
    const double need = static_cast<double>(p.top_p) * total;
    const double floor = 0.5 * (total - need) / static_cast<double>(n);
    bool found = false;
    for (const double bound : {floor, -0.5}) {
      size_t count = 0;
      for (size_t j = 0; j < n; ++j) {
        if (l[j] >= 0.0f && l[j] >= bound) tmp[count++] = l[j];
      }
      std::sort(tmp, tmp + count, std::greater<float>());
      double cum = 0.0;
      threshold = tmp[count - 1];
      for (size_t i = 0; i < count && !found; ++i) {
        cum += tmp[i];
        if (cum >= need) {
          threshold = tmp[i];
          found = true;
        }
      }
      if (found) break;
    }
    total = 0.0;
    for (size_t j = 0; j < n; ++j) {
      if (l[j] >= threshold) total += l[j];
    }
  }
  const double target = uniform * total;
  double cum = 0.0;
  int32_t last = -1;
  for (size_t j = 0; j < n; ++j) {
    if (!(l[j] >= threshold)) continue;
    cum += l[j];
    last = static_cast<int32_t>(j);
    if (cum > target) return last;
  }
  return last;
}

float sampling_exp(float x) { return sampling_detail::exp_nonpositive<HostArith>(x); }

LogSoftmaxNorm log_softmax_norm(std::span<const float> logits) {
  double m = -std::numeric_limits<double>::infinity();
  for (float v : logits) {
    if (!std::isnan(v)) m = std::max(m, static_cast<double>(v));
  }
  // exp(v - m) with the maximum itself weighing 1, so that infinite maxima give no NaN.
  double sum = 0.0;
  for (float v : logits) {
    if (!std::isnan(v)) sum += static_cast<double>(v) == m ? 1.0 : std::exp(v - m);
  }
  return LogSoftmaxNorm{m, std::log(sum)};
}

float token_logprob(std::span<const float> logits, int32_t id) {
  LORAPLEX_CHECK(id >= 0 && static_cast<size_t>(id) < logits.size(), "token_logprob: id ", id,
                 " outside the vocabulary of ", logits.size());
  const LogSoftmaxNorm n = log_softmax_norm(logits);
  const double x = logits[static_cast<size_t>(id)];
  return static_cast<float>((x == n.max ? 0.0 : x - n.max) - n.log_sum);
}

}  // namespace loraplex::model
