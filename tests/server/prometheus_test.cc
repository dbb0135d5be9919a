// /metrics text: vLLM's names and labels, and a strict structural check of the exposition
// format (HELP and TYPE before samples, cumulative buckets ending in +Inf == count).

#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>
#include <map>
#include <sstream>

#include "loraplex/server/prometheus.h"

namespace loraplex::server {
namespace {

engine::EngineMetrics sample_metrics() {
  engine::EngineMetrics m;
  m.num_running = 3;
  m.num_waiting = 11;
  m.kv_cache_usage = 0.4375;
  m.running_adapters = {"sql", "pirate", "sql"};
  m.waiting_adapters = {"vocab"};
  m.max_loras = 4;
  m.prompt_tokens_total = 12345;
  m.generation_tokens_total = 678;
  m.preemptions_total = 2;
  m.finished_total = {{"stop", 5}, {"length", 7}, {"abort", 1}};
  m.time_to_first_token_s = {{0.001, 0.01, 0.1, 1.0}, {0, 3, 9, 10}, 2.75, 12};
  m.inter_token_latency_s = {{0.01, 0.025}, {40, 90}, 1.5, 100};
  m.e2e_request_latency_s = {{0.3, 1.0}, {1, 4}, 6.5, 13};
  m.queue_time_s = {{0.3}, {13}, 0.1, 13};
  m.request_prompt_tokens = {{1, 2, 5, 10}, {0, 0, 4, 13}, 80.0, 13};
  m.request_generation_tokens = {{1, 2, 5, 10}, {0, 1, 1, 13}, 90.0, 13};
  m.iteration_tokens_total = {{1, 8, 16}, {20, 30, 41}, 300.0, 41};
  return m;
}

TEST(Prometheus, NumbersAreWrittenAsPrometheusClientWritesThem) {
  EXPECT_EQ(prometheus_number(1.0), "1.0");
  EXPECT_EQ(prometheus_number(0.001), "0.001");
  EXPECT_EQ(prometheus_number(2560.0), "2560.0");
  EXPECT_EQ(prometheus_number(12345.0), "12345.0");
  EXPECT_EQ(prometheus_number(1713456789.25), "1.71345678925e+09");
  EXPECT_EQ(prometheus_number(1234567.0), "1.234567e+06");
  EXPECT_EQ(prometheus_number(0.0), "0.0");
  EXPECT_EQ(prometheus_number(1.0 / 0.0), "+Inf");
}

TEST(Prometheus, VllmNamesLabelsAndValues) {
  const std::string text = format_prometheus(sample_metrics(), "base", 1713456789.25);
  const std::string l = "{model_name=\"base\",engine=\"0\"}";
  for (const std::string& line : {
           "vllm:num_requests_running" + l + " 3.0",
           "vllm:num_requests_waiting" + l + " 11.0",
           "vllm:kv_cache_usage_perc" + l + " 0.4375",
           "vllm:gpu_cache_usage_perc" + l + " 0.4375",
           std::string("vllm:lora_requests_info{max_lora=\"4\",waiting_lora_adapters=\"vocab\","
                       "running_lora_adapters=\"sql,pirate\"} 1.71345678925e+09"),
           "vllm:prompt_tokens_total" + l + " 12345.0",
           "vllm:generation_tokens_total" + l + " 678.0",
           "vllm:num_preemptions_total" + l + " 2.0",
           std::string("vllm:request_success_total{model_name=\"base\",engine=\"0\","
                       "finished_reason=\"length\"} 7.0"),
           std::string("vllm:time_to_first_token_seconds_bucket{model_name=\"base\",engine=\"0\","
                       "le=\"0.01\"} 3.0"),
           std::string("vllm:time_to_first_token_seconds_bucket{model_name=\"base\",engine=\"0\","
                       "le=\"+Inf\"} 12.0"),
           "vllm:time_to_first_token_seconds_sum" + l + " 2.75",
           "vllm:inter_token_latency_seconds_count" + l + " 100.0",
           "vllm:time_per_output_token_seconds_count" + l + " 100.0",
           "vllm:e2e_request_latency_seconds_count" + l + " 13.0",
           "vllm:request_queue_time_seconds_count" + l + " 13.0",
           std::string("vllm:request_prompt_tokens_bucket{model_name=\"base\",engine=\"0\","
                       "le=\"5.0\"} 4.0"),
           "vllm:request_generation_tokens_sum" + l + " 90.0",
           std::string("vllm:iteration_tokens_total_bucket{model_name=\"base\",engine=\"0\","
                       "le=\"16.0\"} 41.0"),
           "vllm:request_decode_time_seconds_count" + l + " 0.0",
       }) {
    EXPECT_NE(text.find(line + "\n"), std::string::npos) << "missing: " << line;
  }
}

bool is_name_char(char c, bool first) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':' ||
         (!first && std::isdigit(static_cast<unsigned char>(c)));
}

// Reads a metric name at `pos`; empty when there is none.
std::string read_name(const std::string& line, size_t& pos) {
  const size_t start = pos;
  while (pos < line.size() && is_name_char(line[pos], pos == start)) ++pos;
  return line.substr(start, pos - start);
}

// A sample line of the text format (0.0.4): name, optional {label="value",...} with escaped
// values, one space, a number. Returns the metric name, or "" when the line is malformed.
std::string parse_sample(const std::string& line) {
  size_t pos = 0;
  const std::string name = read_name(line, pos);
  if (name.empty()) return "";
  if (pos < line.size() && line[pos] == '{') {
    ++pos;
    while (pos < line.size() && line[pos] != '}') {
      if (read_name(line, pos).empty() || pos + 1 >= line.size() || line[pos] != '=' ||
          line[pos + 1] != '"') {
        return "";
      }
      pos += 2;
      while (pos < line.size() && line[pos] != '"') {
        if (line[pos] == '\\') {
          if (pos + 1 >= line.size() ||
              std::string("\\\"n").find(line[pos + 1]) == std::string::npos) {
            return "";
          }
          ++pos;
        } else if (line[pos] == '\n') {
          return "";
        }
        ++pos;
      }
      if (pos >= line.size()) return "";
      ++pos;  // closing quote
      if (pos < line.size() && line[pos] == ',') ++pos;
    }
    if (pos >= line.size()) return "";
    ++pos;  // }
  }
  if (pos >= line.size() || line[pos] != ' ') return "";
  const std::string value = line.substr(pos + 1);
  if (value == "+Inf" || value == "-Inf" || value == "NaN") return name;
  char* end = nullptr;
  std::strtod(value.c_str(), &end);
  return !value.empty() && end == value.c_str() + value.size() ? name : "";
}

TEST(Prometheus, ExpositionFormatIsWellFormed) {
  const std::string text = format_prometheus(sample_metrics(), "we\"ird\\name", 1.0);
  std::map<std::string, std::string> types;
  std::string current;
  std::istringstream in(text);
  int samples = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# HELP ", 0) == 0) {
      size_t pos = 7;
      current = read_name(line, pos);
      EXPECT_FALSE(current.empty()) << line;
      EXPECT_TRUE(pos + 1 < line.size() && line[pos] == ' ') << "HELP without text: " << line;
      continue;
    }
    if (line.rfind("# TYPE ", 0) == 0) {
      size_t pos = 7;
      const std::string name = read_name(line, pos);
      const std::string type = pos < line.size() ? line.substr(pos + 1) : "";
      EXPECT_EQ(name, current) << "TYPE without its HELP: " << line;
      EXPECT_TRUE(type == "gauge" || type == "counter" || type == "histogram") << line;
      EXPECT_TRUE(types.emplace(name, type).second) << "family declared twice: " << line;
      continue;
    }
    const std::string name = parse_sample(line);
    ASSERT_FALSE(name.empty()) << "not a sample line: " << line;
    // A sample belongs to the family declared last (suffixes _bucket, _sum, _count).
    EXPECT_EQ(name.rfind(current, 0), 0u) << line;
    ++samples;
  }
  EXPECT_GT(samples, 30);
  EXPECT_EQ(types["vllm:time_to_first_token_seconds"], "histogram");
  EXPECT_EQ(types["vllm:prompt_tokens_total"], "counter");
  EXPECT_NE(text.find("model_name=\"we\\\"ird\\\\name\""), std::string::npos);
}

}  // namespace
}  // namespace loraplex::server
