#pragma once
// The workload of `loraplex bench serve`: a seeded arrival trace (Poisson arrivals or all at
// once; prompt and output lengths fixed or drawn; each request's adapter drawn uniformly or
// zipf from a pool) and the percentile helper its report uses.

#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace loraplex::cli {

/// A token count: fixed ("128"), uniform over a range ("64-256") or exponential around a mean
/// ("exp:200", at least 1, at most 8 x the mean).
struct LengthSpec {
  enum class Kind { kFixed, kUniform, kExponential };
  Kind kind = Kind::kFixed;
  int64_t lo = 1;
  int64_t hi = 1;
  double mean = 1.0;

  /// Throws loraplex::Error naming `flag` and the text when it is not one of the forms above.
  static LengthSpec parse(const std::string& flag, const std::string& text);
  int64_t draw(std::mt19937_64& rng) const;
  int64_t max() const;
  std::string str() const;
};

struct TraceOptions {
  int64_t num_requests = 100;
  double rate = 0.0;  // requests per second; <= 0 or infinite: all at once
  LengthSpec prompt_len;
  LengthSpec output_len;
  int num_adapters = 0;  // 0: every request runs on the base model
  bool zipf = false;     // else uniform
  double zipf_s = 1.0;   // popularity of the k-th adapter ~ 1 / k^s
  int32_t vocab_size = 0;
  int32_t first_token_id = 0;  // prompt ids are drawn from [first_token_id, vocab_size)
  int64_t shared_prefix = 0;   // tokens every prompt starts with (part of prompt_len)
  uint64_t seed = 0;
};

struct TraceRequest {
  double arrival_s = 0.0;
  std::vector<int32_t> prompt;
  int64_t output_len = 0;
  int adapter = -1;  // index into the pool; -1 = base model
};

/// The requests in arrival order.
std::vector<TraceRequest> make_trace(const TraceOptions& options);

/// The p-th percentile (0..100) with linear interpolation between order statistics (numpy's
/// default); 0 for no values.
double percentile(std::vector<double> values, double p);

/// Sleeps for `tick` or until request `next` of `trace` arrives (`start` + its arrival_s),
/// whichever comes first (past the end of the trace: `tick`).
void wait_for_arrival(std::chrono::steady_clock::time_point start,
                      const std::vector<TraceRequest>& trace, size_t next,
                      std::chrono::steady_clock::duration tick);

}  // namespace loraplex::cli
