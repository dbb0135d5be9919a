// Prints format_prometheus() of fixed metrics, for check_metrics.py to parse with
// prometheus_client.

#include <cstdio>

#include "loraplex/server/prometheus.h"

int main() {
  loraplex::engine::EngineMetrics m;
  m.num_running = 2;
  m.num_waiting = 5;
  m.kv_cache_usage = 0.25;
  m.running_adapters = {"sql", "pirate"};
  m.waiting_adapters = {"vocab"};
  m.max_loras = 3;
  m.prompt_tokens_total = 1000;
  m.generation_tokens_total = 250;
  m.finished_total = {{"stop", 4}, {"length", 6}};
  m.time_to_first_token_s = {{0.01, 0.1, 1.0}, {1, 4, 10}, 3.5, 10};
  m.inter_token_latency_s = {{0.01, 0.1}, {100, 240}, 9.0, 240};
  m.e2e_request_latency_s = {{1.0, 10.0}, {2, 10}, 31.0, 10};
  m.queue_time_s = {{0.3}, {10}, 0.2, 10};
  const std::string text = loraplex::server::format_prometheus(m, "base-model", 1713456789.5);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}
