#include "sampling_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "loraplex/core/dtype.h"
#include "loraplex/model/sampler.h"

namespace loraplex::test {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();
}  // namespace

ReferencePick reference_sample(std::span<const float> logits, const model::SamplingParams& p,
                               double uniform, std::span<const int32_t> banned) {
  const auto n = static_cast<int32_t>(logits.size());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const bool greedy = p.temperature == 0.0f || p.top_k == 1;
  std::vector<float> l(logits.begin(), logits.end());
  for (float& v : l) v = std::isnan(v) ? neg_inf : (greedy ? v : v / p.temperature);
  for (int32_t b : banned) {
    if (b >= 0 && b < n) l[b] = neg_inf;
  }
  ReferencePick out;
  out.walk_margin = kInf;
  out.top_p_margin = kInf;
  out.min_p_margin = kInf;
  // Ids by scaled logit, largest first, ties by id.
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  if (l[order[0]] == neg_inf) {
    // Nothing allowed: the first largest raw logit, NaNs skipped (0 when all are NaN).
    out.id = 0;
    bool found = false;
    for (int32_t j = 0; j < n; ++j) {
      if (std::isnan(logits[j])) continue;
      if (!found || logits[j] > logits[out.id]) out.id = j;
      found = true;
    }
    return out;
  }
  if (greedy) {
    out.id = order[0];
    return out;
  }
  const float m = l[order[0]];
  float kth = neg_inf;
  if (p.top_k > 0 && p.top_k < n) kth = l[order[p.top_k - 1]];
  std::vector<int32_t> kept;
  for (int32_t j = 0; j < n; ++j) {
    if (l[j] == neg_inf || l[j] < kth) continue;
    if (p.min_p > 0.0f) {
      // min_p: the id's probability over the largest, exp(l - m), in double.
      const double ratio = l[j] == m ? 1.0 : std::exp(static_cast<double>(l[j]) - m);
      out.min_p_margin = std::min(out.min_p_margin, std::abs(ratio - p.min_p));
      if (ratio < p.min_p) continue;
    }
    kept.push_back(j);
  }
  std::vector<float> w(static_cast<size_t>(n), 0.0f);
  for (int32_t j : kept) w[j] = l[j] == m ? 1.0f : model::sampling_exp(l[j] - m);
  auto mass_of = [&](const std::vector<int32_t>& ids) {
    long double s = 0.0L;
    for (int32_t j : ids) s += w[j];
    return s;
  };
  long double total = mass_of(kept);
  if (p.top_p < 1.0f) {
    std::vector<float> sorted;
    for (int32_t j : kept) sorted.push_back(w[j]);
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    const long double need = static_cast<long double>(p.top_p) * total;
    long double before = 0.0L;
    float threshold = sorted.back();
    out.top_p_margin = 0.0;  // the sums never reaching `need` is a rounding case
    for (size_t i = 0; i < sorted.size();) {
      size_t e = i;
      long double end = before;
      while (e < sorted.size() && sorted[e] == sorted[i]) end += sorted[e++];
      if (end >= need) {
        threshold = sorted[i];
        out.top_p_margin = static_cast<double>(std::min(end - need, need - before) / total);
        break;
      }
      before = end;
      i = e;
    }
    std::vector<int32_t> top;
    for (int32_t j : kept) {
      if (w[j] >= threshold) top.push_back(j);
    }
    kept.swap(top);
    total = mass_of(kept);
  }
  const long double target = static_cast<long double>(uniform) * total;
  long double cum = 0.0L;
  out.id = kept.back();
  out.walk_margin = 0.0;  // past every kept id: a rounding case
  for (int32_t j : kept) {
    const long double before = cum;
    cum += w[j];
    if (cum > target) {
      out.id = j;
      out.walk_margin = static_cast<double>(std::min(target - before, cum - target) / total);
      break;
    }
  }
  double z = 0.0;
  for (int32_t j : kept) z += std::exp(static_cast<double>(l[j]) - m);
  for (int32_t j : kept) out.kept.emplace_back(j, std::exp(static_cast<double>(l[j]) - m) / z);
  return out;
}

double reference_logprob(std::span<const float> logits, int32_t id) {
  long double m = -std::numeric_limits<long double>::infinity();
  for (float v : logits) {
    if (!std::isnan(v)) m = std::max<long double>(m, v);
  }
  long double s = 0.0L;
  for (float v : logits) {
    if (!std::isnan(v)) s += v == m ? 1.0L : std::exp(static_cast<long double>(v) - m);
  }
  const long double x = logits[static_cast<size_t>(id)];
  return static_cast<double>((x == m ? 0.0L : x - m) - std::log(s));
}

const char* row_kind_name(RowKind kind) {
  switch (kind) {
    case RowKind::kNormal:
      return "normal";
    case RowKind::kTies:
      return "ties";
    case RowKind::kNans:
      return "nans";
    case RowKind::kNegInf:
      return "neg_inf";
    case RowKind::kCoarse:
      return "coarse";
  }
  return "?";
}

std::vector<float> random_logits(int64_t n, RowKind kind, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    x = normal(rng);
    switch (kind) {
      case RowKind::kNormal:
        break;
      case RowKind::kTies:
        x = std::round(x * 2.0f) / 2.0f;
        break;
      case RowKind::kNans:
        if (unit(rng) < 0.1) x = std::numeric_limits<float>::quiet_NaN();
        break;
      case RowKind::kNegInf:
        if (unit(rng) < 0.3) x = -std::numeric_limits<float>::infinity();
        break;
      case RowKind::kCoarse:
        x = bf16_bits_to_float(float_to_bf16_bits(x));
        break;
    }
  }
  return v;
}

std::vector<int32_t> random_banned(int64_t n, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> count(0, model::kMaxBannedTokens);
  std::uniform_int_distribution<int64_t> id(0, n - 1);
  std::uniform_int_distribution<int> kind(0, 5);
  std::vector<int32_t> b(static_cast<size_t>(count(rng)));
  for (int32_t& x : b) {
    const int k = kind(rng);
    x = k == 0 ? -1 : k == 1 ? static_cast<int32_t>(n + id(rng)) : static_cast<int32_t>(id(rng));
  }
  return b;
}

}  // namespace loraplex::test
