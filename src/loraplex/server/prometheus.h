#pragma once
// GET /metrics: the engine's counters and histograms in the Prometheus text format (0.0.4)
// under vLLM's metric names and labels, so that routers built for vLLM (the Gateway API
// Inference Extension's endpoint picker) read loraplex unchanged. Numbers are written the way
// prometheus_client writes them (1.0, 2.5e+09, +Inf).

#include <string>

#include "loraplex/engine/engine.h"

namespace loraplex::server {

/// The exposition text. `model_name` is the served model name (the model_name label);
/// `now_unix_seconds` is the value of vllm:lora_requests_info (vLLM sets it to the time of the
/// latest update, and routers pick the newest series by it).
std::string format_prometheus(const engine::EngineMetrics& metrics, const std::string& model_name,
                              double now_unix_seconds);

/// prometheus_client's floatToGoString.
std::string prometheus_number(double value);

}  // namespace loraplex::server
