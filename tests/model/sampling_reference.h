#pragma once
// A naive reference of the sampling rule (step_batch.h) for the sampler tests: sort-based,
// sums in long double, written from the rule's text and sharing nothing with sampler.cc but
// the weight function sampling_exp (itself tested against std::exp), so that its picks can
// be compared id for id. It also says how far the decision was from flipping: the distance of
// the target to the picked id's interval ends and of top_p * mass to the masses on either side
// of the chosen top-p threshold (and of min_p to the probabilities beside it), so a test can tell a
// wrong pick from one that a last-bit difference in a sum could move.

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "loraplex/model/step_batch.h"

namespace loraplex::test {

struct ReferencePick {
  int32_t id = -1;
  /// Distance of the target to the nearest end of the picked id's interval, over the kept
  /// mass (infinite for greedy picks and rows without an allowed id).
  double walk_margin = 0.0;
  /// Distance of top_p * mass to the nearest mass that decides the top-p threshold, over
  /// the mass (infinite when top-p is off).
  double top_p_margin = 0.0;
  /// Distance of min_p to the nearest probability over the largest of an id it kept or
  /// dropped (infinite when min_p is off).
  double min_p_margin = 0.0;
  /// The kept ids with their probabilities under the filtered softmax, from std::exp in
  /// double (for frequency tests); empty for greedy picks.
  std::vector<std::pair<int32_t, double>> kept;

  /// The margins above `relative` (the pick cannot move by sums wrong by less than that), and
  /// min_p's clear of the float weights' few ulps of error.
  bool clear(double relative) const {
    return walk_margin > relative && top_p_margin > relative && min_p_margin > 1e-6;
  }
};

ReferencePick reference_sample(std::span<const float> logits, const model::SamplingParams& p,
                               double uniform, std::span<const int32_t> banned);

/// log_softmax(logits)[id] in long double, NaNs left out.
double reference_logprob(std::span<const float> logits, int32_t id);

/// Kinds of random logit rows the sampler tests draw.
enum class RowKind { kNormal, kTies, kNans, kNegInf, kCoarse };
inline constexpr RowKind kAllRowKinds[] = {RowKind::kNormal, RowKind::kTies, RowKind::kNans,
                                           RowKind::kNegInf, RowKind::kCoarse};
const char* row_kind_name(RowKind kind);

/// A row of `n` logits: normal(0, 3) values; kTies: on a grid of 0.5 (many exact ties);
/// kNans: 10% NaN; kNegInf: 30% -inf; kCoarse: rounded to bfloat16's 8 bits of mantissa.
std::vector<float> random_logits(int64_t n, RowKind kind, std::mt19937_64& rng);

/// Up to kMaxBannedTokens banned ids for a row of `n` (some -1, some beyond n, some real).
std::vector<int32_t> random_banned(int64_t n, std::mt19937_64& rng);

}  // namespace loraplex::test
