#pragma once
// The histograms of EngineMetrics with vLLM's bucket bounds (vllm/v1/metrics/loggers.py), so
// that dashboards and routers built for vLLM read loraplex's /metrics unchanged.

#include <cstdint>
#include <vector>

#include "loraplex/engine/engine.h"

namespace loraplex::engine {

/// vllm:time_to_first_token_seconds: 0.001 .. 2560 s.
std::vector<double> ttft_buckets();
/// vllm:inter_token_latency_seconds and time_per_output_token_seconds: 0.01 .. 80 s.
std::vector<double> inter_token_buckets();
/// e2e, queue, inference, prefill and decode times: 0.3 .. 7680 s.
std::vector<double> request_latency_buckets();
/// vllm:iteration_tokens_total: 1 .. 16384.
std::vector<double> iteration_tokens_buckets();
/// 1, 2, 5, 10, 20, 50, ... up to max_value (request token counts).
std::vector<double> one_two_five_buckets(int64_t max_value);

/// An empty histogram over `bounds` (ascending).
EngineMetrics::Histogram make_histogram(std::vector<double> bounds);
/// Counts `value` in every bucket whose bound is >= value (cumulative, as Prometheus).
void observe(EngineMetrics::Histogram& h, double value);

/// Metrics with every histogram's buckets set and nothing counted.
EngineMetrics empty_metrics(int max_loras, int64_t max_model_len);

}  // namespace loraplex::engine
