#include "loraplex/engine/engine_metrics.h"

#include <algorithm>

namespace loraplex::engine {

std::vector<double> ttft_buckets() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}

std::vector<double> inter_token_buckets() {
  return {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
          0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
}

std::vector<double> request_latency_buckets() {
  return {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
          30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}

std::vector<double> iteration_tokens_buckets() {
  return {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384};
}

std::vector<double> one_two_five_buckets(int64_t max_value) {
  std::vector<double> out;
  for (int64_t scale = 1;; scale *= 10) {
    for (int64_t m : {1, 2, 5}) {
      if (m * scale > max_value) return out;
      out.push_back(static_cast<double>(m * scale));
    }
  }
}

EngineMetrics::Histogram make_histogram(std::vector<double> bounds) {
  EngineMetrics::Histogram h;
  h.counts.assign(bounds.size(), 0);
  h.bounds = std::move(bounds);
  return h;
}

void observe(EngineMetrics::Histogram& h, double value) {
  const auto first = std::lower_bound(h.bounds.begin(), h.bounds.end(), value);
  for (size_t i = static_cast<size_t>(first - h.bounds.begin()); i < h.counts.size(); ++i)
    ++h.counts[i];
  h.sum += value;
  ++h.count;
}

EngineMetrics empty_metrics(int max_loras, int64_t max_model_len) {
  EngineMetrics m;
  m.max_loras = max_loras;
  m.time_to_first_token_s = make_histogram(ttft_buckets());
  m.inter_token_latency_s = make_histogram(inter_token_buckets());
  m.time_per_output_token_s = make_histogram(inter_token_buckets());
  m.e2e_request_latency_s = make_histogram(request_latency_buckets());
  m.queue_time_s = make_histogram(request_latency_buckets());
  m.request_inference_time_s = make_histogram(request_latency_buckets());
  m.request_prefill_time_s = make_histogram(request_latency_buckets());
  m.request_decode_time_s = make_histogram(request_latency_buckets());
  m.request_prompt_tokens = make_histogram(one_two_five_buckets(max_model_len));
  m.request_generation_tokens = make_histogram(one_two_five_buckets(max_model_len));
  m.request_params_max_tokens = make_histogram(one_two_five_buckets(max_model_len));
  m.iteration_tokens_total = make_histogram(iteration_tokens_buckets());
  std::vector<double> adapters;
  for (int i = 0; i <= max_loras; ++i) adapters.push_back(i);
  m.adapters_per_step = make_histogram(std::move(adapters));
  for (const char* reason : {"stop", "length", "abort", "error"}) m.finished_total[reason] = 0;
  return m;
}

}  // namespace loraplex::engine
