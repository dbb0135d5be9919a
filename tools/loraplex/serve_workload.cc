#include "serve_workload.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "cli_args.h"
#include "loraplex/core/error.h"

namespace loraplex::cli {

LengthSpec LengthSpec::parse(const std::string& flag, const std::string& text) {
  LengthSpec s;
  if (text.rfind("exp:", 0) == 0) {
    s.kind = Kind::kExponential;
    s.mean = static_cast<double>(parse_int(flag, text.substr(4), 1));
    s.lo = 1;
    s.hi = static_cast<int64_t>(8 * s.mean);
    return s;
  }
  const size_t dash = text.find('-');
  if (dash != std::string::npos && dash > 0) {
    s.kind = Kind::kUniform;
    s.lo = parse_int(flag, text.substr(0, dash), 1);
    s.hi = parse_int(flag, text.substr(dash + 1), s.lo);
    s.mean = 0.5 * static_cast<double>(s.lo + s.hi);
    return s;
  }
  s.lo = s.hi = parse_int(flag, text, 1);
  s.mean = static_cast<double>(s.lo);
  return s;
}

int64_t LengthSpec::draw(std::mt19937_64& rng) const {
  switch (kind) {
    case Kind::kFixed:
      return lo;
    case Kind::kUniform:
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    case Kind::kExponential: {
      const double v = std::exponential_distribution<double>(1.0 / mean)(rng);
      return std::clamp<int64_t>(static_cast<int64_t>(std::llround(v)), lo, hi);
    }
  }
  return lo;
}

int64_t LengthSpec::max() const { return hi; }

std::string LengthSpec::str() const {
  switch (kind) {
    case Kind::kFixed:
      return std::to_string(lo);
    case Kind::kUniform:
      return std::to_string(lo) + "-" + std::to_string(hi);
    case Kind::kExponential:
      return "exp:" + std::to_string(static_cast<int64_t>(mean));
  }
  return "";
}

std::vector<TraceRequest> make_trace(const TraceOptions& o) {
  LORAPLEX_CHECK(o.vocab_size > o.first_token_id, "trace: no token ids in [", o.first_token_id,
                 ", ", o.vocab_size, ")");
  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<int32_t> token(o.first_token_id, o.vocab_size - 1);
  std::vector<int32_t> prefix(static_cast<size_t>(o.shared_prefix));
  for (int32_t& t : prefix) t = token(rng);
  std::vector<double> weights;
  for (int k = 0; k < o.num_adapters; ++k)
    weights.push_back(o.zipf ? 1.0 / std::pow(static_cast<double>(k + 1), o.zipf_s) : 1.0);
  std::discrete_distribution<int> pick(weights.begin(), weights.end());
  const bool at_once = !(o.rate > 0.0) || std::isinf(o.rate);
  std::exponential_distribution<double> gap(at_once ? 1.0 : o.rate);

  std::vector<TraceRequest> out;
  double t = 0.0;
  for (int64_t i = 0; i < o.num_requests; ++i) {
    TraceRequest r;
    if (!at_once && i > 0) t += gap(rng);
    r.arrival_s = t;
    const int64_t len = std::max(o.prompt_len.draw(rng), o.shared_prefix + 1);
    r.prompt = prefix;
    while (static_cast<int64_t>(r.prompt.size()) < len) r.prompt.push_back(token(rng));
    r.output_len = o.output_len.draw(rng);
    r.adapter = o.num_adapters > 0 ? pick(rng) : -1;
    out.push_back(std::move(r));
  }
  return out;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double pos = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(v.size() - 1);
  const size_t i = static_cast<size_t>(pos);
  if (i + 1 >= v.size()) return v.back();
  const double f = pos - static_cast<double>(i);
  return v[i] + f * (v[i + 1] - v[i]);
}

void wait_for_arrival(std::chrono::steady_clock::time_point start,
                      const std::vector<TraceRequest>& trace, size_t next,
                      std::chrono::steady_clock::duration tick) {
  using Clock = std::chrono::steady_clock;
  Clock::time_point until = Clock::now() + tick;
  if (next < trace.size()) {
    const auto arrival = start + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(trace[next].arrival_s));
    until = std::min(until, arrival);
  }
  std::this_thread::sleep_until(until);
}

}  // namespace loraplex::cli
