#include "loraplex/server/prometheus.h"

#include <cmath>
#include <vector>

#include "loraplex/template/value.h"

namespace loraplex::server {
namespace {

std::string escape_label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

using Labels = std::vector<std::pair<std::string, std::string>>;

std::string labels_text(const Labels& labels) {
  if (labels.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i) out += ",";
    out += labels[i].first + "=\"" + escape_label(labels[i].second) + "\"";
  }
  return out + "}";
}

class Writer {
 public:
  explicit Writer(std::string model) : base_{{"model_name", std::move(model)}, {"engine", "0"}} {}

  void header(const std::string& name, const std::string& type, const std::string& help) {
    out_ += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  }
  void sample(const std::string& name, const Labels& labels, double value) {
    out_ += name + labels_text(labels) + " " + prometheus_number(value) + "\n";
  }
  void gauge(const std::string& name, const std::string& help, double value) {
    header(name, "gauge", help);
    sample(name, base_, value);
  }
  // prometheus_client declares a counter under its sample name (with _total), and its parser
  // only files the samples under the family when the names agree.
  void counter(const std::string& name, const std::string& help, double value) {
    header(name + "_total", "counter", help);
    sample(name + "_total", base_, value);
  }
  void histogram(const std::string& name, const std::string& help,
                 const engine::EngineMetrics::Histogram& h) {
    header(name, "histogram", help);
    for (size_t i = 0; i < h.bounds.size() && i < h.counts.size(); ++i) {
      Labels l = base_;
      l.emplace_back("le", prometheus_number(h.bounds[i]));
      sample(name + "_bucket", l, static_cast<double>(h.counts[i]));
    }
    Labels inf = base_;
    inf.emplace_back("le", "+Inf");
    sample(name + "_bucket", inf, static_cast<double>(h.count));
    sample(name + "_count", base_, static_cast<double>(h.count));
    sample(name + "_sum", base_, h.sum);
  }
  const Labels& base() const { return base_; }
  std::string& out() { return out_; }

 private:
  Labels base_;
  std::string out_;
};

// vLLM joins the distinct adapter names with commas.
std::string join_unique(const std::vector<std::string>& names) {
  std::vector<std::string> seen;
  std::string out;
  for (const std::string& n : names) {
    bool dup = false;
    for (const std::string& s : seen) dup = dup || s == n;
    if (dup) continue;
    seen.push_back(n);
    if (!out.empty()) out += ",";
    out += n;
  }
  return out;
}

}  // namespace

std::string prometheus_number(double d) {
  if (std::isinf(d)) return d > 0 ? "+Inf" : "-Inf";
  if (std::isnan(d)) return "NaN";
  const std::string s = jinja::python_float_repr(d);
  const size_t dot = s.find('.');
  // Go writes exponents sooner than Python; prometheus_client mirrors Go for positive values.
  if (d > 0 && dot != std::string::npos && dot > 6 && s.find('e') == std::string::npos) {
    std::string mantissa = s.substr(0, 1) + "." + s.substr(1, dot - 1) + s.substr(dot + 1);
    while (!mantissa.empty() && (mantissa.back() == '0' || mantissa.back() == '.')) {
      mantissa.pop_back();
    }
    return mantissa + "e+0" + std::to_string(dot - 1);
  }
  return s;
}

std::string format_prometheus(const engine::EngineMetrics& m, const std::string& model_name,
                              double now) {
  Writer w(model_name);
  w.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
          static_cast<double>(m.num_running));
  w.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
          static_cast<double>(m.num_waiting));
  w.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
          m.kv_cache_usage);
  // The name before vLLM 0.10, which routers configured for older vLLM still read.
  w.gauge("vllm:gpu_cache_usage_perc",
          "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use "
          "vllm:kv_cache_usage_perc instead.",
          m.kv_cache_usage);
  w.header("vllm:lora_requests_info", "gauge", "Running stats on lora requests.");
  w.sample("vllm:lora_requests_info",
           {{"max_lora", std::to_string(m.max_loras)},
            {"waiting_lora_adapters", join_unique(m.waiting_adapters)},
            {"running_lora_adapters", join_unique(m.running_adapters)}},
           now);
  w.counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
            static_cast<double>(m.prompt_tokens_total));
  w.counter("vllm:generation_tokens", "Number of generation tokens processed.",
            static_cast<double>(m.generation_tokens_total));
  w.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
            static_cast<double>(m.preemptions_total));
  w.counter("vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            static_cast<double>(m.prefix_cache_queries_total));
  w.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            static_cast<double>(m.prefix_cache_hits_total));
  w.header("vllm:request_success_total", "counter", "Count of successfully processed requests.");
  for (const char* reason : {"stop", "length", "abort"}) {
    const auto it = m.finished_total.find(reason);
    Labels l = w.base();
    l.emplace_back("finished_reason", reason);
    w.sample("vllm:request_success_total", l,
             it == m.finished_total.end() ? 0.0 : static_cast<double>(it->second));
  }
  w.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
              m.time_to_first_token_s);
  w.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
              m.inter_token_latency_s);
  // vLLM's earlier name for the same intervals.
  w.histogram("vllm:time_per_output_token_seconds",
              "Histogram of time per output token in seconds.", m.inter_token_latency_s);
  w.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
              m.e2e_request_latency_s);
  w.histogram("vllm:request_queue_time_seconds",
              "Histogram of time spent in WAITING phase for request.", m.queue_time_s);
  w.histogram("vllm:request_inference_time_seconds",
              "Histogram of time spent in RUNNING phase for request.", m.request_inference_time_s);
  w.histogram("vllm:request_prefill_time_seconds",
              "Histogram of time spent in PREFILL phase for request.", m.request_prefill_time_s);
  w.histogram("vllm:request_decode_time_seconds",
              "Histogram of time spent in DECODE phase for request.", m.request_decode_time_s);
  w.histogram("vllm:request_time_per_output_token_seconds",
              "Histogram of time_per_output_token_seconds per request.", m.time_per_output_token_s);
  w.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
              m.request_prompt_tokens);
  w.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
              m.request_generation_tokens);
  w.histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
              m.request_params_max_tokens);
  w.histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
              m.iteration_tokens_total);
  return std::move(w.out());
}

}  // namespace loraplex::server
